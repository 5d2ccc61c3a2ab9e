"""Where the text comes from: the registered datasets, local files and their formats, the first-record check,
and the streaming HF `datasets` source. Torch-free, so the launcher and train.py check a dataset before any
rank imports torch (`check_data_source`); trainer/data/text.py tokenizes and batches what this yields.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kiln_base.config import Training, Validation
from kiln_base.errors import ConfigError, DataError
from kiln_base.files import loads_json, require_regular

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class DatasetSpec:
    path: str  # local file/folder, or a hub dataset id when `hub` is set
    hub_config: str | None = None
    hub: bool = False
    text_key: str = "text"
    split: str = "train"  # a hub dataset's split


CORPUS = os.path.join(REPO_ROOT, "assets", "corpus")
DATASETS: dict[str, DatasetSpec] = {
    "kiln_corpus": DatasetSpec(os.path.join(CORPUS, "kiln_corpus.jsonl")),
    # The held-out split (validation's default): documents the generator made after the training ones, none of
    # them in kiln_corpus (scripts/make_corpus.py).
    "kiln_corpus_validation": DatasetSpec(os.path.join(CORPUS, "kiln_corpus_validation.jsonl")),
    "c4": DatasetSpec("allenai/c4", hub_config="en", hub=True),
    "c4_validation": DatasetSpec("allenai/c4", hub_config="en", hub=True, split="validation"),
}


def _registered(name: str, section: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ConfigError(
            f"{section}.dataset: unknown dataset '{name}'; registered: {', '.join(DATASETS)} "
            f"(or set {section}.dataset_path)"
        )
    return DATASETS[name]


_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def _local_files(path: str, section: str) -> tuple[str, list[str]]:
    """The `datasets` builder name and the data files for a local file or folder (`section`.dataset_path)."""
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
        raise ConfigError(f"{section}.dataset_path: no .jsonl/.json/.parquet/.txt files under {path}")
    kinds = {_FORMATS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(
            f"{section}.dataset_path: {path} must hold files of one format: .jsonl, .json, .parquet or .txt"
        )
    kind = kinds.pop()
    assert kind is not None
    for f in files:
        try:
            require_regular(f)  # a FIFO or device would block the first read, or never end
        except OSError as e:
            raise ConfigError(f"{section}.dataset_path: cannot read {f}: {e.strerror or e}") from None
        except ValueError as e:
            raise ConfigError(f"{section}.dataset_path: {e} (give .jsonl/.json/.parquet/.txt files)") from None
        _check_readable(f, kind)
    return kind, files


def _check_readable(path: str, kind: str) -> None:
    """Fail now, naming the file, rather than mid-run: open it and check its first record."""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            pq.read_metadata(path)
            return
        problem = first_bad_record(path, "text", max_records=1)
    except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError
        raise DataError(f"data file {path}: cannot read: {e}") from None
    if problem is not None:
        raise DataError(f"data file {path}, {problem}")


_JSON_TYPES = {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number"}


def record_problem(record: Any, key: str) -> str | None:
    """Why `record` (a parsed record) cannot be trained on, or None."""
    if not isinstance(record, dict):
        return f"not a JSON object but {_JSON_TYPES.get(type(record), type(record).__name__)}"
    if key not in record:
        return f"no '{key}' field (has: {', '.join(record) or 'nothing'})"
    value = record[key]
    if value is None:
        return f"'{key}' is null"
    if not isinstance(value, str):
        return f"'{key}' is {_JSON_TYPES.get(type(value), type(value).__name__)}, not a string"
    return None


def first_bad_record(path: str, key: str, max_records: int | None = None) -> str | None:
    """'record R (line L): why' for the first record of a .jsonl or .txt file that cannot be trained on.

    Used before training (first record) and after `datasets` failed or yielded a bad value, to name the exact
    line: `datasets` reads JSON in blocks, so its own error cannot say which line (blank lines are not records).
    """
    ext = os.path.splitext(path)[1]
    if ext not in (".jsonl", ".txt"):
        return None
    record = 0
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if max_records is not None and record >= max_records:
                return None
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"record {record + 1} (line {line_no}): not UTF-8 (byte 0x{raw[e.start]:02x})"
            if ext == ".txt":  # every line is a record
                record += 1
                continue
            if not line.strip():  # JSON Lines readers skip blank lines
                continue
            record += 1
            try:
                problem = record_problem(loads_json(line.rstrip("\r\n")), key)
            except json.JSONDecodeError as e:
                return f"record {record} (line {line_no}): not valid JSON ({e.msg}, column {e.colno})"
            except ValueError as e:  # nested too deep to parse
                return f"record {record} (line {line_no}): not valid JSON ({e})"
            if problem is not None:
                return f"record {record} (line {line_no}): {problem}; every record needs a string '{key}' field"
    return None


class JsonLinesFiles:
    """Local .jsonl files, one shard per file, read line by line with the standard library. The bundled corpus
    and most local data need no `datasets`, whose import alone costs every rank ~2 s (pandas and pyarrow)."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.n_shards = len(files)

    def records(self, shard: int, start: int) -> Iterator[Any]:
        """The parsed records of `shard` from record `start` on (blank lines are not records, as for `datasets`;
        those before `start` are counted, not parsed). A line that is not UTF-8 JSON raises ValueError."""
        seen = 0
        with open(self.files[shard], "rb") as fh:
            for raw in fh:
                if not raw.decode("utf-8").strip():
                    continue
                if seen >= start:
                    yield loads_json(raw)
                seen += 1


class HFStream:
    """A streaming HF IterableDataset (a hub dataset, or local .json/.parquet/.txt files), one shard per file."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds
        self.n_shards: int = ds.n_shards

    def records(self, shard: int, start: int) -> Iterator[Any]:
        ds = self.ds if self.n_shards == 1 else self.ds.shard(num_shards=self.n_shards, index=shard)
        return iter(ds.skip(start) if start else ds)


def load_text_dataset(
    name: str, path: str | None, section: str = "training"
) -> tuple[JsonLinesFiles | HFStream, list[str] | None]:
    """The records of a registered name or a local path (`section`'s dataset keys), and its shards' file names
    (None for a hub dataset)."""
    if path is None:
        spec = _registered(name, section)
        if spec.hub:
            import datasets  # lazy: heavy import

            try:
                return HFStream(
                    datasets.load_dataset(spec.path, name=spec.hub_config, split=spec.split, streaming=True)
                ), None
            except Exception as e:  # offline, gated, renamed: whatever the hub says, it is not a kiln bug
                raise ConfigError(
                    f"{section}.dataset {name}: cannot open {spec.path} on the Hugging Face hub ({e}); "
                    f"use {section}.dataset_path for local data"
                ) from None
        path = spec.path
    builder, files = _local_files(path, section)
    if all(f.endswith(".jsonl") for f in files):
        return JsonLinesFiles(files), files
    import datasets  # lazy: heavy import

    # kiln names the file and line of a malformed record itself; the json builder's own ERROR log line about
    # the same failure would be a second, less precise line on stderr.
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
    except StopIteration:  # what `datasets` raises when it infers the columns from empty files
        raise DataError(f"{section}.dataset_path {path}: no records in {', '.join(files)}") from None
    if ds.n_shards != len(files):  # one shard per file is what names files in errors
        raise AssertionError(f"expected one shard per file, got {ds.n_shards} shards for {len(files)} files")
    return HFStream(ds), files


def check_data_source(cfg: Training | Validation, n_words: int | None = None) -> None:
    """The dataset name is registered, and a local dataset's files exist, share one format and start with a
    good record (ConfigError / DataError naming the key, file and line). A hub dataset is only named here.
    Token files (with the tokenizer's `n_words`) are opened and checked: headers, index against token file, dtype
    and recorded largest id against the vocabulary (trainer/data/token_files.py)."""
    section = "validation" if isinstance(cfg, Validation) else "training"
    from trainer.data.token_files import is_token_path

    mix = cfg.dataset_mix if isinstance(cfg, Training) else []
    if mix or (cfg.dataset_path is not None and is_token_path(cfg.dataset_path)):
        if n_words is not None:
            from trainer.data.sample_index import open_mixture

            paths = [(s.path, s.weight, s.max_epochs) for s in mix] or [(str(cfg.dataset_path), 1.0, None)]
            seq_len = cfg.seq_len if cfg.seq_len is not None else 1  # validation's unset seq_len: training's
            open_mixture(paths, seq_len, n_words, seed=0, shuffle=False)
        return
    if cfg.dataset_path is not None:
        _local_files(cfg.dataset_path, section)
    elif not (spec := _registered(cfg.dataset, section)).hub:
        _local_files(spec.path, section)
