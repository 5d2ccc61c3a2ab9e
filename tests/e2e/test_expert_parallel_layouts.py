"""Expert parallelism across layouts, through the Trainer from train.py arguments (gloo ranks): `debugmodel_moe` at
2 layers, seq 32, float32, global batch 4, 6 steps, seed 0, the expert bias on (model.moe_load_balance_coeff).

- EP 4 on 4 ranks and EP 2 on 2 ranks follow one rank: every step's loss and gradient norm within TOL.
- Save at EP 2, resume at EP 4, resume at one rank: EP 2 trains (its step-2 checkpoint handed on), EP 4 resumes
  that (steps 3-6; its step-4 checkpoint handed on), one rank resumes that (steps 5-6); every run is configured for
  the same 6 steps, so the learning-rate schedule is the straight run's. What a resume loads is bitwise what the
  other layout held when it saved: every weight (the experts' [E, ...] tensors re-sharded 2 -> 4 -> 1 ranks), the
  expert bias (moved from 0 by then) and the AdamW state, each gathered whole. The resumed steps' losses and
  gradient norms follow the straight one-rank run within TOL, not bitwise: as in tests/e2e/test_resume_layouts.py,
  a resume is bitwise only in the layout that saved; another layout sums the loss and the gradients over its
  ranks in another order, so its steps are a float32 ulp or so from one rank's (EP from scratch alike).

- `--profiling.saved_activations_report` measures an EP step (it once crashed reading the storage of a functional
  all-to-all's output): each EP 2 rank keeps its experts' grouped-GEMM activations and the dispatched tokens (the
  all-to-all's output), and what the two ranks' experts keep of their SiLU adds up to one rank's (the same routed
  tokens, split).

Runs shared between the assertions: one group of 2 ranks, one of 4 (EP 4 from scratch, then the EP 4 resume), one
of 1 (the straight run, then the last resume); the reports run in the 2- and 1-rank groups.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.helpers.common import DEBUG_CONFIG, open_trainer
from tests.helpers.distributed import forget_dtensor_plans, reopen_group, run_distributed
from trainer.hooks import StepHook, StepOutput

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = (
    *("--job.config_file", DEBUG_CONFIG, "--model.name", "qwen3", "--model.flavor", "debugmodel_moe"),
    *("--model.n_layers", "2", "--training.seq_len", "32", "--training.global_batch_size", "4"),
    *("--training.steps", "6", "--training.seed", "0", "--training.mixed_precision_param", "float32"),
    *("--training.deterministic", "--metrics.log_freq", "1", "--optimizer.lr", "3e-3"),
    *("--lr_scheduler.warmup_steps", "1", "--activation_checkpoint.mode", "none"),
    *("--model.moe_load_balance_coeff", "1e-3", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"),
)
LAYOUT = {
    1: ("--training.local_batch_size", "4"),
    2: ("--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"),
    4: ("--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "4"),
}
# Measured (torch 2.13 CPU, 2026-12-02): from one rank's, the losses at most 9.5e-7 apart (one float32 ulp at 8)
# and the gradient norms 2.6e-8 relative, in every layout and resume; the bound leaves ten times that, far below
# what a wrong expert or a lost bias moves (the loss moves ~0.3 a step).
TOL = 1e-5


def _whole(t: torch.Tensor) -> np.ndarray:
    # numpy, pickled by value: a torch tensor would cross back to the test through shared memory its rank frees
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()


def full_state(trainer: Any) -> dict[str, np.ndarray]:
    """The model's state dict (weights and the expert bias) and the AdamW state, each tensor whole (collective)."""
    out = {f"model.{k}": _whole(v) for k, v in trainer.model.state_dict().items()}
    names = {p: n for n, p in trainer.model.named_parameters()}
    for p, state in trainer.optimizer.state.items():
        out |= {f"optim.{names[p]}.{k}": _whole(v) for k, v in state.items()}
    return out


class Record(StepHook):
    """Each step's gradient norm; the whole state before the run's first step and after the steps in `at`."""

    def __init__(self, trainer: Any, at: tuple[int, ...]) -> None:
        self.trainer, self.at = trainer, at
        self.first: dict[str, np.ndarray] | None = None
        self.saved: dict[int, dict[str, np.ndarray]] = {}
        self.grad_norms: list[float] = []

    def pre_step(self, step: int) -> None:
        if self.first is None:
            self.first = full_state(self.trainer)

    def post_step(self, out: StepOutput) -> None:
        self.grad_norms.append(float(out.grad_norm))
        if out.step in self.at:
            self.saved[out.step] = full_state(self.trainer)


def train(world: int, dump: Path, store: str, at: tuple[int, ...] = ()) -> dict[str, Any]:
    """One Trainer on this group's ranks: its losses, gradient norms and states."""
    reopen_group(store)
    forget_dtensor_plans()
    with open_trainer([*COMMON, *LAYOUT[world], "--job.dump_folder", str(dump)]) as trainer:
        record = Record(trainer, at)
        trainer.train([record])
    return {"losses": trainer.losses, "grad_norms": record.grad_norms, "first": record.first, "saved": record.saved}


def saved_bytes(world: int, dump: Path, store: str) -> list[dict[str, int]]:
    """Every rank's saved-activation report (bytes by producing op) for one step of this layout."""
    reopen_group(store)
    forget_dtensor_plans()
    argv = [*COMMON, *LAYOUT[world], "--job.dump_folder", str(dump), "--profiling.saved_activations_report"]
    with open_trainer(argv) as trainer:
        report = {r.op: r.nbytes for r in trainer.report_saved_activations().rows}
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, report)
    return reports


def resume_from(src: Path, step: int, dump: Path) -> None:
    """Rank 0 copies only `src`'s step-`step` checkpoint into a fresh dump folder (a copy handed over)."""
    if dist.get_rank() == 0:
        shutil.copytree(src / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    dist.barrier()


def _group(world: int, folder: str) -> dict[str, Any]:
    root = Path(folder)
    out: dict[str, Any] = {}
    if world == 2:
        out["ep2"] = train(2, root / "ep2", f"{folder}/s2", at=(2,))
        out["ep2_saved"] = saved_bytes(2, root / "ep2_saved", f"{folder}/s2b")
    elif world == 4:
        out["ep4"] = train(4, root / "ep4", f"{folder}/s4a")
        reopen_group(f"{folder}/s4b")
        resume_from(root / "ep2", 2, root / "ep4_resumed")
        out["ep4_resumed"] = train(4, root / "ep4_resumed", f"{folder}/s4b", at=(4,))
    else:
        out["one"] = train(1, root / "one", f"{folder}/s1a")
        reopen_group(f"{folder}/s1b")
        resume_from(root / "ep4_resumed", 4, root / "one_resumed")
        out["one_resumed"] = train(1, root / "one_resumed", f"{folder}/s1b")
        out["one_saved"] = saved_bytes(1, root / "one_saved", f"{folder}/s1c")
    return out if int(os.environ["RANK"]) == 0 else {}  # rank 0's record alone crosses back


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("ep_layouts"))
    out: dict[str, Any] = {}
    for world in (2, 4, 1):  # the order the checkpoints are handed on
        out |= run_distributed(_group, world, world, folder, timeout_s=1200)[0]
    return out


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=TOL, abs_tol=TOL) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("ep", ["ep4", "ep2"])
def test_expert_parallel_follows_one_rank(ep: str, runs: dict[str, Any]) -> None:
    one, run = runs["one"], runs[ep]
    assert len(one["losses"]) == 6 and all(math.isfinite(x) for x in one["losses"]), one["losses"]
    assert min(one["losses"]) < one["losses"][0] - 0.5, one["losses"]  # it trains
    assert close(run["losses"], one["losses"]), (run["losses"], one["losses"])
    assert close(run["grad_norms"], one["grad_norms"]), (run["grad_norms"], one["grad_norms"])


@pytest.mark.parametrize(
    "saver,step,loader", [("ep2", 2, "ep4_resumed"), ("ep4_resumed", 4, "one_resumed")], ids=["ep2-to-ep4", "ep4-to-1"]
)
def test_resume_loads_what_the_other_layout_saved(saver: str, step: int, loader: str, runs: dict[str, Any]) -> None:
    saved, loaded = runs[saver]["saved"][step], runs[loader]["first"]
    assert saved.keys() == loaded.keys()
    experts = [k for k in saved if k.startswith("model.") and ".moe.experts." in k]
    biases = [k for k in saved if k.endswith(".expert_bias")]
    assert len(experts) == 6 and len(biases) == 2, sorted(saved)  # w1, w2, w3 of 2 layers; one bias a layer
    assert all(np.count_nonzero(saved[k]) > 0 for k in biases), [saved[k] for k in biases]  # the bias has moved
    assert any(".moe.experts." in k for k in saved if k.startswith("optim."))
    different = [k for k in saved if saved[k].dtype != loaded[k].dtype or saved[k].tobytes() != loaded[k].tobytes()]
    assert different == [], different  # bitwise


@pytest.mark.parametrize(
    "resumed,after", [("ep4_resumed", 2), ("one_resumed", 4)], ids=["ep4-steps-3-6", "1-steps-5-6"]
)
def test_resumed_steps_follow_the_straight_run(resumed: str, after: int, runs: dict[str, Any]) -> None:
    straight, run = runs["one"], runs[resumed]
    assert close(run["losses"], straight["losses"][after:]), (run["losses"], straight["losses"])
    assert close(run["grad_norms"], straight["grad_norms"][after:]), (run["grad_norms"], straight["grad_norms"])


def test_saved_activation_report_measures_expert_parallel(runs: dict[str, Any]) -> None:
    ep2, (one,) = runs["ep2_saved"], runs["one_saved"]
    grouped, dispatched = "aten._grouped_mm", "_c10d_functional.all_to_all_single"
    assert len(ep2) == 2 and all(r.get(grouped, 0) > 0 and r.get(dispatched, 0) > 0 for r in ep2), ep2
    assert one.get(grouped, 0) > 0 and dispatched not in one, one
    # The experts' SiLU runs once on each routed token: the two ranks' tokens are one rank's, split.
    assert sum(r["aten.silu"] for r in ep2) == one["aten.silu"], (ep2, one)
