"""DCP checkpoints: model, optimizer, LR scheduler, data loader (global position) and train step; atomic saves.

Layout: `{folder}/step-N/` holds one torch.distributed.checkpoint (DCP) save (`.metadata` plus one
`__R_0.distcp` file per rank) and `kiln.json` (step, contents, layout, model shape, save order); weights-only
saves are exports, `{folder}/export-step-N/`, and never a resume point. Keys follow torchtitan,
so its users' tools read kiln checkpoints: model weights at the top level (`layers.0.attention.wq.weight`),
then `optimizer.*` (flattened, keyed by parameter name), `lr_scheduler.*`, `dataloader.*` (the global data
position, the same on every rank) and `train_state.step` / `train_state.settings` (trainer/checkpoint/resume.py).
A weights-only save holds the model keys alone.

Atomicity: rank 0 creates `step-N.tmp` with a `.kiln-saving` mark, every rank writes into it; DCP writes
`.metadata` on rank 0 only after gathering every rank's write results, then rank 0 writes `kiln.json` and
renames the folder to `step-N`. Only complete `step-N` folders count as checkpoints, so a process killed
mid-save leaves the previous checkpoint as the latest; the marked `.tmp` is removed at the next start.

Safety: every read goes through trainer/checkpoint/reader.py (no code runs from a checkpoint); the folder's
lock, names and retention rules are in trainer/checkpoint/folder.py.

Object storage (`checkpoint.folder s3://...`): the same names and rules, kept by trainer/checkpoint/objects.py (no
rename there: a step is written in place and counts once its kiln.json, written last, exists); DCP writes into a
local staging folder and each rank uploads its files; a load reads a downloaded copy through the same reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from kiln_base.config import Checkpoint
from kiln_base.errors import CheckpointError
from kiln_base.files import url_scheme
from kiln_base.internals import dtensor_local_tensor, flatten_state_dict, float8_weight_inner, mxfp8_weight_data
from trainer.checkpoint.checksums import (
    METADATA,
    ChecksummingWriter,
    agree_on,
    check_files,
    collect,
    file_checksum,
    verify,
)
from trainer.checkpoint.folder import (
    MARKER,  # noqa: F401  (re-exported: scripts/convert_hf.py reads it from here)
    Entry,
    FolderClaim,
    agree,
    prepare_save,
    publish,
    purge,
    remove_killed_save,
    remove_killed_saves,
    save_name,
    scan,
)
from trainer.checkpoint.objects import (
    ObjectEntry,
    ObjectStore,
    check_ranges,
    claim_folder,
    download_step,
    fetch_planned,
    prepare_object_save,
    publish_object,
    purge_objects,
    remove_killed_object_save,
    remove_killed_object_saves,
    scan_objects,
    upload_step,
)
from trainer.checkpoint.reader import (
    IncompleteCheckpointError,
    check_loaded_state,
    load,
    planned_ranges,
    read_metadata,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

logger = logging.getLogger("kiln")

MODEL, OPTIMIZER, DATALOADER, TRAIN_STATE = "model", "optimizer", "dataloader", "train_state"
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keyed by FQN: layout-independent


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def complete_steps(folder: str) -> list[int]:
    """Steps of the `step-N` folders with a `.metadata` under `folder`, oldest first (no exports, no `.tmp`)."""
    return [e.step for e in scan(folder) if not e.export and not e.tmp and e.has_metadata]


def resolve_step_dir(path: str) -> str:
    """A DCP step folder, or the highest complete `step-N` / `export-step-N` of a checkpoint folder."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    done = [e for e in scan(path) if not e.tmp and e.has_metadata] if os.path.isdir(path) else []
    if not done:
        raise CheckpointError(f"{path}: not a DCP checkpoint (no .metadata) and no complete step-N folder in it")
    return max(done, key=lambda e: (e.step, e.export)).path


def check_stored_args(entry: Entry, model: Any) -> None:
    """A weights-only step-N's stored ModelArgs (kiln.json) must be the model's: same shapes are not enough
    (rope_theta, norm_eps, rope scaling change what the weights compute)."""
    from models.args import ModelArgs, first_difference, stored_model_args

    saved = (entry.marker() or {}).get("model_args")
    ours = getattr(model, "model_args", None)
    if not isinstance(saved, dict) or ours is None:
        return
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    stored = stored_model_args({k: v for k, v in saved.items() if k in known}, f"{entry.path}/{MARKER}")
    diff = first_difference(stored, ours)
    if diff is not None:
        field, there, here = diff
        raise CheckpointError(
            f"checkpoint {entry.path} holds another model: {field} is {there!r} there but {here!r} in this one "
            "(model.flavor); train it with checkpoint.initial_load_path and model.flavor = from_checkpoint"
        )


def plain_tensor(t: Any) -> Any:
    """A tensor with torchao's float8 or MXFP8 weight wrapper removed (same storage), anything else unchanged.

    Under FSDP float8 all-gather the sharded weights are WeightWithDynamicFloat8CastTensor (inside a DTensor);
    under the MXFP8 recipes the weights and AdamW's states of them (zeros_like keeps the class) are
    MXFP8TrainingWeightWrapperTensor, plain or inside a DTensor.
    Saved as such, every load would need torchao imported first (DCP loads tensors with
    torch.load(weights_only=True), which accepts the class only once torchao registers it as a safe global):
    a bf16 run or scripts/convert_hf.py could not read a float8 run's checkpoint. So saves hold the plain
    high-precision tensor inside.
    In-place loads into the unwrapped tensor write the wrapped parameter's storage.
    """
    if isinstance(t, DTensor):
        local = dtensor_local_tensor(t)
        inner = plain_tensor(local)
        if inner is local:
            return t
        return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    if type(t).__name__ == "MXFP8TrainingWeightWrapperTensor":
        return mxfp8_weight_data(t)
    inner = float8_weight_inner(t)
    return t if inner is None else inner


def reset_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """Set the step counts of an optimizer that has not stepped back to 0.

    torch's get_optimizer_state_dict creates the state of an optimizer that has none by taking one step with zero
    gradients at lr 0: the weights and Adam's moments stay exactly as they were (zeros), but the step count becomes
    1. Saved so (the seed checkpoint, step-0), the run it seeds would take its first step with Adam's bias
    corrections for step 2, and from step 2 on train a different run than one started from scratch. With the count
    at 0 the state is, bit for bit, what a fresh AdamW creates at its first step (trainer/components/optim.py).
    """
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()


def _is_dataclass_instance(obj: Any) -> TypeGuard[DataclassInstance]:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def is_model_key(key: str) -> bool:
    return key.split(".", 1)[0] not in (OPTIMIZER, "lr_scheduler", DATALOADER, TRAIN_STATE)


def _param_of_optimizer_key(key: str) -> str | None:
    """The parameter FQN of a flattened optimizer key (`optimizer.state.<fqn>.exp_avg`,
    `optimizer.param_groups.<fqn>.lr`), None for any other key."""
    for prefix in (f"{OPTIMIZER}.state.", f"{OPTIMIZER}.param_groups."):
        if key.startswith(prefix):
            return key[len(prefix) :].rsplit(".", 1)[0]
    return None


def fetch_checked(entry: ObjectEntry, local: str, state_dict: dict[str, Any], md: Metadata) -> None:
    """Every rank (collectives): read once into `local` (entry's download, its head there) the bytes a load of
    `state_dict` reads: this rank fetches only those of its own load plan, each file whole by one rank, which checks
    its checksum and vouches for the ranges the others fetched of it. Damage: one CheckpointError, on every rank."""
    whole, ranges = fetch_planned(entry, local, planned_ranges(state_dict, md))
    verify(local, only={METADATA, *whole})
    check_ranges(local, whole, ranges, entry.path)


def check_matches(
    path: str,
    ours: dict[str, Any],
    md: Metadata,
    weights_only: bool,
    held_elsewhere: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """Raise CheckpointError if checkpoint `path` cannot fill state dict `ours`: other model shape or state keys.

    `held_elsewhere`: the model keys (whole shapes) that other ranks of a pipeline hold instead of this one; they
    are checked too (so every rank finds the same mismatch), and their optimizer entries are not extra here.
    The data-loader position is global (the same on every rank), so any data-parallel layout resumes it."""
    flat, _ = flatten_state_dict(ours)
    elsewhere = dict(held_elsewhere or {})
    saved = md.state_dict_metadata
    where = f"checkpoint {path}"
    shapes = {k: tuple(v.shape) for k, v in flat.items() if is_model_key(k) and isinstance(v, torch.Tensor)}
    model_keys = [k for k in flat if is_model_key(k)] + [k for k in elsewhere if k not in flat]
    for key in sorted(model_keys, key=_model_key_order):  # model keys first: a shape mismatch before layout
        if key not in saved:
            raise CheckpointError(f"{where} holds another model: it has no '{key}'")
        meta = saved[key]
        shape = shapes.get(key, elsewhere.get(key))
        if shape is not None:
            got = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
            if got != shape:
                raise CheckpointError(
                    f"{where} holds another model: '{key}' has shape {got} there but {shape} "
                    "in this model (check model.flavor and the tokenizer's vocabulary)"
                )
    for key, value in flat.items():  # the optimizer's tensors too: a record is never larger than what it fills
        entry = saved.get(key)
        if is_model_key(key) or entry is None or not isinstance(value, torch.Tensor):
            continue
        got = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "not a tensor"
        if got != tuple(value.shape):
            raise CheckpointError(
                f"{where} does not match this run's optimizer/state: '{key}' has shape {got} there but "
                f"{tuple(value.shape)} here"
            )
    extra = [
        k
        for k in saved
        if k not in flat
        and k not in elsewhere
        and _param_of_optimizer_key(k) not in elsewhere
        and (is_model_key(k) or not weights_only)
    ]
    extra_model = [k for k in extra if is_model_key(k)]
    if extra_model:
        raise CheckpointError(f"{where} holds another model: it has '{extra_model[0]}', which this model lacks")
    if weights_only:
        return
    if any(k.startswith(f"{DATALOADER}.dp_rank_") for k in saved):
        raise CheckpointError(
            f"{where} holds per-rank data-loader positions (saved before kiln's global sample order); "
            "its data position cannot be resumed"
        )
    # The text path's position has an epoch (and shard, record, buffer); token files' is one sample number.
    text_saved, text_here = f"{DATALOADER}.epoch" in saved, f"{DATALOADER}.epoch" in flat
    if text_saved != text_here:
        was, now = ("text data", "token files") if text_saved else ("token files", "text data")
        raise CheckpointError(
            f"{where} was saved training on {was} and this run trains on {now}: switching a run between text data "
            f"and token files is not supported on resume; start a new checkpoint.folder (with "
            f"checkpoint.initial_load_path {path} to start from its weights)"
        )
    missing = [k for k in flat if k not in saved]
    if missing or extra:
        what = f"has no '{missing[0]}'" if missing else f"has '{extra[0]}', which this run lacks"
        raise CheckpointError(f"{where} does not match this run's optimizer/state: it {what}")


def _model_key_order(key: str) -> tuple[int, int]:
    """The whole model's order (embedding, blocks by id, norm, output; a stable sort keeps the module order inside
    each), whichever rank holds a key: every rank of a pipeline reports the same first mismatch."""
    head, _, rest = key.partition(".")
    if head == "layers":
        layer, _, _ = rest.partition(".")
        return (1, int(layer) if layer.isdigit() else 0)
    return ({"tok_embeddings": 0, "norm": 2, "output": 3}.get(head, 4), 0)


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"


def _folder_bytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))


@dataclasses.dataclass
class _Pending:
    """A background save: DCP's future, what it saves, when it started, what staging cost the training loop."""

    future: Any
    step: int
    weights_only: bool
    t0: float
    staged: float  # seconds the training loop spent staging it
    writer: ChecksummingWriter


def _gathered(obj: Any, group: Any = None) -> list[Any]:
    """`obj` of every rank, in rank order (itself alone without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)  # object collectives run on CPU (gloo) in kiln's process groups
    return out


T = TypeVar("T")


def _in_background(fn: Callable[..., T], *args: Any) -> Callable[[], T]:
    """fn(*args) on a daemon thread; the returned call waits for it and returns its result (or raises its error).
    Daemon: a refusal raised meanwhile ends the process without waiting for the reads (but for the one 8 MiB
    piece file_checksum's helper may be checksumming)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="kiln-verify", daemon=True)
    thread.start()

    def result() -> T:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["result"]

    return result


class CheckpointManager:
    """Saves and loads `states` (model, optimizer, lr_scheduler, dataloader, train_state) under `folder`."""

    def __init__(
        self,
        cfg: Checkpoint,
        folder: str,
        states: dict[str, Any],
        claim: FolderClaim | None = None,
        held_elsewhere: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        """`claim`: claim_folder(folder) when the caller claimed the folder already (the Trainer does, before it
        builds the model); otherwise it is claimed here: created, checked writable, locked. `held_elsewhere`: the
        model keys other pipeline stages hold (their ranks save them; check_matches)."""
        self.cfg = cfg
        self.held_elsewhere = dict(held_elsewhere or {})
        self.folder = folder
        self.states = states
        self.enabled = cfg.enable_checkpoint
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.claim = (claim or claim_folder(folder)) if self.enabled else claim
        self.store = ObjectStore(folder) if self.enabled and url_scheme(folder) is not None else None
        self._downloads: str | None = None  # the local folder a load downloads object-storage steps into
        self.mode = cfg.async_mode
        if self.enabled and self.mode == "async_with_pinned_mem" and not torch.cuda.is_available():
            logger.warning("checkpoint.async_mode async_with_pinned_mem needs CUDA; saving with async_mode=async")
            self.mode = "async"
        self._pg = None
        self._stager = None
        if self.enabled and self.mode != "disabled" and dist.is_initialized():
            # The background save runs collectives while training runs its own: a separate group keeps
            # the two from interleaving on one communicator. gloo: DCP's save collectives are CPU-side.
            self._pg = dist.new_group(backend="gloo")
        if self.enabled and self.mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Staging (device -> pinned host copy) is synchronous, so the next optimizer step cannot race it;
            # only the file writes run in the background.
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True
                )
            )
        self._pending: _Pending | None = None  # the background save in flight
        self._uploader: ThreadPoolExecutor | None = None  # object storage under async_mode: the upload's thread
        self.loaded: str | None = None  # the checkpoint load() loaded, None when it found none

    # ------------------------------------------------------------------ state dicts

    def _model_state(self) -> dict[str, Any]:
        return {k: plain_tensor(v) for k, v in get_model_state_dict(self.states[MODEL]).items()}

    def _state_dict(self, weights_only: bool) -> dict[str, Any]:
        """The flat-by-component state dict DCP saves or loads in place (model keys at the top level)."""
        sd = self._model_state()
        if weights_only:
            return sd
        for name, obj in self.states.items():
            if name == MODEL:
                continue
            if name == OPTIMIZER:
                unstepped = not obj.state
                osd = get_optimizer_state_dict(self.states[MODEL], obj, options=_OPTIM_OPTIONS)
                if unstepped:
                    reset_step_counts(obj)
                sd[name] = {k: plain_tensor(v) for k, v in osd.items()}
            else:
                sd[name] = obj.state_dict()
        return sd

    def _marker(self, step: int, weights_only: bool, dtype: str) -> dict[str, Any]:
        args = getattr(self.states[MODEL], "model_args", None)
        loader = self.states.get(DATALOADER)
        return {
            "step": step,
            "model_weights_only": weights_only,
            "dtype": dtype,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "dp_degree": getattr(loader, "dp_degree", None),
            "model_args": dataclasses.asdict(args) if _is_dataclass_instance(args) else None,
            "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    # ------------------------------------------------------------------ the folder or the bucket

    def _entries(self) -> list[Entry]:
        return list(scan_objects(self.store)) if self.store is not None else scan(self.folder)

    def _complete_steps(self) -> list[int]:
        return [e.step for e in self._entries() if not e.export and not e.tmp and e.has_metadata]

    @contextlib.contextmanager
    def _local(self, entry: Entry) -> Iterator[str]:
        """The local folder to read `entry` from: itself, or (object storage) its download, fetched once per load;
        a CheckpointError raised inside names the object-storage step, not its download."""
        if not isinstance(entry, ObjectEntry):
            yield entry.path
            return
        if self._downloads is None:
            self._downloads = tempfile.mkdtemp(prefix="kiln-download-")
        local = download_step(entry, self._downloads)  # its head: .metadata and kiln.json (once)
        try:
            yield local
        except CheckpointError as e:
            # Any rank's download: a refusal agreed over the ranks names the folder of the rank that found it.
            copies = re.escape(os.path.dirname(os.path.dirname(local))) + r"/kiln-download-[^/\s]+/"
            raise type(e)(re.sub(copies + re.escape(entry.name) + r"\b", lambda _: entry.path, str(e))) from None

    def _read_metadata(self, entry: Entry) -> Metadata:
        with self._local(entry) as local:  # object storage: the index against the listed objects' sizes
            return read_metadata(local, entry.sizes if isinstance(entry, ObjectEntry) else None)

    # ------------------------------------------------------------------ load

    def _is_weights_only(self, entry: Entry, md: Metadata) -> bool:
        marker = entry.marker()
        if marker is not None and "model_weights_only" in marker:
            return bool(marker["model_weights_only"])
        return all(is_model_key(k) for k in md.state_dict_metadata)  # torchtitan's or converted checkpoints

    def _latest(self, entries: list[Entry]) -> tuple[Entry, Metadata, bool] | None:
        """The newest complete full checkpoint; else the newest weights-only `step-N` (initial weights); else None.

        Incomplete or damaged `step-N` folders are skipped with a warning (never deleted or written over); an
        unsafe one stops the run. If nothing usable is left but something damaged is there, that is an error.
        """
        weights: tuple[Entry, Metadata, bool] | None = None
        broken: list[str] = []
        for entry in sorted((e for e in entries if not e.export and not e.tmp), key=lambda e: -e.step):
            if not entry.has_metadata:
                what = f"no {MARKER} or .metadata (kiln writes {MARKER} last)" if self.store else "no .metadata"
                broken.append(f"{entry.path} has {what} (an incomplete copy?)")
                continue
            try:
                md = self._read_metadata(entry)
            except IncompleteCheckpointError as e:
                broken.append(str(e))
                continue
            if self._is_weights_only(entry, md):
                weights = weights or (entry, md, True)
                continue
            for why in broken:
                logger.warning(f"Not resuming from a damaged checkpoint: {why}; kiln leaves it alone")
            return entry, md, False
        if weights is not None:
            for why in broken:
                logger.warning(f"Not resuming from a damaged checkpoint: {why}; kiln leaves it alone")
            return weights
        if broken:
            raise CheckpointError(f"checkpoint folder {self.folder} has no usable checkpoint: {broken[0]}")
        return None

    def _requested(self, entries: list[Entry]) -> tuple[Entry, Metadata, bool]:
        """checkpoint.load_step's `step-N`, refused when newer full checkpoints are in the folder (a rollback)."""
        want = self.cfg.load_step
        by_step = {e.step: e for e in entries if not e.export and not e.tmp}
        entry = by_step.get(want)
        if entry is None or not entry.has_metadata:
            available = [e.step for e in by_step.values() if e.has_metadata]
            raise CheckpointError(
                f"checkpoint.load_step {want}: no complete checkpoint {step_dir(self.folder, want)} "
                f"(available steps: {available or 'none'})"
            )
        md = self._read_metadata(entry)
        later = []
        for e in by_step.values():
            if e.step > want and e.has_metadata:
                try:
                    if not self._is_weights_only(e, self._read_metadata(e)):
                        later.append(e.name)
                except IncompleteCheckpointError:
                    continue  # a damaged later folder is no resume point: it does not block a rollback
        if later:
            raise CheckpointError(
                f"checkpoint.load_step {want} is older than {', '.join(later)} in {self.folder}: resuming from it "
                "there would mix two runs' histories (and keep_latest_k would count both); kiln refuses a rollback "
                f"in place: move {', '.join(later)} out of the folder, or copy step-{want} into a new checkpoint.folder"
            )
        return entry, md, self._is_weights_only(entry, md)

    def _check_planned_saves(self, entries: list[Entry], start: int, last_step: int | None) -> None:
        """Refuse at start what a save of this run would otherwise meet hours later: a name already taken."""
        if last_step is None:
            return
        clashes = []
        # links, files: never written through or replaced (object storage has neither)
        others = scan(self.folder, others=True) if self.store is None else []
        for e in [*entries, *others]:
            if not (start < e.step <= last_step and self.due(e.step, e.step == last_step)):
                continue
            if self._weights_only_save(e.step == last_step) != e.export or (e.kiln_saving and e not in others):
                continue  # another kind of save, or our own killed save (replaced)
            what = " (a symbolic link)" if os.path.islink(e.path) else " (not a folder)"
            clashes.append(e.name + (what if e in others else ""))
        if clashes:
            raise CheckpointError(
                f"checkpoint folder {self.folder} already holds {', '.join(clashes[:3])}, which this run (steps "
                f"{start + 1}-{last_step}) would save again; kiln never writes over a checkpoint it did not just "
                "supersede: move it out of the folder, or set another checkpoint.folder"
            )

    def _barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier(group=self._pg)

    def load(self, last_step: int | None = None) -> int:
        """Load the latest (or checkpoint.load_step) checkpoint into `states`; return its step (0 if none).

        Only full `step-N` checkpoints are resume points. Without one, a weights-only `step-N` (converted from
        Hugging Face) loads the model only and training starts at step 0, as in torchtitan. `last_step`
        (training.steps) lets it refuse now a save that would land on a name already taken. Every mismatch is a
        CheckpointError raised before anything is modified on disk.
        """
        if not self.enabled:
            return 0
        try:
            return self._load(last_step)
        finally:
            if self._downloads is not None:
                shutil.rmtree(self._downloads, ignore_errors=True)
                self._downloads = None

    def _load(self, last_step: int | None) -> int:
        entries = self._entries()
        chosen = self._requested(entries) if self.cfg.load_step >= 0 else self._latest(entries)
        if chosen is None:
            self._check_planned_saves(entries, 0, last_step)
            logger.info(f"No checkpoint in {self.folder} to resume")
            self._remove_killed_saves()
            return 0
        entry, md, weights_only = chosen
        path = entry.path
        if weights_only:
            check_stored_args(entry, self.states[MODEL])
        self._check_planned_saves(entries, 0 if weights_only else entry.step, last_step)
        t0 = time.perf_counter()
        # A folder's checksums are read on a helper thread while the state dict to load into is built (the
        # optimizer's moments allocated: CPU work beside the disk's); every rank's verdict is in before any record
        # is read.
        checking = None if isinstance(entry, ObjectEntry) else _in_background(check_files, path)
        sd = self._state_dict(weights_only)
        check_matches(path, sd, md, weights_only, self.held_elsewhere)
        with self._local(entry) as local:  # object storage: the downloaded bytes are what is checked and read
            if isinstance(entry, ObjectEntry):
                fetch_checked(entry, local, sd, md)
            elif checking is not None:
                agree_on(checking())  # damage: one CheckpointError, on every rank
            load(sd, local, md)
        self._check_loaded(sd, entry, weights_only)
        model = self.states[MODEL]
        set_model_state_dict(model, {k: v for k, v in sd.items() if is_model_key(k)})
        if not weights_only:
            for name, obj in self.states.items():
                if name == OPTIMIZER:
                    set_optimizer_state_dict(model, obj, sd[name], options=_OPTIM_OPTIONS)
                elif name != MODEL:
                    obj.load_state_dict(sd[name])
        self._remove_killed_saves()
        self.loaded = path
        kind = "model weights only; training starts at step 0" if weights_only else "full state"
        logger.info(f"Loaded checkpoint {path} ({kind}) in {time.perf_counter() - t0:.2f} s")
        return int(sd[TRAIN_STATE]["step"]) if TRAIN_STATE in sd else 0

    def _check_loaded(self, sd: dict[str, Any], entry: Entry, weights_only: bool) -> None:
        """What `entry` loaded into `sd`, against what kiln writes (checkpoint_reader.check_loaded_state) and its
        kiln.json step against its name, before anything is applied; every rank raises the first rank's refusal
        (each checked its own shards)."""
        error = None
        try:
            marker_step = (entry.marker() or {}).get("step", entry.step)
            if not weights_only and marker_step != entry.step:
                raise CheckpointError(
                    f"checkpoint {entry.path}: its {MARKER} says step {marker_step!r}, its name step {entry.step} "
                    "(a renamed or crafted folder; not loaded)"
                )
            check_loaded_state(sd, entry.path, None if weights_only else entry.step, self._n_words())
        except CheckpointError as e:
            error = str(e)
        error = agree(error)
        if error is not None:
            raise CheckpointError(error)

    def _n_words(self) -> int:
        """The vocabulary the data loader's buffered token ids must lie in: the tokenizer's, else the model's."""
        n = getattr(self.states.get(DATALOADER), "n_words", None)
        if n is None:
            n = getattr(getattr(self.states[MODEL], "model_args", None), "vocab_size", None)
        return n if isinstance(n, int) else 2**63

    def _remove_killed_saves(self) -> None:
        self._barrier()  # every rank has listed the folder before rank 0 changes it
        if self.rank == 0 and self.store is not None:
            remove_killed_object_saves(self.store)
        elif self.rank == 0:
            remove_killed_saves(self.folder)

    # ------------------------------------------------------------------ save

    def due(self, step: int, last: bool = False) -> bool:
        """Whether maybe_save(step, last) will write a checkpoint."""
        return self.enabled and (last or step % self.cfg.interval == 0)

    def _weights_only_save(self, last: bool) -> bool:
        return self.cfg.model_weights_only or (last and self.cfg.last_save_model_weights_only)

    def maybe_save(self, step: int, last: bool = False) -> None:
        """Save at every `interval` steps and at the last step; finish a background save that is done."""
        if not self.enabled:
            return
        if self._pending is not None and self._pending.future.done():
            self._finish_pending()
        if not self.due(step, last):
            return
        weights_only = self._weights_only_save(last)
        self._finish_pending()  # one save in flight at a time: this step waits for the previous one's write
        self._save(step, weights_only, background=self.mode != "disabled" and not last)

    def _prepare(self, name: str) -> None:
        """Rank 0 creates `name.tmp` (marked as kiln's) before any rank writes into it; all ranks learn refusals."""
        error = None
        if self.rank == 0:
            try:
                if self.store is not None:
                    prepare_object_save(self.store, name)
                else:
                    prepare_save(self.folder, name)
            except CheckpointError as e:
                error = str(e)
            except OSError as e:  # a full disk or a read-only remount: nothing of this save exists yet
                newest = self._complete_steps()
                intact = f"; {step_dir(self.folder, newest[-1])} is intact" if newest else ""
                error = f"saving checkpoint {name}: cannot create {name}.tmp in {self.folder}: {e}{intact}"
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self._pg)  # also keeps ranks > 0 out of the folder till now
            error = box[0]
        if error is not None:
            raise CheckpointError(error)

    def save_seed(self) -> str:
        """checkpoint.create_seed_checkpoint: the initial state as the full checkpoint step-0, in a folder that holds
        no checkpoint yet (a seed checkpoint starts a run)."""
        if self.loaded is not None:
            raise CheckpointError(
                f"checkpoint.create_seed_checkpoint: {self.folder} already holds {self.loaded}; a seed checkpoint "
                "starts a run: use an empty checkpoint.folder"
            )
        self._save(0, weights_only=False, background=False)
        return step_dir(self.folder, 0)

    def save_full(self, step: int) -> str | None:
        """Save a full (resumable) checkpoint of `step` now, synchronously, unless maybe_save(step) just wrote
        one (preemption: the run must resume right after this step). Returns its folder; None when disabled."""
        if not self.enabled:
            return None
        self._finish_pending()  # a background save of this step is published first
        if not (self.due(step) and not self.cfg.model_weights_only):
            self._save(step, weights_only=False, background=False)
        return step_dir(self.folder, step)

    def _saved_line(
        self, name: str, seconds: float, n_bytes: int, stall: float, waited: float = 0.0, background: bool = False
    ) -> str:
        """`Saved checkpoint PATH in 2.10 s: 1.23 GB, training stalled 40 ms`: rank 0 gives the whole checkpoint's
        size, another rank the size of its own files. `waited`: the part of the stall a later step spent waiting
        for the background write to finish (the next save, or the end of training, came before it did)."""
        size = _size(n_bytes) if self.rank == 0 else f"{_size(n_bytes)} written by rank {self.rank}"
        line = f"Saved checkpoint {os.path.join(self.folder, name)} in {seconds:.2f} s"
        line += f"{' (async)' if background else ''}: {size}"
        line += f", training stalled {stall * 1e3:.0f} ms"
        if waited >= 0.0005:
            line += f" ({waited * 1e3:.0f} ms of it waiting for its {'upload' if self.store else 'write'} to finish)"
        return line

    def _save(self, step: int, weights_only: bool, background: bool) -> None:
        t0 = time.perf_counter()
        dtype = self.cfg.export_dtype if weights_only else "float32"
        sd = self._state_dict(weights_only)
        if weights_only and dtype != "float32":
            # checkpoint.export_dtype's choices are torch dtype names
            sd = {k: v.to(getattr(torch, dtype)) for k, v in sd.items()}
        name = save_name(step, export=weights_only)
        self._prepare(name)
        if self.store is not None and background:
            self._upload_in_background(sd, step, weights_only, t0)
            return
        if self.store is not None:
            with self._writing(name):
                n_bytes = self._save_to_store(sd, step, weights_only)
            seconds = time.perf_counter() - t0
            logger.info(self._saved_line(name, seconds, n_bytes, seconds))
            return
        tmp = os.path.join(self.folder, name + ".tmp")
        if background:
            kwargs: dict[str, Any] = {"async_stager": self._stager} if self._stager is not None else {}
            writer = ChecksummingWriter(tmp)  # checksums in the background thread that writes the files
            result = dcp.async_save(sd, checkpoint_id=tmp, storage_writer=writer, process_group=self._pg, **kwargs)
            future = getattr(result, "upload_completion", result)  # AsyncSaveResponse with a custom stager
            staged = time.perf_counter() - t0
            self._pending = _Pending(future, step, weights_only, t0, staged, writer)
            logger.info(f"Checkpoint {name}: staged in {staged:.2f} s, writing in background")
            return
        writer = ChecksummingWriter(tmp)
        with self._writing(name):
            dcp.save(sd, checkpoint_id=tmp, storage_writer=writer)
            n_bytes = self._publish(step, weights_only) or writer.bytes
        seconds = time.perf_counter() - t0
        logger.info(self._saved_line(name, seconds, n_bytes, seconds))

    def _save_to_store(self, sd: dict[str, Any], step: int, weights_only: bool) -> int:
        """Object storage: DCP writes this rank's files into a local staging folder (checksummed as written), each
        rank uploads its own; once all have, rank 0 uploads the index, then kiln.json last (objects.py). Returns the
        bytes saved: the whole step's on rank 0, this rank's files' on the others."""
        name = save_name(step, export=weights_only)
        stage = tempfile.mkdtemp(prefix="kiln-stage-")
        try:
            local = os.path.join(stage, name)
            writer = ChecksummingWriter(local)
            dcp.save(sd, checkpoint_id=local, storage_writer=writer)
            return self._upload(local, step, weights_only, writer)
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def _upload_in_background(self, sd: dict[str, Any], step: int, weights_only: bool, t0: float) -> None:
        """Object storage under async_mode: staged in host memory now, as a folder save; the local write, the
        uploads, the index and kiln.json (still last) in one background thread, in that order. The next save, a
        preemption's and the end of training wait for it (_finish_pending), as for a folder."""
        name = save_name(step, export=weights_only)
        stage = tempfile.mkdtemp(prefix="kiln-stage-")
        local = os.path.join(stage, name)
        writer = ChecksummingWriter(local)
        kwargs: dict[str, Any] = {"async_stager": self._stager} if self._stager is not None else {}
        try:
            result = dcp.async_save(sd, checkpoint_id=local, storage_writer=writer, process_group=self._pg, **kwargs)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        written: Any = getattr(result, "upload_completion", result)  # a Future (AsyncSaveResponse with a stager)

        def upload() -> int:
            try:
                written.result()
                return self._upload(local, step, weights_only, writer)
            finally:
                shutil.rmtree(stage, ignore_errors=True)

        if self._uploader is None:
            self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-upload")
        staged = time.perf_counter() - t0
        self._pending = _Pending(self._uploader.submit(upload), step, weights_only, t0, staged, writer)
        logger.info(f"Checkpoint {name}: staged in {staged:.2f} s, uploading in background")

    def _upload(self, local: str, step: int, weights_only: bool, writer: ChecksummingWriter) -> int:
        """This rank's staged files of `step` uploaded; once every rank's are, rank 0 uploads `.metadata`, then
        kiln.json, and applies keep_latest_k. The bytes saved (as _save_to_store's)."""
        assert self.store is not None
        name = save_name(step, export=weights_only)
        error = None
        try:
            upload_step(self.store, local, name, writer.sums)
        except CheckpointError as e:
            error = str(e)
        # every rank's uploads done (or failed) first; the async save's own group when in the background
        results = _gathered((error, writer.sums, writer.bytes), self._pg)
        error = next((e for e, _, _ in results if e is not None), None)
        if error is not None:
            raise CheckpointError(error)
        if self.rank != 0:
            return writer.bytes
        checksums = {file: crc for _, sums, _ in results for file, crc in sums.items()}
        checksums[METADATA] = file_checksum(os.path.join(local, METADATA))
        self.store.upload(os.path.join(local, METADATA), f"{name}/{METADATA}")
        dtype = self.cfg.export_dtype if weights_only else "float32"
        publish_object(self.store, name, {**self._marker(step, weights_only, dtype), "checksums": checksums})
        purge_objects(self.store, self.cfg.keep_latest_k)
        return sum(n for _, _, n in results) + os.path.getsize(os.path.join(local, METADATA))

    def _finish_pending(self) -> None:
        """Wait for the background save (if any) and publish it; the wait and the publish count as its stall."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        t1 = time.perf_counter()
        name = save_name(pending.step, export=pending.weights_only)
        with self._writing(name):
            uploaded = pending.future.result()  # re-raises a failed background save
            waited = time.perf_counter() - t1
            if self.store is not None:  # published in the background, kiln.json last
                n_bytes = uploaded
            else:
                n_bytes = self._publish(pending.step, pending.weights_only) or pending.writer.bytes
        now = time.perf_counter()
        stall = pending.staged + now - t1
        logger.info(self._saved_line(name, now - pending.t0, n_bytes, stall, waited, background=True))

    @contextlib.contextmanager
    def _writing(self, name: str) -> Iterator[None]:
        """Around the writes of save `name`: a write that fails (a full disk, a quota, a read-only remount) removes
        the partial `name.tmp` (rank 0) and stops the run with one line naming the folder, the free space on its
        disk and the newest complete checkpoint, which is intact. A failed collective (a lost rank) is not a write
        failure: it passes through to train.py's lost-peer report."""
        try:
            yield
        except (CheckpointException, OSError, CheckpointError) as e:
            if isinstance(e, CheckpointError) and self.store is None:
                raise  # a refusal of the folder's rules, not a failed write
            failures = getattr(e, "failures", None)
            cause = next(iter(failures.values()))[0] if failures else e
            reason = " ".join(f"{type(cause).__name__}: {cause}".split())[:200]
            if self.store is not None:
                self._failed_upload(name, reason)
            if self.rank == 0:
                remove_killed_save(self.folder, name)
            try:
                free = f"{shutil.disk_usage(self.folder).free / 2**20:,.0f} MiB free"
            except OSError:
                free = "free space unknown"
            done = self._complete_steps()
            good = "no complete checkpoint was saved before this one"
            if done:
                good = f"{step_dir(self.folder, done[-1])} is the newest complete checkpoint and is intact"
            raise CheckpointError(
                f"saving checkpoint {name} into {self.folder} failed ({reason}); the disk holding it has {free}; "
                f"{good}; the partial {name}.tmp was removed. Free space (or set checkpoint.folder elsewhere) and "
                "run again to resume"
            ) from None

    def _failed_upload(self, name: str, reason: str) -> None:
        """The one line for a save into object storage that failed; rank 0 first deletes what it left (or leaves it
        to the next start, which removes a killed save)."""
        assert self.store is not None
        left = f"the partial {os.path.join(self.folder, name)}/ was removed"
        if self.rank == 0:
            try:
                remove_killed_object_save(self.store, name)
            except CheckpointError:
                left = f"the partial {os.path.join(self.folder, name)}/ is removed at the next start"
        try:
            done = self._complete_steps()
            good = (
                f"{step_dir(self.folder, done[-1])} is the newest complete checkpoint" if done else "none is saved yet"
            )
        except CheckpointError:
            good = "the complete checkpoints before it are untouched"
        raise CheckpointError(
            f"saving checkpoint {name} into {self.folder} failed ({reason}); {good}; {left}. Check the bucket's "
            "credentials, permissions and reachability and run again to resume"
        ) from None

    def _publish(self, step: int, weights_only: bool) -> int:
        """Rank 0: make a finished save visible (marker, then rename), then apply keep_latest_k; return the bytes
        of the published checkpoint (0 on the other ranks).

        Every rank's files are on disk by now: DCP's coordinator (rank 0) writes `.metadata` only after
        gathering all ranks' write results, and the save returns on rank 0 only after that.
        """
        if self.rank != 0:
            return 0
        dtype = self.cfg.export_dtype if weights_only else "float32"
        name = save_name(step, export=weights_only)
        checksums = collect(os.path.join(self.folder, name + ".tmp"))  # every rank's files, and .metadata
        final = publish(self.folder, name, {**self._marker(step, weights_only, dtype), "checksums": checksums})
        n_bytes = _folder_bytes(final)
        purge(self.folder, self.cfg.keep_latest_k)
        return n_bytes

    def close(self) -> None:
        """Wait for a background save to finish and publish it; let go of the folder lock."""
        try:
            if self.enabled:
                self._finish_pending()
        finally:
            if self._uploader is not None:
                self._uploader.shutdown()
                self._uploader = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self.claim is not None:
                self.claim.release()
