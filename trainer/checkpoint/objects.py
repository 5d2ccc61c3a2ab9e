"""Checkpoints in object storage (`s3://BUCKET/PREFIX` through fsspec's s3fs, `gs://BUCKET/PREFIX` through gcsfs):
the local folder's promises on a store that has no rename, no lock and no partial listing guarantees beyond what it
wrote.

Layout: the local folder's names as key prefixes: `{url}/step-N/` holds `.metadata`, one `__R_0.distcp` per rank,
`.kiln-saving` and `kiln.json`; `{url}/.kiln.lock` is the one-job lock. kiln reads no other key.

- A step counts only once its kiln.json exists, and kiln.json is written last: rank 0 writes `step-N/.kiln-saving`
  first (the prefix is kiln's from then on); every rank has DCP write its files into a local staging folder through
  ChecksummingWriter (the CRC-32 of each staged file) and uploads them under `step-N/`; once every rank's upload has
  succeeded, rank 0 uploads `.metadata`, then kiln.json with every file's checksum. A kill at any moment before
  leaves a prefix without kiln.json: never loaded, never counted as the latest, and (it holds `.kiln-saving`)
  deleted at the next start as a killed save. A prefix without either is not kiln's: left alone, never written into.
- keep_latest_k deletes only steps whose kiln.json proves kiln published them at this URL (save_seq and written_to,
  as folder.Entry.published_here), by save order: kiln.json first (the step stops counting), `.kiln-saving` last
  (until then the rest is a killed save, removed at the next start).
- Loading downloads a step's `.metadata` and kiln.json into a local folder (plain names only, so a key cannot name a
  place outside the download), checks the index against the listed sizes of the `.distcp` objects, and, for the
  step chosen, fetches only the bytes this rank's DCP load plan reads (read once: N ranks fetch about one
  checkpoint in all, not N): each `.distcp` whole on one rank, which checks its whole-file checksum, and the other
  ranks' ranges of it checked against that copy (fetch_planned, check_ranges). The copy is read exactly as a local
  checkpoint: `.metadata` through the restricted unpickler, each record inside the folder
  (trainer/checkpoint/reader.py).
- One job per URL: rank 0 creates `.kiln.lock` with a conditional put (S3: If-None-Match: *; GCS: ifGenerationMatch=0;
  fsspec's pipe_file mode="create" in both), which the store refuses
  when the object exists, so two jobs cannot both take it; the run deletes it when it ends. A run killed without
  its end (SIGKILL, a lost node) leaves it: the next run refuses, naming the holder and the object to delete.
- Every request is retried with backoff (TRIES per scheme, BACKOFF_S doubling: on S3 5 tries, 15 s of waits, on top
  of botocore's and s3fs's own retries: a refused connection takes ~8 s a try, ~53 s in all; on GCS 2, as gcsfs
  retries each request 6 times itself over ~31 s of waits), then fails as one CheckpointError line naming the URL;
  no such bucket or a refused permission is not retried. gcsfs's own log records (a traceback per request it gives
  up) are kept out of the log: kiln's warning per try and its one line say it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch.distributed as dist

from kiln_base.errors import CheckpointError
from kiln_base.files import FileRefused, loads_json, url_scheme
from trainer.checkpoint.folder import (
    LOCK_FILE,
    MARKER,
    MARKER_LIMIT,
    SAVING,
    STEP_NAME,
    Entry,
    FolderClaim,
    agree,
)

logger = logging.getLogger("kiln")

# kiln's tries per scheme: gcsfs already retries a failed connection, a 5xx, 408 or 429 six times with doubling
# waits (~31 s), so 5 kiln tries of it took 200 s to report an unreachable store; botocore tries 5 times without
# waiting long, so S3 keeps kiln's 5.
TRIES = {"s3": 5, "gs": 2}
BACKOFF_S = 1.0  # then 2, 4, 8 s: S3's 5 tries wait ~15 s before a request is given up
METADATA = ".metadata"
HEAD = (METADATA, MARKER)  # what a load downloads of every step it considers; the data files only of the chosen one
# The names a step prefix may hold that kiln downloads: DCP's index, kiln.json and the ranks' data files.
_READ = re.compile(r"^(\.metadata|kiln\.json|__\d{1,6}_\d{1,6}\.distcp)$")
_NOT_TRANSIENT = (FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
# botocore's and google-auth's, by name (this module imports neither): no credentials will not appear on a retry
_NOT_TRANSIENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "NoRegionError", "DefaultCredentialsError"}
# Per scheme: where credentials come from, where the endpoint is set, how a user deletes a left lock.
_HINTS = {
    "s3": ("AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "aws s3 rm"),
    "gs": (
        "GOOGLE_APPLICATION_CREDENTIALS or gcloud auth application-default login",
        "STORAGE_EMULATOR_HOST",
        "gcloud storage rm",
    ),
}
T = TypeVar("T")


def _not_transient(e: Exception) -> bool:
    """A failure a retry will not fix: a refused permission (gcsfs raises a plain OSError 'Forbidden' for a 403),
    missing credentials, an object that exists where kiln asked for none."""
    if isinstance(e, _NOT_TRANSIENT) or type(e).__name__ in _NOT_TRANSIENT_NAMES:
        return True
    return type(e) is OSError and str(e).startswith("Forbidden")


def _reason(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


class ObjectStore:
    """The fsspec filesystem behind one checkpoint URL; every request retried (`retried`). Credentials and the
    endpoint come from the standard environment (S3: AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws, an instance role;
    GCS: Application Default Credentials, STORAGE_EMULATOR_HOST)."""

    def __init__(self, url: str, sleep: Callable[[float], None] = time.sleep) -> None:
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        self.sleep = sleep
        scheme = "s3" if url.startswith("s3://") else "gs"
        self.hints, self.tries = _HINTS[scheme], TRIES[scheme]
        if scheme == "gs":  # gcsfs logs an ERROR and traceback for each request it gives up; kiln says it in one line
            logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
        # No listing cache: kiln lists right after it writes or deletes, and must see what is there now.
        self.fs, self.root = url_to_fs(self.url, use_listings_cache=False, skip_instance_cache=True)
        self.root = self.root.rstrip("/")

    def key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def retried(self, what: str, name: str, fn: Callable[[], T], absent_ok: bool = False) -> T:
        """fn(), tried again after a transient failure (a timeout, a dropped connection, a 5xx), `tries` times in
        all with doubling waits; then one CheckpointError naming the URL. A refused permission or a missing bucket
        is one at once; with `absent_ok` a missing object raises FileNotFoundError (the caller asked if it exists)."""
        for attempt in range(1, self.tries + 1):
            try:
                return fn()
            except FileNotFoundError:
                if absent_ok:
                    raise
                raise CheckpointError(
                    f"object storage: {what} {self.where(name)} failed: no such bucket or object (check the URL)"
                ) from None
            except Exception as e:  # fsspec, botocore and gcsfs raise many types for a transient failure
                if _not_transient(e):
                    raise CheckpointError(
                        f"object storage: {what} {self.where(name)} failed: {_reason(e)}"
                        + (
                            f" (check the credentials: {self.hints[0]})"
                            if type(e).__name__ in _NOT_TRANSIENT_NAMES
                            else ""
                        )
                    ) from None
                if attempt == self.tries:
                    raise CheckpointError(
                        f"object storage: {what} {self.where(name)} failed after {self.tries} tries: {_reason(e)} "
                        f"(check the network, the credentials and {self.hints[1]})"
                    ) from None
                logger.warning(f"object storage: {what} {self.where(name)} failed ({_reason(e)}); trying again")
                self.sleep(BACKOFF_S * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def listing(self) -> dict[str, dict[str, int]]:
        """Every key under the URL, as {first name: {each name below it: its size}}; a top-level object maps to
        {"": its size}."""
        keys = self.retried("listing", "", lambda: self.fs.find(self.root, detail=True))
        out: dict[str, dict[str, int]] = {}
        for key, info in keys.items():
            rel = key[len(self.root) + 1 :] if key.startswith(self.root + "/") else None
            if not rel:
                continue
            head, _, rest = rel.partition("/")
            size = info.get("size") if isinstance(info, dict) else None
            out.setdefault(head, {})[rest] = size if isinstance(size, int) else -1
        return out

    def read(self, name: str, limit: int) -> bytes:
        """The object's bytes, refused past `limit` (FileRefused); FileNotFoundError when it does not exist."""
        data = self.retried(
            "reading", name, lambda: self.fs.cat_file(self.key(name), start=0, end=limit + 1), absent_ok=True
        )
        if len(data) > limit:  # a ValueError, as read_bounded's refusal: "not kiln's" to the callers
            raise FileRefused(f"{self.where(name)} is larger than the {limit:,} bytes kiln reads for it")
        return data

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the object (a ranged GET)."""
        return self.retried(
            "reading", name, lambda: self.fs.cat_file(self.key(name), start=offset, end=offset + length)
        )

    def write(self, name: str, data: bytes) -> None:
        self.retried("writing", name, lambda: self.fs.pipe_file(self.key(name), data))

    def create(self, name: str, data: bytes) -> bool:
        """Write the object only if it does not exist (a conditional put); False when it exists."""

        def put() -> bool:
            try:
                self.fs.pipe_file(self.key(name), data, mode="create")
            except FileExistsError:
                return False
            return True

        return self.retried("creating", name, put)

    def upload(self, local: str, name: str) -> None:
        self.retried("uploading to", name, lambda: self.fs.put_file(local, self.key(name)))

    def download(self, name: str, local: str) -> None:
        self.retried("downloading", name, lambda: self.fs.get_file(self.key(name), local))

    def remove(self, name: str) -> None:
        """Delete the object; one already gone is fine (a retried delete that succeeded the first time)."""

        def rm() -> None:
            try:
                self.fs.rm_file(self.key(name))
            except FileNotFoundError:
                pass

        self.retried("deleting", name, rm)


@dataclasses.dataclass(frozen=True)
class ObjectEntry(Entry):
    """One `step-N` / `export-step-N` prefix in object storage: `files`, the names under it when it was listed."""

    files: frozenset[str] = frozenset()
    store: ObjectStore | None = dataclasses.field(default=None, compare=False, repr=False)
    sizes: Mapping[str, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)  # file: bytes
    # True: `store` is the step's own prefix (step_entry: an initial load's source, maybe a bucket's top), so a
    # file's key is its name; else `store` is the checkpoint folder's and the key is `name/file`.
    own_store: bool = dataclasses.field(default=False, compare=False, repr=False)

    def key(self, file: str) -> str:
        """The key of the step's `file` in `store`."""
        return file if self.own_store else f"{self.name}/{file}"

    @property
    def has_metadata(self) -> bool:
        """Complete: its kiln.json, written last, exists (and its index)."""
        return METADATA in self.files and MARKER in self.files

    @property
    def kiln_saving(self) -> bool:
        """A save kiln started here and never published (or a deletion kiln began): kiln's to remove. Such a
        prefix is listed as `tmp`, as a local `.tmp` folder is: never loaded, counted or purged."""
        return self.tmp

    def marker(self) -> dict[str, Any] | None:
        if MARKER not in self.files or self.store is None:
            return None
        try:
            marker = loads_json(self.store.read(self.key(MARKER), MARKER_LIMIT))
        except (FileNotFoundError, ValueError):
            return None
        return marker if isinstance(marker, dict) else None

    def place(self) -> str:
        return self.path


def scan_objects(store: ObjectStore) -> list[ObjectEntry]:
    """The step prefixes kiln may own under the URL, in step order (one listing)."""
    entries = []
    for name, below in store.listing().items():
        m = STEP_NAME.match(name)
        if m and not m.group(3):  # no `.tmp` names in object storage: a step is published in place
            sizes = {n: size for n, size in below.items() if n and "/" not in n}
            files = frozenset(sizes)
            saving = SAVING in files and MARKER not in files
            entries.append(
                ObjectEntry(store.where(name), int(m.group(2)), bool(m.group(1)), saving, files, store, sizes)
            )
    return sorted(entries, key=lambda e: (e.step, e.export))


def remove_step(store: ObjectStore, entry: ObjectEntry) -> None:
    """Delete a step prefix kiln owns: kiln.json first (it stops counting), `.kiln-saving` last (until then what is
    left is a killed save, removed at the next start)."""
    rest = sorted(entry.files - {MARKER, SAVING})
    for name in ([MARKER] if MARKER in entry.files else []) + rest + [SAVING]:
        store.remove(f"{entry.name}/{name}")


def prepare_object_save(store: ObjectStore, name: str) -> None:
    """Rank 0, before a save: mark `name/` as kiln's with `.kiln-saving`; refuse a prefix that holds a checkpoint
    or objects kiln did not start; remove kiln's own killed save there (the lock proves its writer is gone)."""
    entry = next((e for e in scan_objects(store) if e.name == name), None)
    if entry is not None and entry.files:
        if MARKER in entry.files:
            raise CheckpointError(
                f"{entry.path} already exists; kiln does not write over a checkpoint: delete it from the bucket or "
                "set another checkpoint.folder"
            )
        if not entry.kiln_saving:
            raise CheckpointError(
                f"{entry.path}/ holds objects kiln did not write ({sorted(entry.files)[0]}, ...); kiln writes no step "
                "there: delete them or set another checkpoint.folder"
            )
        remove_step(store, entry)
    mark = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    store.write(f"{name}/{SAVING}", json.dumps(mark).encode())


def upload_step(store: ObjectStore, local: str, name: str, files: Iterable[str]) -> None:
    """This rank's files of save `name`, from its staging folder `local`, under `name/`."""
    for file in sorted(files):
        store.upload(os.path.join(local, file), f"{name}/{file}")


def publish_object(store: ObjectStore, name: str, marker: dict[str, Any]) -> None:
    """Rank 0, once every rank's files and `.metadata` are uploaded: kiln.json, last (with save order and place)."""
    seqs = [m.get("save_seq") for e in scan_objects(store) if (m := e.marker()) is not None]
    seq = 1 + max((s for s in seqs if isinstance(s, int)), default=0)
    marker = {**marker, "save_seq": seq, "written_to": store.where(name)}
    store.write(f"{name}/{MARKER}", json.dumps(marker, indent=1).encode())


def purge_objects(store: ObjectStore, keep: int) -> None:
    """keep_latest_k: per kind (full, export), delete all but the newest `keep` saves kiln published at this URL."""
    if keep <= 0:
        return
    entries = scan_objects(store)
    for export in (False, True):
        ours = [(m["save_seq"], e) for e in entries if e.export == export and (m := e.published_here())]
        for _, e in sorted(ours, key=lambda x: x[0])[:-keep]:
            logger.info(f"checkpoint.keep_latest_k={keep}: deleting {e.path} (superseded)")
            try:
                remove_step(store, e)
            except CheckpointError as err:  # the new step is published: a failed deletion does not fail the save
                logger.warning(
                    f"{err}; {e.path} is deleted by a later save, or at the next start once its kiln.json is gone"
                )
                return


def remove_killed_object_save(store: ObjectStore, name: str) -> None:
    """Rank 0, after a failed save of `name`: delete what it wrote (its prefix is kiln's and unpublished)."""
    entry = next((e for e in scan_objects(store) if e.name == name), None)
    if entry is not None and entry.kiln_saving:
        remove_step(store, entry)


def remove_killed_object_saves(store: ObjectStore) -> None:
    """Rank 0, at start: delete kiln's own killed saves (`.kiln-saving`, no kiln.json); warn about other prefixes
    without kiln.json (not kiln's: left alone, never loaded)."""
    for e in scan_objects(store):
        if e.kiln_saving:
            logger.warning(f"Removing {e.path}/: a save that was killed before it completed (no {MARKER})")
            remove_step(store, e)
        elif MARKER not in e.files:
            logger.warning(
                f"Leaving {e.path}/ alone: no {MARKER} (not a complete checkpoint) and not a save kiln started"
            )


# The names of a Hugging Face folder kiln downloads (it reads only safetensors, never pickled .bin files).
HF_READ = re.compile(r"^(config\.json|model\.safetensors\.index\.json|[A-Za-z0-9_.-]{1,200}\.safetensors)$")


def top_names(store: ObjectStore) -> set[str]:
    """The names of the objects right under the URL (one listing)."""
    return {head for head, below in store.listing().items() if "" in below}


def download_prefix(url: str, local: str, hf: bool) -> None:
    """The files kiln reads right under `url` (a kiln step prefix, or with `hf` a Hugging Face folder: plain names
    only, as download_step) into the existing local folder `local`."""
    store = ObjectStore(url)
    for name in sorted(n for n in top_names(store) if (HF_READ if hf else _READ).match(n)):
        store.download(name, os.path.join(local, name))


def step_entry(url: str) -> ObjectEntry:
    """The kiln step prefix at `url`, of any name (an initial load's source: also a bucket's top), as an entry
    download_step and fetch_planned read: the objects right under it, listed once, with their sizes."""
    store = ObjectStore(url)
    sizes = {n: below[""] for n, below in store.listing().items() if "" in below}
    return ObjectEntry(store.url, 0, False, False, frozenset(sizes), store, sizes, own_store=True)


def newest_complete(store: ObjectStore) -> ObjectEntry | None:
    """The newest step under the URL that its kiln.json completes (an export wins a tie, as resolve_step_dir)."""
    done = [e for e in scan_objects(store) if not e.tmp and e.has_metadata]
    return max(done, key=lambda e: (e.step, e.export)) if done else None


def download_step(entry: ObjectEntry, local_root: str, names: Iterable[str] = HEAD) -> str:
    """Download files `names` of step `entry` (by default its head: `.metadata` and kiln.json) into
    `local_root/<its name>`, each once; that folder. Only names kiln reads (_READ), and only objects the step
    holds: a load downloads the head first, then the data files its own load plan reads (read once)."""
    assert entry.store is not None
    local = os.path.join(local_root, entry.name)
    os.makedirs(local, exist_ok=True)
    for name in sorted(n for n in set(names) & entry.files if _READ.match(n)):
        if not os.path.exists(os.path.join(local, name)):
            entry.store.download(entry.key(name), os.path.join(local, name))
    return local


def fetch_planned(
    entry: ObjectEntry, local: str, ranges: dict[str, list[tuple[int, int]]]
) -> tuple[set[str], list[tuple[str, int, int, int]]]:
    """Every rank (a collective): fetch into `local` (the step's download, its head there) the bytes this rank's
    load plan reads, `ranges` ({data file: (offset, length) ranges}, reader.planned_ranges). Each file a plan reads
    is downloaded whole by one rank, the one whose plan reads most of it (its own shards: `__R_0.distcp` on rank R
    when the layout is the saved one); the others fetch only their ranges, into a sparse file at their offsets, so
    DCP reads it as the whole file. Returns (the files this rank has whole, its ranges fetched as (file, offset,
    length, CRC-32)): check_ranges checks the latter against the former's owners."""
    assert entry.store is not None
    rank = dist.get_rank() if dist.is_initialized() else 0
    wants: list[dict[str, int]] = [{f: sum(n for _, n in r) for f, r in ranges.items()}]
    if dist.is_initialized() and dist.get_world_size() > 1:
        wants = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(wants, {f: sum(n for _, n in r) for f, r in ranges.items()})
    whole, fetched = set(), []
    error = None
    try:
        for file, spans in sorted(ranges.items()):
            owner = max(range(len(wants)), key=lambda r: (wants[r].get(file, 0), -r))
            target = os.path.join(local, file)
            if owner == rank or len(wants) == 1:
                download_step(entry, os.path.dirname(local), [file])
                whole.add(file)
                continue
            with open(target, "wb") as out:
                out.truncate(entry.sizes.get(file, 0))  # sparse: the bytes not fetched read as zeros, unread
                for offset, length in spans:
                    data = entry.store.read_range(entry.key(file), offset, length)
                    out.seek(offset)
                    out.write(data)
                    fetched.append((file, offset, length, zlib.crc32(data)))
    except CheckpointError as e:
        error = str(e)
    # Every rank raises the first rank's failure together: a rank stopped alone would leave the others to be
    # ended mid-download by the launcher, their downloads left behind.
    error = agree(error)
    if error is not None:
        raise CheckpointError(error)
    return whole, fetched


def check_ranges(local: str, whole: set[str], fetched: list[tuple[str, int, int, int]], where: str) -> None:
    """Every rank (a collective), after verify() checked the files each rank has whole: each range a rank fetched
    of a file another has whole (fetch_planned) must have the CRC-32 of those bytes in that rank's checked copy; a
    mismatch (a damaged or changed object) is one CheckpointError naming the file, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    asked: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(asked, fetched)
    error = agree(range_mismatch(local, whole, [item for items in asked for item in items], where))
    if error is not None:
        raise CheckpointError(error)


def range_mismatch(local: str, whole: set[str], asked: list[tuple[str, int, int, int]], where: str) -> str | None:
    """The first of the ranges `asked` (file, offset, length, CRC-32) of a file this rank has whole whose bytes in
    that copy have another CRC-32, as the error line; None when all match."""
    for file, offset, length, crc in asked:
        if file in whole:
            with open(os.path.join(local, file), "rb") as f:
                f.seek(offset)
                if zlib.crc32(f.read(length)) != crc:
                    return (
                        f"checkpoint file {where}/{file} is damaged: bytes {offset:,}-{offset + length:,} one rank "
                        "fetched differ from the same bytes of the copy another rank checked against kiln.json's "
                        "checksum; not loaded: copy the checkpoint again from a good copy, or resume from another "
                        "checkpoint (checkpoint.load_step)"
                    )
    return None


class ObjectLock:
    """Rank 0's `.kiln.lock` object for the run's life, taken with a conditional put (module docstring)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store: ObjectStore | None = None
        holder = f"{os.getpid()}@{socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        if not store.create(LOCK_FILE, holder.encode()):
            try:
                held = store.read(LOCK_FILE, 256).decode(errors="replace").strip()
            except FileNotFoundError:
                held = "a run that has just ended"
            except FileRefused:
                held = "not a kiln lock: larger than kiln writes"
            raise CheckpointError(
                f"checkpoint folder {store.url} is in use by another kiln run ({held or 'unknown'}; lock "
                f"{store.where(LOCK_FILE)}): one run per folder; wait for it or stop it, or set another "
                "checkpoint.folder. A run killed without ending (SIGKILL, a lost node) leaves the lock: if that run is "
                f"gone, delete the lock object ({store.hints[2]} URL/.kiln.lock)"
            )
        self.store = store

    def release(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            store.remove(LOCK_FILE)


class ObjectClaim(FolderClaim):
    """A run's claim on its object-storage URL: rank 0 holds the lock object until release; every rank learns a
    refusal (the lock taken proves the bucket is reachable and writable)."""

    def __init__(self, store: ObjectStore) -> None:
        self.folder = store.url
        self._lock = None
        self._object_lock: ObjectLock | None = None
        error = None
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            try:
                self._object_lock = ObjectLock(store)
            except CheckpointError as e:
                error = str(e)
        error = agree(error)
        if error is not None:
            self.release()
            raise CheckpointError(error)

    def release(self) -> None:
        if self._object_lock is not None:
            lock, self._object_lock = self._object_lock, None
            lock.release()


def claim_folder(folder: str) -> FolderClaim:
    """The run's claim on its checkpoint folder: a local folder's flock, or an object-storage URL's lock object."""
    return ObjectClaim(ObjectStore(folder)) if url_scheme(folder) is not None else FolderClaim(folder)
