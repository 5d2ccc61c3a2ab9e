"""Document boundaries of token-file batches, for document-masked attention (models/attention.py, block_causal).

A boundary comes from where the data records it, never from a token the data may not hold: a Megatron `.idx` lists
its documents (Megatron's preprocess_data.py writes each as text ... EOD, with no BOS, so a BOS scan finds no
boundary in it); a flat numpy file has no index, and there the tokenizer's EOS ends a document. Text data is
encoded by kiln, BOS ... EOS per document, and the model counts its BOS tokens (trainer/data/text.py). So a batch of
token files carries each input token's document id, (bs, seq_len) int32: the documents begun in its row up to and
including it (TokenFile.document_starts per window).

Two checks around it: a run whose token files record no boundary at all (every `.idx` holding one document) is
refused before training, naming model.flavor; a run whose first batches hold no boundary (one huge document, or a
numpy file without the tokenizer's EOS) is warned about once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kiln_base.errors import DataError
from trainer.data.sample_index import Mixture

logger = logging.getLogger("kiln")

WATCHED_BATCHES = 4  # batches a run's loader looks at for a first boundary before it warns


@dataclass(frozen=True)
class DocumentMask:
    """A document-masked model's needs of the data: its model.flavor (named in the checks) and the tokenizer's EOS
    (a numpy file's document end)."""

    flavor: str
    eos_id: int


def boundaries_line(mixture: Mixture, eos_id: int) -> str:
    """Where the documents of a mix come from, for the start-up attention line."""
    files = [f for s in mixture.sources for f in s.files]
    kinds = []
    if any(f.index is not None for f in files):
        kinds.append("documents from the .idx document index")
    if any(f.index is None for f in files):
        kinds.append(f"documents ended by EOS (token {eos_id}) in the numpy token files (no index)")
    return " and ".join(kinds)


def check_boundaries_recorded(mixture: Mixture, flavor: str, where: str) -> None:
    """Refuse a document-masked run over token files whose indexes all record one document per file: no window can
    hold a boundary (windows never cross files), so the mask cannot apply."""
    files = [f for s in mixture.sources for f in s.files]
    if all(f.documents is not None and f.documents <= 1 for f in files):
        raise DataError(
            f"model.flavor {flavor} masks attention by document, but every .idx of {where} records one document "
            f"per file (e.g. {files[0].path[: -len('.bin')]}.idx): no boundary to mask at; use a causal flavor, or "
            "write the index with one document per document (scripts/tokenize_data.py, Megatron's preprocess_data.py)"
        )


def document_ids(starts: list[np.ndarray], seq_len: int) -> np.ndarray:
    """(rows, seq_len) int32 document ids from each row's document starts (offsets in (0, seq_len))."""
    marks = np.zeros((len(starts), seq_len), dtype=np.int32)
    for row, s in zip(marks, starts, strict=True):
        row[s] = 1
    return np.cumsum(marks, axis=1, dtype=np.int32)


class BoundaryWatch:
    """Warns once when the first WATCHED_BATCHES batches of a document-masked run hold no document boundary: the
    mask then does what causal attention does, and the data is the likely reason."""

    def __init__(self, flavor: str, where: str, boundaries: str, eos_id: int) -> None:
        self.flavor, self.where, self.boundaries, self.eos_id = flavor, where, boundaries, eos_id
        self.batches = 0  # batches seen, all without a boundary
        self.done = False  # a boundary was seen, or the warning given

    def see(self, starts: list[np.ndarray], seq_len: int) -> None:
        """One batch's document starts (per row)."""
        if self.done:
            return
        self.batches += 1
        self.done = any(s.size for s in starts) or self.batches == WATCHED_BATCHES
        if self.done and not any(s.size for s in starts):
            numpy = f", or numpy token files without EOS (token {self.eos_id})" if "numpy" in self.boundaries else ""
            logger.warning(
                f"model.flavor {self.flavor}: no document boundary in the first {WATCHED_BATCHES} batches of "
                f"{self.where} ({self.boundaries}): documents longer than seq_len {seq_len}{numpy}; the document "
                "mask attends as causal attention does"
            )
