"""The float8 numerics observatory: cast statistics against tensors with known underflow and saturation (and
torchao's own MXFP8 cast), the alarm on a layer made to underflow, and the Trainer path (JSONL, log line, compile)."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch

from float8.numerics import Cast, cast_stats, recipe_casts, to_record
from tests.helpers.common import tiny_run_args
from tests.helpers.sac import batch, debug_model, loss_fn

E4M3 = torch.float8_e4m3fn


def _known() -> torch.Tensor:
    """1000 elements: one 448 (e4m3's max), 750 ones, 249 of 1e-4 (below half e4m3's smallest subnormal, 2^-10)."""
    return torch.cat([torch.tensor([448.0]), torch.ones(750), torch.full((249,), 1e-4)]).reshape(10, 100)


def test_cast_stats_known_underflow_and_saturation() -> None:
    x = _known()
    rec = to_record(cast_stats(x, Cast(E4M3, "tensor")).tolist())
    assert rec["amax"] == 448 and rec["scale"] == 1.0  # 448 / amax
    assert rec["underflow"] == pytest.approx(249 / 1000) and rec["saturation"] == 0
    # The only error is the 249 lost 1e-4s; 448 and 1.0 are exact in e4m3.
    signal2, noise2 = 448**2 + 750 + 249e-8, 249e-8
    assert rec["sqnr_db"] == pytest.approx(10 * math.log10(signal2 / noise2), rel=1e-4)
    # A stale scale of 2 (as a precomputed scale after the weights grew): 448 * 2 saturates, 1e-4 * 2 still underflows.
    rec = to_record(cast_stats(x, Cast(E4M3, "tensor"), scale=torch.tensor(2.0)).tolist())
    assert rec["saturation"] == pytest.approx(1 / 1000) and rec["underflow"] == pytest.approx(249 / 1000)
    # Per-row scales: the row without the 448 scales by 2^floor(log2(448)) = 256, so its 1e-4s survive.
    rows = to_record(cast_stats(x, Cast(E4M3, "row")).tolist())
    assert rows["scale"] == 1.0 and rows["underflow"] == 0 and rows["saturation"] == 0


def test_mxfp8_cast_stats_match_torchao() -> None:
    """MXFP8 (blocks of 32, rceil e8m0 scales) against torchao's own emulated cast of the same tensor."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization.quantize_.common import KernelPreference

    torch.manual_seed(0)
    x = torch.randn(64, 128) * torch.logspace(-8, 2, 128)[torch.randperm(128)]  # blocks span 10 decades
    x[:, :32] = 0  # an all-zero block in every row: no error, no underflow
    mx = MXTensor.to_mx(x, E4M3, 32, ScaleCalculationMode.RCEIL, KernelPreference.EMULATED)
    dq = mx.dequantize(torch.float32)
    rec = to_record(cast_stats(x, recipe_casts("mxfp8_rceil")["input"]).tolist())
    want_sqnr = 20 * math.log10(x.norm() / (x - dq).norm())
    want_underflow = ((x != 0) & (dq == 0)).sum().item() / (x != 0).sum().item()
    assert want_underflow > 0.01
    assert rec["sqnr_db"] == pytest.approx(want_sqnr, rel=1e-5)
    assert rec["underflow"] == pytest.approx(want_underflow) and rec["saturation"] == 0


def test_numerics_hook_alarm_fires_once_on_an_underflowing_layer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A layer whose weight is one outlier and tiny values (tensorwise: the outlier sets the scale, the rest
    underflow) gets one warning naming it and the fixes; the JSONL holds every layer and operand per logged step."""
    from float8.numerics_report import NumericsReport
    from kiln_base.config import parse_args
    from trainer.hooks import NumericsHook, StepOutput

    caplog.set_level(logging.INFO, logger="kiln")
    cfg = parse_args(tiny_run_args("--float8.enable_float8_linear", "--float8.numerics_log_freq", "1")).float8
    model = debug_model("tensorwise", save_list=None)
    bad = model.layers["1"].feed_forward.w2
    with torch.no_grad():
        bad.weight.mul_(1e-4)
        bad.weight[0, 0] = 100.0
    hook = NumericsHook(model, cfg, NumericsReport(cfg, str(tmp_path), 0, True, None))
    for step in (1, 2):
        hook.pre_step(step)
        with hook.step_context(step):
            loss_fn(model, batch())().backward()
        hook.post_step(StepOutput(step, step == 2, torch.zeros(()), torch.zeros(()), 0.0))
    hook.close()
    alarms = [r.getMessage() for r in caplog.records if r.getMessage().startswith("float8 numerics alarm")]
    assert len(alarms) == 1, alarms  # once per layer, not once per step
    assert alarms[0].startswith("float8 numerics alarm: layers.1.feed_forward.w2 weight at step 1:"), alarms
    assert "underflow to 0" in alarms[0] and "--float8.recipe_name rowwise" in alarms[0]
    assert "--float8.filter_fqns layers.1.feed_forward.w2" in alarms[0]
    records = [json.loads(line) for line in (tmp_path / "rank_0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] * 14 + [2] * 14
    by_layer = {r["layer"]: r for r in records if r["step"] == 1}
    assert by_layer["layers.1.feed_forward.w2"]["weight"]["underflow"] > 0.5
    assert all(
        r[op]["underflow"] < 0.05
        for r in by_layer.values()
        for op in ("input", "grad_output")
        if r is not by_layer["layers.1.feed_forward.w2"]
    )
    assert all(set(r) >= {"input", "weight", "grad_output", "output_sqnr_db"} for r in records)
    assert (tmp_path / "rank_0_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn at close
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("float8 numerics step 1"))
    assert "most underflow layers.1.feed_forward.w2 weight" in line, line


def test_output_sqnr_points_at_the_layer_that_hurts() -> None:
    """The folded SQNR monitor: the output SQNR against an fp32 matmul singles out a layer with a damaged output."""
    from float8.numerics import NumericsObservatory

    model = debug_model("tensorwise", save_list=None)
    bad = model.layers["1"].feed_forward.w2
    bad.register_forward_hook(lambda m, i, out: out + 0.3 * out.std() * torch.randn_like(out))
    obs = NumericsObservatory(model, "tensorwise")
    obs.active = True
    with torch.no_grad():
        loss_fn(model, batch())()
    values = {layer: e["output_sqnr_db"] for layer, e in obs.collect().items()}
    assert len(values) == 14 and all(math.isfinite(v) for v in values.values())
    worst = min(values, key=values.get)
    assert worst == "layers.1.feed_forward.w2", values
    assert min(v for n, v in values.items() if n != worst) > 20 and values[worst] < 15


@pytest.mark.slow
def test_numerics_under_compile_train_and_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--float8.numerics_log_freq 2 with --training.compile: logged steps run eagerly, the others compiled; the
    losses equal a run without the observatory (it must not change the step); JSONL rows for steps 2 and 4."""
    from tests.helpers.common import run_trainer

    caplog.set_level(logging.INFO, logger="kiln")
    extra = ["--training.steps", "4", "--model.n_layers", "1", "--float8.enable_float8_linear", "--training.seed", "0"]
    extra += ["--training.compile"]
    plain = run_trainer(tiny_run_args("--job.dump_folder", str(tmp_path / "p"), *extra))
    torch._dynamo.reset()
    watched = run_trainer(
        tiny_run_args("--job.dump_folder", str(tmp_path / "w"), *extra, "--float8.numerics_log_freq", "2")
    )
    torch.testing.assert_close(torch.tensor(watched.losses), torch.tensor(plain.losses), rtol=1e-4, atol=0)
    records = [json.loads(x) for x in (tmp_path / "w" / "float8_numerics" / "rank_0.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records}) == [2, 4] and len(records) == 14
    assert all(20 < r[op]["sqnr_db"] < 40 for r in records for op in ("input", "weight"))  # e4m3 tensorwise
    assert all(r["grad_output"]["sqnr_db"] > 10 for r in records)  # e5m2: 2 mantissa bits
    steps = [int(m.group(1)) for r in caplog.records if (m := re.match(r"float8 numerics step (\d+)", r.getMessage()))]
    assert steps == [2, 4]
