"""Reading DCP checkpoints without running code from them.

torch.distributed.checkpoint's FileSystemReader unpickles `.metadata` with plain `pickle.load`, and its
DefaultLoadPlanner loads every non-tensor item (optimizer hyper-parameters, LR-scheduler state, data-loader
position, train step) with `torch.load(weights_only=False)`: a checkpoint someone else wrote, or one altered on
shared storage, runs arbitrary code on resume. Tensors are already read with `torch.load(weights_only=True)`.

SafeFileSystemReader closes both holes and is passed to `dcp.load(storage_reader=...)` by every kiln loader
(trainer resume, scripts/convert_hf.py):
- `.metadata` goes through MetadataUnpickler, whose find_class admits only DCP's own metadata classes and the
  torch values they hold (listed from real kiln checkpoints with pickletools; see METADATA_GLOBALS);
- each non-tensor item is decoded with `torch.load(weights_only=True)` (plain containers, numbers, strings,
  bytes, tensors) before the planner sees it; the planner then gets a re-serialisation of that plain object,
  so its own weights_only=False load only ever meets bytes kiln produced from plain data.
Anything else raises UnsafeCheckpointError naming the folder and the refused global, before it is called.

Same code for torch 2.11 and 2.13: FileSystemReader, the metadata classes and DefaultLoadPlanner.load_bytes
are identical in both (checked against the 2.11 wheel's sources). The one private name kiln relies on is
DCP's metadata file name, `.metadata` (and `__R.metadata` for rank-local metadata), in `_metadata_path`.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from kiln_base.errors import CheckpointError

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
# torch pickles a dtype as the global torch.<name>; read from torch's namespace once, without getattr (which
# would import lazily loaded torch submodules by name).
_DTYPE_NAMES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file needs code that is not plain data to load: refused, nothing of it run."""


def _metadata_path(path: str | os.PathLike, rank: int | None = None) -> str:
    # DCP private naming (torch.distributed.checkpoint.filesystem._metadata_fn), the same in torch 2.11 and 2.13.
    return os.path.join(path, ".metadata" if rank is None else f"__{rank}.metadata")


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler for DCP `.metadata`: only METADATA_GLOBALS and torch dtypes resolve."""

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


def load_metadata(path: str | os.PathLike, rank: int | None = None) -> Metadata:
    """Unpickle the DCP index of checkpoint folder `path` with MetadataUnpickler."""
    with open(_metadata_path(path, rank), "rb") as f:
        md = MetadataUnpickler(f, str(path)).load()
    if not isinstance(md, Metadata):
        what = type(md).__name__
        raise UnsafeCheckpointError(f"checkpoint {path} refused: its .metadata holds a {what}, not DCP Metadata")
    return md


# torch 2.11/2.13 name a refused global as "Unsupported global: GLOBAL m.n ..." or "... unsupported GLOBAL m.n whose
# module m is blocked"; any other weights-only failure ("Unsupported operand 0") is damage, not code.
_REFUSED_GLOBAL = re.compile(r"[Uu]nsupported(?: global:)? GLOBAL ([\w.]+)")


def load_plain(data: BinaryIO, where: str, fqn: str) -> Any:
    """torch.load(weights_only=True) of one non-tensor checkpoint item; a refused global is an UnsafeCheckpointError."""
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        m = _REFUSED_GLOBAL.search(text)
        if m:
            raise UnsafeCheckpointError(
                f"checkpoint {where} refused: item '{fqn}' needs the global {m.group(1)}, which is not plain data "
                "(torch.load weights_only=True; kiln does not run code from checkpoints)"
            ) from None
        detail = text.split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
        raise CheckpointError(f"checkpoint {where} could not be read (corrupt?): item '{fqn}': {detail}") from None


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


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that refuses code: restricted `.metadata` unpickling, weights_only non-tensor items.

    `metadata`, when given (already read by kiln's checks), is served instead of reading the file again.
    """

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = self._metadata if self._metadata is not None and rank is None else load_metadata(self.path, rank)
        # As FileSystemReader.read_metadata does: checkpoints from older torch have no storage_meta.
        storage_meta = getattr(md, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        md.storage_meta = storage_meta
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _PlainBytesPlanner(planner, str(self.path)))  # type: ignore[arg-type]
