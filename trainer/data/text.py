"""Text datasets (trainer/data/sources.py: local JSON Lines read directly, the rest streamed with HF
`datasets`), tokenized and packed into seq_len+1 windows in one global order.

The sample order is global (Megatron's global sample index; torchtitan instead splits the dataset per rank,
which ties a checkpoint to its data-parallel degree): every rank streams the whole dataset, shard by shard and
record by record, packs the same windows, and takes its slice of each round of dp_degree x local_batch_size
windows: window j of a round goes to DP rank j // local_batch_size. So the global batch of step N is the same
sequences whatever the DP degree and local batch size. The price: every rank tokenizes the whole stream
(docs/config.md has the measured cost).

The loader state is global and made of plain types (ints and a list of ints; the same on every rank): the
number of sequences consumed, and where that position lies in the stream (epoch, shard, records read from
it, tokens left over from the last record), so a run resumed under any DP layout continues with exactly the
tokens the uninterrupted run would have seen, without re-tokenizing what came before.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from kiln_base.config import Training, Validation, validation_shape
from kiln_base.errors import CheckpointError, DataError
from trainer.components.tokenizer import Tokenizer
from trainer.data.sources import (
    DATASETS,
    HFStream,
    JsonLinesFiles,
    first_bad_record,
    load_text_dataset,
    record_problem,
)

logger = logging.getLogger("kiln")


class TokenWindows:
    """Token windows of length seq_len+1 from the whole dataset, in one global order.

    Documents are encoded with bos and eos and concatenated, so windows cross document boundaries (standard
    pretraining packing). Shards (files) are read in order, records in file order. When the data runs out it
    warns and starts over (`loop`; else the iteration ends). Every record must have a string `text_key` field; a
    bad one is a DataError naming the file (or shard) and the record.
    """

    def __init__(
        self,
        source_records: JsonLinesFiles | HFStream,
        tokenizer: Tokenizer,
        seq_len: int,
        text_key: str = "text",
        source: str = "training dataset",
        shard_files: list[str] | None = None,
        loop: bool = True,
        seq_len_key: str = "training.seq_len",
    ) -> None:
        self.data = source_records
        self.n_shards = source_records.n_shards
        self.shard_files = shard_files  # local data: the file of each shard, named in errors
        self.tokenizer = tokenizer
        self.window = seq_len + 1
        self.text_key = text_key
        self.source = source  # named in errors
        self.loop = loop
        self.seq_len_key = seq_len_key  # named in errors
        # The position: `sequences` windows produced; the next record is `record` of `shard` in `epoch`;
        # `buffer` holds the tokens read but not yet in a window.
        self.sequences = 0
        self.epoch = 0
        self.shard = 0
        self.record = 0
        self.buffer: list[int] = []

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            from_start, produced, records = (self.shard, self.record) == (0, 0), False, 0
            while self.shard < self.n_shards:
                for text in self._texts(self.shard, self.record):
                    self.record += 1
                    records += 1
                    self.buffer.extend(self.tokenizer.encode(text, bos=True, eos=True))
                    while len(self.buffer) >= self.window:
                        produced = True
                        window, self.buffer = self.buffer[: self.window], self.buffer[self.window :]
                        self.sequences += 1
                        yield window
                self.shard, self.record = self.shard + 1, 0
            if from_start and records == 0:
                files = f" in {', '.join(self.shard_files)}" if self.shard_files is not None else ""
                raise DataError(f"{self.source}: no records{files}")
            if from_start and not produced:
                raise DataError(
                    f"{self.source} is too small to fill one sequence of {self.seq_len_key} + 1 = {self.window} tokens"
                )
            if not self.loop:
                return
            self.epoch, self.shard = self.epoch + 1, 0
            logger.warning(f"dataset exhausted; re-looping (epoch {self.epoch})")

    def _where(self, shard: int, record: int) -> str:
        """'data file F' or 'training.dataset c4 shard S/N', then the 1-based record number."""
        if self.shard_files is not None:
            return f"data file {self.shard_files[shard]}, record {record + 1}"
        return f"{self.source} shard {shard + 1}/{self.n_shards}, record {record + 1}"

    def _error(self, shard: int, record: int, problem: str) -> DataError:
        """A DataError naming the exact file and line when the file can be scanned, else the record `datasets`
        was reading."""
        if self.shard_files is not None:
            try:
                exact = first_bad_record(self.shard_files[shard], self.text_key)
            except OSError:
                exact = None
            if exact is not None:
                return DataError(f"data file {self.shard_files[shard]}, {exact}")
        return DataError(f"{self._where(shard, record)}: {problem}")

    def _texts(self, shard: int, start: int) -> Iterator[str]:
        """The text of each record of `shard` from record `start` on (the ones before are skipped unread by
        the tokenizer)."""
        it = self.data.records(shard, start)
        record = start
        while True:
            try:
                sample = next(it)
            except StopIteration:
                return
            except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid (bad JSON/parquet) is a ValueError
                raise self._error(shard, record, f"cannot read (at or after this record): {e}") from None
            problem = record_problem(sample, self.text_key)
            if problem is not None:
                raise self._error(shard, record, f"{problem}; every record needs a string '{self.text_key}' field")
            yield sample[self.text_key]
            record += 1

    def state_dict(self) -> dict[str, Any]:
        """The position, in plain types (loads with torch.load(weights_only=True)); the same on every rank."""
        return {
            "sequences": self.sequences,
            "epoch": self.epoch,
            "shard": self.shard,
            "record": self.record,
            "buffer": list(self.buffer),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A position from a checkpoint: its values were checked (plain integers, token ids inside the vocabulary)
        by checkpoint_reader.check_loaded_state; the shard must exist in this dataset."""
        if not 0 <= state["shard"] < self.n_shards:
            raise CheckpointError(
                f"the checkpoint's data position is in shard {state['shard'] + 1}, but {self.source} has "
                f"{self.n_shards} shard(s)"
            )
        self.sequences, self.epoch = int(state["sequences"]), int(state["epoch"])
        self.shard, self.record = int(state["shard"]), int(state["record"])
        self.buffer = [int(t) for t in state["buffer"]]


class DataLoader:
    """Batches windows into (inputs, labels) LongTensors of shape [local_batch_size, seq_len] for one DP rank.

    Each call reads one round of dp_degree x batch_size windows of the global order and keeps this rank's
    slice: window j of the round goes to rank j // batch_size. A background thread tokenizes and packs up to
    `prefetch` batches ahead (pinned in memory when `pin_memory`, so the host-to-device copy can overlap
    compute). Each queued batch carries the loader position just after it, so `state_dict()` describes
    exactly the batches the trainer consumed, not the ones prefetched.
    """

    def __init__(
        self,
        windows: TokenWindows,
        batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        prefetch: int = 2,
        pin_memory: bool = False,
    ) -> None:
        self.windows = windows
        self.batch_size = batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self._position = windows.state_dict()  # after the last batch handed out
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._it: Iterator[list[int]] | None = None  # used when prefetch == 0

    tokens_by_source = None  # one text stream: no per-source counts (TokenFileLoader's mix has them)
    boundaries = None  # documents start at the tokenizer's BOS, which the model finds itself

    def __iter__(self) -> DataLoader:
        return self

    def fingerprint(self, cfg: Training) -> dict[str, Any]:
        """What identifies this data in a checkpoint (dataset_fingerprint)."""
        return dataset_fingerprint(cfg, self.windows.shard_files)

    @property
    def n_words(self) -> int:
        """The tokenizer's vocabulary: every token id of a batch (and of a saved position) lies below it."""
        return self.windows.tokenizer.n_words

    @property
    def source(self) -> str:
        """The dataset as errors name it."""
        return self.windows.source

    @property
    def window(self) -> int:
        """Tokens per window: seq_len + 1."""
        return self.windows.window

    def _next_batch(self, it: Iterator[list[int]]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        rows = []
        for j in range(self.dp_degree * self.batch_size):  # the other ranks' windows are read and dropped
            window = next(it)
            if j // self.batch_size == self.dp_rank:
                rows.append(window)
        batch = torch.tensor(rows, dtype=torch.long)
        # Contiguous copies: a non-contiguous slice of pinned memory is staged through pageable memory on its
        # way to the GPU, so the non_blocking copy would block (local batch > 1; a 1-row slice is contiguous).
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if self.pin_memory:
            inputs, labels = inputs.pin_memory(), labels.pin_memory()
        return inputs, labels, self.windows.state_dict()

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

    def state_dict(self) -> dict[str, Any]:
        """The global position after the last batch handed out (TokenWindows.state_dict): one DCP item per key,
        identical on every rank, so a checkpoint resumes under any data-parallel layout."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self._position.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reset()
        self.windows.load_state_dict(state)
        self._position = self.windows.state_dict()


def build_validation_loader(
    v: Validation, t: Training, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, pin_memory: bool = False
) -> DataLoader:
    """This DP rank's slice of the validation set's global batches, from the set's start, once through (the
    iteration ends with the set; an incomplete last round of dp_degree x local batch windows is dropped)."""
    records, files = load_text_dataset(v.dataset, v.dataset_path, "validation")
    text_key = DATASETS[v.dataset].text_key if v.dataset in DATASETS else "text"
    source = f"validation.dataset_path {v.dataset_path}" if v.dataset_path else f"validation.dataset {v.dataset}"
    batch, seq_len = validation_shape(v, t)
    windows = TokenWindows(
        records, tokenizer, seq_len, text_key, source, files, loop=False, seq_len_key="validation.seq_len"
    )
    return DataLoader(windows, batch, dp_rank, dp_degree, prefetch=t.data_prefetch, pin_memory=pin_memory)


def dataset_fingerprint(cfg: Training, files: list[str] | None) -> dict[str, Any]:
    """What identifies the training data in a checkpoint: the hub dataset id, or each local file's path
    (relative to the dataset folder) and size, `files` being the loader's (TokenWindows.shard_files). Moving
    the data keeps it; adding, removing, editing or replacing a file changes it. Cheap: a stat per file."""
    if files is None:
        spec = DATASETS[cfg.dataset]
        return {"hub": f"{spec.path}/{spec.hub_config}"}
    path = cfg.dataset_path if cfg.dataset_path is not None else DATASETS[cfg.dataset].path
    root = path if os.path.isdir(path) else os.path.dirname(path)
    return {"files": [[os.path.relpath(f, root), os.path.getsize(f)] for f in files]}


def build_dataloader(
    cfg: Training, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, pin_memory: bool = False
) -> DataLoader:
    """This DP rank's loader over the global sample order (every rank streams the whole dataset)."""
    records, files = load_text_dataset(cfg.dataset, cfg.dataset_path)
    text_key = DATASETS[cfg.dataset].text_key if cfg.dataset in DATASETS else "text"
    source = f"training.dataset_path {cfg.dataset_path}" if cfg.dataset_path else f"training.dataset {cfg.dataset}"
    windows = TokenWindows(records, tokenizer, cfg.seq_len, text_key, source, files)
    return DataLoader(
        windows, cfg.local_batch_size, dp_rank, dp_degree, prefetch=cfg.data_prefetch, pin_memory=pin_memory
    )
