"""End-to-end Trainer on the CPU: the loss falls, the log line has torchtitan's shape and exact values, clipping
and gradient accumulation change the gradients exactly as they should."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import trainer.components.metrics as metrics_module
from kiln_base.config import parse_args
from tests.helpers.common import DEBUG_CONFIG, open_trainer, run_trainer
from tests.helpers.step_metrics import StepClock, TimedStep, logged_metrics
from trainer.components.metrics import format_step_line, peak_flops
from trainer.components.optim import lr_factor
from trainer.hooks import compiling_steps
from trainer.trainer import Trainer

STEP_LINE = re.compile(
    r"step: +\d+  loss: +\d+\.\d{4}  memory: +\d+\.\d{2}GiB\(\d+\.\d{2}%\)  tps: [\d,]+  mfu: (n/a|\d+\.\d{2}%)"
)


# Small and fast: 2 layers of the debug model's width, short sequences, fp32 for exact comparisons.
BASE = (
    "--training.seq_len 64 --training.local_batch_size 4 --training.steps 4 --training.seed 0 "
    "--training.mixed_precision_param float32 --activation_checkpoint.mode none --model.n_layers 2"
).split()
# Smaller still, for the tests that compare gradients and logged values of one or two steps.
TINY = (
    "--training.seq_len 32 --training.local_batch_size 2 --training.seed 0 --training.mixed_precision_param float32 "
    "--activation_checkpoint.mode none --model.n_layers 2"
).split()


def argv(tmp_path: Path, *overrides: str, base: list[str] = BASE) -> list[str]:
    return ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), *base, *overrides]


def train(tmp_path: Path, *overrides: str) -> list[float]:
    return run_trainer(argv(tmp_path, *overrides)).losses


def grads_seen_by_optimizer(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Each step's gradients as the optimizer receives them (after accumulation and clipping), recorded by torch's
    optimizer step pre-hook: what the update is made of, whatever the optimizer then does with it."""
    seen: list[dict[str, torch.Tensor]] = []
    names = {p: n for n, p in trainer.model.named_parameters()}

    def record(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        seen.append({names[p]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]})

    trainer.optimizer.register_step_pre_hook(record)
    return seen


def total_norm(grads: dict[str, torch.Tensor]) -> float:
    """The gradients' global norm, exactly (float64: torch's float32 norm of a whole tensor is ~1e-4 off)."""
    return sum(float(torch.linalg.vector_norm(g.double()) ** 2) for g in grads.values()) ** 0.5


def test_debug_model_learns_and_logs_every_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kiln")
    losses = train(tmp_path, "--training.steps", "25", "--lr_scheduler.warmup_steps", "2")
    assert len(losses) == 25
    assert losses[0] > 7.0  # ~ln(2256) = 7.72 at init
    assert losses[0] - min(losses[-5:]) > 1.5, losses
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    assert len(lines) == 25 and all(STEP_LINE.match(line) for line in lines), lines[:2]
    assert "mfu: n/a" in lines[0]  # CPU without metrics.peak_tflops: no fake number


def test_logged_tps_tflops_mfu_and_eta_are_exact_under_a_controlled_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Step s takes s seconds by the clock; with 2 micro-batches of 2 x 32 tokens a step is 128 tokens per device.
    Log steps 1, 2, 4, 5 (log_freq 2, last step): intervals of 1, 1, 2 and 1 steps."""
    caplog.set_level(logging.INFO, logger="kiln")
    clock = StepClock()
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=clock))
    peak_tflops = 1e-6
    overrides = ["--training.global_batch_size", "4", "--training.steps", "5", "--metrics.log_freq", "2"]
    overrides += ["--metrics.peak_tflops", str(peak_tflops)]
    with open_trainer(argv(tmp_path, *overrides, base=TINY)) as trainer:
        logged = logged_metrics(trainer)
        trainer.train_step = TimedStep(trainer.train_step, clock, lambda n: n)  # step s takes s seconds
        trainer.train()
        flops_per_token = trainer.flops_per_token
    tokens_per_step = 2 * 32 * 2  # local batch x seq_len x micro-batches
    intervals = {1: [1], 2: [2], 4: [3, 4], 5: [5]}  # log step -> the steps it covers
    assert len(logged) == len(intervals)
    for got, steps in zip(logged, intervals.values(), strict=True):
        tps = tokens_per_step * len(steps) / sum(steps)
        assert got["tps"] == pytest.approx(tps, rel=1e-12), steps
        assert got["tflops"] == pytest.approx(tps * flops_per_token / 1e12, rel=1e-12)
        assert got["mfu"] == pytest.approx(100 * tps * flops_per_token / (peak_tflops * 1e12), rel=1e-12)
    # ETA: remaining steps x the interval's seconds per step (step 2: 3 steps left at 2 s each).
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    assert [re.search(r"eta: (\S+)", line).group(1) for line in lines] == ["0:00:04", "0:00:06", "0:00:03", "0:00:00"]


def _first_step_grads(tmp_path: Path, max_norm: float) -> tuple[dict[str, torch.Tensor], float, float]:
    """Step 1's gradients as the optimizer gets them, the grad norm the step returns and the one it logs."""
    with open_trainer(argv(tmp_path, "--training.max_norm", str(max_norm), "--training.steps", "1", base=TINY)) as t:
        grads, logged = grads_seen_by_optimizer(t), logged_metrics(t)
        t.train()
    return grads[0], logged[0]["grad_norm"], total_norm(grads[0])


def test_grad_clipping_applies_max_norm_only_above_it_and_is_off_at_zero(tmp_path: Path) -> None:
    raw, raw_norm, applied = _first_step_grads(tmp_path, max_norm=0)  # clipping off: the raw gradients
    assert applied == pytest.approx(raw_norm, rel=1e-5) and raw_norm > 0.5
    for off in (-1.0, 2 * raw_norm):  # also off: a negative max_norm; untouched: a max_norm above the norm
        grads, logged_norm, _ = _first_step_grads(tmp_path, max_norm=off)
        assert logged_norm == raw_norm
        for name, g in grads.items():
            assert torch.equal(g, raw[name]), (off, name)
    max_norm = raw_norm / 4
    grads, logged_norm, applied = _first_step_grads(tmp_path, max_norm=max_norm)
    assert logged_norm == raw_norm  # the logged norm is the one before clipping
    assert applied <= max_norm * (1 + 1e-6) and applied == pytest.approx(max_norm, rel=1e-5)
    for name, g in grads.items():  # same direction: every gradient scaled by max_norm / raw_norm
        torch.testing.assert_close(g, raw[name] * (max_norm / raw_norm), rtol=1e-5, atol=1e-9)


def test_same_seed_same_losses(tmp_path: Path) -> None:
    assert train(tmp_path / "a") == train(tmp_path / "b")


def test_gradient_accumulation_matches_big_batch(tmp_path: Path) -> None:
    """2 micro-batches of 2 vs one batch of 4: the same gradients reach the optimizer (fp32 tolerance), the same
    grad norm and loss are logged, at step 1 and at step 2 (after an update made from them)."""

    def run(*batch: str) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, float]]]:
        with open_trainer(argv(tmp_path, "--training.steps", "2", "--training.max_norm", "0", *batch, base=TINY)) as t:
            grads, logged = grads_seen_by_optimizer(t), logged_metrics(t)
            t.train()
            assert t.plan.grad_accum_steps == (2 if "--training.global_batch_size" in batch else 1)
        return grads, logged

    big_grads, big_logged = run("--training.local_batch_size", "4")
    acc_grads, acc_logged = run("--training.local_batch_size", "2", "--training.global_batch_size", "4")
    assert len(big_grads) == len(acc_grads) == 2
    for big, acc in zip(big_grads, acc_grads, strict=True):
        torch.testing.assert_close(acc, big, rtol=1e-4, atol=1e-6)  # a dict: a mismatch names the parameter
    assert len(big_logged) == len(acc_logged) == 2
    for big, acc in zip(big_logged, acc_logged, strict=True):
        assert acc["grad_norm"] == pytest.approx(big["grad_norm"], rel=1e-5)
        assert acc["loss"] == pytest.approx(big["loss"], rel=1e-6)


def test_bf16_autocast_trains(tmp_path: Path) -> None:
    """bfloat16 without FSDP: autocast computes the logits in bf16 over fp32 master weights; the losses differ
    from the fp32 run's (bf16 really ran) by bf16 rounding only."""
    fp32 = run_trainer(argv(tmp_path / "fp32", "--training.steps", "2", base=TINY)).losses
    with open_trainer(
        argv(tmp_path, "--training.mixed_precision_param", "bfloat16", "--training.steps", "2", base=TINY)
    ) as t:
        dtypes: list[torch.dtype] = []
        t.model.output.register_forward_hook(lambda mod, inp, out: dtypes.append(out.dtype))
        t.train()
        assert {p.dtype for p in t.model.parameters()} == {torch.float32}
    assert dtypes == [torch.bfloat16] * 2
    assert t.losses != fp32
    torch.testing.assert_close(torch.tensor(t.losses), torch.tensor(fp32), rtol=1e-2, atol=0)


def test_tensorboard_writes_events(tmp_path: Path) -> None:
    train(tmp_path, "--training.steps", "1", "--metrics.enable_tensorboard")
    assert list((tmp_path / "tb" / "rank_0").glob("events.out.tfevents.*"))


def test_global_batch_must_divide(tmp_path: Path) -> None:
    from kiln_base.errors import ConfigError

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
    assert compiling_steps(0, compile=False, numerics_freq=10) == {1}  # eager: warm-up only
    assert compiling_steps(0, compile=True, numerics_freq=0) == {1}  # step 1 compiles
    assert compiling_steps(0, compile=True, numerics_freq=1) == {1}  # numerics every step: never compiles
    assert compiling_steps(1, compile=True, numerics_freq=2) == {2, 3}  # step 2 runs eagerly: 3 compiles
    assert compiling_steps(8, compile=True, numerics_freq=3) == {9, 10}  # resumed at 8: 9 is a numerics step


def test_collective_timeout_is_long_while_steps_may_compile(tmp_path: Path) -> None:
    """float8 + compile: step 1 compiles (the float8 probe leaves it compiled), so it keeps the init timeout; the
    short one starts at step 2. Read back from the process group itself."""
    from kiln_base.internals import pg_timeout
    from trainer.hooks import CollectiveTimeoutHook

    cfg = parse_args(
        ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), *BASE, "--training.compile"]
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
        assert seen == [77, 77, 11, 11, 11]
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
        cfg = parse_args(["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), *BASE])
        cfg.training.compile = compile
        trainer = Trainer(cfg)
        try:
            assert (trainer.train_step.loss_fn is not cross_entropy_loss) is compiled_loss
            assert (getattr(trainer.train_step.loss_fn, "__wrapped__", None) is cross_entropy_loss) is compiled_loss
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


def test_precision_auto_is_float32_on_cpu_and_bf16_is_honoured_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`auto` (the default) computes in float32 on a CPU, where bf16 autocast measured 0.06x-0.57x as fast; an
    explicit bfloat16 still runs bf16 compute, with one warning stating that cost."""
    from kiln_base.config import JobConfig

    assert JobConfig().training.mixed_precision_param == "auto"
    caplog.set_level(logging.INFO, logger="kiln")
    logits = {}
    for param in ("auto", "bfloat16"):
        cfg = parse_args(["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), *BASE])
        cfg.training.mixed_precision_param = param
        trainer = Trainer(cfg)
        try:
            with torch.no_grad(), trainer.train_step.amp:
                logits[param] = trainer.model(torch.zeros(1, 8, dtype=torch.long))
        finally:
            trainer.close()
    assert logits["auto"].dtype == torch.float32 and logits["bfloat16"].dtype == torch.bfloat16
    messages = [r.getMessage() for r in caplog.records]
    chosen = [m for m in messages if m.startswith("Mixed precision: ")]
    assert chosen == [
        "Mixed precision: float32 compute, float32 master weights and optimizer state "
        "(training.mixed_precision_param = auto on cpu)",
        "Mixed precision: bfloat16 compute, float32 master weights and optimizer state "
        "(training.mixed_precision_param = bfloat16)",
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0.06x float32's speed on an AVX2 CPU" in warnings[0], warnings


def test_validation_time_is_left_out_of_tps_and_mfu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/metrics.md: validation time is left out of the next line's tps and mfu. Each step takes 1 s and each
    validation (steps 1, 2 and 4 with freq 2) 100 s by one clock: every line's tps is a step's tokens per second."""
    import trainer.hooks as hooks_module

    clock = StepClock()
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(hooks_module, "time", SimpleNamespace(perf_counter=clock))
    overrides = ["--training.steps", "4", "--metrics.log_freq", "1", "--metrics.peak_tflops", "1e-6"]
    overrides += ["--validation.enable", "--validation.freq", "2", "--validation.steps", "1"]
    with open_trainer(argv(tmp_path, *overrides, base=TINY)) as trainer:
        logged = logged_metrics(trainer)
        step, validate = trainer.train_step, trainer.validator.run

        def timed_validation(*args: Any, **kwargs: Any) -> Any:
            clock.now += 100
            return validate(*args, **kwargs)

        trainer.train_step, trainer.validator.run = TimedStep(step, clock, lambda n: 1), timed_validation
        trainer.train()
        flops_per_token = trainer.flops_per_token
    tokens_per_step = 2 * 32  # local batch x seq_len
    assert [m["tps"] for m in logged] == pytest.approx([tokens_per_step] * 4, rel=1e-12)
    assert [m["mfu"] for m in logged] == pytest.approx([100 * tokens_per_step * flops_per_token / 1e6] * 4)
    assert [("val_loss" in m) for m in logged] == [True, True, False, True]
