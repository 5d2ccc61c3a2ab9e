"""The float8 precision policy: first/last blocks kept high precision, and the scheduled switch to high precision
(float8.disable_after_step) across a checkpoint resume."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.helpers.common import run_trainer, tiny_run_args


def test_high_precision_first_last_keeps_the_edge_blocks() -> None:
    from float8.converter import Float8Converter, is_float8_linear
    from kiln_base.config import parse_args
    from models import LLAMA3_FLAVORS, Transformer

    cfg = parse_args(tiny_run_args("--float8.enable_float8_linear", "--float8.high_precision_first_last", "1"))
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=512)
    with torch.device("meta"):
        model = Transformer(args)  # 6 blocks
    conv = Float8Converter(cfg.float8)
    conv.convert(model)
    float8_blocks = sorted({int(n.split(".")[1]) for n, m in model.named_modules() if is_float8_linear(m)})
    assert float8_blocks == [1, 2, 3, 4]
    reasons = {d.fqn: d.reason for d in conv.decisions}
    assert reasons["layers.0.attention.wq"] == "high_precision_first_last 1 (block 0 of 6)"
    assert reasons["layers.5.feed_forward.w2"] == "high_precision_first_last 1 (block 5 of 6)"
    assert reasons["layers.1.attention.wq"] == "" and reasons["output"] == "filter_fqns 'output'"


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8_rceil", "nvfp4"])
def test_switch_to_high_precision_runs_the_exact_matmul(recipe: str) -> None:
    """After the switch every float8 Linear computes F.linear of its high-precision weight, exactly; before, not."""
    from float8.converter import Float8Converter, is_float8_linear, switch_to_high_precision
    from float8.numerics import high_precision_weight
    from kiln_base.config import parse_args

    extra = ("--float8.emulate",) if recipe != "tensorwise" else ()
    cfg = parse_args(tiny_run_args("--float8.enable_float8_linear", "--float8.recipe_name", recipe, *extra))
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False))
    Float8Converter(cfg.float8).convert(model)
    x = torch.randn(32, 64)
    w = high_precision_weight(model[0])
    assert not torch.equal(model[0](x), x @ w.t())
    assert switch_to_high_precision(model) == ["0", "1"]
    assert not any(is_float8_linear(m) for m in model)
    torch.testing.assert_close(model[0](x), x @ w.t(), rtol=0, atol=0)


@pytest.mark.slow
def test_disable_after_step_survives_resume(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """disable_after_step 2 of 4: steps 3-4 run high precision in a straight run and in one resumed from step 2,
    with the same losses; both log the switch, and the resumed run skips the float8-in-use check."""
    from float8.converter import HighPrecisionLinear

    caplog.set_level(logging.INFO, logger="kiln")
    argv = tiny_run_args(
        *("--training.steps", "4", "--model.n_layers", "2", "--training.seed", "0", "--training.deterministic"),
        *("--float8.enable_float8_linear", "--float8.disable_after_step", "2"),
        *("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path)),
    )
    straight = run_trainer(argv)
    assert sum(isinstance(m, HighPrecisionLinear) for m in straight.model.modules()) == 14
    switch = "float8 policy: step 3: 14 float8 Linears now run in high precision (float8.disable_after_step 2)"
    assert caplog.text.count(switch) == 1
    assert "float8 in use: 14/15 Linears are Float8Linear" in caplog.text  # step 1 was float8
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    caplog.clear()
    resumed = run_trainer(argv)
    assert caplog.text.count(switch) == 1 and "float8 in use" not in caplog.text
    assert sum(isinstance(m, HighPrecisionLinear) for m in resumed.model.modules()) == 14
    assert resumed.losses == straight.losses[2:], (resumed.losses, straight.losses)
