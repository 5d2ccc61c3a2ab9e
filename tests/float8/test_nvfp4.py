"""The nvfp4 recipe (float8/nvfp4.py, emulated): torchao's NVFP4 numerics on a CPU, the three GEMMs of an NVFP4Linear,
which Linears convert (the last 15% of blocks stay high precision by default), refusals, the first-step check, the
dry run, and a resume that reproduces the straight run. Layouts and compile: tests/e2e/test_composition.py's nvfp4
cells; the loss against float8 off over 200 steps: docs/float8.md."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from tests.helpers.common import DEBUG_CONFIG, run_trainer, tiny_run_args

NV = ("--float8.enable_float8_linear", "--float8.recipe_name", "nvfp4", "--float8.emulate")


def _cfg(*extra: str) -> Any:
    from kiln_base.config import parse_args

    return parse_args(tiny_run_args(*NV, *extra))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------------------- numerics


def test_torchaos_nvfp4_training_linear_cannot_run_on_a_cpu() -> None:
    """Why kiln emulates: torchao 0.18's NVFP4 training linear calls Triton kernels only. If this starts to pass
    through, torchao runs NVFP4 training on a CPU and kiln could use it directly."""
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig
    from torchao.quantization import quantize_

    model = nn.Sequential(nn.Linear(128, 128, bias=False))
    quantize_(model, NVFP4TrainingConfig())
    with pytest.raises(NotImplementedError, match="triton_rht_amax requires torch 2.10.0\\+ and triton installed"):
        model(torch.randn(128, 128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_to_nearest_is_torchaos_nvfp4_tensor(dtype: torch.dtype) -> None:
    """Bit for bit torchao's NVFP4Tensor (per-tensor scale amax / (448 x 6), e4m3 block scales, e2m1), over 5
    decades of magnitude."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    from float8.nvfp4 import NEAREST, fake_quantize

    torch.manual_seed(0)
    x = (torch.randn(64, 128) * torch.logspace(-3, 2, 128)).to(dtype)
    scale = per_tensor_amax_to_scale(x.float().abs().amax())
    want = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32)
    got = fake_quantize(x, NEAREST)
    assert torch.equal(got, want)
    assert 0.05 < _rel(got, x.float()) < 0.2  # 4-bit elements: ~10% error, never exact


def test_casts_tiles_rounding_and_the_hadamard_transform() -> None:
    from float8.nvfp4 import NEAREST, NEAREST_TILES, STOCHASTIC, _e2m1_values, fake_quantize, hadamard

    torch.manual_seed(0)
    w = torch.randn(96, 64)
    # 16 x 16 tiles: the weight and its transpose quantize to the same values (forward and grad_input GEMMs).
    assert torch.equal(fake_quantize(w, NEAREST_TILES).t(), fake_quantize(w.t().contiguous(), NEAREST_TILES))
    assert not torch.equal(fake_quantize(w, NEAREST).t(), fake_quantize(w.t().contiguous(), NEAREST))
    # Stochastic rounding is unbiased (the mean of many draws converges on x, unlike round-to-nearest) and differs
    # from draw to draw; the grid it rounds onto is torchao's e2m1 decode table.
    x = torch.randn(32, 64)
    draws = torch.stack([fake_quantize(x, STOCHASTIC) for _ in range(2000)])
    assert not torch.equal(draws[0], draws[1])
    assert _rel(draws.mean(0), x) < 0.2 * _rel(fake_quantize(x, NEAREST), x)
    assert _e2m1_values(x.device).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    # An all-zero tensor stays zero (no 0/0 scale).
    assert not fake_quantize(torch.zeros(16, 32), STOCHASTIC).any()
    # The Hadamard transform is orthogonal along K: products are unchanged (to float32 rounding).
    a, b = torch.randn(8, 64), torch.randn(4, 64)
    torch.testing.assert_close(hadamard(a) @ hadamard(b).t(), a @ b.t(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hadamard(a), a)


def test_nvfp4_linear_quantizes_all_three_gemms() -> None:
    """Forward, grad_input and grad_weight each carry NVFP4's error (and only it: the same matmuls on the
    quantize-dequantized operands give the result exactly); three custom-op GEMMs per call, counted."""
    from float8.converter import NVFP4Linear, is_float8_linear
    from float8.nvfp4 import NEAREST, NEAREST_TILES, counting_gemms, fake_quantize

    torch.manual_seed(0)
    ref = nn.Linear(64, 96, bias=True)
    with torch.device("meta"):
        mod = NVFP4Linear(64, 96, bias=True)
    mod.weight, mod.bias = nn.Parameter(ref.weight.detach().clone()), nn.Parameter(ref.bias.detach().clone())
    assert is_float8_linear(mod)
    x = torch.randn(2, 16, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    seen: list[bool] = []
    with counting_gemms(seen.append):
        out = mod(x1)
        g = torch.randn_like(out)
        out.backward(g)
    assert seen == [False, False, False]  # three GEMMs ran (none traced)
    out_ref = ref(x2)
    out_ref.backward(g)
    for got, want in ((out, out_ref), (x1.grad, x2.grad), (mod.weight.grad, ref.weight.grad)):
        assert 0.02 < _rel(got, want) < 0.35
    exact = fake_quantize(x.view(-1, 64), NEAREST) @ fake_quantize(ref.weight.detach(), NEAREST_TILES).t()
    torch.testing.assert_close(out.detach().view(-1, 96), exact + ref.bias.detach(), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- which Linears convert


def test_the_last_15_percent_of_blocks_stay_high_precision_by_default() -> None:
    from float8.converter import Float8Converter, is_float8_linear
    from models import LLAMA3_FLAVORS, Transformer

    def nvfp4_blocks(n_layers: int, *extra: str) -> list[int]:
        args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=512, n_layers=n_layers)
        with torch.device("meta"):
            model = Transformer(args)
        conv = Float8Converter(_cfg(*extra).float8)
        conv.convert(model)
        assert not is_float8_linear(model.output)
        return sorted({int(n.split(".")[1]) for n, m in model.named_modules() if is_float8_linear(m)})

    assert nvfp4_blocks(6) == [0, 1, 2, 3, 4]  # 15% of 6 = 0.9: one block
    assert nvfp4_blocks(32) == list(range(27))  # 4.8: five blocks, as for Llama 3 8B
    assert nvfp4_blocks(2) == [0, 1]  # 0.3: none
    assert nvfp4_blocks(6, "--float8.high_precision_last", "0") == [0, 1, 2, 3, 4, 5]
    assert nvfp4_blocks(6, "--float8.high_precision_last", "2", "--float8.high_precision_first_last", "1") == [1, 2, 3]
    conv = Float8Converter(_cfg().float8)
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=512)
    with torch.device("meta"):
        conv.convert(Transformer(args))
    reasons = {d.fqn: d.reason for d in conv.decisions}
    assert reasons["layers.5.attention.wq"] == "high_precision_last 1 (block 5 of 6; nvfp4's default: the last 15%)"
    assert _cfg("--float8.recipe_name", "rowwise").float8.high_precision_last_blocks(32) == 0  # float8: no default


def test_blocks_of_16_per_rank() -> None:
    from float8.converter import Float8Converter

    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40), nn.Linear(64, 48))  # 40: not 16 x n
    conv = Float8Converter(_cfg().float8)
    conv.convert(model)
    assert [d.reason for d in conv.decisions] == ["", "in/out features 96/40 not divisible by 16", ""]
    conv = Float8Converter(_cfg().float8, tp_degree=2)
    conv.convert(nn.Sequential(nn.Linear(64, 96), nn.Linear(64, 48)))  # 48 = 16 x 3: TP 2 would split it into 24s
    why = "in/out features 64/48 not divisible by 32 (16 per rank x tensor_parallel_degree 2)"
    assert [d.reason for d in conv.decisions] == ["", why]


def test_nvfp4_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One line, exit 2: nvfp4 without emulate (on any device: a config rule); tokens not a multiple of 16; the auto
    filter; the numerics observatory; high_precision_last without float8."""
    import train

    base = [*tiny_run_args(), "--job.dump_folder", str(tmp_path)]
    no_emulate = [a for a in NV if a != "--float8.emulate"]
    cases = [
        ([*no_emulate], "nvfp4 runs emulated only: torchao's NVFP4 training kernels need Triton and a Blackwell"),
        ([*NV, "--training.seq_len", "20"], "local_batch_size x seq_len = 40; make it a multiple of 16"),
        ([*NV, "--float8.auto_filter_small_kn"], "float8.auto_filter_small_kn: torchao has no size thresholds"),
        ([*NV, "--float8.numerics_log_freq", "2"], "float8.numerics_log_freq: the numerics observatory has no NVFP4"),
        (["--float8.high_precision_last", "1"], "float8.high_precision_last set but float8 is off"),
    ]
    for extra, message in cases:
        assert train.main([*base, *extra]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("kiln: error: float8.") and message in line, line


def test_dry_run_lists_nvfp4_linears() -> None:
    from kiln_base.config import parse_args
    from trainer.tools.dry_run import dry_run

    text = dry_run(parse_args(["--job.config_file", DEBUG_CONFIG, *NV, "--job.dry_run"]))
    assert "float8: 35/43 Linears converted (recipe nvfp4)" in text, text
    assert "Float8 NVFP4Linear (emulated: e2m1 in blocks of 16" in text
    assert "high precision: high_precision_last 1 (block 5 of 6; nvfp4's default: the last 15%)" in text


# ----------------------------------------------------------------------------- the Trainer


@pytest.mark.slow
def test_nvfp4_trains_checks_and_resumes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """4 steps of the 2-block debug model: the first-step check counts the NVFP4 GEMMs (14 Linears x 3), the loss
    falls and stays within 1% of float8 off; a run resumed from step 2's checkpoint gives the straight run's
    losses exactly (stochastic rounding draws are reseeded per step)."""
    caplog.set_level(logging.INFO, logger="kiln")
    common = tiny_run_args(
        *("--training.steps", "4", "--model.n_layers", "2", "--training.seed", "0", "--optimizer.lr", "3e-3"),
        *("--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--training.local_batch_size", "4"),
    )
    off = run_trainer([*common, "--job.dump_folder", str(tmp_path / "off")])
    ckpt = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path / "nv"))
    straight = run_trainer([*common, *NV, *ckpt])
    assert "float8 in use: 14/15 Linears are NVFP4Linear" in caplog.text
    assert "float8 in use: emulated NVFP4 matmuls in the first step: 42 ran" in caplog.text
    assert min(straight.losses[1:]) < straight.losses[0] - 0.3
    gaps = [abs(a - b) / b for a, b in zip(straight.losses, off.losses, strict=True)]
    assert 0 < max(gaps) < 0.01, (straight.losses, off.losses)
    shutil.rmtree(tmp_path / "nv" / "checkpoint" / "step-4")
    resumed = run_trainer([*common, *NV, *ckpt])
    assert resumed.losses == straight.losses[2:], (resumed.losses, straight.losses)
