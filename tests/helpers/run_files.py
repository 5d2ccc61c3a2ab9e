"""Read back what a run wrote for its dashboards: an offline W&B run's .wandb file, TensorBoard event files.

wandb (0.31) ships no reader for its own files in Python any more (the Go core writes them), so the .wandb file is
read here: a LevelDB-log of protobuf `Record`s (wandb.proto.wandb_internal_pb2), as wandb's former Python
DataStore documented it: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each
with a 7-byte header (CRC32 of type + data, length, type FULL/FIRST/MIDDLE/LAST); a block's tail shorter than a
chunk header is zero padding. Every CRC is checked, so a misread fails loudly.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """Every protobuf Record of a .wandb file, in the order written."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[: len(HEADER)] == HEADER, f"{path}: not a .wandb file ({data[:7]!r})"
    i, pending = len(HEADER), b""
    while i + CHUNK_HEADER <= len(data):
        left = BLOCK - i % BLOCK
        if left < CHUNK_HEADER:  # block trailer
            i += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[i : i + CHUNK_HEADER])
        chunk = data[i + CHUNK_HEADER : i + CHUNK_HEADER + length]
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF, f"{path}: bad CRC at byte {i}"
        i += CHUNK_HEADER + length
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@dataclass
class OfflineRun:
    folder: Path
    project: str
    name: str
    config: dict[str, Any]  # wandb.init's config, as recorded with the run
    history: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> {key: value}, wandb's `_*` dropped


def finished_records(run_file: Path, timeout_s: float = 60.0) -> list[Any]:
    """The run's records once its `exit` record is on disk: wandb's `run.finish()` returns before its core process
    has flushed the file (measured: a 14-record run read empty right after finish in 3 of 6 tries)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(wandb_records(run_file))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def read_offline_run(folder: Path) -> OfflineRun:
    """The one offline run under `folder` (a wandb.init `dir`): its project, name, config and logged rows."""
    (run_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    run: OfflineRun | None = None
    rows: list[dict[str, Any]] = []
    for record in finished_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            config = {item.key: json.loads(item.value_json) for item in r.config.update if item.key != "_wandb"}
            run = OfflineRun(run_file.parent, r.project, r.display_name, config)
        elif kind == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    assert run is not None, f"{run_file}: no run record"
    for row in rows:
        step = int(row["_step"])
        run.history.setdefault(step, {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return run


def tensorboard_scalars(folder: Path) -> dict[int, dict[str, float]]:
    """step -> {tag: value} of every scalar in the TensorBoard event files under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out
