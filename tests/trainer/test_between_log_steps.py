"""What the loop keeps on the device between log steps and reads only at a log step (or a save), pinned at
metrics.log_freq 3 under a warm-up + decay schedule, where every step's lr differs and a figure of the wrong step of
the interval shows: the logged step's own loss, grad norm and lr; tokens and data waits of all steps since the last
line; the skip's pending count and the schedule's position after skipped steps between checks; the guard's first bad
step when good steps followed it; the validation loss of a step that is not a log step.

Each is checked against a computation of its own: the same run at log_freq 1 (every step's figures), lr_factor (the
schedule's formula, tested against numbers in test_trainer.py), a clock the test moves.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import trainer.components.metrics as metrics_module
import trainer.step.step as step_module
from kiln_base.errors import NonFiniteError
from tests.helpers.common import LogLines, kiln_log_lines, open_trainer, tiny_run_args
from tests.helpers.step_metrics import SlowData, StepClock, TimedStep, logged_metrics
from trainer.components.optim import lr_factor
from trainer.hooks import StepHook

LR, MIN_LR = 8e-4, 0.1
# Warm-up 2 then linear decay to 0.1 of the peak over the rest: no two steps of a run apply the same lr.
SCHEDULE = (
    *("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "1"),
    *("--lr_scheduler.min_lr_factor", str(MIN_LR)),
)


def _argv(dump: Path, steps: int, log_freq: int, *extra: str) -> list[str]:
    return tiny_run_args(
        *("--job.dump_folder", str(dump), "--training.steps", str(steps), "--metrics.log_freq", str(log_freq)),
        *("--optimizer.lr", str(LR), *SCHEDULE, "--training.deterministic", "--training.seed", "0"),
        *extra,
    )


def _lr(position: int, steps: int) -> float:
    """The schedule's lr after `position` optimizer steps of a `steps`-step run (warm-up 2, decay over the rest)."""
    return LR * lr_factor(position, 2, steps - 2, steps, "linear", MIN_LR)


def _applied_lrs(trainer: Any) -> list[float]:
    """The lr each optimizer step call ran with (a device tensor under the skip), in order."""
    seen: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: seen.append(float(opt.param_groups[0]["lr"])))
    return seen


class PoisonLoss(StepHook):
    """On `steps`: NaN times the loss, so the loss and every gradient are NaN (a test seam through the loss function
    the step holds, put back after the step)."""

    def __init__(self, trainer: Any, steps: set[int]) -> None:
        self.step_object, self.steps = trainer.train_step, steps

    @contextlib.contextmanager
    def _poisoned(self) -> Iterator[None]:
        loss_fn = self.step_object.loss_fn
        self.step_object.loss_fn = lambda *args: loss_fn(*args) * float("nan")
        try:
            yield
        finally:
            self.step_object.loss_fn = loss_fn

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        return self._poisoned() if step in self.steps else contextlib.nullcontext()


def test_the_line_of_a_log_step_shows_that_step_and_counts_every_step_since_the_last_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_model: None
) -> None:
    """7 steps at log_freq 3: lines at 1, 3, 6 and 7 (the last). Each line's loss, grad norm and lr are its own
    step's (the same run at log_freq 1 logs every step's; the lr also from lr_factor and from the optimizer); tps
    and data share count the tokens and data waits of every step since the previous line. Step s computes s seconds
    and waits 0.25 s for its batch."""
    steps = 7
    with open_trainer(_argv(tmp_path / "every", steps, 1)) as trainer:
        every = logged_metrics(trainer)
        trainer.train()
    assert len(every) == steps
    assert [m["lr"] for m in every] == pytest.approx([_lr(s - 1, steps) for s in range(1, steps + 1)], rel=1e-12)

    clock = StepClock()
    for module in (metrics_module, step_module):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=clock))
    with open_trainer(_argv(tmp_path / "third", steps, 3)) as trainer:
        logged, applied = logged_metrics(trainer), _applied_lrs(trainer)
        trainer.train_step.dataloader = SlowData(trainer.dataloader, clock, 0.25)
        trainer.train_step = TimedStep(trainer.train_step, clock, lambda n: float(n))
        with kiln_log_lines() as log:
            trainer.train()
    intervals = {1: [1], 3: [2, 3], 6: [4, 5, 6], 7: [7]}  # log step -> the steps since the previous line
    lines = [line for line in log.lines if line.startswith("step:")]
    assert [int(line.split()[1]) for line in lines] == list(intervals)
    for got, (step, covered) in zip(logged, intervals.items(), strict=True):
        own = every[step - 1]
        assert (got["loss"], got["grad_norm"], got["lr"]) == (own["loss"], own["grad_norm"], own["lr"]), step
        assert got["lr"] == applied[step - 1], step  # what the optimizer ran step `step` with
        seconds = sum(s + 0.25 for s in covered)
        assert got["tps"] == pytest.approx(2 * 32 * len(covered) / seconds, rel=1e-12), step
        assert got["data_loading_pct"] == pytest.approx(100 * 0.25 * len(covered) / seconds, rel=1e-12), step
    assert [re.search(r"lr: (\S+)", line).group(1) for line in lines] == [f"{m['lr']:.4e}" for m in logged]


def _skip_run(dump: Path, log_freq: int, bad: set[int]) -> tuple[Any, list[dict[str, float]], list[float], list[str]]:
    """7 steps under training.skip_nonfinite_steps 3 with NaN on `bad`: the closed trainer, its logged figures, the
    lr of every optimizer step call, kiln's warnings."""
    warnings = LogLines(logging.WARNING)
    logging.getLogger("kiln").addHandler(warnings)
    try:
        with open_trainer(_argv(dump, 7, log_freq, "--training.skip_nonfinite_steps", "3")) as trainer:
            logged, applied = logged_metrics(trainer), _applied_lrs(trainer)
            trainer.train([PoisonLoss(trainer, bad)])
    finally:
        logging.getLogger("kiln").removeHandler(warnings)
    return trainer, logged, applied, warnings.lines


def test_steps_skipped_between_log_steps_hold_the_schedule_back_by_their_number(
    tmp_path: Path, small_model: None
) -> None:
    """Steps 2, 4, 5 and 7 skipped, checks at 1, 3, 6 and 7 (log_freq 3, the last step): two skips pending at one
    check, and one on the last step, which is no log step. Every step applies the lr of the optimizer steps taken
    before it (a skipped step takes none), also while the skips are not yet counted on the host; the schedule ends
    at the 3 steps taken; each skip is reported once. The run is the one that checks every step, to the bit (the
    weights) and line for line (the logged figures)."""
    bad = {2, 4, 5, 7}
    trainer, logged, applied, warnings = _skip_run(tmp_path / "third", 3, bad)
    taken_before = [sum(1 for t in range(1, s) if t not in bad) for s in range(1, 8)]  # 0 1 1 2 2 2 3
    assert applied == pytest.approx([_lr(p, 7) for p in taken_before], rel=1e-12)
    assert [m["lr"] for m in logged] == [applied[s - 1] for s in (1, 3, 6, 7)]
    assert trainer.lr_scheduler.last_epoch == 3
    assert [int(w.split()[2].rstrip(":")) for w in warnings if w.startswith("Skipped step")] == [2, 4, 5, 7]

    every, every_logged, every_applied, _ = _skip_run(tmp_path / "every", 1, bad)
    assert applied == every_applied and every.lr_scheduler.last_epoch == 3
    figures = [m[k] for m in logged for k in ("loss", "grad_norm", "lr")]
    want = [every_logged[s - 1][k] for s in (1, 3, 6, 7) for k in ("loss", "grad_norm", "lr")]
    assert figures == pytest.approx(want, rel=0, abs=0, nan_ok=True)  # step 7's loss is NaN in both
    for (name, p), q in zip(trainer.model.named_parameters(), every.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_bad_step_between_log_steps_and_saves_stops_the_run_before_the_next_save(
    tmp_path: Path, small_model: None
) -> None:
    """Step 3 is non-finite, steps 4 on are not; lines every 5 steps, saves every 2: the save of step 4 checks
    first, names step 3 and writes nothing; step 2's checkpoint is the last good one."""
    argv = _argv(tmp_path, 10, 5, "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2")
    with open_trainer(argv) as trainer, pytest.raises(NonFiniteError) as e:
        trainer.train([PoisonLoss(trainer, {3})])
    assert str(e.value) == (
        "non-finite loss or grad norm at step 3; stopped before any later checkpoint save. "
        f"Last good checkpoint: {tmp_path}/checkpoint/step-2"
    )
    assert trainer.step == 4
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [".kiln.lock", "step-2"]


def test_the_last_step_is_checked_when_it_is_not_a_log_step(tmp_path: Path, small_model: None) -> None:
    """5 steps at log_freq 3, no checkpoints: the last line (step 5) is not a log step. A non-finite step 5 still
    stops the run (the skip's report of a last skipped step: the test above)."""
    with open_trainer(_argv(tmp_path, 5, 3)) as trainer:
        with pytest.raises(NonFiniteError, match="non-finite loss or grad norm at step 5;"):
            trainer.train([PoisonLoss(trainer, {5})])


def test_a_validation_step_between_log_steps_gets_its_line_and_is_checked_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_model: None
) -> None:
    """log_freq 3, validation every 2 steps: steps 2 and 4 validate without being log steps. Their lines show
    their own validation loss; a non-finite step 4 stops the run before its validation runs on the weights it
    made."""
    validate = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "1"]
    with open_trainer(_argv(tmp_path / "clean", 5, 3, *validate)) as trainer:
        logged, run, results = logged_metrics(trainer), trainer.validator.run, {}

        def recorded(step: int) -> Any:
            results[step] = run(step)
            return results[step]

        monkeypatch.setattr(trainer.validator, "run", recorded)
        trainer.train()
    assert sorted(results) == [1, 2, 4]
    lines = {1: True, 2: True, 3: False, 4: True, 5: False}  # step -> validated (lines at log, validation, last)
    assert [("val_loss" in m) for m in logged] == list(lines.values())
    assert [m["val_loss"] for m in logged if "val_loss" in m] == [results[s].loss for s in (1, 2, 4)]

    with open_trainer(_argv(tmp_path / "bad", 5, 3, *validate)) as trainer:
        run, validated = trainer.validator.run, []
        monkeypatch.setattr(trainer.validator, "run", lambda step: validated.append(step) or run(step))
        with pytest.raises(NonFiniteError, match="non-finite loss or grad norm at step 4;"):
            trainer.train([PoisonLoss(trainer, {4})])
    assert validated == [1, 2]
