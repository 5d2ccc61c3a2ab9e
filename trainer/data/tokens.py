"""Batches from pre-tokenized files for one data-parallel rank: training.dataset_path or validation.dataset_path
naming token files, or training.dataset_mix (docs/data.md).

The global sample order is the mixture's (trainer/data/sample_index.py): step N's global batch is samples
[N x global batch, (N+1) x global batch), and in each round of dp_degree x local_batch_size samples rank r takes
samples r x local_batch_size onwards, the text path's rule. A rank computes where its own samples lie and copies
their windows out of the memory-mapped files: nothing else is read, so its cost per batch is the same at any
data-parallel degree. The loader state is one integer, the global sample number, so a checkpoint resumes under
any layout; the mix's position follows from it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from kiln_base.config import Training, Validation, validation_shape
from kiln_base.errors import DataError
from trainer.data.documents import (
    BoundaryWatch,
    DocumentMask,
    boundaries_line,
    check_boundaries_recorded,
    document_ids,
)
from trainer.data.sample_index import Mixture, normalised, open_mixture
from trainer.data.token_files import is_token_path, source_names, token_file_paths

logger = logging.getLogger("kiln")


def uses_token_files(cfg: Training | Validation) -> bool:
    """Whether a section's data is token files (the mix, or a dataset_path naming them) rather than text."""
    if isinstance(cfg, Training) and cfg.dataset_mix:
        return True
    return cfg.dataset_path is not None and is_token_path(cfg.dataset_path)


def data_seed(cfg: Training) -> int:
    """The seed of the sample order: training.seed, or 0 when unset (every rank must draw the same order)."""
    return cfg.seed if cfg.seed is not None else 0


def mix_entries(cfg: Training) -> list[tuple[str, float, float | None]]:
    if cfg.dataset_mix:
        return [(s.path, s.weight, s.max_epochs) for s in cfg.dataset_mix]
    assert cfg.dataset_path is not None
    return [(cfg.dataset_path, 1.0, None)]


class TokenFileLoader:
    """(inputs, labels) LongTensors of shape [local_batch_size, seq_len] for one DP rank, from a Mixture.

    `samples`: with a count, the iteration ends before the first round that would pass it (validation: once through
    the set, an incomplete last round dropped); None, it never ends (training: sources repeat, epoch by epoch).
    `eos_id`: the tokenizer's EOS, given when the model masks attention by document: each batch is then (inputs,
    labels, doc_ids), doc_ids (local_batch_size, seq_len) int32 (trainer/data/documents.py). `watch` looks at the
    first batches' boundaries (training).
    """

    def __init__(
        self,
        mixture: Mixture,
        batch_size: int,
        n_words: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        samples: int | None = None,
        pin_memory: bool = False,
        source: str = "training.dataset_mix",
        eos_id: int | None = None,
        watch: BoundaryWatch | None = None,
    ) -> None:
        self.mixture, self.source = mixture, source  # `source`: the key errors name
        self.eos_id, self.watch = eos_id, watch
        self.boundaries = boundaries_line(mixture, eos_id) if eos_id is not None else None  # for the attention line
        self.window = mixture.sources[0].window
        self.batch_size, self.dp_rank, self.dp_degree = batch_size, dp_rank, dp_degree
        self._n_words, self.samples, self.pin_memory = n_words, samples, pin_memory
        self.sequences = 0  # global samples consumed (all ranks' batches): the whole loader state

    def __iter__(self) -> TokenFileLoader:
        return self

    @property
    def n_words(self) -> int:
        return self._n_words

    def __next__(self) -> tuple[torch.Tensor, ...]:
        round_size = self.dp_degree * self.batch_size
        if self.samples is not None and self.sequences + round_size > self.samples:
            raise StopIteration
        first = self.sequences + self.dp_rank * self.batch_size
        rows = np.empty((self.batch_size, self.window), dtype=np.int64)
        starts = []  # each row's document starts, under a document mask
        for i in range(self.batch_size):
            f, start, _ = self.mixture.sample(first + i)
            rows[i] = f.tokens[start : start + self.window]
            if self.eos_id is not None:  # the inputs' documents: tokens [start, start + seq_len)
                starts.append(f.document_starts(start, start + self.window - 1, self.eos_id))
            if not f.ids_checked:  # no (complete) stats sidecar: check this window's ids as they are read
                high = int(rows[i].max())
                if high >= self._n_words or int(rows[i].min()) < 0:
                    bad = high if high >= self._n_words else int(rows[i].min())
                    at = start + int(np.argmax(rows[i] == bad))
                    raise DataError(
                        f"{f.path}: token {at:,} is id {bad}, outside the tokenizer's vocabulary (0 to "
                        f"{self._n_words - 1}); was it tokenized with another tokenizer?"
                    )
        self.sequences += round_size
        batch = torch.from_numpy(rows)
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if self.pin_memory:
            inputs, labels = inputs.pin_memory(), labels.pin_memory()
        if self.eos_id is None:
            return inputs, labels
        if self.watch is not None:
            self.watch.see(starts, self.window - 1)
        doc_ids = torch.from_numpy(document_ids(starts, self.window - 1))
        return inputs, labels, doc_ids.pin_memory() if self.pin_memory else doc_ids

    def fingerprint(self, cfg: Training) -> dict[str, Any]:
        """What identifies this data in a checkpoint (token_fingerprint)."""
        return token_fingerprint(cfg, self.mixture)

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens read from each source by all ranks so far (seq_len + 1 per sample)."""
        counts = self.mixture.counts(self.sequences)
        return {s.name: int(c) * self.window for s, c in zip(self.mixture.sources, counts, strict=True)}

    def close(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """The global sample number: identical on every rank, the same under every layout."""
        return {"sequences": self.sequences}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sequences = int(state["sequences"])


def build_token_loader(
    cfg: Training,
    n_words: int,
    dp_rank: int,
    dp_degree: int,
    global_batch: int,
    pin_memory: bool = False,
    documents: DocumentMask | None = None,
) -> TokenFileLoader:
    """This DP rank's training loader over token files; logs the realised mix of the run (training.steps global
    batches of `global_batch`) and refuses a source read past its max_epochs, before any step. `documents`: the
    model masks by document (its batches carry document ids; files that record no boundary are refused)."""
    mixture = open_mixture(mix_entries(cfg), cfg.seq_len, n_words, data_seed(cfg))
    where = "training.dataset_mix" if cfg.dataset_mix else f"training.dataset_path {cfg.dataset_path}"
    if documents is not None:
        check_boundaries_recorded(mixture, documents.flavor, where)
    run_samples = cfg.steps * global_batch
    mixture.check_epochs(run_samples, where)
    unchecked = [f.path for s in mixture.sources for f in s.files if not f.ids_checked]
    if unchecked:
        logger.info(
            f"Token files without a stats sidecar of their ids' range ({len(unchecked)}, e.g. {unchecked[0]}): their "
            "ids are checked window by window as read (scripts/tokenize_data.py --stats FILE checks them once, "
            "before any step)"
        )
    logger.info(
        f"Data mix over the run ({cfg.steps} steps x {global_batch} sequences of {cfg.seq_len + 1} "
        f"tokens, seed {data_seed(cfg)}):\n{mixture.format_table(run_samples)}"
    )
    watch = None
    if documents is not None:
        watch = BoundaryWatch(documents.flavor, where, boundaries_line(mixture, documents.eos_id), documents.eos_id)
    eos_id = documents.eos_id if documents is not None else None
    return TokenFileLoader(
        mixture,
        cfg.local_batch_size,
        n_words,
        dp_rank,
        dp_degree,
        pin_memory=pin_memory,
        source=where,
        eos_id=eos_id,
        watch=watch,
    )


def build_token_validation_loader(
    v: Validation,
    t: Training,
    n_words: int,
    dp_rank: int,
    dp_degree: int,
    pin_memory: bool = False,
    documents: DocumentMask | None = None,
) -> TokenFileLoader:
    """This DP rank's slice of the validation set's windows in file order, once through (with document ids under a
    document mask, as training's)."""
    assert v.dataset_path is not None
    batch, seq_len = validation_shape(v, t)
    mixture = open_mixture([(v.dataset_path, 1.0, None)], seq_len, n_words, seed=0, shuffle=False)
    samples = mixture.sources[0].n_windows  # too few for one round: the Validator's error names the set
    where = f"validation.dataset_path {v.dataset_path}"
    eos_id = documents.eos_id if documents is not None else None
    return TokenFileLoader(mixture, batch, n_words, dp_rank, dp_degree, samples, pin_memory, where, eos_id)


def _file_identity(path: str) -> str:
    """A token file as the checkpoint remembers it: its size, and for a Megatron pair a hash of its .idx (the
    documents' lengths; its size alone would not see re-tokenized text of the same length). Cheap: the index is
    16 bytes per document; the .bin is not read."""
    import hashlib

    size = os.path.getsize(path)
    if path.endswith(".npy"):
        return f"{size} bytes"
    with open(path[: -len(".bin")] + ".idx", "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return f"{size} bytes, idx sha256 {digest}"


def token_fingerprint(cfg: Training, mixture: Mixture | None = None) -> dict[str, Any]:
    """What identifies the training data in a checkpoint: per source (by its name in the mix: the shortest end of
    its path that tells it from the others, so two `train` folders are two entries, and moving the data keeps them)
    its normalised weight, cap and files (names relative to the source, sizes, index hashes), and the seed of the
    order. seq_len is recorded on its own. `mixture`: the loader's, opened already (its files are not listed
    again)."""
    entries = mix_entries(cfg)
    weights = normalised([w for _, w, _ in entries])
    sources: dict[str, Any] = {}
    names = source_names([p for p, _, _ in entries])
    opened = [[f.path for f in s.files] for s in mixture.sources] if mixture is not None else None
    for i, ((path, _, max_epochs), name, weight) in enumerate(zip(entries, names, weights, strict=True)):
        root = path if os.path.isdir(path) else os.path.dirname(path)
        paths = opened[i] if opened is not None else token_file_paths(path)
        files = {os.path.relpath(f, root): _file_identity(f) for f in paths}
        sources[name] = {"weight": round(float(weight), 12), "max_epochs": max_epochs, "files": files}
    return {"token_sources": sources, "seed": data_seed(cfg)}
