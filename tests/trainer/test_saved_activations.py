"""Saved-activation report and the memory-regression checks built on it (torchtitan PR #808: per-op SAC kept abs(W))."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.common import DEBUG_CONFIG, needs_cpu_rowwise
from tests.helpers.distributed import run_distributed
from tests.helpers.sac import LAYERS, SAVE_LIST, aten, batch, debug_model, loss_fn
from trainer.tools.saved_activations import (
    SavedActivationReport,
    check_float8_overhead,
    check_ops_not_saved,
    measure_saved_activations,
)

WITH_ABS = SAVE_LIST | {aten.abs.default}


def report(recipe: str | None, save_list: tuple | None = SAVE_LIST) -> SavedActivationReport:
    model = debug_model(recipe, save_list)
    return measure_saved_activations(model, loss_fn(model, batch()))


@pytest.fixture(scope="module")
def bf16_report() -> SavedActivationReport:
    return report(None)


def test_report_sees_sac_cache_and_autograd_saves(bf16_report: SavedActivationReport) -> None:
    r = bf16_report
    # Per-op SAC caches every second mm: 4 of the 7 block matmuls per block, each (2*64, out) bf16.
    mm = r.row("aten.mm")
    assert mm is not None and mm.count == 4 * LAYERS and mm.dtypes == {"bfloat16"}
    dim, hidden, kv = 256, 768, 256  # debugmodel: wq, wk, wv, wo -> dim; w1, w3 -> hidden; w2 -> dim
    assert mm.nbytes == LAYERS * 2 * 128 * (dim + kv + dim + hidden)  # saved mm #1 wq, #3 wv, #5 w1, #7 w2
    assert r.row("aten._scaled_dot_product_flash_attention_for_cpu").count == LAYERS * 2  # out + logsumexp
    # Outside SAC regions autograd's own saves show up: log-softmax of the loss, the output-layer input.
    assert r.bytes_of("aten._log_softmax") == 2 * 64 * 2256 * 4
    assert "saved_activations_total_bytes: " + str(r.total_bytes) in r.format()
    assert r.total_bytes == sum(row.nbytes for row in r.rows if row.op != "(parameter)")


def test_no_ac_keeps_more_than_per_op_sac(bf16_report: SavedActivationReport) -> None:
    no_ac = report(None, save_list=None)
    assert no_ac.total_bytes > 2 * bf16_report.total_bytes
    assert no_ac.row("aten.silu") is not None and bf16_report.row("aten.silu") is None


@pytest.mark.parametrize("recipe", [pytest.param("rowwise", marks=needs_cpu_rowwise), "tensorwise"])
def test_float8_keeps_no_more_than_bf16_and_no_abs(bf16_report: SavedActivationReport, recipe: str) -> None:
    fp8 = report(recipe)
    assert check_ops_not_saved(fp8) == []
    assert check_float8_overhead(bf16_report, fp8) == []
    # The matmul outputs SAC keeps now come from _scaled_mm, same bytes as bf16's mm.
    assert fp8.bytes_of("aten._scaled_mm") == bf16_report.bytes_of("aten.mm")
    scale_op = "aten.max" if recipe == "tensorwise" else "aten.amax"
    assert fp8.bytes_of(scale_op) > 0  # amaxes are saved (cheap), abs is recomputed


def test_abs_in_save_list_is_caught(bf16_report: SavedActivationReport) -> None:
    """The seed's bug: with abs saved, SAC keeps abs(W) of every float8 weight; both checks must fail."""
    fp8 = report("tensorwise", WITH_ABS)
    (violation,) = check_ops_not_saved(fp8)
    assert violation.startswith("aten.abs: ")
    # At least abs(W) of the converted fp32 weights (7 Linears per block), 4 bytes per element.
    model = debug_model(None, None)
    weights = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert fp8.bytes_of("aten.abs") >= 4 * weights
    assert check_float8_overhead(bf16_report, fp8) != []


# ----------------------------------------------------------------------------- 2 ranks, FSDP2, float8 rowwise


def _fsdp_rank() -> dict[str, tuple]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    totals = {}
    for name, save_list in (("torchtitan", SAVE_LIST), ("with_abs", WITH_ABS)):
        model = debug_model("rowwise", save_list)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        # FSDP's MixedPrecisionPolicy casts to bf16 (rowwise _scaled_mm needs bf16): no autocast.
        r = measure_saved_activations(model, loss_fn(model, batch(seed=dist.get_rank()), autocast=False))
        totals[name] = (r.total_bytes, r.bytes_of("aten.abs"), r.bytes_of("aten.amax"), check_ops_not_saved(r))
    return totals


@pytest.mark.distributed
@needs_cpu_rowwise
def test_fsdp_two_ranks_rowwise_per_op_sac() -> None:
    for totals in run_distributed(_fsdp_rank, 2):
        good, bad = totals["torchtitan"], totals["with_abs"]
        assert good[1] == 0 and good[3] == [] and good[2] > 0, good  # no abs rows, amax rows
        # abs(W) of the unsharded bf16 weights (FSDP param_dtype) appears only with abs in the list.
        assert bad[1] > 0 and len(bad[3]) == 1, bad
        assert bad[0] - good[0] == bad[1], (good, bad)


def test_cli_report_runs_one_step_and_exits_0(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import train

    caplog.set_level(logging.INFO, logger="kiln")
    argv = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path)]
    argv += ["--training.seq_len", "64", "--training.local_batch_size", "2", "--profiling.saved_activations_report"]
    assert train.main(argv) == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in text and "saved_activations_total_bytes: " in text
    assert "step:" not in text  # no training step logged


@pytest.mark.slow
@needs_cpu_rowwise
def test_compiled_per_op_sac_saves_amax_not_abs() -> None:
    """--training.compile + per-op SAC + float8: the compiled block (checkpoint wrapper inside torch.compile, as
    apply_ac then apply_compile build it) carries kiln's policy (the amax op must-save, abs recompute) and its
    forward saves amax results, never abs (read from the partitioned graphs; the eager report cannot see inside)."""
    from trainer.tools.saved_activations import saved_ops_under_compile

    scale_op = "aten.amax"  # rowwise: amax(abs(x), dim); tensorwise's max(abs(x)) is aten.max
    model = debug_model("rowwise")
    x = torch.randn(2, 64, model.model_args.dim, requires_grad=True)
    found = saved_ops_under_compile(model.layers["0"], lambda block: block(x, model.freqs_cis[:64]).pow(2).mean())
    assert found.must_save[scale_op] > 0 and found.recompute["aten.abs"] > 0 and found.must_save["aten.abs"] == 0
    assert found.saved[scale_op] > 0 and found.saved["aten.abs"] == 0, found
