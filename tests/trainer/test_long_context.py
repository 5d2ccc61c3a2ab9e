"""Long context in the dry run: Llama 3.1 8B at its full 131,072-token context planned with context parallelism,
the per-rank memory it prints, and training.memory_budget_gib's verdict on it."""

from __future__ import annotations

import re

import pytest

from kiln_base.config import parse_args
from kiln_base.errors import ConfigError
from tests.helpers.common import ROOT
from trainer.tools.dry_run import dry_run

LLAMA_8B = str(ROOT / "train_configs" / "llama3_8b.toml")
PLAN_131K = [
    *("--job.config_file", LLAMA_8B, "--model.flavor", "3.1-8B", "--training.seq_len", "131072", "--job.dry_run"),
    *("--parallelism.context_parallel_degree", "8", "--parallelism.data_parallel_shard_degree", "1"),
    *("--activation_checkpoint.mode", "full"),
]


def _memory(plan: str) -> dict[str, float]:
    """The plan's per-device memory lines, in GiB."""
    return {m[1].strip(): float(m[2]) for m in re.finditer(r"^  ([a-zA-Z][^\n]*?)\s+([\d.]+) GiB$", plan, re.M)}


def test_31_8b_at_131k_tokens_with_cp8_fits_an_80gb_gpu() -> None:
    plan = dry_run(parse_args([*PLAN_131K, "--training.memory_budget_gib", "80"]))
    assert "simulated world: 8 = dp_replicate 1 x dp_shard 1 x cp 8 x tp 1" in plan
    assert "each rank holds 16384 of every sequence's 131072 tokens: 16 chunks of 8192, rank i holds chunks i" in plan
    assert "FSDP shards over dp_shard x cp = 8 ranks" in plan
    assert "FSDP reduce-scatter over 8 ranks" in plan  # the gradients are reduced over the CP ranks too
    mem = _memory(plan)
    # 8.03 B parameters, fp32 weights + gradients + AdamW's two moments = 16 bytes each, over the 8 FSDP ranks.
    assert mem["params (fp32)"] == pytest.approx(8_030_261_248 * 4 / 8 / 2**30, abs=0.01)
    assert 10 < mem["activations (one micro-batch)"] < 20 and mem["total"] < 80, mem
    assert "training.memory_budget_gib 80: fits" in plan


def test_cp_divides_the_activations_and_a_budget_refuses_one_rank() -> None:
    one = _memory(dry_run(parse_args([*PLAN_131K, "--parallelism.context_parallel_degree", "1"])))
    eight = _memory(dry_run(parse_args(PLAN_131K)))
    assert eight["activations (one micro-batch)"] == pytest.approx(one["activations (one micro-batch)"] / 8, rel=1e-3)
    assert "CP key/value buffers (one block)" not in one and eight["CP key/value buffers (one block)"] > 0
    plan = dry_run(
        parse_args([*PLAN_131K, "--parallelism.context_parallel_degree", "1", "--training.memory_budget_gib", "80"])
    )
    assert "training.memory_budget_gib 80: DOES NOT FIT" in plan


def test_dry_run_refuses_a_sequence_that_does_not_split() -> None:
    with pytest.raises(ConfigError, match=r"training.seq_len \(131070\) must split into 2 x context_parallel_degree"):
        dry_run(parse_args([*PLAN_131K, "--training.seq_len", "131070"]))
