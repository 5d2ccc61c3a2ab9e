"""Resume in every float8 layout: save at step 2 of 4, resume from that checkpoint, compare with the straight run.

Each scenario trains the debug model (2 layers, seq 32, global batch 4, fp32 parameters, deterministic) for 4 steps
with a checkpoint every 2, copies `step-2` into a fresh dump folder and resumes there to step 4, through the path
users run (`parse_args` + `Trainer`, gloo ranks). Same layout and recipe: steps 3-4 must equal the straight run's
bitwise. A changed recipe (bf16 -> float8, float8 -> bf16, tensorwise -> rowwise) is allowed with a warning
(trainer/checkpoint/resume.py) and must train on from step 3 with finite losses.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.helpers.common import DEBUG_CONFIG, LogLines
from tests.helpers.distributed import reopen_group, run_distributed, train_in_group

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

F8 = ("--float8.enable_float8_linear", "--float8.recipe_name")
P = "--parallelism."
COMMON = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "32"),
    *("--training.global_batch_size", "4", "--training.steps", "4", "--training.seed", "0"),
    *("--training.mixed_precision_param", "float32", "--training.deterministic", "--metrics.log_freq", "1"),
    *("--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1", "--activation_checkpoint.mode", "none"),
    *("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"),
)
OP_SAC = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
FSDP2 = (f"{P}data_parallel_shard_degree", "2", "--training.local_batch_size", "2")
TP2 = (f"{P}data_parallel_shard_degree", "1", f"{P}tensor_parallel_degree", "2", "--training.local_batch_size", "4")
FSDP2_TP2 = (
    f"{P}data_parallel_shard_degree",
    "2",
    f"{P}tensor_parallel_degree",
    "2",
    "--training.local_batch_size",
    "2",
)
ONE = ("--training.local_batch_size", "4")
# Context parallel: both ranks read the same batches and keep their halves of every sequence; FSDP over them.
CP2 = (f"{P}context_parallel_degree", "2", f"{P}context_parallel_rotate_method", "alltoall", *ONE)
TENSORWISE_AG = (
    *(*F8, "tensorwise", "--float8.enable_fsdp_float8_all_gather"),
    "--float8.precompute_float8_dynamic_scale_for_fsdp",
)

# id -> (world size, arguments of the saving run, arguments of the resumed run)
SCENARIOS: dict[str, tuple[int, tuple[str, ...], tuple[str, ...]]] = {
    "1rank-tensorwise-compile": (1, *[(*ONE, *F8, "tensorwise", "--training.compile")] * 2),
    "1rank-bf16-to-tensorwise": (1, ONE, (*ONE, *F8, "tensorwise")),
    "1rank-tensorwise-to-bf16": (1, (*ONE, *F8, "tensorwise"), ONE),
    "1rank-tensorwise-to-rowwise": (1, (*ONE, *F8, "tensorwise"), (*ONE, *F8, "rowwise")),
    "fsdp2-tensorwise-ag-precompute-opsac": (2, *[(*FSDP2, *TENSORWISE_AG, *OP_SAC)] * 2),
    "tp2-rowwise": (2, *[(*TP2, *F8, "rowwise")] * 2),
    "cp2-alltoall-tensorwise-ag": (2, *[(*CP2, *TENSORWISE_AG)] * 2),
    "fsdp2xtp2-tensorwise": (4, *[(*FSDP2_TP2, *F8, "tensorwise")] * 2),
}


def _run_scenarios(ids: list[str], folder: str) -> dict[str, dict[str, Any]]:
    """On every rank of one spawned group: the straight run, then the resumed one, for each scenario."""
    records = LogLines(logging.WARNING)
    logging.getLogger("kiln").addHandler(records)
    out: dict[str, dict[str, Any]] = {}
    for i, sid in enumerate(ids):
        _, save_args, resume_args = SCENARIOS[sid]
        straight, resumed = Path(folder, sid, "straight"), Path(folder, sid, "resumed")
        losses = train_in_group(
            [*COMMON, *save_args, "--job.dump_folder", str(straight)], f"{folder}/store_{i}_a"
        ).losses
        reopen_group(f"{folder}/store_{i}_b")
        if dist.get_rank() == 0:  # only step-2: the resumed run starts from it, as from a copy handed over
            shutil.copytree(straight / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
        dist.barrier()
        records.lines.clear()
        after = train_in_group(
            [*COMMON, *resume_args, "--job.dump_folder", str(resumed)], f"{folder}/store_{i}_b"
        ).losses
        out[sid] = {"straight": losses, "resumed": after, "warnings": list(records.lines)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for world in sorted({w for w, _, _ in SCENARIOS.values()}):
        ids = [sid for sid, (w, _, _) in SCENARIOS.items() if w == world]
        out |= run_distributed(_run_scenarios, world, ids, str(tmp_path_factory.mktemp(f"world{world}")))[0]
    return out


SAME = [sid for sid, (_, a, b) in SCENARIOS.items() if a == b]
CHANGED = [sid for sid in SCENARIOS if sid not in SAME]


@pytest.mark.parametrize("sid", SAME)
def test_resume_equals_straight_run(sid: str, results: dict[str, dict[str, Any]]) -> None:
    r = results[sid]
    assert len(r["straight"]) == 4 and all(math.isfinite(x) for x in r["straight"]), r
    assert r["resumed"] == r["straight"][2:], r  # bitwise: deterministic CPU kernels, same data position
    assert r["warnings"] == [], r["warnings"]


@pytest.mark.parametrize("sid", CHANGED)
def test_changed_recipe_trains_on_with_a_warning(sid: str, results: dict[str, dict[str, Any]]) -> None:
    r = results[sid]
    assert len(r["resumed"]) == 2 and all(math.isfinite(x) for x in r["resumed"]), r
    # Continues from the saved weights: near the straight run's later losses, far below a fresh start's ~7.7.
    assert max(r["resumed"]) < r["straight"][0] - 0.3, r
    assert any("with changed float8" in line and "this run's float8 setting" in line for line in r["warnings"]), r
