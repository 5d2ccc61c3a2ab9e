"""training.skip_nonfinite_steps: a step whose loss or grad norm is non-finite on any rank is skipped on every rank,
logged with its batch's position; N consecutive skips stop the run (trainer/step/guards.py, NonFiniteSkip).

The fault is injected by a test hook (PoisonGrads) into one rank's gradients: on the chosen steps a forward hook on
the final norm makes the gradient flowing back through it NaN. The loss of that step stays finite; its grad norm
does not (under FSDP the reduce-scatter carries the NaN to every rank's shards).

"A run that never saw that batch's update", precisely: the same run, but with the skipped step's batch taken from
the data loader and dropped before the step (DropBatch), and one step fewer. Its step k (from the skipped step on)
trains on the batch of the faulty run's step k + 1, after the same number of optimizer and LR-scheduler steps, so
their losses agree bitwise (the schedule has no decay: its lr depends on the steps taken, not on training.steps).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kiln_base.config import parse_args
from kiln_base.errors import ConfigError, NonFiniteError
from tests.helpers.common import LogLines, open_trainer, tiny_run_args
from tests.helpers.distributed import run_distributed
from trainer.hooks import StepHook, StepOutput

SKIP = ("--training.skip_nonfinite_steps", "3", "--lr_scheduler.decay_ratio", "0", "--training.deterministic")


class PoisonGrads(StepHook):
    """On `steps` (and only where `rank` is this process's): NaN into the gradients flowing back through the final
    norm. A test seam: it changes the step, which kiln's own hooks never do."""

    def __init__(self, model: torch.nn.Module, steps: set[int], rank: int = 0) -> None:
        self.norm, self.steps, self.rank = model.norm, steps, rank

    @contextlib.contextmanager
    def _poisoned(self) -> Iterator[None]:
        def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda grad: grad * float("nan"))

        handle = self.norm.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        here = not dist.is_initialized() or dist.get_rank() == self.rank
        return self._poisoned() if step in self.steps and here else contextlib.nullcontext()


class DropBatch(StepHook):
    """Before step `step`: take one batch from the data loader and drop it."""

    def __init__(self, loader: Any, step: int) -> None:
        self.loader, self.step = loader, step

    def pre_step(self, step: int) -> None:
        if step == self.step:
            next(self.loader)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


class Snapshots(StepHook):
    """After each step: this rank's parameters and AdamW state (exp_avg, exp_avg_sq, step), copied."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def post_step(self, out: StepOutput) -> None:
        snap = {f"param {n}": _local(p) for n, p in self.model.named_parameters()}
        for i, p in enumerate(self.model.parameters()):
            for k, v in self.optimizer.state[p].items():
                snap[f"{k} {i}"] = _local(v)
        self.after[out.step] = snap


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train(argv: list[str], hooks: Callable[[Any], list[StepHook]]) -> tuple[Any, list[str]]:
    """Train with the test hooks `hooks(trainer)` after kiln's; the closed trainer and kiln's warnings."""
    lines = LogLines(logging.WARNING)
    logging.getLogger("kiln").addHandler(lines)
    try:
        with open_trainer(argv) as trainer:
            trainer.train(hooks(trainer))
    finally:
        logging.getLogger("kiln").removeHandler(lines)
    return trainer, lines.lines


def test_a_skipped_step_changes_nothing_and_the_run_goes_on_as_if_it_never_saw_the_batch(tmp_path: Path) -> None:
    run = tiny_run_args("--job.dump_folder", str(tmp_path), *SKIP)
    snaps: list[Snapshots] = []

    def faulty(t: Any) -> list[StepHook]:
        snaps.append(Snapshots(t.model, t.optimizer))
        return [PoisonGrads(t.model, {3}), snaps[0]]

    skipped, warnings = _train([*run, "--training.steps", "6"], faulty)
    assert skipped.step == 6
    assert warnings == [
        "Skipped step 3: non-finite loss or grad norm on some rank; no optimizer or LR-scheduler step on any rank, "
        "its batch (global sequences 4-5, epoch 0) is not trained on"
    ]
    after = snaps[0].after
    assert _equal(after[3], after[2])  # weights, exp_avg, exp_avg_sq and step counts, bitwise
    assert not _equal(after[4], after[3])  # and the next step trains
    assert {float(v) for k, v in after[6].items() if k.startswith("step ")} == {5.0}  # 5 optimizer steps in 6
    assert skipped.lr_scheduler.last_epoch == 5

    never_saw, _ = _train([*run, "--training.steps", "5"], lambda t: [DropBatch(t.dataloader, 3)])
    assert all(torch.isfinite(torch.tensor(skipped.losses)))  # the loss of step 3 is finite: its gradients are not
    assert skipped.losses[:2] == never_saw.losses[:2] and skipped.losses[3:] == never_saw.losses[2:]
    # The skip decision costs nothing on healthy steps: a run without the key logs the same losses, bitwise.
    plain = tiny_run_args("--job.dump_folder", str(tmp_path / "plain"), *SKIP[2:], "--training.steps", "3")
    with open_trainer(plain) as without:
        without.train()
    assert without.losses == skipped.losses[:3]


def test_consecutive_skips_stop_the_run_as_the_guard_does(tmp_path: Path) -> None:
    run = tiny_run_args("--job.dump_folder", str(tmp_path), *SKIP, "--training.steps", "8")
    snaps: list[Snapshots] = []

    def faulty(t: Any) -> list[StepHook]:
        snaps.append(Snapshots(t.model, t.optimizer))
        return [PoisonGrads(t.model, {2, 4, 5, 6, 7}), snaps[0]]

    with pytest.raises(NonFiniteError) as e:
        _train(run, faulty)
    assert str(e.value) == (
        "non-finite loss or grad norm at 3 consecutive steps (4-6), each skipped (training.skip_nonfinite_steps 3); "
        "stopped before any later checkpoint save. Last good checkpoint: none"
    )
    after = snaps[0].after
    assert sorted(after) == [1, 2, 3, 4, 5]  # stopped in step 6's check (log_freq 1); step 2's skip was forgiven
    assert _equal(after[5], after[3]) and _equal(after[2], after[1])


def test_the_key_needs_the_fused_optimizer(tmp_path: Path) -> None:
    argv = tiny_run_args("--job.dump_folder", str(tmp_path), *SKIP, "--optimizer.implementation", "foreach")
    with pytest.raises(ConfigError, match="training.skip_nonfinite_steps skips .* is foreach: set it to fused"):
        parse_args(argv)


class PoisonLoss(StepHook):
    """On `step`, where `rank` is this process's: NaN added to the loss as a constant, so the gradients stay finite
    (a test seam through the loss function the Trainer holds, put back after the step)."""

    def __init__(self, trainer: Any, step: int, rank: int) -> None:
        self.trainer, self.step, self.rank = trainer, step, rank

    @contextlib.contextmanager
    def _poisoned(self) -> Iterator[None]:
        loss_fn = self.trainer.train_step.loss_fn
        self.trainer.train_step.loss_fn = lambda *args: loss_fn(*args) + torch.tensor(float("nan"))
        try:
            yield
        finally:
            self.trainer.train_step.loss_fn = loss_fn

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        here = step == self.step and dist.get_rank() == self.rank
        return self._poisoned() if here else contextlib.nullcontext()


def _fsdp_rank(dump: str, fault: str) -> dict[str, Any]:
    argv = tiny_run_args("--job.dump_folder", dump, *SKIP, "--training.steps", "4")
    argv += ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "1"]
    snaps: list[Snapshots] = []

    def faulty(t: Any) -> list[StepHook]:
        snaps.append(Snapshots(t.model, t.optimizer))
        poison = PoisonGrads(t.model, {2}, rank=1) if fault == "grads" else PoisonLoss(t, 2, rank=1)
        return [poison, snaps[0]]

    trainer, warnings = _train(argv, faulty)
    after = snaps[0].after
    return {
        "unchanged": _equal(after[2], after[1]),
        "trained after": not _equal(after[3], after[2]),
        "warnings": warnings,
        "losses": trainer.losses,
        "scheduler steps": trainer.lr_scheduler.last_epoch,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["grads", "loss"])
def test_under_fsdp_a_fault_on_one_rank_skips_the_step_on_both(tmp_path: Path, fault: str) -> None:
    """A NaN in one rank's gradients reaches every rank through the reduce-scatter; a NaN loss with finite gradients
    reaches the other rank only through the skip's own all-reduce."""
    ranks = run_distributed(_fsdp_rank, 2, str(tmp_path), fault)
    for r in ranks:  # rank 0 saw no fault itself
        assert r["unchanged"] and r["trained after"] and r["scheduler steps"] == 3, r
        assert r["warnings"] == [
            "Skipped step 2: non-finite loss or grad norm on some rank; no optimizer or LR-scheduler step on any "
            "rank, its batch (global sequences 2-3, epoch 0) is not trained on"
        ]
    losses = torch.tensor(ranks[0]["losses"])
    assert len(losses) == 4 and losses[[0, 2, 3]].isfinite().all()
