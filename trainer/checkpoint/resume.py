"""Resume compatibility: the settings that alter training are saved in every full checkpoint and compared
when it is resumed, key by key, as docs/checkpoint.md's table says:

- refused (CheckpointError, exit 2): the data (dataset files and sizes, or the hub id), the tokenizer (file
  hash), training.seq_len and the model's shape: the saved data position and weights mean nothing under them;
- handled exactly (a warning says what changed): training.steps, lr_scheduler.* and optimizer.*: the config's
  values apply from the resumed step on. The LR schedule is rebuilt for the new total at the current step (the
  first resumed step uses the new schedule's lr), and the optimizer's hyperparameters are set from the config
  (a checkpoint's param_groups would otherwise silently keep the old ones);
- warned: the global batch size (the data continues at the saved sequence index, each step now takes the new
  number of sequences), the float8 recipe, the compute dtype, the attention (a document-masked flavor of the same
  shape: the weights are the same model's).

The settings travel as train_state.settings, a JSON string inside the DCP checkpoint: every rank reads them in
the same load, they are as atomic as the rest of the state, and they load with torch.load(weights_only=True).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from kiln_base.config import JobConfig
from kiln_base.errors import CheckpointError
from kiln_base.internals import set_scheduler_last_lr
from models import ModelArgs
from models.args import ATTENTION_FIELDS
from trainer.checkpoint.manager import step_dir

logger = logging.getLogger("kiln")

# Keys whose change makes the checkpoint meaningless for this run, with the reason given to the user.
REFUSED = {
    "data": "its data position (a sequence index into that data) would point into other data",
    "model.tokenizer": "its data position and embeddings belong to another tokenizer",
    "training.seq_len": "its data position counts sequences of the saved length",
    "model": "its weights belong to another model",
}
SCHEDULE = ("training.steps", "optimizer.lr", "lr_scheduler")  # handled: the schedule is rebuilt
OPTIMIZER = ("optimizer.name", "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay")
WARNED = {
    "training.global_batch_size": "the data continues at the saved sequence index; each step now takes the new "
    "number of sequences",
    "float8": "training continues with this run's float8 setting",
    "training.mixed_precision_param": "training continues in this run's compute dtype",
    "model.attention": "training continues with this run's attention (same weights, another mask)",
}
# ModelArgs fields that do not change a trained model: the RoPE table's length, the init rule, how it attends.
_INIT_ONLY = ("max_seq_len", "depth_init", *ATTENTION_FIELDS)
CAUSAL = "sdpa attention, causal mask"  # what a checkpoint saved before attention was recorded trained with


def attention_setting(args: ModelArgs) -> str:
    return f"{args.attn_type} attention, {args.attn_mask_type} mask"


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def training_settings(
    cfg: JobConfig, model_args: ModelArgs, global_batch_size: int, data: dict[str, Any], tokenizer_sha256: str
) -> dict[str, Any]:
    """The settings a checkpoint is saved with (plain JSON types), keyed as the table in docs/checkpoint.md."""
    t, o, f8 = cfg.training, cfg.optimizer, cfg.float8
    model = {k: v for k, v in dataclasses.asdict(model_args).items() if k not in _INIT_ONLY}
    float8 = {
        "enable_float8_linear": f8.enable_float8_linear,
        "recipe_name": f8.recipe_name,
        "filter_fqns": list(f8.filter_fqns),
        "auto_filter_small_kn": f8.auto_filter_small_kn,
        "high_precision_first_last": f8.high_precision_first_last,
        "disable_after_step": f8.disable_after_step,
    }
    if f8.high_precision_last >= 0:  # saved only when set: checkpoints from before the key read as its default
        float8["high_precision_last"] = f8.high_precision_last
    if f8.moe_fqns:  # likewise
        float8["moe_fqns"] = list(f8.moe_fqns)
    return {
        "data": data,  # files and sizes (not their folder: moved data is the same data), or the hub id
        "model.tokenizer": tokenizer_sha256,
        "training.seq_len": t.seq_len,
        "model": model,
        "training.steps": t.steps,
        "lr_scheduler": dataclasses.asdict(cfg.lr_scheduler),
        "optimizer.name": o.name,
        "optimizer.lr": o.lr,
        "optimizer.beta1": o.beta1,
        "optimizer.beta2": o.beta2,
        "optimizer.eps": o.eps,
        "optimizer.weight_decay": o.weight_decay,
        "training.global_batch_size": global_batch_size,
        "float8": float8,
        "training.mixed_precision_param": t.mixed_precision_param,
        "model.attention": attention_setting(model_args),
    }


def _difference(old: Any, new: Any) -> str:
    """The first differing entry of two settings values, for the message."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            if old.get(k) != new.get(k):
                return f"{k}: {_difference(old.get(k), new.get(k))}"
    return f"{old!r} there, {new!r} in this run"


def _with_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as compared: ModelArgs fields added since a save take their defaults, fields that do not change a
    trained model (_INIT_ONLY) are left out, and a save from before attention was recorded trained causally."""
    out = {"model.attention": CAUSAL, **settings}
    if isinstance(out.get("model"), dict):
        defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs) if f.name not in _INIT_ONLY}
        out["model"] = {k: v for k, v in {**defaults, **out["model"]}.items() if k not in _INIT_ONLY}
    return out


def check_resume(
    saved: dict[str, Any], current: dict[str, Any], where: str, allow_data_change: bool = False
) -> list[str]:
    """Raise CheckpointError for a refused change; return one warning line per handled or warned change.
    `allow_data_change` (training.allow_data_change) turns a change of data into a warning: the new data continues
    from the saved sample number."""
    saved, current = _with_defaults(saved), _with_defaults(current)
    warnings = []
    for key, why in REFUSED.items():
        if key == "data" and allow_data_change and saved.get(key) != current[key]:
            warnings.append(
                f"resuming {where} with changed data ({_difference(saved.get(key), current[key])}): "
                "training.allow_data_change: this run's data continues from the checkpoint's sample number"
            )
            continue
        if saved.get(key) != current[key]:
            raise CheckpointError(
                f"{where} was saved with other {key} ({_difference(saved.get(key), current[key])}): {why}; "
                f"resume with the settings it was saved with, or start a new run in another checkpoint.folder"
                + (" (or set training.allow_data_change to continue with this data)" if key == "data" else "")
            )
    for key in (*SCHEDULE, *OPTIMIZER):
        if saved.get(key) != current[key]:
            warnings.append(
                f"resuming {where} with changed {key} ({_difference(saved.get(key), current[key])}): "
                "this run's value applies from the resumed step on"
                + (" (LR schedule rebuilt for this run's steps at the current step)" if key in SCHEDULE else "")
            )
    for key, what in WARNED.items():
        if saved.get(key) != current[key]:
            warnings.append(
                f"resuming {where} with changed {key} ({_difference(saved.get(key), current[key])}): {what}"
            )
    return warnings


def apply_config_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> tuple[float, float]:
    """After a checkpoint load: make the optimizer and LR schedule this run's again; return (old lr, new lr).

    Loading restores param_groups (lr, betas, eps, weight decay) and the scheduler's base_lrs from the
    checkpoint, so a changed config value would be ignored, and the first resumed step would use the lr the old
    schedule computed. The optimizer's `defaults` hold this run's config (it was built from it); the lr of the
    next step is this run's schedule at the current step, the same expression LambdaLR evaluates, so with
    unchanged settings nothing changes, bitwise.
    """
    old_lr = optimizer.param_groups[0]["lr"]
    hyper = {k: v for k, v in optimizer.defaults.items() if k != "lr"}
    base_lr = optimizer.defaults["lr"]
    scheduler.base_lrs = [base_lr] * len(optimizer.param_groups)
    for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(hyper)
        group["initial_lr"] = base_lr
        group["lr"] = base_lr * fn(scheduler.last_epoch)
    set_scheduler_last_lr(scheduler, [g["lr"] for g in optimizer.param_groups])  # what the log line reports
    return old_lr, optimizer.param_groups[0]["lr"]


class TrainState:
    """The checkpoint's train_state: the run's step counter (the last step applied: the loop advances it, a healing
    replica group moves it to the live groups') and the settings a resume is checked against, saved as JSON text.
    Loading it refuses (CheckpointError) or warns about changed settings, as check_resume says."""

    def __init__(
        self, settings: dict[str, Any] | None = None, folder: str = "", allow_data_change: bool = False, step: int = 0
    ) -> None:
        self.settings, self.folder, self.allow_data_change, self.step = settings or {}, folder, allow_data_change, step

    def state_dict(self) -> dict[str, int | str]:
        return {"step": self.step, "settings": json.dumps(self.settings, sort_keys=True)}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        where = f"checkpoint {step_dir(self.folder, int(state['step']))}"
        saved = json.loads(str(state["settings"]))
        for line in check_resume(saved, self.settings, where, self.allow_data_change):
            logger.warning(line)
        self.step = int(state["step"])
