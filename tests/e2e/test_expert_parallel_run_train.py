"""Expert parallelism through run_train.sh: a qwen3 MoE run with `--parallelism.expert_parallel_degree 2` on 2 ranks
prints the one-rank run's losses and gradient norms (one seed, one model, the same global batch), and its loss falls.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.helpers.common import DEBUG_CONFIG
from tests.helpers.kiln_process import run_kiln

pytestmark = pytest.mark.distributed

STEP = re.compile(r"step: +(\d+)  loss: +(\S+)  .*grad_norm: +(\S+)")
TINY = (
    *("--job.config_file", DEBUG_CONFIG, "--model.name", "qwen3", "--model.flavor", "debugmodel_moe"),
    *("--model.n_layers", "2", "--training.seq_len", "32", "--training.steps", "4", "--training.seed", "0"),
    *("--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--optimizer.lr", "3e-3"),
    *("--lr_scheduler.warmup_steps", "1", "--activation_checkpoint.mode", "selective"),
)


def steps(ngpu: int, dump: Path, *args: str, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """Rank 0's (loss, grad_norm) per step, as printed (with `env`: the run's output in dump/../NAME.out too)."""
    proc = run_kiln([*TINY, "--job.dump_folder", dump, *args], ngpu=ngpu, threads=1, timeout=900, env=env)
    dump.with_suffix(".out").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = [m.groups() for line in proc.stdout.splitlines() if (m := STEP.search(line))]
    assert [int(s) for s, _, _ in found] == [1, 2, 3, 4], proc.stdout[-4000:]
    assert "routed experts of 2 MoE layers split over" in proc.stdout or ngpu == 1, proc.stdout[-4000:]
    return [(loss, norm) for _, loss, norm in found]


def test_ep2_follows_one_rank(tmp_path: Path) -> None:
    # Global batch 2 in both: local batch 2 on one rank, 1 on each of the two data-parallel (and EP) ranks.
    one = steps(1, tmp_path / "one", "--training.local_batch_size", "2")
    ep = steps(2, tmp_path / "ep2", "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "1")
    losses = [float(loss) for loss, _ in ep]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1, losses
    assert ep == one  # the printed 4 decimals of every step's loss and gradient norm


def test_ep2_compiled_follows_one_rank_without_recompiling(tmp_path: Path) -> None:
    """EP 2 under training.compile, every second block checkpointed (selective_ac_option 2): each MoE layer's dispatch
    runs eagerly between its block's graphs (parallelisms/parallelize.py apply_compile; dynamo traces the MoE layer's
    forward around it), the checkpointed block compiled inside its checkpoint (said at start). The losses and
    gradient norms are the eager one-rank run's within 1e-4 relative (compiled kernels sum in another order), and
    nothing recompiles although every step routes a different number of rows to each expert's rank
    (TORCH_LOGS=recompiles prints each one)."""
    one = steps(1, tmp_path / "one", "--training.local_batch_size", "2", "--activation_checkpoint.mode", "none")
    ep = steps(
        2,
        tmp_path / "ep2",
        *("--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "1"),
        *("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"),
        "--training.compile",
        env={"TORCH_LOGS": "recompiles,dynamo"},
    )
    out = (tmp_path / "ep2.out").read_text()
    assert (
        "the expert-parallel dispatch and experts of 2 MoE layers run eagerly, the rest of each block compiled around "
        "them (1 inside their activation checkpoint)"
    ) in out
    assert re.search(r"torchdynamo start tracing forward \S*models/moe\.py", out), out[-6000:]
    # The checkpoint itself not traced: compiled around it, dynamo failed to capture it and ran the block eagerly whole
    assert not re.search(r"torchdynamo start tracing forward \S*checkpoint_wrapper\.py", out), out[-6000:]
    assert "unable to trace" not in out, out[-6000:]
    assert "Recompiling function" not in out, out[-6000:]
    for (loss, norm), (want_loss, want_norm) in zip(ep, one, strict=True):
        assert math.isclose(float(loss), float(want_loss), rel_tol=1e-4), (ep, one)
        assert math.isclose(float(norm), float(want_norm), rel_tol=1e-4), (ep, one)
