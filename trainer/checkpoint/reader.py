"""The one reader of checkpoint files kiln did not necessarily write: nothing in them runs, points out of the
folder, inflates, or loads unchecked.

torch.distributed.checkpoint's FileSystemReader unpickles `.metadata` with plain `pickle.load`, reads each record
at whatever path `.metadata` names, lets torch.load inflate a record's zip members to any size, and its
DefaultLoadPlanner loads every non-tensor item (optimizer hyper-parameters, LR-scheduler state, data-loader
position, train step) with `torch.load(weights_only=False)`: a checkpoint someone else wrote, or one altered on
shared storage, could run code, read other files, or exhaust memory on resume. Every kiln loader (trainer resume,
checkpoint.initial_load_path, scripts/convert_hf.py) reads through this module instead:

- read_metadata: `.metadata` goes through MetadataUnpickler, whose find_class admits only DCP's own metadata
  classes and the torch values they hold (listed from real kiln checkpoints with pickletools; see
  METADATA_GLOBALS), and whose BUILD sets state only on instances of DCP's metadata dataclasses (on a class or a
  function it would change them for the whole process). Every record must name a file inside the folder
  (kiln_base.files.inside), carry no stream transform (kiln writes none: they decompress), and fit in its file.
- SafeFileSystemReader (passed to dcp.load by `load`): each record must be a zip whose members are stored, not
  compressed, so it inflates to at most its declared length; each non-tensor item is decoded with
  `torch.load(weights_only=True)` (plain containers, numbers, strings, bytes, tensors) before the planner sees
  it, and the planner gets a re-serialisation of that plain object, so its own weights_only=False load only ever
  meets bytes kiln produced from plain data; a tensor record that needs a global is named, not retried.
- check_loaded_state: every loaded train_state, lr_scheduler and dataloader value against what kiln writes
  (types, ranges, token ids inside the vocabulary, the step against the folder's name), before any is applied.
Anything else raises a CheckpointError naming the folder and the record (UnsafeCheckpointError for code), before
it is called or applied.

Same code for torch 2.11 and 2.13: FileSystemReader, `_slice_file`, the metadata classes and
DefaultLoadPlanner.load_bytes are identical in both (checked against the 2.11 wheel's sources). The private names
kiln relies on: DCP's metadata file name, `.metadata` (and `__R.metadata` for rank-local metadata), in
`_metadata_path`; the record hook and the pure-Python unpickler, in kiln_base/internals.py
(RecordCheckingReader, BuildCheckingUnpickler).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import zipfile
from collections.abc import Iterator, Mapping
from typing import IO, Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.futures import Future

from kiln_base.errors import CheckpointError
from kiln_base.files import FileRefused, inside, require_regular
from kiln_base.internals import BuildCheckingUnpickler, DCPStorageInfo, RecordCheckingReader

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Every global a `.metadata` of a kiln checkpoint holds (weights-only and full saves, 1 and 2 ranks, FSDP),
# listed with pickletools / a recording find_class. Classes only get called with the pickled arguments
# (dataclass constructors, torch.Size, an Enum lookup, PosixPath); _get_layout looks a layout up by name.
METADATA_GLOBALS = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),  # Python 3.13 spells pathlib's module so
        ("pathlib._local", "PurePosixPath"),
    }
)
# The only objects a BUILD opcode may set state on: instances of DCP's metadata dataclasses (as pickle restores
# them). Never a class, a function or a torch value: that would change it for the whole process.
_BUILDABLE = frozenset(
    {
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        DCPStorageInfo,
    }
)
# torch pickles a dtype as the global torch.<name>; read from torch's namespace once, without getattr (which
# would import lazily loaded torch submodules by name).
_DTYPE_NAMES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file needs code that is not plain data to load: refused, nothing of it run."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint with a missing, truncated or unreadable index or data file."""


def _metadata_path(path: str | os.PathLike, rank: int | None = None) -> str:
    # DCP private naming (torch.distributed.checkpoint.filesystem._metadata_fn), the same in torch 2.11 and 2.13.
    return os.path.join(path, ".metadata" if rank is None else f"__{rank}.metadata")


class MetadataUnpickler(BuildCheckingUnpickler):
    """Unpickler for DCP `.metadata`: only METADATA_GLOBALS and torch dtypes resolve, and BUILD only restores
    instances of DCP's metadata dataclasses (the pure-Python unpickler, whose opcodes can be refused)."""

    def __init__(self, file: BinaryIO, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"checkpoint {self.where} refused: its .metadata needs the global {module}.{name}, which is not one of "
            "DCP's metadata types (a crafted or foreign file; kiln does not run code from checkpoints)"
        )

    def check_build(self, target: Any) -> None:
        if type(target) not in _BUILDABLE:
            what = target.__name__ if isinstance(target, type) else type(target).__name__
            raise UnsafeCheckpointError(
                f"checkpoint {self.where} refused: its .metadata sets attributes on {what}, which is not a DCP "
                "metadata record (a crafted file; changing a class or function would change it for the whole process)"
            )


# torch.save's zip around a tensor's bytes: ~1.6 KB measured (data.pkl, byteorder, version, 64-byte alignment).
RECORD_OVERHEAD = 64 * 1024
MAX_BYTES_RECORD = 256 * 2**20  # a non-tensor item: the data-loader's buffer is the largest kiln writes (~MBs)


def _declared_bytes(md: Metadata, index: MetadataIndex, record: str) -> int:
    """The most bytes record `index` may hold: its tensor chunk's elements x dtype size (+ torch.save's zip), or
    MAX_BYTES_RECORD for a non-tensor item. The chunk must lie inside its tensor, whose size the loaders compare
    with their own (check_matches), so no record holds more than what it fills."""
    meta = md.state_dict_metadata.get(index.fqn)
    if isinstance(meta, BytesStorageMetadata):
        return MAX_BYTES_RECORD
    if not isinstance(meta, TensorStorageMetadata) or not isinstance(meta.properties.dtype, torch.dtype):
        raise IncompleteCheckpointError(f"{record} has no tensor or item entry in the index")
    size = tuple(meta.size)
    for chunk in meta.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if not (len(offsets) == len(sizes) == len(size)) or not all(
            type(o) is int and type(n) is int and o >= 0 and n >= 0 and o + n <= whole
            for o, n, whole in zip(offsets, sizes, size)
        ):
            raise IncompleteCheckpointError(f"{record} has a chunk {offsets}+{sizes} outside its tensor {size}")
        if offsets == tuple(index.offset or ()):
            return math.prod(sizes) * meta.properties.dtype.itemsize + RECORD_OVERHEAD
    raise IncompleteCheckpointError(f"{record} names a chunk at {index.offset} that its tensor does not have")


def _check_records(md: Metadata, path: str) -> None:
    """Every record of `md` names a file inside checkpoint folder `path`, at a sane place, without a transform,
    no longer than what it declares."""
    where = f"checkpoint {_metadata_path(path)}"
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict | None):
        raise IncompleteCheckpointError(f"{where} is not a DCP index (its entries are not tables)")
    for index, info in (md.storage_data or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, DCPStorageInfo):
            raise IncompleteCheckpointError(f"{where} is not a DCP index (a record of another type)")
        record = f"{where}: record '{index.fqn}'"
        try:
            inside(path, info.relative_path, record)
        except FileRefused as e:
            raise UnsafeCheckpointError(str(e)) from None
        if not all(type(v) is int and v >= 0 for v in (info.offset, info.length)):
            raise IncompleteCheckpointError(f"{record} has offset {info.offset!r} and length {info.length!r}")
        if info.transform_descriptors:
            raise UnsafeCheckpointError(
                f"{record} is stored through {list(info.transform_descriptors)}: kiln writes plain records only "
                "(a transform decompresses to any size)"
            )
        declared = _declared_bytes(md, index, record)
        if info.length > declared:
            raise UnsafeCheckpointError(
                f"{record} is {info.length:,} bytes, more than the {declared:,} its entry declares: kiln reads no "
                "record larger than what it fills"
            )


def load_metadata(path: str | os.PathLike, rank: int | None = None) -> Metadata:
    """Unpickle the DCP index of checkpoint folder `path` with MetadataUnpickler and check its records."""
    file = _metadata_path(path, rank)
    require_regular(file)  # a FIFO would block the open
    with open(file, "rb") as f:
        data = f.read()  # in memory: a pickled length (BINUNICODE8 of 2**40) reads no further than the file
    md = MetadataUnpickler(io.BytesIO(data), str(path)).load()
    if not isinstance(md, Metadata):
        what = type(md).__name__
        raise UnsafeCheckpointError(f"checkpoint {path} refused: its .metadata holds a {what}, not DCP Metadata")
    _check_records(md, str(path))
    return md


def read_metadata(path: str, sizes: Mapping[str, int] | None = None) -> Metadata:
    """The DCP index of checkpoint folder `path` (load_metadata), checked against its files' sizes: the files in
    the folder, or `sizes` (object storage: the listed size of each object, whose download is `path`, holding the
    index only until a load fetches the files its plan reads).

    Raises UnsafeCheckpointError for code, a record outside the folder or a transform; IncompleteCheckpointError
    for damage (a missing or short file, an unreadable index)."""
    meta_file = _metadata_path(path)
    try:
        md = load_metadata(path)
    except CheckpointError:
        raise
    except Exception as e:  # unpickling garbage can raise almost anything
        reason = " ".join(f"{type(e).__name__}{': ' if str(e) else ''}{e}".split())[:300]
        raise IncompleteCheckpointError(f"checkpoint {meta_file} is corrupt or truncated: {reason}") from None
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, need in sorted(needed.items()):
        f = os.path.join(path, rel)
        listed = sizes.get(rel) if sizes is not None else (os.path.getsize(f) if os.path.isfile(f) else None)
        if listed is None:
            raise IncompleteCheckpointError(
                f"checkpoint file {f} is missing or not a regular file (listed in {meta_file})"
            )
        size = listed
        if size < need:
            raise IncompleteCheckpointError(f"checkpoint file {f} is truncated: {size} bytes, its index needs {need}")
    return md


# torch 2.11/2.13 name a refused global as "Unsupported global: GLOBAL m.n ..." or "... unsupported GLOBAL m.n whose
# module m is blocked"; any other weights-only failure ("Unsupported operand 0") is damage, not code.
_REFUSED_GLOBAL = re.compile(r"[Uu]nsupported(?: global:)? GLOBAL ([\w.]+)")


def _load_failure(e: pickle.UnpicklingError, where: str, fqn: str) -> CheckpointError:
    """The line for a weights_only load that failed: code refused, or damage (never torch's advice to retry with
    weights_only=False)."""
    text = str(e)
    m = _REFUSED_GLOBAL.search(text)
    if m:
        return UnsafeCheckpointError(
            f"checkpoint {where} refused: item '{fqn}' needs the global {m.group(1)}, which is not plain data "
            "(torch.load weights_only=True; kiln does not run code from checkpoints)"
        )
    detail = text.split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:300]
    return CheckpointError(f"checkpoint {where} could not be read (corrupt?): item '{fqn}': {detail}")


def load_plain(data: BinaryIO, where: str, fqn: str) -> Any:
    """torch.load(weights_only=True) of one non-tensor checkpoint item; a refused global is an UnsafeCheckpointError."""
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _load_failure(e, where, fqn) from None


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, seekable (zipfile reads the directory at the end)."""

    def __init__(self, file: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise OSError("seek before the start of the record")
        self._pos = base + pos
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._length - self._pos))
        self._file.seek(self._offset + self._pos)
        data = self._file.read(n)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def check_record(file: IO[bytes], info: Any, where: str, fqn: str) -> None:
    """Record `fqn` (`info`: where it lies in `file`) is a zip of stored (uncompressed) members, each inside the
    record: what torch.save writes, and what inflates to no more than the record's declared length."""
    try:
        with zipfile.ZipFile(_Window(file, info.offset, info.length)) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CheckpointError(
            f"checkpoint {where} could not be read (corrupt?): item '{fqn}' is not a torch.save record ({e})"
        ) from None
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size:
            raise UnsafeCheckpointError(
                f"checkpoint {where} refused: item '{fqn}' has a compressed member {m.filename} ({m.compress_size:,} "
                f"bytes inflating to {m.file_size:,}): kiln reads records that are stored, never inflated"
            )
        if m.header_offset + m.file_size > info.length:
            raise CheckpointError(
                f"checkpoint {where} could not be read (corrupt?): item '{fqn}' has a member past its end"
            )


class _PlainBytesPlanner:
    """Wraps a LoadPlanner: non-tensor items reach it only as re-serialised plain data (see module docstring)."""

    def __init__(self, planner: LoadPlanner, where: str) -> None:
        self._planner = planner
        self._where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_plain(value, self._where, read_item.dest_index.fqn)
        plain = io.BytesIO()
        torch.save(obj, plain)
        plain.seek(0)
        self._planner.load_bytes(read_item, plain)

    def __getattr__(self, name: str) -> Any:  # resolve_tensor, commit_tensor, ...: the planner's own
        return getattr(self._planner, name)


class SafeFileSystemReader(RecordCheckingReader):
    """FileSystemReader that refuses code and inflation: restricted `.metadata` unpickling, stored-only records,
    weights_only non-tensor items.

    `metadata`, when given (already read by read_metadata), is served instead of reading the file again.
    """

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._names: dict[int, str] = {}  # id(record) -> its item's name, for messages
        self._reading = "?"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = self._metadata if self._metadata is not None and rank is None else load_metadata(self.path, rank)
        # As FileSystemReader.read_metadata does: checkpoints from older torch have no storage_meta.
        storage_meta = getattr(md, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        md.storage_meta = storage_meta
        return md

    def check_record(self, file: IO[bytes], info: Any) -> None:
        self._reading = self._names.get(id(info), "?")
        check_record(file, info, str(self.path), self._reading)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._names = {id(info): index.fqn for index, info in self.storage_data.items()}
        try:
            return super().read_data(plan, _PlainBytesPlanner(planner, str(self.path)))  # type: ignore[arg-type]
        except pickle.UnpicklingError as e:  # a tensor record (DCP loads those itself, weights_only=True)
            raise _load_failure(e, str(self.path), self._reading) from None


def planned_ranges(state_dict: dict[str, Any], md: Metadata) -> dict[str, list[tuple[int, int]]]:
    """The bytes a `load` of `state_dict` (this rank's shards) reads: {data file: its (offset, length) ranges,
    sorted, touching ones merged}, from its DCP load plan, as DCP's default planner, which `load` uses, makes it
    (the coordinator's global plan keeps each rank's items)."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, md, is_coordinator=False)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for item in planner.create_local_plan().items:
        info = md.storage_data[item.storage_index]
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length))
    out: dict[str, list[tuple[int, int]]] = {}
    for file, ranges in by_file.items():
        merged: list[tuple[int, int]] = []
        for offset, length in sorted(set(ranges)):
            if merged and offset <= merged[-1][0] + merged[-1][1]:
                start = merged[-1][0]
                merged[-1] = (start, max(merged[-1][1], offset + length - start))
            else:
                merged.append((offset, length))
        out[file] = merged
    return out


def load(state_dict: dict[str, Any], path: str, md: Metadata, no_dist: bool = False) -> None:
    """dcp.load of `state_dict` (in place) from checkpoint folder `path` (`md`: its read_metadata) through
    SafeFileSystemReader. Any failure, on any rank, is a CheckpointError naming the folder (the same on every
    rank: DCP gathers the ranks' failures)."""
    try:
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(path, md), no_dist=no_dist)
    except (Exception, CheckpointException) as e:
        failures = getattr(e, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else e
        if isinstance(cause, CheckpointError):
            raise type(cause)(str(cause)) from None
        reason = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
        raise CheckpointError(f"checkpoint {path} could not be read (corrupt?): {reason}") from None


# ---------------------------------------------------------------------------------------------- loaded values


def _bad(path: str, key: str, value: Any, valid: str) -> CheckpointError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return CheckpointError(
        f"checkpoint {path}: {key} is {shown}, but kiln writes {valid} (a damaged or crafted checkpoint; not loaded)"
    )


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_float(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


MAX_SETTINGS_BYTES = 1 << 20  # train_state.settings is ~2 KB of JSON


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key, this rank's tensor) of every tensor in a loaded state dict (a DTensor's local shard)."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}{key}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix[:-1], tree.to_local() if isinstance(tree, DTensor) else tree


_SUMMABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_loaded_state(sd: Mapping[str, Any], path: str, step: int | None, n_words: int) -> None:
    """Every value a checkpoint loaded into `sd`, against what kiln writes, before any is applied: each floating
    tensor (weights, AdamW moments) finite, kiln never saves after a non-finite step; then, for a full checkpoint
    (`step`: the step in the folder's name), every train_state, lr_scheduler and dataloader value, the step against
    the folder's name and the data loader's buffered token ids below `n_words`. CheckpointError naming the key and
    what is valid. This rank's shards only: the caller makes the ranks agree."""
    for key, t in _tensors(sd):
        if not t.is_floating_point() or not t.numel():
            continue
        # A finite sum means every value is finite (one NaN or inf makes it NaN or inf), ~20x faster than isfinite
        # over every value; a non-finite sum may be an overflow of finite values, so only then is each looked at.
        if t.dtype in _SUMMABLE and bool(torch.isfinite(t.sum())):
            continue
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"checkpoint {path}: '{key}' holds NaN or infinite values, but kiln never saves after a non-finite "
                "step (a damaged or crafted checkpoint; not loaded)"
            )
    if step is None:
        return
    ts = sd.get("train_state")  # the keys are this run's own (check_matches): each is checked when it is there
    if isinstance(ts, Mapping):
        if "step" in ts and (not _is_int(ts["step"]) or ts["step"] != step):
            raise _bad(path, "train_state.step", ts["step"], f"the step of the folder's name ({step})")
        if "settings" in ts:
            text = ts["settings"]
            if not isinstance(text, str) or len(text) > MAX_SETTINGS_BYTES:
                raise _bad(path, "train_state.settings", text, "a JSON object of the run's settings (a string)")
            try:
                settings = json.loads(text)
            except (ValueError, RecursionError):
                settings = None
            if not isinstance(settings, dict):
                raise _bad(path, "train_state.settings", text, "a JSON object of the run's settings")
    lr = sd.get("lr_scheduler")
    if isinstance(lr, Mapping):
        if not _is_int(lr.get("last_epoch")) or lr.get("last_epoch") != step:
            raise _bad(path, "lr_scheduler.last_epoch", lr.get("last_epoch"), f"the train step ({step})")
        for key in ("base_lrs", "_last_lr"):
            v = lr.get(key)
            if key in lr and not (isinstance(v, list) and v and all(_is_float(x) and x >= 0 for x in v)):
                raise _bad(path, f"lr_scheduler.{key}", v, "a list of learning rates (finite, >= 0)")
        if "_step_count" in lr and not (_is_int(lr["_step_count"]) and lr["_step_count"] >= 0):
            raise _bad(path, "lr_scheduler._step_count", lr["_step_count"], "a count (an integer >= 0)")
        for key in ("_is_initial", "_get_lr_called_within_step", "verbose"):
            if key in lr and type(lr[key]) is not bool:
                raise _bad(path, f"lr_scheduler.{key}", lr[key], "true or false")
        lambdas = lr.get("lr_lambdas", [])
        if not (isinstance(lambdas, list) and all(x is None or x == {} for x in lambdas)):
            # LambdaLR copies each dict into its schedule function's __dict__: kiln's (a partial) has none
            raise _bad(path, "lr_scheduler.lr_lambdas", lambdas, "a list of empty objects (the schedule is code)")
    dl = sd.get("dataloader")
    if isinstance(dl, Mapping):
        expected = {"sequences", "epoch", "shard", "record", "buffer"}
        if set(dl) not in (expected, {"sequences"}):  # the text path's position, or token files' sample number
            raise _bad(path, "the data-loader state", sorted(dl), f"the keys {sorted(expected)} or ['sequences']")
        for key in ("sequences", "epoch", "shard", "record"):
            if key in dl and not (_is_int(dl[key]) and dl[key] >= 0):
                raise _bad(path, f"dataloader.{key}", dl[key], "a position (an integer >= 0)")
        buffer = dl.get("buffer", [])
        if not isinstance(buffer, list):
            raise _bad(path, "dataloader.buffer", buffer, "a list of token ids")
        bad = next((t for t in buffer if not (_is_int(t) and 0 <= t < n_words)), None)
        if bad is not None:
            raise _bad(path, "dataloader.buffer", bad, f"token ids of this tokenizer (0 to {n_words - 1})")
    optim = sd.get("optimizer")
    if isinstance(optim, Mapping):
        for key, v in optim.items():
            if str(key).endswith(".step") and type(v) is torch.Tensor:  # AdamW's step count, a plain scalar
                count = float(v.reshape(-1)[0]) if v.numel() == 1 else math.nan
                if not (math.isfinite(count) and count >= 0):
                    raise _bad(path, f"optimizer.{key}", v.tolist(), "AdamW's step count (one finite number >= 0)")
