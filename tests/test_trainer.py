"""End-to-end Trainer on the CPU: the loss falls, the log line has torchtitan's shape, accumulation is exact."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from trainer.components.metrics import format_step_line, peak_flops
from trainer.components.optim import lr_factor
from trainer.config import parse_args
from trainer.hooks import compiling_steps
from trainer.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")
STEP_LINE = re.compile(
    r"step: +\d+  loss: +\d+\.\d{4}  memory: +\d+\.\d{2}GiB\(\d+\.\d{2}%\)  tps: [\d,]+  mfu: (n/a|\d+\.\d{2}%)"
)


# Small and fast: 2 layers of the debug model's width, short sequences, fp32 for exact comparisons.
BASE = (
    "--training.seq_len 64 --training.local_batch_size 4 --training.steps 4 --training.seed 0 "
    "--training.mixed_precision_param float32 --activation_checkpoint.mode none --model.n_layers 2"
).split()


def train(tmp_path: Path, *overrides: str) -> list[float]:
    cfg = parse_args(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), *BASE, *overrides])
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer.losses


def test_debug_model_learns_and_logs_every_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kiln")
    losses = train(tmp_path, "--training.steps", "25", "--lr_scheduler.warmup_steps", "2")
    assert len(losses) == 25
    assert losses[0] > 7.0  # ~ln(2256) = 7.72 at init
    assert losses[0] - min(losses[-5:]) > 1.5, losses
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    assert len(lines) == 25 and all(STEP_LINE.match(line) for line in lines), lines[:2]
    assert "mfu: n/a" in lines[0]  # CPU without metrics.peak_tflops: no fake number


def test_mfu_with_peak_override(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kiln")
    train(tmp_path, "--training.steps", "1", "--metrics.peak_tflops", "1.0")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    assert re.search(r"mfu: \d+\.\d{2}%", line), line


def test_same_seed_same_losses(tmp_path: Path) -> None:
    assert train(tmp_path / "a") == train(tmp_path / "b")


def test_gradient_accumulation_matches_big_batch(tmp_path: Path) -> None:
    big = train(tmp_path / "big", "--training.local_batch_size", "4")
    accum = train(tmp_path / "acc", "--training.local_batch_size", "2", "--training.global_batch_size", "4")
    torch.testing.assert_close(torch.tensor(accum), torch.tensor(big), rtol=1e-5, atol=1e-5)


def test_bf16_autocast_trains(tmp_path: Path) -> None:
    losses = train(tmp_path, "--training.mixed_precision_param", "bfloat16", "--training.steps", "3")
    assert all(torch.isfinite(torch.tensor(losses)))


def test_tensorboard_writes_events(tmp_path: Path) -> None:
    train(tmp_path, "--training.steps", "1", "--metrics.enable_tensorboard")
    assert list((tmp_path / "tb" / "rank_0").glob("events.out.tfevents.*"))


def test_global_batch_must_divide(tmp_path: Path) -> None:
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="training.global_batch_size \\(6\\) must be a multiple"):
        train(tmp_path, "--training.global_batch_size", "6")


def test_lr_schedule_warmup_stable_decay() -> None:
    f = dict(warmup_steps=2, decay_steps=4, total_steps=10, min_lr_factor=0.1)
    assert [round(lr_factor(s, decay_type="linear", **f), 4) for s in range(11)] == [
        0.3333,
        0.6667,
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
        0.775,
        0.55,
        0.325,
        0.1,
    ]
    assert lr_factor(8, decay_type="cosine", **f) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 0.5)).item())
    )
    assert lr_factor(8, decay_type="sqrt", **f) == pytest.approx(0.1 + 0.9 * (1 - 0.5**0.5))


def test_step_line_shape_and_peak_table() -> None:
    line = format_step_line(10, 7.1234, 1.23, 4.56, 12345.4, 12.344, 1.0, 8e-4)
    assert line.startswith("step: 10  loss:  7.1234  memory:  1.23GiB(4.56%)  tps: 12,345  mfu: 12.34%")
    cpu = peak_flops(torch.device("cpu"), None)
    assert cpu.bf16 is None
    assert peak_flops(torch.device("cpu"), 989.0).bf16 == 989e12


def test_compiling_steps() -> None:
    """The steps that keep the long collective timeout: warm-up, and each graph's first compiled step."""
    assert compiling_steps(0, compile=False, eager_first_step=True, sqnr_freq=10) == {1}  # eager: warm-up only
    assert compiling_steps(0, compile=True, eager_first_step=False, sqnr_freq=0) == {1}
    assert compiling_steps(0, compile=True, eager_first_step=True, sqnr_freq=0) == {1, 2}  # float8 check: eager 1
    assert compiling_steps(0, compile=True, eager_first_step=True, sqnr_freq=10) == {1, 2, 10}
    assert compiling_steps(0, compile=True, eager_first_step=True, sqnr_freq=2) == {1, 2, 3}
    assert compiling_steps(0, compile=True, eager_first_step=True, sqnr_freq=1) == {1, 2}  # every step measures
    assert compiling_steps(7, compile=True, eager_first_step=True, sqnr_freq=4) == {8, 9, 12}  # resumed at 7


def test_collective_timeout_is_long_while_steps_may_compile(tmp_path: Path) -> None:
    """float8 + compile: step 1 runs eagerly (float8 check), step 2 compiles, so both keep the init timeout; the
    short one starts at step 3. Read back from the process group itself."""
    from trainer.hooks import CollectiveTimeoutHook
    from trainer.internals import pg_timeout

    cfg = parse_args(
        ["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), *BASE, "--training.compile"]
        + ["--float8.enable_float8_linear", "--comm.init_timeout_seconds", "77", "--comm.train_timeout_seconds", "11"]
    )
    trainer = Trainer(cfg)
    hooks = trainer.build_hooks()
    try:
        (hook,) = [h for h in hooks if isinstance(h, CollectiveTimeoutHook)]
        seen = [pg_timeout().total_seconds()]
        for step in (1, 2, 3, 4):
            hook.pre_step(step)
            seen.append(pg_timeout().total_seconds())
        assert seen == [77, 77, 77, 11, 11]
    finally:
        for h in hooks:
            h.close()
        trainer.close()


def test_peak_table_matches_the_most_specific_gpu_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """H200 NVL (PCIe, 600 W) is slower than the H200 SXM: its own row must win over the plain 'H200' one."""
    cuda = torch.device("cuda", 0)
    for name, bf16, fp8 in [
        ("NVIDIA H200 NVL", 835.5e12, 1670.5e12),
        ("NVIDIA H200", 989e12, 1979e12),
        ("NVIDIA H100 80GB HBM3", 989e12, 1979e12),
        ("NVIDIA H100 NVL", 835e12, 1671e12),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        peak = peak_flops(cuda, None)
        assert (peak.bf16, peak.float8, peak.source) == (bf16, fp8, name)


def test_loss_is_compiled_with_the_model(tmp_path: Path) -> None:
    """training.compile compiles the loss too (no (tokens x vocab) fp32 transients; docs/performance.md)."""
    from trainer.components.loss import cross_entropy_loss

    for compile, compiled_loss in ((False, False), (True, True)):
        cfg = parse_args(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), *BASE])
        cfg.training.compile = compile
        trainer = Trainer(cfg)
        try:
            assert (trainer.loss_fn is not cross_entropy_loss) is compiled_loss
            assert (getattr(trainer.loss_fn, "__wrapped__", None) is cross_entropy_loss) is compiled_loss
        finally:
            trainer.close()


@pytest.mark.slow
def test_compiled_loss_matches_eager() -> None:
    from trainer.components.loss import build_loss_fn, cross_entropy_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 16, 1000, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 16))
    eager = cross_entropy_loss(logits, labels)
    (grad_eager,) = torch.autograd.grad(eager, logits)
    compiled = build_loss_fn(compile=True)(logits, labels)
    (grad_compiled,) = torch.autograd.grad(compiled, logits)
    assert compiled.dtype == torch.float32
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_compiled, grad_eager)
