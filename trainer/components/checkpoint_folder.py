"""The checkpoint folder's housekeeping: one run per folder, names kiln owns, retention by save order.

Rules (docs/checkpoint.md):
- One run per folder: rank 0 holds an exclusive `fcntl.flock` on `{folder}/.kiln.lock` (holding `pid@host`) for
  the run's life; the kernel releases it when the process dies, so a killed run never blocks the next one.
- kiln writes only `step-N` (full checkpoints, the resume points), `export-step-N` (weights-only exports, never
  resumed from) and their `.tmp` folders while a save is in flight. A `.tmp` holds `.kiln-saving` from the
  moment kiln creates it; only such a folder is ever removed as "a killed save". Other names are never touched.
- keep_latest_k deletes only checkpoints whose kiln.json proves kiln published them in this very folder
  (`save_seq` and `written_to`), by save order, per kind; the newest save is always kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from typing import Any

import torch.distributed as dist

from kiln_base.errors import CheckpointError

logger = logging.getLogger("kiln")

MARKER = "kiln.json"  # written into every checkpoint kiln publishes
SAVING = ".kiln-saving"  # written into step-N.tmp when kiln starts a save there
LOCK_FILE = ".kiln.lock"
_NAME = re.compile(r"^(export-)?step-(\d+)(\.tmp)?$")


def save_name(step: int, export: bool) -> str:
    return f"{'export-' if export else ''}step-{step}"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One `step-N` / `export-step-N` (optionally `.tmp`) name in the checkpoint folder."""

    path: str
    step: int
    export: bool
    tmp: bool

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def has_metadata(self) -> bool:
        return os.path.isfile(os.path.join(self.path, ".metadata"))

    @property
    def kiln_saving(self) -> bool:
        """A `.tmp` kiln created for a save (and, as the folder lock is ours now, one whose writer is gone)."""
        return self.tmp and os.path.isfile(os.path.join(self.path, SAVING))

    def marker(self) -> dict[str, Any] | None:
        """kiln.json, or None when absent or unreadable (then kiln cannot prove it wrote this)."""
        try:
            with open(os.path.join(self.path, MARKER)) as f:
                marker = json.load(f)
        except (OSError, ValueError):
            return None
        return marker if isinstance(marker, dict) else None

    def published_here(self) -> dict[str, Any] | None:
        """kiln.json if it proves kiln published this very folder (save order and place recorded), else None."""
        marker = self.marker()
        if (
            self.tmp
            or marker is None
            or not isinstance(marker.get("save_seq"), int)
            or marker.get("written_to") != os.path.realpath(self.path)
            or marker.get("step") != self.step
            or bool(marker.get("model_weights_only")) != self.export
            or not self.has_metadata
        ):
            return None
        return marker


def scan(folder: str) -> list[Entry]:
    """The names kiln may own under `folder` (directories only), in step order."""
    if not os.path.isdir(folder):
        return []
    entries = []
    for name in os.listdir(folder):
        m = _NAME.match(name)
        path = os.path.join(folder, name)
        if m and os.path.isdir(path) and not os.path.islink(path):
            entries.append(Entry(path, int(m.group(2)), bool(m.group(1)), bool(m.group(3))))
    return sorted(entries, key=lambda e: (e.step, e.export, e.tmp))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Write JSON durably and atomically (temp file, fsync, rename)."""
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


# ---------------------------------------------------------------------------------------------- claiming


def _agree(error: str | None) -> str | None:
    """Every rank learns the first rank's error (rank order), so all ranks raise the same one or none does."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # object collectives run on CPU (gloo) in kiln's process groups
    return next((e for e in errors if e is not None), None)


def _check_writable(folder: str) -> str | None:
    """Create `folder` if needed and prove it takes a new file; the error line, or None."""
    where = f"checkpoint folder {folder} (job.dump_folder + checkpoint.folder)"
    if os.path.lexists(folder) and not os.path.isdir(folder):
        return f"{where} exists and is not a directory"
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kiln-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{where} is not usable: {e.strerror or e} (checked at start, before training)"
    return None


class FolderLock:
    """Rank 0's exclusive flock on `{folder}/.kiln.lock` for the run's life (released by close or process death)."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK_FILE)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 256, 0).decode(errors="replace").strip() or "unknown pid@host"
            os.close(self._fd)
            self._fd = None
            pid, _, host = holder.partition("@")
            raise CheckpointError(
                f"checkpoint folder {folder} is in use by another kiln run (pid {pid} on {host or 'unknown host'}, "
                f"lock {self.path}): one run per folder; wait for it or stop it, or set another checkpoint.folder"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}@{socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class FolderClaim:
    """A run's claim on its checkpoint folder: checked writable on every rank, locked by rank 0 until release."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        rank = dist.get_rank() if dist.is_initialized() else 0
        error = _check_writable(folder)
        self._lock = None
        if error is None and rank == 0:
            try:
                self._lock = FolderLock(folder)
            except CheckpointError as e:
                error = str(e)
        error = _agree(error)  # every rank raises, or none does
        if error is not None:
            self.release()
            raise CheckpointError(error)

    def release(self) -> None:
        """Let go of the lock (rank 0); idempotent."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None


# ---------------------------------------------------------------------------------------------- saving


def prepare_save(folder: str, name: str) -> None:
    """Rank 0, before a save: create `name.tmp` with the .kiln-saving mark; refuse to write over anything."""
    final = os.path.join(folder, name)
    tmp = final + ".tmp"
    if os.path.lexists(final):
        raise CheckpointError(f"{final} already exists; kiln does not write over a checkpoint: move it out of {folder}")
    if os.path.lexists(tmp):
        if not Entry(tmp, 0, False, True).kiln_saving:
            raise CheckpointError(f"{tmp} exists and is not a save kiln started; move it out of {folder}")
        shutil.rmtree(tmp)  # our own killed save (the folder lock proves its writer is gone)
    os.makedirs(tmp)
    write_json(os.path.join(tmp, SAVING), {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})


def next_save_seq(folder: str) -> int:
    """1 + the highest save_seq recorded in kiln.json of any checkpoint in `folder`."""
    seqs = [m.get("save_seq") for e in scan(folder) if not e.tmp and (m := e.marker()) is not None]
    return 1 + max((s for s in seqs if isinstance(s, int)), default=0)


def publish(folder: str, name: str, marker: dict[str, Any]) -> str:
    """Rank 0, after every rank's files are written: kiln.json (with save order and place), rename, fsync."""
    final = os.path.join(folder, name)
    tmp = final + ".tmp"
    marker = {**marker, "save_seq": next_save_seq(folder), "written_to": os.path.realpath(final)}
    write_json(os.path.join(tmp, MARKER), marker)
    os.rename(tmp, final)
    _fsync_dir(folder)  # make the rename itself durable
    with contextlib.suppress(FileNotFoundError):  # a kill before this leaves a stray mark in a complete folder
        os.remove(os.path.join(final, SAVING))
    return final


def purge(folder: str, keep: int) -> None:
    """keep_latest_k: per kind (full, export), delete all but the newest `keep` saves kiln published here."""
    if keep <= 0:
        return
    for export in (False, True):
        ours = [(m["save_seq"], e) for e in scan(folder) if e.export == export and (m := e.published_here())]
        for _, e in sorted(ours, key=lambda x: x[0])[:-keep]:
            logger.info(f"checkpoint.keep_latest_k={keep}: deleting {e.path} (superseded)")
            shutil.rmtree(e.path, ignore_errors=True)


def remove_killed_saves(folder: str) -> None:
    """Rank 0, at start: delete `.tmp` folders of kiln's own killed saves; warn about other `.tmp` names."""
    for e in scan(folder):
        if not e.tmp:
            continue
        if e.kiln_saving:
            logger.warning(f"Removing {e.path}: a save that was killed before it completed")
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            logger.warning(f"Leaving {e.path} alone: not a save kiln started (no {SAVING})")
