"""Checksums of a checkpoint's files: recorded when each file is written, verified before a load reads it.

A flipped bit in a `.distcp` file (bit rot on a disk, a bad copy between clusters) would otherwise load and train
on silently: DCP's records carry no checksum, and a flipped bit inside a tensor is a valid tensor.

Saving: every rank writes its files through ChecksummingWriter (DCP's FileSystemWriter), which computes the CRC-32
of each file from the bytes as they are written (a helper thread checksums each piece while the writing thread hands
it to the OS: the file is not read back; a background thread under checkpoint.async_mode) and leaves them in a small
sidecar, `.kiln-checksums-<rank>.json`. torch.save's own CRC-32 of each record inside a file is switched off for
those writes (it covered the same bytes again; torch.load does not need it). When the save is complete, rank 0
merges the sidecars and the checksum of `.metadata` into kiln.json (`"checksums": {"__0_0.distcp": "crc32:1a2b3c4d",
...}`) and removes them (collect). CRC-32: the fastest of the digests the standard library offers on the CPUs measured
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

import contextlib
import io
import json
import logging
import os
import zlib
from collections.abc import Collection, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from kiln_base.errors import CheckpointError
from kiln_base.files import FileRefused, MiB, loads_json, read_bounded, require_regular, write_atomic
from trainer.checkpoint.folder import MARKER, MARKER_LIMIT, agree

logger = logging.getLogger("kiln")

SIDECAR = ".kiln-checksums-"  # + rank + ".json", in the save's .tmp folder until rank 0 collects it
METADATA = ".metadata"
_CHUNK = 8 * MiB


def file_checksum(path: str) -> str:
    """`crc32:<8 hex digits>` of the file's bytes, read in 8 MiB pieces (_CHUNK); a file of several pieces is read
    and checksummed at once: piece i's CRC on a helper thread while this thread reads piece i + 1 (both release the
    GIL), so a cold file goes at about the disk's rate, not the disk's plus zlib's."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size <= 2 * _CHUNK:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
            return f"crc32:{crc:08x}"
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-crc") as pool:
            chunk = f.read(_CHUNK)
            while chunk:
                pending = pool.submit(zlib.crc32, chunk, crc)
                chunk = f.read(_CHUNK)
                crc = pending.result()
    return f"crc32:{crc:08x}"


class _ChecksummedFile:
    """A file opened for writing whose CRC-32 follows the bytes written to it: each piece is checksummed on `pool`'s
    thread while this thread writes it (zlib and the write both release the GIL). Pieces under _INLINE (records'
    headers) are checksummed here. DCP and torch.save write each file front to back; a seek would break that, so
    `sequential` goes False and the writer reads the file back instead."""

    _INLINE = 1 * MiB

    def __init__(self, file: io.BufferedWriter, pool: ThreadPoolExecutor) -> None:
        self._file = file
        self._pool = pool
        self.crc = 0
        self.written = 0
        self.sequential = True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _CHUNK):
            piece = view[start : start + _CHUNK]
            if piece.nbytes < self._INLINE:
                self.crc = zlib.crc32(piece, self.crc)
                self._file.write(piece)
            else:
                crc = self._pool.submit(zlib.crc32, piece, self.crc)
                self._file.write(piece)
                self.crc = crc.result()  # before returning: the caller may reuse its buffer then
        self.written += view.nbytes
        return view.nbytes

    def seek(self, *args: Any) -> int:
        self.sequential = False
        return self._file.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (DCP's fsync), close, ...: the file's own
        return getattr(self._file, name)


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, its files for writing opened as _ChecksummedFile; `files` holds each one written."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, _ChecksummedFile] = {}
        self.pool: ThreadPoolExecutor | None = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb" or self.pool is None:  # .metadata (checksummed by collect), and reads
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as f:
            checked = _ChecksummedFile(f, self.pool)
            self.files[os.path.basename(path)] = checked
            yield checked  # type: ignore[misc]  # a file-like DCP writes, tells, flushes and fsyncs


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer, recording the checksum of every file this rank writes (module docstring); `sums` holds
    them once written (object storage gathers them from every rank instead of reading the sidecars), `bytes` their
    size."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _ChecksummingFileSystem()
        self.sums: dict[str, str] = {}
        self.bytes = 0  # the size of the files it wrote

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fs = self.fs
        assert isinstance(fs, _ChecksummingFileSystem)
        record_crc = torch.serialization.get_crc32_options()
        fs.files, fs.pool = {}, ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-crc")
        # For the span of this write, in the thread that writes (torch 2.13 keeps the setting per thread; where a
        # torch keeps it per process, another thread's torch.save meanwhile skips it too: harmless, torch.load does
        # not check it).
        torch.serialization.set_crc32_options(False)
        try:
            done = super().write_data(plan, planner)  # FileSystemWriter writes before it returns (a completed future)
        finally:
            torch.serialization.set_crc32_options(record_crc)
            fs.pool.shutdown()
            fs.pool = None
        files = sorted({r.storage_data.relative_path for r in done.value()})
        sums = {}
        for name in files:
            path = os.path.join(self.path, name)
            stream = fs.files.get(name)
            if stream is not None and stream.sequential and stream.written == os.path.getsize(path):
                sums[name] = f"crc32:{stream.crc:08x}"
            else:  # not written front to back through the stream: read it back
                sums[name] = file_checksum(path)
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
    agree_on(check_files(path, only))


def check_files(path: str, only: Collection[str] | None = None) -> str | None:
    """verify()'s reading part, on this rank alone (no collective: it may run on a helper thread beside the
    training thread's own collectives): the first mismatch among this rank's share, or None. agree_on() then makes
    every rank raise the first rank's. A kiln.json that cannot be read raises here (every rank reads the same one)."""
    sums = recorded_checksums(path)
    if sums is None:
        logger.warning(f"Checkpoint {path} records no checksums (saved by an older kiln or another tool): unverified")
        return None
    # Every file a load reads, whatever the record lists: a deleted entry must not hide a damaged file.
    unlisted = sorted(n for n in os.listdir(path) if (n == METADATA or n.endswith(".distcp")) and n not in sums)
    if unlisted:  # every rank lists the same folder: all find the same
        return (
            f"checkpoint file {os.path.join(path, unlisted[0])} has no checksum in {os.path.join(path, MARKER)} "
            "(every file a load reads must have one: the record was edited or cut); not loaded: copy the checkpoint "
            "again from a good copy, or resume from another checkpoint (checkpoint.load_step)"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if only is not None:
        sums = {n: want for n, want in sums.items() if n in only}
    for i, (name, want) in enumerate(sorted(sums.items())):
        if only is not None or i % world == rank:
            error = _mismatch(path, name, want)
            if error is not None:
                return error
    return None


def agree_on(error: str | None) -> None:
    """Every rank raises the first rank's check_files error (rank order) as a CheckpointError; nothing if none."""
    error = agree(error)
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
