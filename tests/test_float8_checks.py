"""Float8-in-use checks: a float8 flag that did nothing stops the run at the first step."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import train
import trainer.train as trainer_module
from float8.checks import ScaledMMCounter, verify_float8_in_use
from tests.common import DEBUG_CONFIG, free_port
from tests.sac_helpers import batch, debug_model, loss_fn
from trainer.config import ConfigError, Float8

ON = Float8(enable_float8_linear=True)


def _first_step_calls(model: nn.Module) -> int:
    with ScaledMMCounter() as counter:
        loss_fn(model, batch())().backward()
    return counter.calls


def test_converted_model_passes_and_counts_scaled_mm() -> None:
    model = debug_model("tensorwise", save_list=None)
    calls = _first_step_calls(model)
    assert calls == 3 * 14  # 14 Float8Linears: forward, grad-input and grad-weight matmuls each
    findings = verify_float8_in_use(model, ON, calls, fsdp_enabled=False)
    assert findings[0] == "float8 in use: 14/15 Linears are Float8Linear"


def test_flag_that_converted_nothing_fails() -> None:
    model = debug_model(None, save_list=None)  # enable_float8_linear set, but the converter skipped all
    with pytest.raises(ConfigError, match="none of the 15 Linears is a Float8Linear"):
        verify_float8_in_use(model, ON, _first_step_calls(model), fsdp_enabled=False)


def test_bypassed_scaled_mm_fails() -> None:
    model = debug_model("tensorwise", save_list=None)
    with pytest.raises(ConfigError, match="no aten._scaled_mm ran"):
        verify_float8_in_use(model, ON, 0, fsdp_enabled=False)


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
            model(torch.randn(16, 32, dtype=torch.bfloat16)).sum().backward()  # a first step, as in the Trainer
            if all_gather:
                findings = verify_float8_in_use(model, cfg, 1, fsdp_enabled=True)
                assert findings[-1] == "float8 in use: FSDP all-gathers 2 Float8Linear weights as 1-byte float8"
            else:  # torchao left the weights plain: FSDP moves bf16
                with pytest.raises(ConfigError, match="all-gathers 2 Float8Linear weights in high precision"):
                    verify_float8_in_use(model, cfg, 1, fsdp_enabled=True)
        with pytest.raises(ConfigError, match="FSDP is not enabled"):
            verify_float8_in_use(model, cfg, 1, fsdp_enabled=False)
    finally:
        dist.destroy_process_group()


class _Converter:
    """Stands in for float8/'s converter: torchao conversion, or a no-op (the flag silently does nothing)."""

    def __init__(self, cfg: Float8, noop: bool) -> None:
        self.noop = noop

    def convert(self, model: nn.Module) -> None:
        if not self.noop:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(
                model,
                config=Float8LinearConfig.from_recipe_name("rowwise"),
                module_filter_fn=lambda m, f: f != "output",
            )

    def post_optimizer_hook(self, model: nn.Module) -> None:
        pass


@pytest.mark.parametrize("noop", [True, False], ids=["noop_converter_exits_2", "converted_trains"])
def test_trainer_checks_float8_at_first_step(
    noop: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(trainer_module, "build_float8_converter", lambda cfg: _Converter(cfg, noop))
    caplog.set_level(logging.INFO, logger="kiln")
    argv = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path)]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "1"]
    argv += ["--float8.enable_float8_linear", "--float8.recipe_name", "rowwise", "--activation_checkpoint.mode", "none"]
    rc = train.main(argv)
    text = "\n".join(r.getMessage() for r in caplog.records)
    if noop:
        assert rc == 2 and "step:" not in text  # stopped before the first step was logged
    else:
        assert rc == 0 and "float8 in use: 42/43 Linears are Float8Linear" in text and "step:  1" in text
    torch.set_default_dtype(torch.float32)
