"""Step hooks: everything the train loop does besides training, plugged in through one small interface.

`Trainer.train` reads top to bottom: for each step it calls every hook's `pre_step`, runs `train_step` inside
every hook's `step_context`, then calls every hook's `post_step` with the step's outputs. Hooks run in list
order, which is significant: the non-finite guard checks before metrics are logged and before a checkpoint is
saved, so no checkpoint is ever written after a bad step. A hook observes the step; it never changes what the
step computes (instrumentation that did so broke tensor parallelism once).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from float8.checks import Float8UsageProbe
from float8.sqnr import Float8SQNRMonitor
from trainer.components.checkpoint import CheckpointManager
from trainer.components.dist import set_collective_timeout
from trainer.components.metrics import MetricsLogger
from trainer.components.preemption import StopOnSignal, TrainingStopped
from trainer.config import Float8, Profiling
from trainer.tools.guards import NonFiniteGuard
from trainer.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling

logger = logging.getLogger("kiln")


@dataclass
class StepOutput:
    step: int
    last: bool  # the final step of the run
    loss: torch.Tensor  # mean over micro-batches, this rank, on the device (no host sync yet)
    grad_norm: torch.Tensor  # global norm before clipping (a DTensor when parameters are sharded)
    lr: float  # the learning rate this step used


class StepHook:
    """Base class: override what you need; the defaults do nothing."""

    def pre_step(self, step: int) -> None:
        """Before the step's first micro-batch."""

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        """Entered around `train_step` (forward, backward, clip, optimizer)."""
        return contextlib.nullcontext()

    def post_step(self, out: StepOutput) -> None:
        """After the optimizer step."""

    def close(self) -> None:
        """Once, when the loop ends (normally or by an exception)."""


class GCHook(StepHook):
    """Python's automatic GC is off during training; collect at a fixed cadence instead of at random points."""

    def __init__(self, freq: int) -> None:
        self.freq = freq
        gc.disable()

    def pre_step(self, step: int) -> None:
        if step % self.freq == 0:
            gc.collect(1)

    def close(self) -> None:
        gc.enable()


class ProfilingHook(StepHook):
    """torch profiler traces every profile_freq steps and CUDA memory snapshots (both off by default)."""

    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device, start_step: int) -> None:
        self._stack = contextlib.ExitStack()
        self.profiler = self._stack.enter_context(maybe_enable_profiling(cfg, dump_folder, rank, start_step))
        self.snapshot = self._stack.enter_context(
            maybe_enable_memory_snapshot(cfg, dump_folder, rank, device, start_step)
        )

    def post_step(self, out: StepOutput) -> None:
        if self.profiler is not None:
            self.profiler.step()
        if self.snapshot is not None:
            self.snapshot.step()

    def close(self) -> None:
        self._stack.close()


class SQNRHook(StepHook):
    """Per-layer float8 SQNR every `freq` steps, measured by forward hooks that are idle on other steps."""

    def __init__(self, model: nn.Module, freq: int, is_logging_rank: bool) -> None:
        self.monitor, self.freq, self.is_logging_rank = Float8SQNRMonitor(model), freq, is_logging_rank

    def pre_step(self, step: int) -> None:
        self.monitor.active = step % self.freq == 0

    def post_step(self, out: StepOutput) -> None:
        if self.monitor.active and self.is_logging_rank:
            self.monitor.log(out.step)
        elif self.monitor.active:
            self.monitor.clear()  # other ranks measured too (collectives); drop the values

    def close(self) -> None:
        self.monitor.remove()


class NonFiniteHook(StepHook):
    """Records non-finite losses/norms on the device every step; raises on log and checkpoint steps."""

    def __init__(self, guard: NonFiniteGuard, must_check: Callable[[StepOutput], bool], checkpoint_folder: str) -> None:
        self.guard, self.must_check, self.checkpoint_folder = guard, must_check, checkpoint_folder

    def post_step(self, out: StepOutput) -> None:
        self.guard.observe(out.step, out.loss, out.grad_norm)
        if self.must_check(out):
            self.guard.check(self.checkpoint_folder)


class MetricsHook(StepHook):
    """The step line (and TensorBoard) on log steps; the only place the loop syncs with the host."""

    def __init__(
        self,
        metrics: MetricsLogger,
        total_steps: int,
        global_mean: Callable[[torch.Tensor], float],
        force: Callable[[], bool] = lambda: False,
    ) -> None:
        self.metrics, self.total_steps, self.global_mean, self.force = metrics, total_steps, global_mean, force
        self.losses: list[float] = []  # losses of logged steps, for tests and callers

    def post_step(self, out: StepOutput) -> None:
        if not (self.metrics.should_log(out.step) or out.last or self.force()):
            return
        # clip_grad_norm_ already returns the global norm (a DTensor when params are sharded).
        norm = out.grad_norm.full_tensor() if hasattr(out.grad_norm, "full_tensor") else out.grad_norm
        loss = self.global_mean(out.loss)
        self.losses.append(loss)
        self.metrics.log(out.step, self.total_steps, loss, norm.item(), out.lr)


class CheckpointHook(StepHook):
    def __init__(self, checkpointer: CheckpointManager) -> None:
        self.checkpointer = checkpointer

    def post_step(self, out: StepOutput) -> None:
        self.checkpointer.maybe_save(out.step, last=out.last)


def compiling_steps(start_step: int, compile: bool, eager_first_step: bool, sqnr_freq: int) -> set[int]:
    """The steps that may compile or warm up for minutes, while other ranks wait in a collective.

    Always the run's first step (warm-up; the compile too when nothing forces it eager). With compile, the first
    compiled step: the one after, when the float8 check runs the first step eagerly. With float8 SQNR the
    compiled blocks have two graphs, the measuring one on SQNR steps and the plain one on the others: the first
    compiled step of each compiles.
    """
    steps = {start_step + 1}
    if not compile:
        return steps
    first = start_step + (2 if eager_first_step else 1)
    if not sqnr_freq:
        return steps | {first}
    steps.add(-(-first // sqnr_freq) * sqnr_freq)  # the first SQNR step
    if sqnr_freq > 1:
        steps.add(first if first % sqnr_freq else first + 1)  # the first plain step
    return steps


class CollectiveTimeoutHook(StepHook):
    """Steps that may compile (see `compiling_steps`) keep the long initialisation timeout; all others run under
    the short training timeout, so a hung collective fails fast. The timeout is set before each step's first
    collective, and only when it changes."""

    def __init__(self, long_steps: set[int], long_seconds: int, short_seconds: int) -> None:
        self.long_steps, self.long, self.short = long_steps, long_seconds, short_seconds
        self.current = long_seconds  # the process group starts with the initialisation timeout

    def pre_step(self, step: int) -> None:
        seconds = self.long if step in self.long_steps else self.short
        if seconds != self.current:
            set_collective_timeout(seconds)
            self.current = seconds


class StopRequestHook(StepHook):
    """SIGTERM (preemption) is caught while training; after every step all ranks agree whether to stop, so they
    stop at the same step (trainer/components/preemption.py: one CPU all-reduce per step). Runs first."""

    def __init__(self) -> None:
        self.signal = StopOnSignal().__enter__()
        self.stopping = False

    def post_step(self, out: StepOutput) -> None:
        self.stopping = self.signal.agreed()

    def close(self) -> None:
        self.signal.__exit__(None, None, None)


class StopHook(StepHook):
    """Runs last: on an agreed stop, save a full checkpoint of this step (if checkpoints are on) and end the run
    with TrainingStopped (exit 143), so a restart resumes at the next step."""

    def __init__(self, request: StopRequestHook, checkpointer: CheckpointManager, total_steps: int) -> None:
        self.request, self.checkpointer, self.total_steps = request, checkpointer, total_steps

    def post_step(self, out: StepOutput) -> None:
        if not self.request.stopping or out.last:
            return
        saved = self.checkpointer.save_full(out.step)
        what = f"saved {saved}" if saved else "nothing saved (checkpoint.enable_checkpoint is off)"
        raise TrainingStopped(
            f"stopped by SIGTERM after step {out.step} of {self.total_steps}; {what}"
            + ("; run the same command again to resume" if saved else "")
        )


class Float8CheckHook(StepHook):
    """At the first step, prove each float8 flag changed what runs (float8/checks.py), or stop the run (exit 2).

    The probe counts torchao's float8 matmuls below DTensor, FSDP and AC; it changes nothing the step computes,
    and a compiled step stays compiled (the count then comes from tracing the graph)."""

    def __init__(self, model: nn.Module, cfg: Float8, fsdp_enabled: bool) -> None:
        self.probe: Float8UsageProbe | None = Float8UsageProbe(model, cfg, fsdp_enabled)

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        return self.probe.during_first_step() if self.probe is not None else contextlib.nullcontext()

    def post_step(self, out: StepOutput) -> None:
        if self.probe is not None:
            probe, self.probe = self.probe, None
            probe.verify()
