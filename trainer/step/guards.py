"""NaN/inf guard: stop a run whose loss or gradient norm went non-finite, before it can save a bad state.

Every step records, on the device and without a host sync, the first step whose loss or local grad norm was
not finite. The verdict is read (one all-reduce + one sync) only on steps whose results are read (log, last,
validation and eval steps: trainer/hooks.py `must_check`) and right before a checkpoint save, so other steps
stay sync-free (docs/performance.md) and no checkpoint is ever written, nor a validation run, after a bad step.
The price: weights in memory may already hold the bad update when the run stops; every checkpoint on
disk is from before it, and the error names the newest one to resume from. With training.skip_nonfinite_steps
(NonFiniteSkip, below) a bad step is skipped instead, before its update, and only N of them in a row stop the run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from kiln_base.errors import NonFiniteError
from kiln_base.internals import set_scheduler_last_lr
from trainer.checkpoint.resume import TrainState
from trainer.step.step import StepWrapper

logger = logging.getLogger("kiln")


def last_checkpoint(folder: str) -> str:
    """The newest complete `step-N` checkpoint in `folder` (unfinished `.tmp` saves never count), or 'none'."""
    from trainer.checkpoint.manager import complete_steps, step_dir

    steps = complete_steps(folder)
    return step_dir(folder, steps[-1]) if steps else "none"


class NonFiniteGuard:
    _FINE = 2**62  # sentinel: no bad step seen; MIN over ranks then gives the earliest bad step anywhere

    def __init__(self, device: torch.device) -> None:
        self.first_bad = torch.full((), self._FINE, dtype=torch.long, device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Device-side bookkeeping only: no sync, no collective (a DTensor norm is checked on its local part)."""
        if hasattr(grad_norm, "to_local"):
            grad_norm = grad_norm.to_local()
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.first_bad = torch.where(bad, torch.minimum(self.first_bad, torch.tensor(step)), self.first_bad)

    def check(self, checkpoint_folder: str) -> None:
        """Raise NonFiniteError on every rank if any rank saw a non-finite value (syncs; log/save steps only)."""
        first_bad = self.first_bad.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        step = int(first_bad.item())
        if step != self._FINE:
            raise NonFiniteError(
                f"non-finite loss or grad norm at step {step}; stopped before any later checkpoint save. "
                f"Last good checkpoint: {last_checkpoint(checkpoint_folder)}"
            )


@dataclass
class _Attempt:
    step: int
    sequences: tuple[int, int]  # the global sequence indices of the step's batch: [first, end)
    epoch: int
    skipped: torch.Tensor  # 1.0 when skipped (on the device until the next check)


class NonFiniteSkip(NonFiniteGuard, StepWrapper):
    """training.skip_nonfinite_steps: a step whose loss or grad norm is non-finite on any rank is skipped on every
    rank, decided on the device; N consecutive skipped steps stop the run as NonFiniteGuard does.

    The decision: one flag per rank (its loss and its grad norm finite?), all-reduced (MAX) over the world, a
    4-byte collective the device queues like any other (no host sync). The skip: the flag is AdamW's `found_inf`,
    which torch's fused kernel reads on the device (torch.amp.GradScaler skips steps the same way): a skipped step
    leaves the weights, exp_avg, exp_avg_sq and the step counts as they were, bit for bit. The LR schedule skips
    too: the lr a step applies is read from a device table of the schedule at (the scheduler's host step count -
    the steps skipped since the last check). At a check (the guard's steps, where it syncs anyway) the
    skipped steps are logged with their batches' positions, the host scheduler is moved back by their number (so
    checkpoints hold the schedule of the steps taken), and N consecutive skips raise NonFiniteError.

    It wraps the step (trainer/step/step.py StepWrapper): the data loader's position at the step's start and end
    name a skipped step's batch; the update runs inside `around_update`.
    """

    def __init__(
        self,
        device: torch.device,
        optimizer: torch.optim.Optimizer,
        scheduler: LambdaLR,
        total_steps: int,
        limit: int,
        loader: Any,  # the training data loader (its state_dict: the global sequences read, the epoch)
    ) -> None:
        super().__init__(device)
        self.optimizer, self.scheduler, self.limit, self.loader = optimizer, scheduler, limit, loader
        self.first: dict[str, Any] = {}  # the loader's position at the start of the step
        # float64 as LambdaLR's Python floats: with no step skipped the applied lr is the schedule's, bitwise.
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        schedules = zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        lrs = [[base * fn(i) for i in range(total_steps + 1)] for base, fn in schedules]
        self.lr_table = torch.tensor(lrs, dtype=dtype, device=device)
        self.pending = torch.zeros((), dtype=torch.long, device=device)  # skipped since the last check
        self.attempts: list[_Attempt] = []  # since the last check
        self.consecutive: list[int] = []  # the skipped steps in a row up to the last check
        self.applied = torch.zeros((), dtype=dtype, device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Nothing: around_update decided already."""

    def start(self, progress: TrainState) -> None:
        self.first = self.loader.state_dict()

    def applied_lr(self, lr: float | torch.Tensor) -> torch.Tensor:
        return self.applied  # the lr the step applied (the schedule skips too), on the device

    @contextlib.contextmanager
    def around_update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Iterator[None]:
        """Around the optimizer step of `step`: skip it on every rank if any rank's loss or grad norm is not finite
        (no host sync)."""
        end = self.loader.state_dict()
        position = (self.first.get("sequences", -1), end.get("sequences", -1), end.get("epoch", -1))
        if hasattr(grad_norm, "to_local"):
            grad_norm = grad_norm.to_local()
        bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).to(torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        host_lrs = [group["lr"] for group in self.optimizer.param_groups]
        index = (self.scheduler.last_epoch - self.pending).view(1)
        lrs = self.lr_table.index_select(1, index).view(-1)
        self.optimizer.found_inf = bad  # type: ignore[attr-defined]  # read by the fused kernel (torch.optim.adam)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        try:
            yield
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]
            for group, lr in zip(self.optimizer.param_groups, host_lrs, strict=True):
                group["lr"] = lr
        self.applied = lrs[0]
        self.pending += bad.long()
        self.attempts.append(_Attempt(step, position[:2], position[2], bad))

    def check(self, checkpoint_folder: str) -> None:
        """Log the steps skipped since the last check, move the host LR schedule back by their number; raise
        NonFiniteError at training.skip_nonfinite_steps consecutive skips (syncs; the guard's check steps only)."""
        if not self.attempts:
            return
        flags = torch.stack([a.skipped for a in self.attempts]).tolist()
        attempts, self.attempts = self.attempts, []
        skipped = [a for a, bad in zip(attempts, flags, strict=True) if bad]
        for a in skipped:
            first, end = a.sequences
            logger.warning(
                f"Skipped step {a.step}: non-finite loss or grad norm on some rank; no optimizer or LR-scheduler "
                f"step on any rank, its batch (global sequences {first}-{end - 1}, epoch {a.epoch}) is not trained on"
            )
        for a, bad in zip(attempts, flags, strict=True):
            self.consecutive = [*self.consecutive, a.step] if bad else []
            if len(self.consecutive) >= self.limit:
                raise NonFiniteError(
                    f"non-finite loss or grad norm at {self.limit} consecutive steps "
                    f"({self.consecutive[0]}-{self.consecutive[-1]}), each skipped (training.skip_nonfinite_steps "
                    f"{self.limit}); stopped before any later checkpoint save. Last good checkpoint: "
                    f"{last_checkpoint(checkpoint_folder)}"
                )
        if skipped:
            self.pending.zero_()
            self.scheduler.last_epoch -= len(skipped)
            for group, base, fn in zip(
                self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas, strict=True
            ):
                group["lr"] = base * fn(self.scheduler.last_epoch)
            set_scheduler_last_lr(self.scheduler, [g["lr"] for g in self.optimizer.param_groups])
