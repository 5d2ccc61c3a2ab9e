"""MXFP8 recipes (torchao's MXFP8TrainingOpConfig) on a CPU, emulated: conversion, numerics, refusals (TP among
them: the first-step check found its matmuls ran in high precision), and the Trainer path on 1 rank and FSDP 2
(+ per-op SAC), each against its layout's float8-off run."""

from __future__ import annotations

import logging
import math
import re
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.common import DEBUG_CONFIG, LogLines
from tests.distributed import run_distributed, train_in_group

MX = ("--float8.enable_float8_linear", "--float8.emulate", "--float8.recipe_name")
COMMON = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "1", "--training.seq_len", "32"),
    *("--training.global_batch_size", "4", "--training.steps", "4", "--training.seed", "0"),
    *("--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"),
    *("--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1"),
)


def _cfg(recipe: str = "mxfp8_rceil", *extra: str) -> Any:
    from trainer.config import parse_args

    return parse_args([*COMMON, *MX, recipe, *extra])


def _mx_linear(recipe: str, k: int = 64, n: int = 96) -> tuple[nn.Linear, nn.Linear]:
    """(an MXFP8 Linear, its fp32 twin with the same weight)."""
    from float8.converter import Float8Converter

    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=False)
    model = nn.Sequential(nn.Linear(k, n, bias=False))
    model[0].weight.data.copy_(ref.weight.data)
    Float8Converter(_cfg(recipe).float8).convert(model)
    return model[0], ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("recipe", ["mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp"])
def test_mxfp8_linear_numerics(recipe: str) -> None:
    """The converted Linear runs MXFP8 in all three GEMMs (wgrad_with_hp: grad_weight exact), error ~e4m3's."""
    from float8.converter import is_float8_linear

    mx, ref = _mx_linear(recipe)
    assert is_float8_linear(mx) and type(mx.weight).__name__ == "MXFP8TrainingWeightWrapperTensor"
    x = torch.randn(64, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, out_ref = mx(x1), ref(x2)
    g = torch.randn_like(out_ref)
    out.backward(g)
    out_ref.backward(g)
    # e4m3 with 32-element power-of-two scales: a few % relative error, never zero (float8 really ran).
    for got, want in ((out, out_ref), (x1.grad, x2.grad)):
        assert 1e-3 < _rel(got, want) < 0.1
    gw = _rel(mx.weight.grad, ref.weight.grad)
    if recipe == "mxfp8_rceil_wgrad_with_hp":
        assert gw < 1e-6  # the weight-gradient GEMM stayed in high precision
    else:
        assert 1e-3 < gw < 0.1


def test_mxfp8_conversion_decisions() -> None:
    """Which Linears get MXFP8 weights: dims must divide by 32, filter_fqns and the first/last policy apply."""
    from float8.converter import Float8Converter, is_float8_linear

    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 48), nn.Linear(64, 64))  # 48 = 16 x 3, not 32 x n
    conv = Float8Converter(_cfg("mxfp8_rceil", "--float8.filter_fqns", "2").float8)
    conv.convert(model)
    assert [is_float8_linear(m) for m in model] == [True, False, False]
    assert [d.reason for d in conv.decisions] == ["", "in/out features 96/48 not divisible by 32", "filter_fqns '2'"]


def test_mxfp8_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One line, exit 2: MXFP8 on a CPU without emulate; tokens not a multiple of 32; the auto filter."""
    import train

    no_emulate = [a for a in (*COMMON, *MX, "mxfp8_rceil") if a != "--float8.emulate"]
    cases = [
        (no_emulate, "MXFP8 kernels need a Blackwell GPU (SM100); on a CPU add --float8.emulate"),
        ([*COMMON, *MX, "mxfp8_rceil", "--training.seq_len", "20"], "make it a multiple of 32"),
        ([*COMMON, *MX, "mxfp8_rceil", "--float8.auto_filter_small_kn"], "no size thresholds"),
        ([*COMMON, *MX, "mxfp8_rceil", "--parallelism.tensor_parallel_degree", "2"], "run in high precision"),
    ]
    for argv, message in cases:
        assert train.main([*argv, "--job.dump_folder", str(tmp_path)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("kiln: error: float8.") and message in line, line


def test_mxfp8_dry_run_lists_mxfp8_weights() -> None:
    from trainer.config import parse_args
    from trainer.tools.dry_run import dry_run

    cfg = parse_args(
        [
            "--job.config_file",
            DEBUG_CONFIG,
            *MX,
            "mxfp8_rceil",
            "--model.n_layers",
            "2",
            "--float8.disable_after_step",
            "9",
        ]
    )
    text = dry_run(cfg)
    assert "float8 policy: high precision from step 10 (float8.disable_after_step)" in text, text
    assert "float8: 14/15 Linears converted (recipe mxfp8_rceil)" in text, text
    assert "Float8 MXFP8 weight (mxfp8_rceil: blocks of 32, e8m0 scales)" in text, text


# ----------------------------------------------------------------------------- the Trainer path

P, BATCH = "--parallelism.", "--training.local_batch_size"
LAYOUT = {  # name -> (world size, arguments); the same global batches in each (global batch 4)
    "1rank": (1, (BATCH, "4")),
    "fsdp2": (2, (f"{P}data_parallel_shard_degree", "2", BATCH, "2")),
}
SAC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
RUNS = {  # name -> (layout, extra arguments); each is compared with its layout's float8-off run
    "1rank": ("1rank", (*MX, "mxfp8_rceil")),
    "fsdp2-sac_op": ("fsdp2", (*MX, "mxfp8_rceil", *SAC_OP)),
    "fsdp2-wgrad_hp": ("fsdp2", (*MX, "mxfp8_rceil_wgrad_with_hp")),
}


def _train_all(runs: list[tuple[str, list[str]]], folder: str) -> dict[str, Any]:
    """On each rank: train each (name, argv) in turn; its losses and float8 log lines, or the error."""

    logger = logging.getLogger("kiln")
    logger.setLevel(logging.INFO)
    records = LogLines()
    logger.addHandler(records)
    out: dict[str, Any] = {}
    for i, (name, argv) in enumerate(runs):
        records.lines.clear()
        try:
            trainer = train_in_group([*argv, "--job.dump_folder", f"{folder}/{name}"], f"{folder}/store_{i}")
            out[name] = {"losses": trainer.losses, "float8": [x for x in records.lines if x.startswith("float8")]}
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            if dist.is_initialized():
                dist.destroy_process_group()
    logger.removeHandler(records)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for world in sorted({w for w, _ in LAYOUT.values()}):
        layouts = [name for name, (w, _) in LAYOUT.items() if w == world]
        runs = [(f"ref-{lay}", [*COMMON, *LAYOUT[lay][1]]) for lay in layouts]
        runs += [(name, [*COMMON, *LAYOUT[lay][1], *extra]) for name, (lay, extra) in RUNS.items() if lay in layouts]
        results |= run_distributed(_train_all, world, runs, str(tmp_path_factory.mktemp(f"mx{world}")))[0]
    return results


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_mxfp8_trains_like_bf16(name: str, trained: dict[str, Any]) -> None:
    """Each layout trains with emulated MXFP8 matmuls (the first-step check saw them) within 3e-3 of float8 off."""
    result, ref = trained[name], trained[f"ref-{RUNS[name][0]}"]
    assert "error" not in result, result.get("error")
    assert "error" not in ref, ref.get("error")
    losses = result["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and min(losses[1:]) < losses[0] - 0.2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=3e-3, atol=0)
    assert any(re.match(r"float8 in use: [1-9]\d*/\d+ Linears have MXFP8 weights", x) for x in result["float8"])
    how = "traced into compiled graphs" if "compile" in name else "ran"
    pattern = rf"float8 in use: emulated MXFP8 matmuls in the first step: .*[1-9]\d* {how}"
    assert any(re.match(pattern, x) for x in result["float8"]), result["float8"]
