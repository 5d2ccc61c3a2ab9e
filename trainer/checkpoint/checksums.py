"""Checksums of a checkpoint's files: recorded when each file is written, verified before a load reads it.

A flipped bit in a `.distcp` file (bit rot on a disk, a bad copy between clusters) would otherwise load and train
on silently: DCP's records carry no checksum, and a flipped bit inside a tensor is a valid tensor.

Saving: every rank writes its files through ChecksummingWriter (DCP's FileSystemWriter), which, right after its
writes and in the same thread (a background thread under checkpoint.async_mode), computes the CRC-32 of each file it
wrote and leaves them in a small sidecar, `.kiln-checksums-<rank>.json`. When the save is complete, rank 0 merges the
sidecars and the checksum of `.metadata` into kiln.json (`"checksums": {"__0_0.distcp": "crc32:1a2b3c4d", ...}`)
and removes them (collect). CRC-32: the fastest of the digests the standard library offers on the CPUs measured
(docs/checkpoint.md, "Checksums"); it catches every single flipped bit and every burst of up to 32, which is
what it is for: damage, not an attacker (who could rewrite kiln.json as well).

Loading: verify() checks the files of the checkpoint about to be loaded against kiln.json before any record is
read, each rank a share of them (file i on rank i mod world), and every rank raises the first mismatch: one line
naming the file. From object storage each rank checks the files it downloaded whole (`only`), and the byte ranges
it fetched of others' files are checked against those files' checked copies (objects.check_ranges). The checks
cover the whole checkpoint, not only what its record lists: every file a load reads (`.metadata` and each
`.distcp`) must have a checksum (an entry deleted, or an emptied map, beside a damaged file is
refused), and a kiln.json that exists but cannot be read (cut in half, not JSON, its checksums not a map) is damage,
refused naming it. Only a checkpoint with no kiln.json, or one whose kiln.json records no checksums at all (saved by
an older kiln, torchtitan, or converted), loads, with one line saying it is unverified.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Collection
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from kiln_base.errors import CheckpointError
from kiln_base.files import FileRefused, MiB, loads_json, read_bounded, require_regular, write_atomic
from trainer.checkpoint.folder import MARKER, MARKER_LIMIT

logger = logging.getLogger("kiln")

SIDECAR = ".kiln-checksums-"  # + rank + ".json", in the save's .tmp folder until rank 0 collects it
METADATA = ".metadata"
_CHUNK = 8 * MiB


def file_checksum(path: str) -> str:
    """`crc32:<8 hex digits>` of the file's bytes, read in 8 MiB pieces (_CHUNK)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer, recording the checksum of every file this rank writes (module docstring); `sums` holds
    them once written (object storage gathers them from every rank instead of reading the sidecars), `bytes` their
    size."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sums: dict[str, str] = {}
        self.bytes = 0  # the size of the files it wrote

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        done = super().write_data(plan, planner)  # FileSystemWriter writes before it returns (a completed future)
        files = sorted({r.storage_data.relative_path for r in done.value()})
        sums = {name: file_checksum(os.path.join(self.path, name)) for name in files}
        rank = dist.get_rank() if dist.is_initialized() else 0
        write_atomic(os.path.join(self.path, f"{SIDECAR}{rank}.json"), json.dumps(sums).encode())
        self.sums = sums
        self.bytes = sum(os.path.getsize(os.path.join(self.path, name)) for name in files)
        return done


def collect(folder: str) -> dict[str, str]:
    """Rank 0, once every rank's files and `.metadata` are written: every file's checksum (the ranks' sidecars and
    `.metadata`'s), the sidecars removed."""
    sums: dict[str, str] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith(SIDECAR):
            path = os.path.join(folder, name)
            sums.update(loads_json(read_bounded(path, 64 * MiB, "a checksum list")))
            os.remove(path)
    sums[METADATA] = file_checksum(os.path.join(folder, METADATA))
    return sums


def recorded_checksums(path: str) -> dict[str, Any] | None:
    """The checksums checkpoint `path`'s kiln.json records: None when it has no kiln.json or its kiln.json no
    "checksums" (saved before kiln recorded them, or by another tool); a kiln.json that exists but cannot be read, or
    whose checksums are not a map, is damage: CheckpointError naming it."""
    marker = os.path.join(path, MARKER)
    try:
        saved = loads_json(read_bounded(marker, MARKER_LIMIT, "a kiln.json"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint record {marker} exists but cannot be read ({e}): a damaged or cut copy; not loaded: copy "
            "the checkpoint again from a good copy, or resume from another checkpoint (checkpoint.load_step)"
        ) from None
    sums = saved.get("checksums") if isinstance(saved, dict) else None
    if not isinstance(saved, dict) or (sums is not None and not isinstance(sums, dict)):
        raise CheckpointError(
            f"checkpoint record {marker} is damaged: {'its checksums are' if isinstance(saved, dict) else 'it is'} "
            "not a JSON object; not loaded: copy the checkpoint again from a good copy, or resume from another "
            "checkpoint (checkpoint.load_step)"
        )
    return sums


def verify(path: str, only: Collection[str] | None = None) -> None:
    """Check checkpoint `path`'s files against the checksums its kiln.json records, each rank its share; every rank
    raises the first mismatch (rank order), or a file a load reads that has no checksum, as a CheckpointError naming
    the file. A checkpoint that records none: one warning, and nothing checked.

    `only`: `path` is this rank's download of an object-storage step (read once): this rank checks these files of
    it, each whole, and no others (the ranks that fetched the rest whole check those; objects.check_ranges the
    ranges fetched of them)."""
    sums = recorded_checksums(path)
    if sums is None:
        logger.warning(f"Checkpoint {path} records no checksums (saved by an older kiln or another tool): unverified")
        return
    # Every file a load reads, whatever the record lists: a deleted entry must not hide a damaged file.
    unlisted = sorted(n for n in os.listdir(path) if (n == METADATA or n.endswith(".distcp")) and n not in sums)
    if unlisted:
        raise CheckpointError(  # every rank lists the same folder: all raise the same, no collective to agree on
            f"checkpoint file {os.path.join(path, unlisted[0])} has no checksum in {os.path.join(path, MARKER)} "
            "(every file a load reads must have one: the record was edited or cut); not loaded: copy the checkpoint "
            "again from a good copy, or resume from another checkpoint (checkpoint.load_step)"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if only is not None:
        sums = {n: want for n, want in sums.items() if n in only}
    error = None
    for i, (name, want) in enumerate(sorted(sums.items())):
        if only is not None or i % world == rank:
            error = _mismatch(path, name, want)
            if error is not None:
                break
    if world > 1:
        errors: list[str | None] = [None] * world
        dist.all_gather_object(errors, error)  # object collectives run on CPU (gloo) in kiln's process groups
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CheckpointError(error)


def _mismatch(path: str, name: Any, want: Any) -> str | None:
    if not isinstance(name, str) or os.sep in name or name in ("", ".", ".."):
        return f"checkpoint {path}: its kiln.json lists a checksum for {name!r}, not a file name in the folder"
    file = os.path.join(path, name)
    try:
        require_regular(file)
        got = file_checksum(file)
    except (OSError, FileRefused) as e:
        return f"checkpoint file {file} cannot be checked against its checksum: {e}"
    if got != want:
        return (
            f"checkpoint file {file} is damaged: its checksum is {got}, kiln.json recorded {want} when it was saved "
            "(a flipped bit on disk or in a copy); not loaded: copy the file again from a good copy, or resume from "
            "another checkpoint (checkpoint.load_step)"
        )
    return None
