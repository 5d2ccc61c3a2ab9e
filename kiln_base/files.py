"""Files that someone else may have made: a stranger's checkpoint, a shared folder, a careless config.

The rules, each in one function here (docs/checkpoint.md, "A checkpoint from a stranger"):

    inside(folder, name)            a file a record names lies inside the record's folder: no absolute path, no
                                    `..` leading out of it (a link inside the folder is read where it points:
                                    the Hugging Face cache links every file to its blob)
    read_bounded(path, limit)       a regular file (never a FIFO, device or folder: reading one hangs or never
                                    ends) of at most `limit` bytes, checked before a byte is read
    require_regular(path)           the same type check, for large files read in pieces (data, weights)
    loads_json(data)                JSON nested no deeper than Python can parse (a RecursionError is a ValueError)
    open_no_follow(path, flags)     a file kiln writes or truncates, never through a link (symbolic or hard)
    write_atomic(path, data)        a file kiln writes whole: `.part` (no link followed), fsync, rename
    remove_tree(path)               a folder kiln owns, never through a link
    writable_dir_problem(path)      a folder kiln will write: created now and proven to take a file
    url_scheme(path)                `s3` for `s3://bucket/run`: a URL names object storage, never a local folder
    output_location(dump, path)     checkpoint.folder under job.dump_folder, or the URL itself
    object_store_problem(url)       why kiln cannot keep checkpoints at this URL (scheme, bucket, package), or None

Each raises FileRefused (a ValueError, so the callers' `except (OSError, ValueError)` turn it into their own
ConfigError, CheckpointError or DataError naming the key) with a message that names the path. Standard library
only: the config parser uses it too.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shutil
import stat
import tempfile
from typing import Any

MiB = 2**20


class FileRefused(ValueError):
    """A file or record kiln will not read or write: where it points, its type, its size or its nesting."""


def inside(folder: str, name: Any, what: str) -> str:
    """The path of `name`, a file named by a record of `folder` (`what` names the record), checked to lie inside
    `folder`: a relative path whose `..` never leads out of it."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise FileRefused(f"{what} names {name!r}, not a file name inside {folder}")
    if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == "..":
        raise FileRefused(
            f"{what} names {name!r}, outside {folder}: a checkpoint's records must name files inside its own folder"
        )
    return os.path.join(folder, name)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def require_regular(path: str) -> None:
    """Raise FileRefused unless `path` (links followed) is a regular file; OSError when it cannot be stat'ed."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise FileRefused(f"{path} is {_kind(mode)}, not a regular file")


def read_bounded(path: str, limit: int, what: str) -> bytes:
    """The bytes of regular file `path`, refused (FileRefused) when it is larger than `limit` bytes (`what` says
    what it is, for the message). Opened without blocking, so a FIFO is refused instead of waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"{path} is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise FileRefused(
                f"{path} is {st.st_size:,} bytes, more than kiln reads for {what} ({limit // MiB} MiB at most)"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)  # a file that grew since fstat is still cut at the limit
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileRefused(f"{path} grew past {limit // MiB} MiB while kiln read it ({what})")
    return data


def loads_json(data: str | bytes) -> Any:
    """json.loads, with nesting too deep for Python's parser (100,000 `[`) a ValueError like any other bad JSON."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested deeper than kiln parses (JSON arrays/objects inside each other)") from None


def open_no_follow(path: str, flags: int, mode: int = 0o644) -> int:
    """os.open of a file kiln writes, never through a link (O_NOFOLLOW: a link, dangling or not, is refused) and
    only a regular file; the descriptor."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FileRefused(
                f"{path} is a symbolic link; kiln never writes, truncates or removes through a link (remove it)"
            ) from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader (O_NONBLOCK: refused instead of waited on)
            raise FileRefused(
                f"{path} is a FIFO (named pipe); kiln writes only regular files there (remove it)"
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FileRefused(f"{path} is {_kind(st.st_mode)}; kiln writes only regular files there (remove it)")
    if st.st_nlink > 1:  # a hard link: the same file under another name, maybe outside the folder
        os.close(fd)
        raise FileRefused(
            f"{path} has {st.st_nlink - 1} other hard link(s); kiln writes only files of its own (remove it)"
        )
    return fd


def write_atomic(path: str, data: bytes) -> None:
    """Write `path` durably and atomically: `path.part` (created or truncated, never through a link), fsync,
    rename over `path` (a rename replaces a link itself, never what it points to)."""
    part = path + ".part"
    fd = open_no_follow(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(part, path)


def refuse_link(path: str) -> None:
    """Raise FileRefused when `path` is a symbolic link (before a write by a library that opens by name)."""
    if os.path.islink(path):
        raise FileRefused(f"{path} is a symbolic link; kiln never writes or removes through a link (remove it)")


def remove_tree(path: str) -> None:
    """Delete folder `path` kiln owns; a link in its place is refused, links inside it are removed, never
    followed (shutil.rmtree's fd-based walk)."""
    refuse_link(path)
    shutil.rmtree(path)


def writable_dir_problem(folder: str) -> str | None:
    """Create `folder` if needed and prove it takes a new file (O_EXCL, never through a link); what is wrong, or
    None. Run at start for every folder a run writes, so a read-only or misplaced one fails before training, not
    at the first save or trace hours later."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        return "exists and is not a directory"
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kiln-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"is not usable: {e.strerror or e} (checked at start, before training)"
    return None


# Object stores kiln keeps checkpoints in: URL scheme -> (the fsspec package that implements it, kiln's extra).
# gcs:// is fsspec's other name for gs://.
OBJECT_STORES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_ALMOST_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)")
_URL_SCHEMES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "hdfs", "http", "https", "file"}  # what a typo is taken for


def url_scheme(path: str) -> str | None:
    """The scheme of a URL (`s3` for `s3://bucket/run/checkpoint`), lower case; None for a local path. A URL is
    never a path: joined under job.dump_folder, `s3://b/x` would be a local folder named `s3:`."""
    m = _URL.match(path)
    return m.group(1).lower() if m else None


def output_location(dump_folder: str, path: str) -> str:
    """Where a run writes `path` (checkpoint.folder): under job.dump_folder (an absolute path as it is), or a URL as
    it is (object storage, never joined as a local folder)."""
    return path.rstrip("/") if url_scheme(path) is not None else os.path.join(dump_folder, path)


def object_store_problem(url: str) -> str | None:
    """Why kiln cannot keep checkpoints at URL `url` (an unknown scheme, no bucket, its package not installed), or
    None: a local path, or a store kiln supports with its package installed. Looks the package up without
    importing it (s3fs pulls in botocore, ~1 s)."""
    scheme = url_scheme(url)
    if scheme is None:
        typo = _ALMOST_URL.match(url)  # s3:/b/p, a slash short: it would be a local folder named `s3:`
        if typo and typo.group(1).lower() in _URL_SCHEMES:
            return f"{url} is not a URL (a slash short?) nor a folder kiln would write; write {typo.group(1)}://..."
        return None
    if not url.startswith(f"{scheme}://"):  # fsspec knows its protocols in lower case only
        return f"write the scheme in lower case: {scheme}://{url[len(scheme) + 3 :]}"
    if scheme not in OBJECT_STORES:
        return (
            f"{scheme}:// is not an object store kiln supports; use s3://BUCKET/PREFIX (S3 or an S3-compatible store "
            "through AWS_ENDPOINT_URL), gs://BUCKET/PREFIX (Google Cloud Storage) or a local folder"
        )
    if not url[len(scheme) + 3 :].split("/", 1)[0]:
        return f"names no bucket; write {scheme}://BUCKET/PREFIX"
    package, extra = OBJECT_STORES[scheme]
    if importlib.util.find_spec(package) is None:
        return (
            f"{scheme}:// needs the {package} package, which is not installed (pip install {package}, or kiln's "
            f"extra: pip install -e '.[{extra}]')"
        )
    return None
