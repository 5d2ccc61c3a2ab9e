"""Float8-in-use checks: a float8 flag that did nothing stops the run at the first step."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import train
from float8.checks import Float8UsageProbe
from float8.converter import prepare_cpu_float8
from kiln_base.config import Float8
from kiln_base.errors import ConfigError
from tests.helpers.common import DEBUG_CONFIG, free_port, needs_cpu_rowwise
from tests.helpers.sac import batch, debug_model, loss_fn
from trainer import build

ON = Float8(enable_float8_linear=True)


@pytest.fixture(autouse=True)
def _cpu_float8() -> None:
    """These tests convert with torchao directly: torch's CPU float8 matmul, as kiln's build uses (tests/conftest.py
    gives each test oneDNN back)."""
    prepare_cpu_float8()


def _probe_first_step(model: nn.Module, cfg: Float8 = ON) -> Float8UsageProbe:
    """A first step's forward and backward (fp32) under the probe."""
    probe = Float8UsageProbe(model, cfg, fsdp_enabled=False)
    with probe.during_first_step():
        loss_fn(model, batch(), autocast=False)().backward()
    return probe


def _hp_float8_linears(model: nn.Module) -> None:
    """Float8Linears whose casts are all disabled: the modules exist, their matmuls run in high precision."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import CastConfig, ScalingType

    off = CastConfig(scaling_type=ScalingType.DISABLED)
    config = Float8LinearConfig(cast_config_input=off, cast_config_weight=off, cast_config_grad_output=off)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn != "output")


def test_probe_counts_torchao_float8_matmuls() -> None:
    probe = _probe_first_step(debug_model("tensorwise", save_list=None))
    # 14 Float8Linears: forward, grad-input and grad-weight matmuls each, run eagerly with the real kernel.
    assert probe.matmuls == {("ran", False): 3 * 14}
    assert probe.verify() == [
        "float8 in use: 14/15 Linears are Float8Linear",
        "float8 in use: float8 matmuls in the first step: 42 ran",
    ]


def test_probe_recognises_emulated_float8_matmuls() -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = debug_model(None, save_list=None)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn != "output")
    probe = _probe_first_step(model, dataclasses.replace(ON, emulate=True))
    assert probe.matmuls == {("ran", True): 3 * 14}
    assert probe.verify()[1] == "float8 in use: emulated float8 matmuls in the first step: 42 ran"


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=needs_cpu_rowwise)])
def test_probe_changes_nothing_and_restores_torchao(recipe: str) -> None:
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

    table = dict(FLOAT8_OPS_TABLE)
    grads = []
    for probed in (False, True):
        model = debug_model(recipe, save_list=None)
        if probed:
            _probe_first_step(model)
        else:
            loss_fn(model, batch(), autocast=False)().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert FLOAT8_OPS_TABLE == table  # every entry is torchao's own again


def test_flag_that_converted_nothing_fails() -> None:
    model = debug_model(None, save_list=None)  # enable_float8_linear set, but the converter skipped all
    with pytest.raises(ConfigError, match="none of the 15 Linears is a Float8Linear"):
        _probe_first_step(model).verify()


def test_float8_linears_with_high_precision_matmuls_fail() -> None:
    model = debug_model(None, save_list=None)
    _hp_float8_linears(model)
    probe = _probe_first_step(model)
    assert not probe.matmuls
    with pytest.raises(ConfigError, match="Float8Linear modules exist but no float8 matmul ran in the first step"):
        probe.verify()


def _compiled(float8: bool) -> nn.Module:
    from torchao.float8 import convert_to_float8_training

    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    if float8:
        convert_to_float8_training(model)
    else:
        _hp_float8_linears(model)
    return torch.compile(model, fullgraph=True)


@pytest.mark.slow
def test_probe_sees_float8_in_compiled_graphs_without_forcing_eager() -> None:
    torch._dynamo.reset()
    x = torch.randn(16, 32)
    try:
        probe = Float8UsageProbe(_compiled(float8=True), ON, fsdp_enabled=False)
        with probe.during_first_step():
            probe.model(x).sum().backward()
        # Counted while dynamo and AOTAutograd trace the graph (fake tensors); the compiled code then runs.
        assert probe.matmuls[("ran", False)] == 0 and probe.matmuls[("traced", False)] >= 2, probe.matmuls
        assert "traced into compiled graphs" in probe.verify()[1]
        # A second model of the same structure reuses the graphs: nothing to observe, so no verdict either way.
        probe = Float8UsageProbe(_compiled(float8=True), ON, fsdp_enabled=False)
        with probe.during_first_step():
            probe.model(x).sum().backward()
        assert probe.compilations == 0 and probe.verify()[1].startswith("float8 not checked")
        # Compiled Float8Linears whose matmuls are high precision: traced, and no float8 matmul in the graph.
        probe = Float8UsageProbe(_compiled(float8=False), ON, fsdp_enabled=False)
        with probe.during_first_step():
            probe.model(x).sum().backward()
        assert probe.compilations > 0
        with pytest.raises(ConfigError, match="no float8 matmul ran"):
            probe.verify()
    finally:
        torch._dynamo.reset()


def test_fsdp_float8_all_gather_is_one_byte_or_fails() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        cfg = Float8(enable_float8_linear=True, enable_fsdp_float8_all_gather=True)
        for all_gather in (True, False):
            model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
            convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather))
            fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            probe = Float8UsageProbe(model, cfg, fsdp_enabled=True)
            with probe.during_first_step():  # a first step, as in the Trainer
                model(torch.randn(16, 32, dtype=torch.bfloat16)).sum().backward()
            if all_gather:
                assert probe.verify()[-1] == "float8 in use: FSDP all-gathers 2 Float8Linear weights as 1-byte float8"
            else:  # torchao left the weights plain: FSDP moves bf16
                with pytest.raises(ConfigError, match="all-gathers 2 Float8Linear weights in high precision"):
                    probe.verify()
        probe.fsdp_enabled = False
        with pytest.raises(ConfigError, match="FSDP is not enabled"):
            probe.verify()
    finally:
        dist.destroy_process_group()


class _Converter:
    """Stands in for float8/'s converter: a no-op (the flag silently does nothing), Float8Linears whose matmuls
    run in high precision, or torchao's rowwise conversion."""

    def __init__(self, cfg: Float8, mode: str) -> None:
        self.mode = mode

    def convert(self, model: nn.Module) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        if self.mode == "high_precision":
            _hp_float8_linears(model)
        elif self.mode == "rowwise":
            config = Float8LinearConfig.from_recipe_name("rowwise")
            convert_to_float8_training(model, config=config, module_filter_fn=lambda m, f: f != "output")

    def post_optimizer_hook(self, model: nn.Module) -> None:
        pass


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("noop", "none of the 43 Linears is a Float8Linear"),
        ("high_precision", "Float8Linear modules exist but no float8 matmul ran in the first step"),
        pytest.param("rowwise", None, marks=needs_cpu_rowwise),
    ],
    ids=["noop_converter_exits_2", "high_precision_float8_linears_exit_2", "converted_trains"],
)
def test_trainer_checks_float8_at_first_step(
    mode: str,
    error: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.setattr(build, "float8_converter", lambda cfg, tp_degree: _Converter(cfg, mode))
    caplog.set_level(logging.INFO, logger="kiln")
    argv = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path)]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "1"]
    # The config asks for tensorwise (every torch's CPU kernel has it); the fake converter decides what is built.
    argv += ["--float8.enable_float8_linear", "--float8.recipe_name", "tensorwise", "--activation_checkpoint.mode"]
    argv += ["none"]
    argv += ["--training.mixed_precision_param", "float32"]
    rc = train.main(argv)
    text = "\n".join(r.getMessage() for r in caplog.records)
    if error:
        (line,) = capsys.readouterr().err.splitlines()
        assert rc == 2 and line.startswith("kiln: error: ") and error in line, line
        assert "step:" not in text  # stopped before the first step was logged
    else:
        assert rc == 0 and "float8 in use: 42/43 Linears are Float8Linear" in text and "step:  1" in text
        assert "float8 in use: float8 matmuls in the first step: 126 ran" in text
