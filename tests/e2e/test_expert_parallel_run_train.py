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


def steps(ngpu: int, dump: Path, *args: str) -> list[tuple[str, str]]:
    """Rank 0's (loss, grad_norm) per step, as printed."""
    proc = run_kiln([*TINY, "--job.dump_folder", dump, *args], ngpu=ngpu, threads=1, timeout=900)
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
