"""The dry run plans a pipeline: every stage's modules and parameters, and each pipeline rank's memory."""

from __future__ import annotations

import re

import pytest

from kiln_base.config import parse_args
from tests.helpers.common import DEBUG_CONFIG, ROOT
from trainer.tools.dry_run import dry_run

PP = "--parallelism.pipeline_parallel_"


def _stage_params(plan: str) -> dict[int, tuple[int, int, str]]:
    """stage -> (rank, parameters, modules), from the plan's stage lines."""
    rows = re.findall(r"^  stage (\d+) +rank (\d+) +([\d,]+) params  (.*)$", plan, re.M)
    return {int(s): (int(r), int(n.replace(",", "")), mods) for s, r, n, mods in rows}


def test_debug_model_interleaved_over_fsdp_and_tp() -> None:
    argv = ["--job.config_file", DEBUG_CONFIG, "--job.dry_run", f"{PP}degree", "2", f"{PP}schedule", "Interleaved1F1B"]
    argv += ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    plan = dry_run(parse_args(argv))
    assert "simulated world: 8 = pp 2 x dp_replicate 1 x dp_shard 2 x tp 2" in plan
    assert (
        "pipeline: Interleaved1F1B, 4 stages over pp 2 (2 per rank), 4 micro-batches of 1 per local batch of 4" in plan
    )
    stages = _stage_params(plan)
    assert [(r, mods) for r, _, mods in stages.values()] == [
        (0, "tok_embeddings, layers.0"),
        (1, "layers.1-2"),
        (0, "layers.3-4"),
        (1, "layers.5, norm, output"),
    ]
    total = int(re.search(r"parameters: ([\d,]+)", plan).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert sum(n for _, n, _ in stages.values()) == total  # every parameter on exactly one stage
    ranks = re.findall(r"^  pp rank (\d) +stages ([\d,]+) +([\d.]+) GiB", plan, re.M)
    assert [(r, s) for r, s, _ in ranks] == [("0", "0,2"), ("1", "1,3")]


@pytest.mark.slow
def test_405b_on_4_nodes_of_8_gpus() -> None:
    """torchtitan's 405B recipe (v0.2.2 TOML as shipped) with one stage per node: PP 4 x TP 8, 32 GPUs."""
    config = str(ROOT / "tests" / "fixtures" / "torchtitan" / "v0.2.2" / "llama3_405b.toml")
    argv = ["--job.config_file", config, "--job.dry_run", f"{PP}degree", "4", "--training.local_batch_size", "8"]
    argv += ["--parallelism.data_parallel_shard_degree", "1", "--float8.no-enable_fsdp_float8_all_gather"]
    argv += ["--float8.no-precompute_float8_dynamic_scale_for_fsdp"]
    plan = dry_run(parse_args(argv))
    assert "simulated world: 32 = pp 4 x dp_replicate 1 x dp_shard 1 x tp 8" in plan
    stages = _stage_params(plan)
    assert [mods for _, _, mods in stages.values()] == [
        "tok_embeddings, layers.0-30",
        "layers.31-62",
        "layers.63-94",
        "layers.95-125, norm, output",
    ]
    assert sum(n for _, n, _ in stages.values()) == 405_853_388_800
    # fp32 weights, gradients and AdamW state of a quarter of the model over 8 TP ranks: ~190 GiB per GPU
    ranks = [float(x) for x in re.findall(r"^  pp rank \d +stages \d +([\d.]+) GiB", plan, re.M)]
    assert len(ranks) == 4 and all(185 < x < 200 for x in ranks), ranks


def test_pipeline_with_context_parallel_plans_a_cp_rank_s_part_per_stage() -> None:
    """PP x CP: the mesh has both; each pipeline rank's activations are its micro-batches in flight of a CP rank's
    part of the sequence, and the CP key/value buffers are one micro-batch's, whatever is in flight."""
    cfg = parse_args(
        ["--job.config_file", str(ROOT / "train_configs" / "llama3_8b.toml"), "--job.dry_run"]
        + ["--model.flavor", "3.1-8B", "--training.seq_len", "131072", "--training.local_batch_size", "4"]
        + ["--parallelism.context_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "4"]
        + ["--parallelism.data_parallel_shard_degree", "1", "--activation_checkpoint.mode", "full"]
    )
    plan = dry_run(cfg)
    assert "simulated world: 32 = pp 4 x dp_replicate 1 x dp_shard 1 x cp 8 x tp 1" in plan
    assert "(FSDP on, HSDP off, CP on, TP off, PP on)" in plan
    ranks = [line for line in plan.splitlines() if line.strip().startswith("pp rank")]
    assert len(ranks) == 4
    kv = {re.search(r"CP key/value buffers ([\d.]+)", line)[1] for line in ranks}  # type: ignore[index]
    assert kv == {"1.50"}  # 16,384 tokens x 8 ranks' keys/values (allgather), one block, one micro-batch
    in_flight = [int(re.search(r"(\d+) micro-batch", line)[1]) for line in ranks]  # type: ignore[index]
    assert in_flight == [4, 3, 2, 1]  # 1F1B: degree - rank, of 4 micro-batches
    # alltoall passes the ring's keys/values a peer at a time: what a run's memory_estimate counts for it (trainer.py)
    cfg.parallelism.context_parallel_rotate_method = "alltoall"
    alltoall = [line for line in dry_run(cfg).splitlines() if line.strip().startswith("pp rank")]
    kv = {re.search(r"CP key/value buffers ([\d.]+)", line)[1] for line in alltoall}  # type: ignore[index]
    assert len(kv) == 1 and float(kv.pop()) < 1.50, alltoall


@pytest.mark.parametrize(("budget", "verdict"), [("20", "fits"), ("10", "DOES NOT FIT")])
def test_pipeline_dry_run_gives_the_memory_budget_verdict_of_its_busiest_rank(budget: str, verdict: str) -> None:
    cfg = parse_args(
        ["--job.config_file", str(ROOT / "train_configs" / "llama3_8b.toml"), "--job.dry_run"]
        + ["--model.flavor", "3.1-8B", "--training.seq_len", "131072", "--training.local_batch_size", "4"]
        + ["--parallelism.context_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "4"]
        + ["--parallelism.data_parallel_shard_degree", "1", "--activation_checkpoint.mode", "full"]
        + ["--training.memory_budget_gib", budget]
    )
    line = next(x for x in dry_run(cfg).splitlines() if "training.memory_budget_gib" in x)
    assert line.strip() == f"training.memory_budget_gib {budget}: {verdict} (pipeline rank 3 needs the most, 17.94 GiB)"
