"""The checkpoint folder's housekeeping: one run per folder, names kiln owns, retention by save order.

Rules (docs/checkpoint.md):
- One run per folder: rank 0 holds an exclusive `fcntl.flock` on `{folder}/.kiln.lock` (holding `pid@host`) for
  the run's life; the kernel releases it when the process dies, so a killed run never blocks the next one.
- kiln writes only `step-N` (full checkpoints, the resume points), `export-step-N` (weights-only exports, never
  resumed from) and their `.tmp` folders while a save is in flight. A `.tmp` holds `.kiln-saving` from the
  moment it has its name: kiln makes it as `.kiln-new-*`, marks it, then renames it, so a kill at any moment
  leaves either a marked `.tmp` or a `.kiln-new-*`; a folder kiln deletes is first renamed `.kiln-removing-*`.
  Only marked `.tmp` folders and those two private names are ever removed as "a killed save"; other names are
  never touched.
- Nothing kiln writes, truncates or removes follows a link (kiln_base/files.py): the lock file, the marks, a
  `.tmp` in the way are refused when they are links.
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
import secrets
import socket
import time
from typing import Any

import torch.distributed as dist

from kiln_base.errors import CheckpointError
from kiln_base.files import (
    FileRefused,
    loads_json,
    open_no_follow,
    read_bounded,
    remove_tree,
    writable_dir_problem,
    write_atomic,
)

logger = logging.getLogger("kiln")

MARKER = "kiln.json"  # written into every checkpoint kiln publishes
SAVING = ".kiln-saving"  # written into step-N.tmp when kiln starts a save there
LOCK_FILE = ".kiln.lock"
NEW, REMOVING = ".kiln-new-", ".kiln-removing-"  # private names: a save being created, a folder being deleted
# The names save_name writes: no leading zeros, at most 18 digits (a step is an int64).
STEP_NAME = re.compile(r"^(export-)?step-(0|[1-9]\d{0,17})(\.tmp)?$")
MARKER_LIMIT = 1 << 20  # kiln.json is ~1 KB


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
        mark = os.path.join(self.path, SAVING)
        return self.tmp and os.path.isfile(mark) and not os.path.islink(mark)

    def marker(self) -> dict[str, Any] | None:
        """kiln.json, or None when absent or unreadable (then kiln cannot prove it wrote this)."""
        try:
            marker = loads_json(read_bounded(os.path.join(self.path, MARKER), MARKER_LIMIT, "a kiln.json"))
        except (OSError, ValueError):
            return None
        return marker if isinstance(marker, dict) else None

    def place(self) -> str:
        """Where this checkpoint is, as kiln.json's written_to records it (the resolved path)."""
        return os.path.realpath(self.path)

    def published_here(self) -> dict[str, Any] | None:
        """kiln.json if it proves kiln published this very folder (save order and place recorded), else None."""
        marker = self.marker()
        if (
            self.tmp
            or marker is None
            or not isinstance(marker.get("save_seq"), int)
            or marker.get("written_to") != self.place()
            or marker.get("step") != self.step
            or bool(marker.get("model_weights_only")) != self.export
            or not self.has_metadata
        ):
            return None
        return marker


def scan(folder: str, others: bool = False) -> list[Entry]:
    """The names kiln may own under `folder` (directories only), in step order; with `others`, instead, those names
    held by something else (a symbolic link, a file, a FIFO): never loaded, written through or removed, and a save
    that would use one is refused at start."""
    if not os.path.isdir(folder):
        return []
    entries = []
    for name in os.listdir(folder):
        m = STEP_NAME.match(name)
        path = os.path.join(folder, name)
        real_dir = os.path.isdir(path) and not os.path.islink(path)
        if m and real_dir != others:
            entries.append(Entry(path, int(m.group(2)), bool(m.group(1)), bool(m.group(3))))
    return sorted(entries, key=lambda e: (e.step, e.export, e.tmp))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Write JSON durably and atomically (temp file, fsync, rename), never through a link."""
    write_atomic(path, json.dumps(obj, indent=1).encode())


# ---------------------------------------------------------------------------------------------- claiming


def agree(error: str | None) -> str | None:
    """Every rank learns the first rank's error (rank order), so all ranks raise the same one or none does."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # object collectives run on CPU (gloo) in kiln's process groups
    return next((e for e in errors if e is not None), None)


def _check_writable(folder: str) -> str | None:
    """Create `folder` if needed and prove it takes a new file; the error line, or None."""
    problem = writable_dir_problem(folder)
    return None if problem is None else f"checkpoint folder {folder} (job.dump_folder + checkpoint.folder) {problem}"


class FolderLock:
    """Rank 0's exclusive flock on `{folder}/.kiln.lock` for the run's life (released by close or process death)."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK_FILE)
        try:
            self._fd: int | None = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except (OSError, FileRefused) as e:
            raise CheckpointError(f"checkpoint folder {folder}: cannot take its lock: {e}") from None
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
        error = agree(error)  # every rank raises, or none does
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
    """Rank 0, before a save: create `name.tmp` with the .kiln-saving mark; refuse to write over anything.

    The folder is made under a private name (`.kiln-new-*`), marked, then renamed: a `.tmp` never exists
    without its mark, so a kill at any moment leaves nothing the next start must refuse."""
    final = os.path.join(folder, name)
    tmp = final + ".tmp"
    if os.path.lexists(final):
        raise CheckpointError(f"{final} already exists; kiln does not write over a checkpoint: move it out of {folder}")
    if os.path.lexists(tmp):
        if os.path.islink(tmp) or not Entry(tmp, 0, False, True).kiln_saving:
            what = "a symbolic link" if os.path.islink(tmp) else "not a save kiln started"
            raise CheckpointError(f"{tmp} exists and is {what}; move it out of {folder}")
        _remove_owned(folder, tmp)  # our own killed save (the folder lock proves its writer is gone)
    new = os.path.join(folder, f"{NEW}{name}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(new)
    write_json(os.path.join(new, SAVING), {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
    os.rename(new, tmp)


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
            _remove_owned(folder, e.path)


def _remove_owned(folder: str, path: str) -> None:
    """Delete `path`, a folder kiln owns in `folder`: first renamed to a private `.kiln-removing-*` name (one
    atomic step), so a kill half-way leaves a name kiln removes at its next start, never a half-deleted `.tmp`
    or checkpoint that looks like something else. A link is refused (kiln_base.files.remove_tree)."""
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link; kiln never removes through a link: move it out of {folder}")
    trash = os.path.join(folder, f"{REMOVING}{os.path.basename(path)}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(path, trash)
    except OSError as e:  # left as it was: a good checkpoint stays one, a killed save is tried again next start
        logger.warning(f"Could not delete {path} ({e}); left in place")
        return
    try:
        remove_tree(trash)
    except OSError as e:  # kiln's own private name: retried at the next start
        logger.warning(f"Could not finish deleting {trash} ({e}); the next start retries")


def remove_killed_save(folder: str, name: str) -> None:
    """Rank 0, after a failed write of save `name`: delete its `.tmp` when it is kiln's (marked, not a link)."""
    tmp = os.path.join(folder, name + ".tmp")
    if Entry(tmp, 0, False, True).kiln_saving and not os.path.islink(tmp):
        _remove_owned(folder, tmp)


def remove_killed_saves(folder: str) -> None:
    """Rank 0, at start: delete `.tmp` folders of kiln's own killed saves and kiln's private `.kiln-new-*` /
    `.kiln-removing-*` folders (the lock proves their writers are gone); warn about other `.tmp` names."""
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if name.startswith((NEW, REMOVING)) and os.path.isdir(path) and not os.path.islink(path):
            logger.warning(f"Removing {path}: kiln's own folder from a save or deletion that was killed")
            _remove_owned(folder, path)
    for e in scan(folder):
        if not e.tmp:
            continue
        if e.kiln_saving:
            logger.warning(f"Removing {e.path}: a save that was killed before it completed")
            _remove_owned(folder, e.path)
        else:
            logger.warning(f"Leaving {e.path} alone: not a save kiln started (no {SAVING})")
