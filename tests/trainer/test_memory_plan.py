"""The plan's memory model (kiln_base/config/plan.py) counts what a run holds, through run_train.sh where a user
meets it: a validation batch too big for memory is refused before any rank starts (as the same training batch is);
activations count at the compute dtype's size (float32: 4 bytes); on a CPU the dense document mask of a _flex flavor
counts too. Each refusal is exit 2 and one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.common import tiny_run_args
from tests.helpers.kiln_process import assert_one_line_error, run_kiln

pytestmark = pytest.mark.distributed  # each test starts run_train.sh


def _gib(line: str, name: str) -> float:
    """The GiB the budget's one line gives for estimate entry `name` (3 significant digits)."""
    match = re.search(re.escape(name) + r" ([\d.e+]+)", line)
    assert match, line
    return float(match.group(1))


def test_a_validation_batch_too_big_for_memory_is_refused_before_any_rank(tmp_path: Path) -> None:
    # 100,000 x 1024 validation tokens: 100M x 2256 (vocab) x 8 bytes of logits, ~1.7 TB; training's batch is tiny.
    big = ("--validation.enable", "--validation.local_batch_size", "100000", "--validation.seq_len", "1024")
    proc = run_kiln([*tiny_run_args(*big, "--job.dump_folder", str(tmp_path / "o"))], ngpu=1, timeout=300)
    line = assert_one_line_error(proc, "GiB of logits (a validation batch: 100000 x validation.seq_len 1024)")
    assert "this machine's RAM" in line and "[rank0]" not in proc.stdout  # the launcher's check, before torchrun


# Debug model (dim 256, 6 blocks, FFN 768, 4 heads x 64, vocab 2256), one process, no activation checkpointing.
DIM, BLOCKS, HIDDEN, VOCAB = 256, 6, 768, 2256


def _budget_run(tmp_path: Path, *args: str) -> str:
    argv = tiny_run_args("--activation_checkpoint.mode", "none", *args, "--job.dump_folder", str(tmp_path / "o"))
    return assert_one_line_error(run_kiln(argv, ngpu=1, timeout=300), "training.memory_budget_gib")


def test_float32_compute_counts_activations_at_4_bytes(tmp_path: Path) -> None:
    # 8 x 2048 tokens: 2.43 GiB of float32 activations (1.29 GiB counted at bf16's 2 bytes, which a 2 GiB budget
    # took: a run then used twice its estimate).
    line = _budget_run(
        tmp_path,
        *("--training.mixed_precision_param", "float32", "--training.local_batch_size", "8"),
        *("--training.seq_len", "2048", "--training.memory_budget_gib", "2"),
    )
    tokens = 8 * 2048
    kept = (8 * DIM + 3 * DIM + 4 * HIDDEN) * 4 * BLOCKS + (4 + 4) * VOCAB  # per token: blocks + logits/log-softmax
    assert _gib(line, "activations (one micro-batch)") == pytest.approx(tokens * kept / 2**30, rel=5e-3), line


def test_the_dense_cpu_document_mask_counts(tmp_path: Path) -> None:
    # A _flex flavor on a CPU evaluates the mask densely: (1, 1, 4096, 4096) in bf16 kept by each of the 6 blocks,
    # 0.19 GiB; without it the estimate (0.40 GiB) fits the 0.5 GiB budget.
    line = _budget_run(
        tmp_path,
        *("--model.flavor", "debugmodel_flex_attn", "--training.mixed_precision_param", "bfloat16"),
        *("--training.local_batch_size", "1", "--training.seq_len", "4096", "--training.memory_budget_gib", "0.5"),
    )
    mask, total = _gib(line, "document mask (dense on a CPU)"), _gib(line, "would need about")
    assert mask == pytest.approx(BLOCKS * 4096 * 4096 * 2 / 2**30, rel=5e-3), line
    assert total - mask < 0.5 < total, line
