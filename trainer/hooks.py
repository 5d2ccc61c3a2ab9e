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
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from float8.checks import Float8UsageProbe
from float8.converter import switch_to_high_precision
from float8.numerics import NumericsObservatory, iter_operand_values
from float8.plots import write_heatmap
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


class NumericsHook(StepHook):
    """The float8 numerics observatory (float8/numerics.py) every `cfg.numerics_log_freq` steps: those steps run
    eagerly with recording hooks; the others are untouched. Writes `<folder>/rank_<r>.jsonl` on every rank (operands
    are this rank's shards), TensorBoard scalars and a worst-layers line on the logging rank, and warns once per
    layer when an operand's SQNR or underflow crosses the alarm thresholds."""

    def __init__(
        self, model: nn.Module, cfg: Float8, folder: str, rank: int, is_logging_rank: bool, writer: Any
    ) -> None:
        self.observatory = NumericsObservatory(model, cfg.recipe)
        self.cfg, self.is_logging_rank, self.writer = cfg, is_logging_rank, writer
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank_{rank}.jsonl")
        self.alarmed: set[str] = set()

    def pre_step(self, step: int) -> None:
        self.observatory.active = step % self.cfg.numerics_log_freq == 0

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        # Compiled blocks would trace the hooks into a second graph; an eager step needs none and keeps them off
        # the graphs every other step runs.
        return torch.compiler.set_stance("force_eager") if self.observatory.active else contextlib.nullcontext()

    def post_step(self, out: StepOutput) -> None:
        if not self.observatory.active:
            return
        self.observatory.active = False
        stats = self.observatory.collect()
        with open(self.path, "a", encoding="utf-8") as f:
            for layer, entry in stats.items():
                f.write(json.dumps({"step": out.step, "layer": layer, **_json_safe(entry)}, allow_nan=False) + "\n")
        if not self.is_logging_rank or not stats:
            return
        if self.writer is not None:
            for layer, entry in stats.items():
                for operand, values in entry.items():
                    if isinstance(values, dict):
                        for stat, v in values.items():
                            if math.isfinite(v):
                                self.writer.add_scalar(f"float8/{layer}/{operand}/{stat}", v, out.step)
        logger.info(worst_layers_line(out.step, stats))
        self._alarms(out.step, stats)

    def _alarms(self, step: int, stats: dict[str, dict[str, Any]]) -> None:
        low, high = self.cfg.numerics_alarm_sqnr_db, self.cfg.numerics_alarm_underflow
        for layer, entry in stats.items():
            for operand, values in entry.items():
                if layer in self.alarmed or not isinstance(values, dict):
                    continue
                problems = []
                if values["sqnr_db"] < low:
                    problems.append(f"SQNR {values['sqnr_db']:.1f} dB (alarm below {low:g})")
                if values["underflow"] > high:
                    problems.append(
                        f"{values['underflow']:.1%} of nonzero elements underflow to 0 (alarm above {high:.1%})"
                    )
                if problems:
                    self.alarmed.add(layer)
                    logger.warning(
                        f"float8 numerics alarm: {layer} {operand} at step {step}: {', '.join(problems)}; "
                        f"suggested fix: {suggested_fix(self.cfg.recipe, layer, operand)}"
                    )

    def close(self) -> None:
        """Remove the hooks; on the logging rank, draw the JSONL as a PNG heatmap when matplotlib is installed."""
        self.observatory.remove()
        if not self.is_logging_rank or not os.path.exists(self.path):
            return
        try:
            write_heatmap(self.path, self.path.replace(".jsonl", "_heatmap.png"))
        except ImportError:
            logger.info("float8 numerics: no heatmap PNG (matplotlib is not installed: pip install -e '.[plots]')")


def _json_safe(value: Any) -> Any:
    """Non-finite floats as null (an exact cast has SQNR inf), so the JSONL is standard JSON."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def suggested_fix(recipe: str, layer: str, operand: str) -> str:
    """What to try for a float8 layer in numerical trouble, finest-grained first."""
    fixes = []
    if recipe == "tensorwise":
        fixes.append("--float8.recipe_name rowwise (one scale per row, e4m3 gradients)")
    if operand == "grad_output" and recipe in ("rowwise", "mxfp8_rceil"):
        fixes.append(
            f"--float8.recipe_name {'rowwise_with_gw_hp' if recipe == 'rowwise' else 'mxfp8_rceil_wgrad_with_hp'} "
            "(weight gradients in high precision)"
        )
    fixes.append(f"keep it in high precision: --float8.filter_fqns {layer}")
    return "; or ".join(fixes)


def worst_layers_line(step: int, stats: dict[str, dict[str, Any]], n: int = 3) -> str:
    """'float8 numerics step S: lowest SQNR ...; most underflow ...; saturation ...': the few worst of each."""
    sqnr = sorted(iter_operand_values(stats, "sqnr_db"), key=lambda t: t[2])[:n]
    under = sorted(iter_operand_values(stats, "underflow"), key=lambda t: -t[2])[:n]
    sat = max((v for _, _, v in iter_operand_values(stats, "saturation")), default=0.0)
    outs = [e["output_sqnr_db"] for e in stats.values() if "output_sqnr_db" in e]
    return (
        f"float8 numerics step {step} ({len(stats)} layers): lowest SQNR (dB) "
        + ", ".join(f"{layer} {op} {v:.1f}" for layer, op, v in sqnr)
        + "; most underflow "
        + ", ".join(f"{layer} {op} {v:.2%}" for layer, op, v in under)
        + f"; max saturation {sat:.2%}"
        + (f"; output SQNR min {min(outs):.1f} dB" if outs else "")
    )


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


def compiling_steps(start_step: int, compile: bool, eager_first_step: bool, numerics_freq: int) -> set[int]:
    """The steps that may compile or warm up for minutes, while other ranks wait in a collective.

    Always the run's first step (warm-up; the compile too when nothing forces it eager). With compile, the first
    compiled step: the one after, when the float8 check runs the first step eagerly, and never a float8 numerics
    step (those run eagerly): the next one.
    """
    steps = {start_step + 1}
    if not compile or numerics_freq == 1:  # numerics every step: nothing is ever compiled
        return steps
    first = start_step + (2 if eager_first_step else 1)
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


class Float8ScheduleHook(StepHook):
    """float8.disable_after_step S: from step S + 1 on, every float8 Linear runs in high precision (the end of
    training), by a switch of the modules' class that keeps parameters, FSDP and TP as they are.

    The switch depends only on the step, so a run resumed past S switches before its first step: the checkpoint
    needs no extra state. Compiled blocks recompile once at the switch (dynamo guards on module classes)."""

    def __init__(self, model: nn.Module, after_step: int, total_steps: int) -> None:
        self.model, self.after, self.switched = model, after_step, False
        if after_step < total_steps:
            logger.info(
                f"float8 policy: float8 Linears switch to high precision after step {after_step} of {total_steps}"
            )

    def pre_step(self, step: int) -> None:
        if not self.switched and step > self.after:
            self.switched = True
            names = switch_to_high_precision(self.model)
            logger.info(
                f"float8 policy: step {step}: {len(names)} float8 Linears now run in high precision "
                f"(float8.disable_after_step {self.after})"
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
