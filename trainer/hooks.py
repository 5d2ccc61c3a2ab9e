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
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from float8.checks import Float8UsageProbe
from float8.converter import PrecisionSchedule
from float8.numerics import NumericsObservatory
from float8.numerics_report import NumericsReport
from kiln_base.config import Float8, JobConfig, Profiling
from kiln_base.errors import TrainingStopped
from trainer.checkpoint.manager import CheckpointManager
from trainer.components.dist import set_collective_timeout
from trainer.components.metrics import MetricsLogger
from trainer.components.preemption import StopOnSignal
from trainer.evaluation.validate import ValidationResult, Validator
from trainer.step.guards import NonFiniteGuard
from trainer.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling

if TYPE_CHECKING:
    from trainer.evaluation.downstream import DownstreamEval

logger = logging.getLogger("kiln")


@dataclass
class StepOutput:
    step: int
    last: bool  # the final step of the run
    loss: torch.Tensor  # mean over micro-batches, this rank, on the device (no host sync yet)
    grad_norm: torch.Tensor  # global norm before clipping, float64, the same on every rank (parallelisms/grad_norm.py)
    lr: float | torch.Tensor  # the learning rate this step used (on the device under training.skip_nonfinite_steps)
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)  # further values of the step (StepResult's)


class StepHook:
    """Base class: override what you need; the defaults do nothing."""

    def pre_step(self, step: int) -> None:
        """Before the step's first micro-batch."""

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        """Entered around the step (forward, backward, clip, optimizer: trainer/step/step.py)."""
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


class NumericsHook(StepHook):
    """The float8 numerics observatory (float8/numerics.py) every `cfg.numerics_log_freq` steps: those steps run
    eagerly with recording hooks; the others are untouched. What is written and said: float8/numerics_report.py."""

    def __init__(
        self, model: nn.Module, cfg: Float8, report: NumericsReport, pp_group: dist.ProcessGroup | None = None
    ) -> None:
        """`pp_group`: under pipeline parallelism the pipeline's ranks; each records its own stages' Linears, and
        the report's lines (worst layers, alarms) read every stage's (one gather per numerics step)."""
        self.observatory = NumericsObservatory(model, cfg.recipe)
        self.freq, self.report, self.pp_group = cfg.numerics_log_freq, report, pp_group

    def pre_step(self, step: int) -> None:
        self.observatory.active = step % self.freq == 0

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        # Compiled blocks would trace the hooks into a second graph; an eager step needs none and keeps them off
        # the graphs every other step runs.
        return torch.compiler.set_stance("force_eager") if self.observatory.active else contextlib.nullcontext()

    def post_step(self, out: StepOutput) -> None:
        if self.observatory.active:
            self.observatory.active = False
            stats = self.observatory.collect()
            every_stage = None
            if self.pp_group is not None:
                gathered: list[dict] = [{} for _ in range(dist.get_world_size(self.pp_group))]
                dist.all_gather_object(gathered, stats, group=self.pp_group)
                every_stage = {layer: entry for part in gathered for layer, entry in part.items()}
            self.report.step(out.step, stats, every_stage)

    def close(self) -> None:
        self.observatory.remove()
        self.report.close()


class NonFiniteHook(StepHook):
    """Records non-finite losses/norms on the device every step; raises on log and checkpoint steps."""

    def __init__(self, guard: NonFiniteGuard, must_check: Callable[[StepOutput], bool], checkpoint_folder: str) -> None:
        self.guard, self.must_check, self.checkpoint_folder = guard, must_check, checkpoint_folder

    def post_step(self, out: StepOutput) -> None:
        self.guard.observe(out.step, out.loss, out.grad_norm)
        if self.must_check(out):
            self.guard.check(self.checkpoint_folder)


def validation_due(step: int, freq: int) -> bool:
    """torchtitan's rule: validate at step 1 and at every multiple of validation.freq."""
    return step == 1 or step % freq == 0


class ValidationHook(StepHook):
    """validation.enable: the loss on held-out data after the optimizer step of step 1 and of every validation.freq-th
    step (trainer/evaluation/validate.py); the step's log line shows it. Its time is left out of tokens/s."""

    def __init__(self, validator: Validator, freq: int, metrics: MetricsLogger) -> None:
        self.validator, self.freq, self.metrics = validator, freq, metrics
        self.result: ValidationResult | None = None  # this step's, when it validated

    def post_step(self, out: StepOutput) -> None:
        self.result = None
        if validation_due(out.step, self.freq):
            t0 = time.perf_counter()
            self.result = self.validator.run(out.step)
            self.metrics.discount(time.perf_counter() - t0)


class DownstreamEvalHook(StepHook):
    """eval.enable: lm-eval multiple-choice accuracy of the weights after the optimizer step of step 1, every
    eval.freq-th step and the last step (trainer/evaluation/downstream.py). Its own log line on the logging rank
    and kiln/eval/<task>/<metric> (those lm-eval reports: acc, acc_norm) and kiln/eval_seconds on the dashboards;
    its time is left out of tokens/s."""

    def __init__(self, downstream: DownstreamEval, freq: int, metrics: MetricsLogger) -> None:
        self.downstream, self.freq, self.metrics = downstream, freq, metrics

    def post_step(self, out: StepOutput) -> None:
        if not (validation_due(out.step, self.freq) or out.last):
            return
        t0 = time.perf_counter()
        result = self.downstream.run(out.step)
        if self.metrics.is_logging_rank:
            logger.info(result.line(out.step))
        writer = self.metrics.writer
        if writer is not None:
            for task in result.scores:
                for metric, value in result.metrics(task).items():
                    writer.add_scalar(f"kiln/eval/{task}/{metric}", value, out.step)
            writer.add_scalar("kiln/eval_seconds", result.seconds, out.step)
            writer.flush()
        self.metrics.discount(time.perf_counter() - t0)


class MetricsHook(StepHook):
    """The step line (and TensorBoard) on log steps and validation steps; the only place the loop syncs with the
    host."""

    def __init__(
        self,
        metrics: MetricsLogger,
        total_steps: int,
        global_mean: Callable[[torch.Tensor], float],
        losses: list[float],
        force: Callable[[], bool] = lambda: False,
        validation: ValidationHook | None = None,
    ) -> None:
        self.metrics, self.total_steps, self.global_mean, self.force = metrics, total_steps, global_mean, force
        self.losses = losses  # losses of logged steps, for tests and callers
        self.validation = validation

    def post_step(self, out: StepOutput) -> None:
        val = self.validation.result if self.validation is not None else None
        if not (self.metrics.should_log(out.step) or out.last or self.force() or val is not None):
            return
        loss = self.global_mean(out.loss)
        self.losses.append(loss)
        shown = None if val is None else (val.loss, val.perplexity)
        scalars = {name: self.global_mean(value) for name, value in out.scalars.items()}  # as the loss
        self.metrics.log(out.step, self.total_steps, loss, out.grad_norm.item(), float(out.lr), shown, scalars)


class CheckpointHook(StepHook):
    def __init__(self, checkpointer: CheckpointManager) -> None:
        self.checkpointer = checkpointer

    def post_step(self, out: StepOutput) -> None:
        self.checkpointer.maybe_save(out.step, last=out.last)


def compiling_steps(start_step: int, compile: bool, numerics_freq: int) -> set[int]:
    """The steps that may compile or warm up for minutes, while other ranks wait in a collective.

    Always the run's first step (warm-up, and the compile). With compile, the first compiled step: never a float8
    numerics step (those run eagerly), so after one of those the next.
    """
    steps = {start_step + 1}
    if not compile or numerics_freq == 1:  # numerics every step: nothing is ever compiled
        return steps
    first = start_step + 1
    if numerics_freq and first % numerics_freq == 0:
        first += 1
    return steps | {first}


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


class StochasticRoundingSeedHook(StepHook):
    """nvfp4 rounds gradients stochastically with torch's default generator (float8/nvfp4.py). Reseeding it before
    every step from (training.seed, step, rank) makes those draws a function of the step alone, so a resumed run
    rounds exactly as the straight run did (nothing else in a step draws from it). It sets what the step draws,
    never what it computes with a given draw."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank

    def pre_step(self, step: int) -> None:
        torch.manual_seed((self.seed * 1_000_003 + step * 4_099 + self.rank) % 2**63)


class Float8ScheduleHook(StepHook):
    """float8.disable_after_step: the switch to high precision before the step after it (float8/converter.py)."""

    def __init__(self, schedule: PrecisionSchedule) -> None:
        self.schedule = schedule

    def pre_step(self, step: int) -> None:
        self.schedule.before_step(step)


class Float8CheckHook(StepHook):
    """At the first step, prove each float8 flag changed what runs (float8/checks.py), or stop the run (exit 2).

    The probe counts torchao's float8 matmuls below DTensor, FSDP and AC; it changes nothing the step computes,
    and a compiled step stays compiled (the count then comes from tracing the graph)."""

    def __init__(
        self, model: nn.Module, cfg: Float8, fsdp_enabled: bool, pp_group: dist.ProcessGroup | None = None
    ) -> None:
        # Under pipeline parallelism each rank counts its own stages and the verdict sums the pipeline's.
        self.probe: Float8UsageProbe | None = Float8UsageProbe(model, cfg, fsdp_enabled, pp_group)

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        return self.probe.during_first_step() if self.probe is not None else contextlib.nullcontext()

    def post_step(self, out: StepOutput) -> None:
        if self.probe is not None:
            probe, self.probe = self.probe, None
            probe.verify()


def build_hooks(
    cfg: JobConfig,
    *,
    model: nn.Module,
    float8_on: bool,
    fsdp_enabled: bool,
    device: torch.device,
    start_step: int,
    metrics: MetricsLogger,
    checkpointer: CheckpointManager,
    nan_guard: NonFiniteGuard,
    global_mean: Callable[[torch.Tensor], float],
    losses: list[float],
    validator: Validator | None = None,
    pp_group: dist.ProcessGroup | None = None,
    downstream: DownstreamEval | None = None,
) -> list[StepHook]:
    """The hooks phase of the build: the loop's non-training concerns, in the order they run. `losses` collects the
    logged losses; `global_mean` averages a loss over the data-parallel ranks (a collective, log steps only);
    `validator` (validation.enable) validates at step 1 and every validation.freq steps; `pp_group`: under pipeline
    parallelism the pipeline's ranks (the float8 check and report cover every stage); `downstream` (eval.enable)
    scores the eval tasks at step 1, every eval.freq steps and the last step."""
    rank = dist.get_rank()
    f8, t = cfg.float8, cfg.training
    stop = StopRequestHook()  # first in post_step: every later hook knows whether this is the last step run
    hooks: list[StepHook] = [
        stop,
        GCHook(t.gc_freq),
        ProfilingHook(cfg.profiling, cfg.job.dump_folder, rank, device, start_step),
    ]
    after = f8.disable_after_step
    if float8_on and after:
        hooks.append(Float8ScheduleHook(PrecisionSchedule(model, after, t.steps)))
    if float8_on and not (after and start_step >= after):  # resumed past the switch: nothing to check
        hooks.append(Float8CheckHook(model, f8, fsdp_enabled, pp_group))
    if float8_on and f8.is_nvfp4 and t.seed is not None:
        hooks.append(StochasticRoundingSeedHook(t.seed, rank))
    if float8_on and f8.numerics_log_freq:
        folder = os.path.join(cfg.job.dump_folder, "float8_numerics")
        report = NumericsReport(f8, folder, rank, metrics.is_logging_rank, metrics.writer)
        hooks.append(NumericsHook(model, f8, report, pp_group))

    validation = ValidationHook(validator, cfg.validation.freq, metrics) if validator is not None else None

    def must_check(out: StepOutput) -> bool:
        """Every step whose results are read: a line (log step, the last step, a stop), a validation, an eval,
        a save. A bad step between them is still named: the guard keeps the first one on the device."""
        return (
            stop.stopping
            or out.last
            or metrics.should_log(out.step)
            or checkpointer.due(out.step, out.last)
            or (validation is not None and validation_due(out.step, validation.freq))
            or (downstream is not None and validation_due(out.step, cfg.eval.freq))
        )

    long_steps = compiling_steps(start_step, t.compile, f8.numerics_log_freq)
    if t.compile and float8_on and after:
        long_steps.add(max(after, start_step) + 1)  # the blocks recompile at the switch
    if validation is not None and t.compile:  # the first validation compiles the blocks' inference graphs
        long_steps.add(1 if start_step == 0 else (start_step // validation.freq + 1) * validation.freq)
    return [
        *hooks,
        NonFiniteHook(nan_guard, must_check, checkpointer.folder),  # before metrics and saves
        *([validation] if validation is not None else []),  # after the guard: never validates a non-finite step
        *([DownstreamEvalHook(downstream, cfg.eval.freq, metrics)] if downstream is not None else []),
        MetricsHook(metrics, t.steps, global_mean, losses, force=lambda: stop.stopping, validation=validation),
        CheckpointHook(checkpointer),
        CollectiveTimeoutHook(long_steps, cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds),
        StopHook(stop, checkpointer, t.steps),  # last: saves and raises TrainingStopped
    ]
