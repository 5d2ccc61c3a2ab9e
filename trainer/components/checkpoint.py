"""DCP checkpoints: model, optimizer, LR scheduler, data loader (per DP rank) and train step; atomic saves.

Layout: `{folder}/step-N/` holds one torch.distributed.checkpoint (DCP) save (`.metadata` plus one
`__R_0.distcp` file per rank) and `kiln.json` (step, contents, layout, model shape). Keys follow torchtitan,
so its users' tools read kiln checkpoints: model weights at the top level (`layers.0.attention.wq.weight`),
then `optimizer.*` (flattened, keyed by parameter name), `lr_scheduler.*`, `dataloader.dp_rank_R` (each
data-parallel rank's own position) and `train_state.step`. A weights-only save holds the model keys alone.

Atomicity: every rank writes into `step-N.tmp`; DCP writes `.metadata` on rank 0 only after gathering every
rank's write results, then rank 0 writes `kiln.json` and renames the folder to `step-N`. Only `step-N`
folders with a `.metadata` count as checkpoints, so a process killed mid-save leaves the previous checkpoint
as the latest; the stale `.tmp` folder is removed at the next start, once a checkpoint has loaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future
from typing import Any

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

from trainer.config import Checkpoint, ConfigError
from trainer.internals import dtensor_local_tensor, flatten_state_dict, float8_weight_inner

logger = logging.getLogger("kiln")

MODEL, OPTIMIZER, DATALOADER, TRAIN_STATE = "model", "optimizer", "dataloader", "train_state"
MARKER = "kiln.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # keyed by FQN: layout-independent


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def complete_steps(folder: str) -> list[int]:
    """Steps of the complete checkpoints under `folder`, oldest first (`.tmp` folders never count)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def plain_tensor(t: Any) -> Any:
    """A tensor with torchao's float8 weight wrapper removed (same storage), anything else unchanged.

    Under FSDP float8 all-gather the sharded weights are WeightWithDynamicFloat8CastTensor (inside a DTensor).
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
    inner = float8_weight_inner(t)
    return t if inner is None else inner


def read_metadata(path: str) -> Metadata:
    """The DCP index of checkpoint folder `path`, checked against the sizes of the files it points into."""
    meta_file = os.path.join(path, ".metadata")
    try:
        md = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # unpickling garbage can raise almost anything
        raise ConfigError(f"checkpoint {meta_file} is corrupt or truncated: {type(e).__name__}: {e}") from None
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, need in sorted(needed.items()):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            raise ConfigError(f"checkpoint file {f} is missing (listed in {meta_file})")
        size = os.path.getsize(f)
        if size < need:
            raise ConfigError(f"checkpoint file {f} is truncated: {size} bytes, its index needs {need}")
    return md


def is_model_key(key: str) -> bool:
    return key.split(".", 1)[0] not in (OPTIMIZER, "lr_scheduler", DATALOADER, TRAIN_STATE)


def check_matches(
    path: str, ours: dict[str, Any], md: Metadata, weights_only: bool, dp_degree: int | None = None
) -> None:
    """Raise ConfigError if checkpoint `path` cannot fill state dict `ours`: other model shape or DP layout."""
    flat, _ = flatten_state_dict(ours)
    saved = md.state_dict_metadata
    where = f"checkpoint {path}"
    for key, value in flat.items():  # model keys come first: a shape mismatch is reported before layout
        if not is_model_key(key):
            continue
        if key not in saved:
            raise ConfigError(f"{where} holds another model: it has no '{key}'")
        meta = saved[key]
        if isinstance(value, torch.Tensor):
            got = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
            if got != tuple(value.shape):
                raise ConfigError(
                    f"{where} holds another model: '{key}' has shape {got} there but {tuple(value.shape)} "
                    "in this model (check model.flavor and the tokenizer's vocabulary)"
                )
    extra = [k for k in saved if k not in flat and (is_model_key(k) or not weights_only)]
    extra_model = [k for k in extra if is_model_key(k)]
    if extra_model:
        raise ConfigError(f"{where} holds another model: it has '{extra_model[0]}', which this model lacks")
    if weights_only:
        return
    # Each rank holds only its own dataloader.dp_rank_R, so the expected set comes from the DP degree.
    theirs_dp = {k for k in saved if k.startswith(DATALOADER + ".")}
    ours_dp = {f"{DATALOADER}.dp_rank_{r}" for r in range(dp_degree)} if dp_degree else theirs_dp
    if ours_dp != theirs_dp:
        raise ConfigError(
            f"{where} was saved by {len(theirs_dp)} data-parallel rank(s) and this run has {len(ours_dp)}: "
            "data-loader positions are per rank, so a full checkpoint resumes only under the same "
            "data-parallel degree: resume with the parallelism settings it was saved with"
        )
    missing = [k for k in flat if k not in saved]
    extra = [k for k in extra if not k.startswith(DATALOADER + ".")]
    if missing or extra:
        what = f"has no '{missing[0]}'" if missing else f"has '{extra[0]}', which this run lacks"
        raise ConfigError(f"{where} does not match this run's optimizer/state: it {what}")


class CheckpointManager:
    """Saves and loads `states` (model, optimizer, lr_scheduler, dataloader, train_state) under `folder`."""

    def __init__(self, cfg: Checkpoint, folder: str, states: dict[str, Any]) -> None:
        self.cfg = cfg
        self.folder = folder
        self.states = states
        self.enabled = cfg.enable_checkpoint
        self.rank = dist.get_rank() if dist.is_initialized() else 0
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
        self._pending: tuple[Future, int, bool, float] | None = None

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
                osd = get_optimizer_state_dict(self.states[MODEL], obj, options=_OPTIM_OPTIONS)
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
            "model_args": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None,
            "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    # ------------------------------------------------------------------ load

    def _recover_and_list(self) -> list[int]:
        """Rank 0 undoes a replace of step-N interrupted between its two renames; then all ranks list."""
        if self.rank == 0 and os.path.isdir(self.folder):
            for name in os.listdir(self.folder):
                if name.endswith(".old") and _STEP_DIR.match(name[:-4]):
                    final = os.path.join(self.folder, name[:-4])
                    if not os.path.exists(final):
                        os.rename(os.path.join(self.folder, name), final)
        if dist.is_initialized():
            dist.barrier()
        return complete_steps(self.folder)

    def _remove_stale(self) -> None:
        """Delete what killed saves left behind (never a complete step-N folder)."""
        if self.rank != 0 or not os.path.isdir(self.folder):
            return
        for name in os.listdir(self.folder):
            if (name.endswith(".tmp") or name.endswith(".old")) and _STEP_DIR.match(name[:-4]):
                logger.warning(f"Removing incomplete checkpoint {os.path.join(self.folder, name)} (a killed save)")
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def load(self) -> int:
        """Load the latest (or checkpoint.load_step) checkpoint into `states`; return its step (0 if none).

        A weights-only checkpoint (an export, or one converted from Hugging Face) loads the model only and
        training starts at step 0, as in torchtitan. Every mismatch is a ConfigError raised before anything
        is modified on disk.
        """
        if not self.enabled:
            return 0
        steps = self._recover_and_list()
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise ConfigError(
                    f"checkpoint.load_step {self.cfg.load_step}: no complete checkpoint "
                    f"{step_dir(self.folder, self.cfg.load_step)} (available steps: {steps or 'none'})"
                )
            step = self.cfg.load_step
        elif not steps:
            logger.info(f"No checkpoint in {self.folder}: training from scratch")
            self._remove_stale()
            return 0
        else:
            step = steps[-1]
        path = step_dir(self.folder, step)
        t0 = time.perf_counter()
        md = read_metadata(path)
        weights_only = all(is_model_key(k) for k in md.state_dict_metadata)
        sd = self._state_dict(weights_only)
        check_matches(path, sd, md, weights_only, getattr(self.states.get(DATALOADER), "dp_degree", None))
        try:
            dcp.load(sd, checkpoint_id=path)
        except (Exception, CheckpointException) as e:  # gathers every rank's failure: all ranks raise here
            failures = getattr(e, "failures", None)
            cause = next(iter(failures.values()))[0] if failures else e
            raise ConfigError(
                f"checkpoint {path} could not be read (corrupt?): {type(cause).__name__}: {cause}"
            ) from None
        model = self.states[MODEL]
        set_model_state_dict(model, {k: v for k, v in sd.items() if is_model_key(k)})
        if not weights_only:
            for name, obj in self.states.items():
                if name == OPTIMIZER:
                    set_optimizer_state_dict(model, obj, sd[name], options=_OPTIM_OPTIONS)
                elif name != MODEL:
                    obj.load_state_dict(sd[name])
        self._remove_stale()
        kind = "model weights only; training starts at step 0" if weights_only else "full state"
        logger.info(f"Loaded checkpoint {path} ({kind}) in {time.perf_counter() - t0:.2f} s")
        return int(sd[TRAIN_STATE]["step"]) if TRAIN_STATE in sd else 0

    # ------------------------------------------------------------------ save

    def due(self, step: int, last: bool = False) -> bool:
        """Whether maybe_save(step, last) will write a checkpoint."""
        return self.enabled and (last or step % self.cfg.interval == 0)

    def maybe_save(self, step: int, last: bool = False) -> None:
        """Save at every `interval` steps and at the last step; finish a background save that is done."""
        if not self.enabled:
            return
        if self._pending is not None and self._pending[0].done():
            self._finish_pending()
        if not self.due(step, last):
            return
        weights_only = self.cfg.model_weights_only or (last and self.cfg.last_save_model_weights_only)
        self._finish_pending()  # one save in flight at a time
        self._save(step, weights_only, background=self.mode != "disabled" and not last)

    def _save(self, step: int, weights_only: bool, background: bool) -> None:
        t0 = time.perf_counter()
        dtype = self.cfg.export_dtype if weights_only else "float32"
        sd = self._state_dict(weights_only)
        if weights_only and dtype != "float32":
            # checkpoint.export_dtype's choices are torch dtype names
            sd = {k: v.to(getattr(torch, dtype)) for k, v in sd.items()}
        tmp = step_dir(self.folder, step) + ".tmp"
        if background:
            kwargs = {"async_stager": self._stager} if self._stager is not None else {}
            result = dcp.async_save(sd, checkpoint_id=tmp, process_group=self._pg, **kwargs)
            future = getattr(result, "upload_completion", result)  # AsyncSaveResponse with a custom stager
            self._pending = (future, step, weights_only, t0)
            logger.info(f"Checkpoint step-{step}: staged in {time.perf_counter() - t0:.2f} s, writing in background")
            return
        dcp.save(sd, checkpoint_id=tmp)
        self._publish(step, weights_only)
        logger.info(f"Saved checkpoint {step_dir(self.folder, step)} in {time.perf_counter() - t0:.2f} s")

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        future, step, weights_only, t0 = self._pending
        self._pending = None
        future.result()  # re-raises a failed background save
        self._publish(step, weights_only)
        logger.info(f"Saved checkpoint {step_dir(self.folder, step)} in {time.perf_counter() - t0:.2f} s (async)")

    def _publish(self, step: int, weights_only: bool) -> None:
        """Rank 0: make a finished save visible (marker, then rename), then apply keep_latest_k.

        Every rank's files are on disk by now: DCP's coordinator (rank 0) writes `.metadata` only after
        gathering all ranks' write results, and the save returns on rank 0 only after that.
        """
        if self.rank != 0:
            return
        final = step_dir(self.folder, step)
        tmp = final + ".tmp"
        dtype = self.cfg.export_dtype if weights_only else "float32"
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(self._marker(step, weights_only, dtype), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # resumed from an earlier step: replace; _recover_and_list undoes a half swap
            logger.warning(f"Replacing existing checkpoint {final}")
            os.rename(final, final + ".old")
            os.rename(tmp, final)
            shutil.rmtree(final + ".old")
        else:
            os.rename(tmp, final)
        fd = os.open(self.folder, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._purge()

    def _purge(self) -> None:
        """keep_latest_k: delete the oldest complete checkpoints; the newest (just published) always stays."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        for old in complete_steps(self.folder)[:-k]:
            logger.info(f"keep_latest_k={k}: deleting {step_dir(self.folder, old)}")
            shutil.rmtree(step_dir(self.folder, old), ignore_errors=True)

    def close(self) -> None:
        """Wait for a background save to finish and publish it."""
        if self.enabled:
            self._finish_pending()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
