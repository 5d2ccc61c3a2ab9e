"""MXFP8 recipes (torchao's MXFP8TrainingOpConfig) on a CPU, emulated: conversion, numerics, refusals, the Trainer
path on 1 rank, FSDP 2 (+ per-op SAC), TP 2 and FSDP 2 x TP 2, each against its layout's float8-off run, and TP 2
against one process from the same weights (losses and gradients)."""

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

from tests.helpers.common import DEBUG_CONFIG, LogLines, open_trainer
from tests.helpers.distributed import reopen_group, run_distributed, train_in_group

MX = ("--float8.enable_float8_linear", "--float8.emulate", "--float8.recipe_name")
COMMON = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "1", "--training.seq_len", "32"),
    *("--training.global_batch_size", "4", "--training.steps", "4", "--training.seed", "0"),
    *("--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"),
    *("--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1"),
)


def _cfg(recipe: str = "mxfp8_rceil", *extra: str) -> Any:
    from kiln_base.config import parse_args

    return parse_args([*COMMON, *MX, recipe, *extra])


def _mx_linear(recipe: str, k: int = 64, n: int = 96, bias: bool = False) -> tuple[nn.Linear, nn.Linear]:
    """(an MXFP8 Linear, its fp32 twin with the same weight and bias)."""
    from float8.converter import Float8Converter

    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=bias)
    model = nn.Sequential(nn.Linear(k, n, bias=bias))
    model.load_state_dict({f"0.{k}": v for k, v in ref.state_dict().items()})
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


def test_mxfp8_linear_adds_its_bias() -> None:
    """torchao 0.18's MXFP8 wrapper drops F.linear's bias; kiln's MXFP8Linear adds it after the MXFP8 matmul."""
    mx, ref = _mx_linear("mxfp8_rceil", bias=True)
    with torch.no_grad():
        ref.bias.fill_(5.0)
        mx.bias.fill_(5.0)
    x = torch.randn(32, 64)
    assert 1e-3 < _rel(mx(x), ref(x)) < 0.05  # MXFP8's error only; without the bias the output is off by ~100%


def test_mxfp8_checkpoint_state_is_plain(tmp_path: Path) -> None:
    """What a checkpoint saves of an MXFP8 Linear, weight and AdamW states alike (zeros_like keeps torchao's wrapper
    class), is plain tensors sharing the parameter's storage: DCP's torch.load(weights_only=True) refused the
    wrapper class, so no MXFP8 run could resume."""
    from trainer.checkpoint.manager import plain_tensor

    mx, _ = _mx_linear("mxfp8_rceil")
    opt = torch.optim.AdamW(mx.parameters())
    mx(torch.randn(32, 64)).sum().backward()
    opt.step()
    state = {"weight": plain_tensor(mx.weight), **{k: plain_tensor(v) for k, v in opt.state[mx.weight].items()}}
    assert {type(t) for t in state.values()} == {torch.Tensor}
    torch.save(state, tmp_path / "state.pt")
    torch.load(tmp_path / "state.pt", weights_only=True)
    with torch.no_grad():
        state["weight"].zero_()  # a load in place writes the parameter itself
    assert not mx(torch.randn(32, 64)).any()


def test_mxfp8_conversion_decisions() -> None:
    """Which Linears get MXFP8 weights: dims must divide by 32 (by 32 x tp_degree under TP, where each rank scales
    blocks of its own shard), filter_fqns and the first/last policy apply."""
    from float8.converter import Float8Converter, is_float8_linear

    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 48), nn.Linear(64, 64))  # 48 = 16 x 3, not 32 x n
    conv = Float8Converter(_cfg("mxfp8_rceil", "--float8.filter_fqns", "2").float8)
    conv.convert(model)
    assert [is_float8_linear(m) for m in model] == [True, False, False]
    assert [d.reason for d in conv.decisions] == ["", "in/out features 96/48 not divisible by 32", "filter_fqns '2'"]
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(64, 128))  # 96 = 32 x 3: TP 2 would split it into 48s
    conv = Float8Converter(_cfg("mxfp8_rceil").float8, tp_degree=2)
    conv.convert(model)
    assert [is_float8_linear(m) for m in model] == [False, True]
    why = "in/out features 64/96 not divisible by 64 (32 per rank x tensor_parallel_degree 2)"
    assert conv.decisions[0].reason == why


def test_mxfp8_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One line, exit 2: MXFP8 on a CPU without emulate; tokens not a multiple of 32; the auto filter."""
    import train

    no_emulate = [a for a in (*COMMON, *MX, "mxfp8_rceil") if a != "--float8.emulate"]
    cases = [
        (no_emulate, "MXFP8 kernels need a Blackwell GPU (SM100); on a CPU add --float8.emulate"),
        ([*COMMON, *MX, "mxfp8_rceil", "--training.seq_len", "20"], "make it a multiple of 32"),
        ([*COMMON, *MX, "mxfp8_rceil", "--float8.auto_filter_small_kn"], "no size thresholds"),
    ]
    for argv, message in cases:
        assert train.main([*argv, "--job.dump_folder", str(tmp_path)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("kiln: error: float8.") and message in line, line


def test_mxfp8_dry_run_lists_mxfp8_weights() -> None:
    from kiln_base.config import parse_args
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
    "fsdp2xtp2": (4, (f"{P}data_parallel_shard_degree", "2", f"{P}tensor_parallel_degree", "2", BATCH, "2")),
}
SAC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
RUNS = {  # name -> (layout, extra arguments); each is compared with its layout's float8-off run
    "1rank": ("1rank", (*MX, "mxfp8_rceil")),
    "fsdp2-sac_op": ("fsdp2", (*MX, "mxfp8_rceil", *SAC_OP)),
    "fsdp2-wgrad_hp": ("fsdp2", (*MX, "mxfp8_rceil_wgrad_with_hp")),
    "fsdp2xtp2-wgrad_hp": ("fsdp2xtp2", (*MX, "mxfp8_rceil_wgrad_with_hp")),
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


# ----------------------------------------------------------------------------- TP 2 against one process

PARITY_STEPS = 3
TP2 = ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2")
# No clipping: the gradients compared are the backward's own (the clip factor's norm is summed in another order
# under TP, which scales every gradient by ~1e-4 relative in this model, with or without float8).
ONE = (*COMMON, BATCH, "4", "--training.max_norm", "0")
PARITY = {  # name -> (world size, arguments); all start from the weights the float8-off run saved
    "hp-1rank": (1, ONE),
    "mx-1rank": (1, (*ONE, *MX, "mxfp8_rceil")),
    "mx-tp2": (2, (*ONE, *TP2, *MX, "mxfp8_rceil")),
}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def _load(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into the parameters (each rank its TP shard; MXFP8 wrappers keep their class)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            p.to_local().copy_(
                distribute_tensor(state[name], p.device_mesh, p.placements, src_data_rank=None).to_local()
            )
        else:
            p.copy_(state[name])


def _parity_runs(names: list[str], folder: str) -> None:
    """On each rank: each named run from the same initial weights (saved by the first run that finds none), its
    losses over PARITY_STEPS steps and the first step's gradients, written by rank 0 to {folder}/{name}.pt."""
    state_file = f"{folder}/initial_weights.pt"
    for i, name in enumerate(names):
        reopen_group(f"{folder}/store_{name}_{i}")
        with open_trainer([*PARITY[name][1], "--job.dump_folder", f"{folder}/{name}"]) as trainer:
            if Path(state_file).exists():
                _load(trainer.model, torch.load(state_file, weights_only=True))
            else:
                torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, state_file)
            losses, grads = [], {}
            for step in range(PARITY_STEPS):
                loss = trainer.train_step(step + 1).loss
                losses.append(loss.item())
                if step == 0:
                    grads = {n: _full(p.grad) for n, p in trainer.model.named_parameters()}
            if dist.get_rank() == 0:
                torch.save({"losses": losses, "grads": grads}, f"{folder}/{name}.pt")


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("mx_parity"))
    run_distributed(_parity_runs, 1, ["hp-1rank", "mx-1rank"], folder)
    run_distributed(_parity_runs, 2, ["mx-tp2"], folder)
    return {name: torch.load(f"{folder}/{name}.pt", weights_only=True) for name in PARITY}


@pytest.mark.slow
@pytest.mark.distributed
def test_mxfp8_tp2_matches_one_process(parity: dict[str, Any]) -> None:
    """From the same weights and batches, TP 2 MXFP8 gives one process's MXFP8 losses and first-step gradients up to
    summation order (each rank scales its shard's own blocks of 32, as one process does), and both differ from float8
    off by MXFP8's error: TP really ran MXFP8, not a high-precision matmul."""
    tp, one, hp = parity["mx-tp2"], parity["mx-1rank"], parity["hp-1rank"]
    torch.testing.assert_close(torch.tensor(tp["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    assert (torch.tensor(one["losses"]) - torch.tensor(hp["losses"])).abs().max() > 1e-4
    assert tp["grads"].keys() == one["grads"].keys() == hp["grads"].keys()
    for name, g in one["grads"].items():
        assert _rel(tp["grads"][name], g) < 1e-5, name
    mx_weights = [n for n in one["grads"] if "layers." in n and n.endswith(("w1.weight", "wq.weight", "wo.weight"))]
    assert len(mx_weights) == 3
    for name in mx_weights:
        assert _rel(tp["grads"][name], hp["grads"][name]) > 1e-3, name
