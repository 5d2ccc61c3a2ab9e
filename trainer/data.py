"""Text datasets streamed with HF `datasets`, tokenized and packed into seq_len+1 windows, per DP rank.

The loader is stateful: `state_dict()` holds the dataset's position and the partly used token buffer, so a
resumed run sees exactly the tokens the uninterrupted run would have.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import ConfigError, Training
from trainer.tokenizer import Tokenizer

logger = logging.getLogger("kiln")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class DatasetSpec:
    path: str  # local file/folder, or a hub dataset id when `hub` is set
    hub_config: str | None = None
    hub: bool = False
    text_key: str = "text"


DATASETS: dict[str, DatasetSpec] = {
    "kiln_corpus": DatasetSpec(os.path.join(REPO_ROOT, "assets", "corpus", "kiln_corpus.jsonl")),
    "c4": DatasetSpec("allenai/c4", hub_config="en", hub=True),
}

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def _local_files(path: str) -> tuple[str, list[str]]:
    """The `datasets` builder name and the data files for a local file or folder."""
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, f)
            for root, _, names in os.walk(path)
            for f in names
            if os.path.splitext(f)[1] in _FORMATS
        )
    else:
        files = [path]
    if not files:
        raise ConfigError(f"training.dataset_path: no .jsonl/.json/.parquet/.txt files under {path}")
    kinds = {_FORMATS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(
            f"training.dataset_path: {path} must hold files of one format: .jsonl, .json, .parquet or .txt"
        )
    kind = kinds.pop()
    for f in files:
        _check_readable(f, kind)
    return kind, files


def _check_readable(path: str, kind: str) -> None:
    """Fail now, naming the file, rather than mid-run inside a `datasets` worker: open it and parse its head."""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            pq.read_metadata(path)
            return
        with open(path, "rb") as fh:
            head = fh.readline()
        if os.path.splitext(path)[1] == ".jsonl" and head.strip():
            record = json.loads(head)
            if not isinstance(record, dict) or "text" not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"its first record has no 'text' field (has: {keys})")
        elif kind == "text":
            head.decode("utf-8")
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError and ArrowInvalid are ValueErrors
        raise ConfigError(f"training.dataset_path: cannot read {path}: {e}") from None


def load_text_dataset(name: str, path: str | None):
    """A streaming HF IterableDataset for a registered name or a local path."""
    import datasets  # lazy: heavy import

    if path is None:
        if name not in DATASETS:
            raise ConfigError(
                f"training.dataset: unknown dataset '{name}'; registered: {', '.join(DATASETS)} "
                "(or set training.dataset_path)"
            )
        spec = DATASETS[name]
        if spec.hub:
            try:
                return datasets.load_dataset(spec.path, name=spec.hub_config, split="train", streaming=True)
            except Exception as e:  # offline, gated, renamed: whatever the hub says, it is not a kiln bug
                raise ConfigError(
                    f"training.dataset {name}: cannot open {spec.path} on the Hugging Face hub ({e}); "
                    "use training.dataset_path for local data"
                ) from None
        path = spec.path
    builder, files = _local_files(path)
    return datasets.load_dataset(builder, data_files=files, split="train", streaming=True)


class TokenWindows:
    """Iterates token windows of length seq_len+1 from one DP rank's share of a text dataset.

    Documents are encoded with bos and eos and concatenated, so windows cross document boundaries
    (standard pretraining packing). When the data runs out it warns and starts over.
    """

    def __init__(
        self,
        hf_dataset: Any,
        tokenizer: Tokenizer,
        seq_len: int,
        dp_rank: int,
        dp_degree: int,
        text_key: str = "text",
        source: str = "training dataset",
    ) -> None:
        from datasets.distributed import split_dataset_by_node

        self.data = split_dataset_by_node(hf_dataset, rank=dp_rank, world_size=dp_degree)
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.tokenizer = tokenizer
        self.window = seq_len + 1
        self.text_key = text_key
        self.source = source  # named in errors
        self.buffer: list[int] = []
        self.epoch = 0

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            produced = False
            for sample in self._samples():
                self.buffer.extend(self.tokenizer.encode(sample, bos=True, eos=True))
                while len(self.buffer) >= self.window:
                    produced = True
                    window, self.buffer = self.buffer[: self.window], self.buffer[self.window :]
                    yield window
            if not produced and self.epoch > 0:
                raise ConfigError(
                    f"{self.source}: too small to fill one sequence of training.seq_len ({self.window - 1}) tokens "
                    f"on data-parallel rank {self.dp_rank} of {self.dp_degree}"
                )
            self.epoch += 1
            logger.warning(f"dataset exhausted; re-looping (epoch {self.epoch})")
            self.data.set_epoch(self.epoch)

    def _samples(self) -> Iterator[str]:
        """The text of each record; a malformed file is a user error that names the dataset."""
        it = iter(self.data)
        while True:
            try:
                sample = next(it)
            except StopIteration:
                return
            except ValueError as e:  # pyarrow's ArrowInvalid (bad JSON/parquet) is a ValueError
                raise ConfigError(f"{self.source}: cannot read: {e}") from None
            if self.text_key not in sample:
                raise ConfigError(f"{self.source}: record has no '{self.text_key}' field (has: {', '.join(sample)})")
            yield sample[self.text_key]

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict(), "buffer": list(self.buffer), "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])
        self.buffer = list(state["buffer"])
        self.epoch = state["epoch"]
        self.data.set_epoch(self.epoch)


class DataLoader:
    """Batches windows into (inputs, labels) LongTensors of shape [local_batch_size, seq_len].

    A background thread tokenizes and packs up to `prefetch` batches ahead (pinned in memory when `pin_memory`,
    so the host-to-device copy can overlap compute). Each queued batch carries the loader position just after
    it, so `state_dict()` describes exactly the batches the trainer consumed, not the ones prefetched.
    """

    def __init__(self, windows: TokenWindows, batch_size: int, prefetch: int = 2, pin_memory: bool = False) -> None:
        self.windows = windows
        # Each DP rank reads its own shard, so each saves its own position under its own key (as torchtitan):
        # a checkpoint then holds dp_rank_0 .. dp_rank_{D-1} and resumes only under the same DP degree.
        self.state_key = f"dp_rank_{windows.dp_rank}"
        self.dp_degree = windows.dp_degree
        self.batch_size = batch_size
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self._position = pickle.dumps(windows.state_dict())  # after the last batch handed out
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._it: Iterator[list[int]] | None = None  # used when prefetch == 0

    def __iter__(self) -> DataLoader:
        return self

    def _next_batch(self, it: Iterator[list[int]]) -> tuple[torch.Tensor, torch.Tensor, bytes]:
        batch = torch.tensor([next(it) for _ in range(self.batch_size)], dtype=torch.long)
        if self.pin_memory:
            batch = batch.pin_memory()
        return batch[:, :-1], batch[:, 1:], pickle.dumps(self.windows.state_dict())

    def _produce(self, q: queue.Queue, stop: threading.Event) -> None:
        it = iter(self.windows)
        while not stop.is_set():
            try:
                item: Any = self._next_batch(it)
            except BaseException as e:  # handed to the consumer, which raises it in the training thread
                item = e
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefetch == 0:
            inputs, labels, self._position = self._next_batch(self._iter())
            return inputs, labels
        if self._queue is None:
            self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
            self._thread = threading.Thread(target=self._produce, args=(self._queue, self._stop), daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        inputs, labels, self._position = item
        return inputs, labels

    def _iter(self) -> Iterator[list[int]]:
        if self._it is None:
            self._it = iter(self.windows)
        return self._it

    def _reset(self) -> None:
        """Stop the producer and drop prefetched batches (before moving the position)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._queue, self._thread, self._it = None, None, None

    def close(self) -> None:
        self._reset()

    def state_dict(self) -> dict[str, bytes]:
        """{dp_rank_R: pickled position}: bytes, so DCP stores it as one opaque item per rank."""
        return {self.state_key: self._position}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        if self.state_key not in state:
            raise ConfigError(
                f"checkpoint has no data-loader state for {self.state_key} (saved with another data-parallel degree)"
            )
        self._reset()
        self._position = state[self.state_key]
        self.windows.load_state_dict(pickle.loads(self._position))


def build_dataloader(
    cfg: Training, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, pin_memory: bool = False
) -> DataLoader:
    hf = load_text_dataset(cfg.dataset, cfg.dataset_path)
    text_key = DATASETS[cfg.dataset].text_key if cfg.dataset in DATASETS else "text"
    source = f"training.dataset_path {cfg.dataset_path}" if cfg.dataset_path else f"training.dataset {cfg.dataset}"
    windows = TokenWindows(hf, tokenizer, cfg.seq_len, dp_rank, dp_degree, text_key, source)
    return DataLoader(windows, cfg.local_batch_size, prefetch=cfg.data_prefetch, pin_memory=pin_memory)
