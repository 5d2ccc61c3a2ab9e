"""What each figure of the step line counts and what it leaves out (docs/metrics.md), each against a computation of
its own: a clock the test moves, the optimizer's own lr, a device memory the test allocates.

tps, tflops, mfu, eta and validation's exclusion: tests/trainer/test_trainer.py; across layouts (tokens / PP and CP
degree): tests/parallelisms/test_grad_norm_layouts.py; the scalars against the line: tests/trainer/test_wandb.py."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import trainer.components.metrics as metrics_module
import trainer.step.step as step_module
from kiln_base.config import Metrics
from tests.helpers.common import kiln_log_lines, open_trainer, tiny_run_args
from tests.helpers.step_metrics import SlowData, StepClock, TimedStep, logged_metrics
from trainer.components.metrics import MetricsLogger

GIB = 2**30


def test_data_share_lr_and_checkpoint_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step: 2 micro-batches, each waiting 0.25 s for data, and 1.5 s of compute (2 s a step); the checkpoint
    saved after step 2 takes 40 s. Log steps 1, 2 and 4 (log_freq 2).

    - data: the interval's data waits over its seconds (25%, 25%, then 1 s of 44 s);
    - the save after step 2 is counted in the next line (steps 3-4 and the save: 44 s), as torchtitan counts it;
    - lr: the lr the optimizer applied in that step (warm-up: it changes every step), not the next step's."""
    clock = StepClock()
    for module in (metrics_module, step_module):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=clock))
    lr = 8e-4
    argv = tiny_run_args("--job.dump_folder", str(tmp_path), "--model.n_layers", "2", "--training.steps", "4")
    argv += ["--metrics.log_freq", "2"]
    argv += ["--training.global_batch_size", "4", "--optimizer.lr", str(lr), "--lr_scheduler.warmup_steps", "3"]
    with open_trainer(argv) as trainer:
        logged = logged_metrics(trainer)
        applied: list[float] = []
        trainer.optimizer.register_step_pre_hook(lambda opt, *_: applied.append(opt.param_groups[0]["lr"]))
        trainer.train_step.dataloader = SlowData(trainer.dataloader, clock, 0.25)
        step, save = trainer.train_step, trainer.checkpointer.maybe_save

        def timed_save(n: int, last: bool = False) -> Any:
            clock.now += 40.0 if n == 2 else 0.0
            return save(n, last=last)

        trainer.train_step, trainer.checkpointer.maybe_save = TimedStep(step, clock, lambda n: 1.5), timed_save
        with kiln_log_lines() as log:
            trainer.train()
    lines = [line for line in log.lines if line.startswith("step:")]
    assert [int(line.split()[1]) for line in lines] == [1, 2, 4]
    tokens = 2 * 32 * 2  # local batch x seq_len x micro-batches, one step
    seconds = [2.0, 2.0, 2 * 2.0 + 40.0]
    data = [0.5, 0.5, 1.0]
    assert [m["tps"] for m in logged] == pytest.approx([tokens / 2.0, tokens / 2.0, 2 * tokens / 44.0], rel=1e-12)
    assert [m["data_loading_pct"] for m in logged] == pytest.approx(
        [100 * d / s for d, s in zip(data, seconds, strict=True)], rel=1e-12
    )
    assert [re.search(r"data: (\S+)%", line).group(1) for line in lines] == ["25.0", "25.0", "2.3"]
    # The lr: what the optimizer applied in steps 1, 2 and 4, and the schedule's warm-up value for that step.
    assert len(applied) == 4
    assert [m["lr"] for m in logged] == [applied[0], applied[1], applied[3]]
    # Warm-up over 3 steps starts at 1/4 of the peak (torchtitan's); step 4 starts the 1-step decay at the peak.
    assert [m["lr"] for m in logged] == pytest.approx([lr / 4, lr / 2, lr], rel=1e-12)
    assert [f"lr: {m['lr']:.4e}" in line for m, line in zip(logged, lines, strict=True)] == [True] * 3


CLOCK = StepClock()  # the metrics module's clock in the tests below (monkeypatched in by _logger)


def _logger(monkeypatch: pytest.MonkeyPatch, device: torch.device, float8: bool, **cfg: Any) -> MetricsLogger:
    """A logging rank's MetricsLogger at 1 GFLOP per token, timed by CLOCK."""
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=CLOCK))
    return MetricsLogger(Metrics(**cfg), device, 1e9, None, True, float8=float8)


def _one_interval(metrics: MetricsLogger, tokens: int = 1000, seconds: float = 1.0) -> tuple[dict[str, float], str]:
    """One step of `tokens` in `seconds`, logged: the metrics and the step line."""
    metrics.count_step(tokens, 0.0)
    CLOCK.now += seconds
    with kiln_log_lines() as log:
        out = metrics.log(1, 10, 5.0, 1.0, 1e-3)
    (line,) = [line for line in log.lines if line.startswith("step:")]
    return out, line


def test_cpu_memory_is_the_process_peak_rss_over_system_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU: memory is getrusage's peak RSS (KiB on Linux) and its share of the machine's RAM; no active figure.
    A float8 run on a CPU without metrics.peak_tflops has no honest MFU: both read n/a."""
    rss_kib = 3 * 2**20 + 2**19  # 3.5 GiB
    fake = SimpleNamespace(RUSAGE_SELF=0, getrusage=lambda who: SimpleNamespace(ru_maxrss=rss_kib))
    monkeypatch.setattr(metrics_module, "resource", fake)
    metrics = _logger(monkeypatch, torch.device("cpu"), float8=True)
    out, line = _one_interval(metrics)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert out["memory_gib"] == 3.5 and out["memory_pct"] == pytest.approx(100 * 3.5 * GIB / ram, rel=1e-12)
    assert f"memory:  3.50GiB({100 * 3.5 * GIB / ram:.2f}%)" in line, line
    assert "active:" not in line and "memory_active_gib" not in out
    assert "mfu: n/a" in line and line.endswith("mfu_fp8: n/a") and "mfu" not in out and "mfu_fp8" not in out


class FakeCuda:
    """torch.cuda's memory statistics for one device, from allocations the test makes: reserved and active bytes,
    their peaks since the last reset_peak_memory_stats."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total = name, total
        self.reserved = self.active = self.peak_reserved = self.peak_active = 0
        self.resets = 0

    def hold(self, reserved: int, active: int) -> None:
        self.reserved, self.active = reserved, active
        self.peak_reserved, self.peak_active = max(self.peak_reserved, reserved), max(self.peak_active, active)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: self.name)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=self.total))
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"active_bytes.all.peak": self.peak_active})
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)

    def reset(self, device: Any = None) -> None:
        self.peak_reserved, self.peak_active, self.resets = self.reserved, self.active, self.resets + 1


def test_cuda_memory_is_the_peak_reserved_since_the_last_line_and_mfu_fp8_uses_the_float8_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA: memory is the peak *reserved* bytes since the last log line (not since the start), its share of the
    device's capacity; active is the peak held by live tensors. mfu is against the bf16 peak, mfu_fp8 against the
    float8 peak of the table (H100 SXM: 989 and 1,979 TFLOP/s)."""
    cuda = FakeCuda("NVIDIA H100 80GB HBM3", 80 * GIB)
    cuda.install(monkeypatch)
    metrics = _logger(monkeypatch, torch.device("cuda", 0), float8=True)
    cuda.hold(reserved=60 * GIB, active=50 * GIB)  # the first interval's peak
    cuda.hold(reserved=20 * GIB, active=10 * GIB)
    first, line = _one_interval(metrics, tokens=4_000_000)
    assert (first["memory_gib"], first["memory_pct"], first["memory_active_gib"]) == (60, 75, 50)
    assert "memory: 60.00GiB(75.00%)" in line and "active: 50.00GiB" in line, line
    tps = 4_000_000 / 1.0
    assert first["mfu"] == pytest.approx(100 * tps * 1e9 / 989e12, rel=1e-12)
    assert first["mfu_fp8"] == pytest.approx(100 * tps * 1e9 / 1979e12, rel=1e-12)
    assert f"mfu: {first['mfu']:.2f}%" in line and line.endswith(f"mfu_fp8: {first['mfu_fp8']:.2f}%"), line
    cuda.hold(reserved=30 * GIB, active=25 * GIB)  # the second interval's peak, below the first's
    cuda.hold(reserved=20 * GIB, active=10 * GIB)
    second, line = _one_interval(metrics)
    assert (second["memory_gib"], second["memory_active_gib"]) == (30, 25), "a peak of an earlier interval"
    assert "memory: 30.00GiB(37.50%)" in line, line


def test_a_gpu_without_float8_peak_reads_mfu_fp8_na(monkeypatch: pytest.MonkeyPatch) -> None:
    """A100: mfu against its 312 TFLOP/s bf16 peak; no float8 tensor cores, so mfu_fp8 is n/a (and not recorded).
    With metrics.peak_tflops the float8 peak is twice it: mfu_fp8 is exactly half of mfu."""
    FakeCuda("NVIDIA A100-SXM4-80GB", 80 * GIB).install(monkeypatch)
    out, line = _one_interval(_logger(monkeypatch, torch.device("cuda", 0), float8=True), tokens=100_000)
    assert out["mfu"] == pytest.approx(100 * 1e5 * 1e9 / 312e12, rel=1e-12) and "mfu_fp8" not in out
    assert line.endswith("mfu_fp8: n/a"), line
    out, line = _one_interval(_logger(monkeypatch, torch.device("cuda", 0), True, peak_tflops=100.0), tokens=10**4)
    assert out["mfu"] == pytest.approx(10.0, rel=1e-12) and out["mfu_fp8"] == pytest.approx(5.0, rel=1e-12)
    out, line = _one_interval(_logger(monkeypatch, torch.device("cuda", 0), False), tokens=1_000_000)
    assert "mfu_fp8" not in line and "mfu_fp8" not in out  # float8 off: no float8 figure at all


# A name torch.cuda.get_device_name reports for each row of docs/metrics.md's peak table.
DEVICE_NAMES = {
    "A100": ["NVIDIA A100-SXM4-80GB"],
    "H100 SXM": ["NVIDIA H100 80GB HBM3"],
    "H100 PCIe": ["NVIDIA H100 PCIe"],
    "H100 NVL": ["NVIDIA H100 NVL"],
    "H200": ["NVIDIA H200"],
    "H200 NVL": ["NVIDIA H200 NVL"],
    "B200": ["NVIDIA B200"],
    "MI300X / MI325X": ["AMD Instinct MI300X", "AMD Instinct MI325X"],
}


def test_the_docs_peak_table_is_the_one_mfu_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row of docs/metrics.md's peak table is what peak_flops returns for that device's name, every entry of
    the code's table has a row, and a GPU in neither has no MFU (n/a, naming metrics.peak_tflops)."""
    text = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    table = text.split("## Peak FLOP/s")[1].split("\n\n")[2]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [row[0] for row in rows] == list(DEVICE_NAMES)
    matched = set()
    for device, bf16, fp8 in rows:
        for name in DEVICE_NAMES[device]:
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, name=name: name)
            peak = metrics_module.peak_flops(torch.device("cuda", 0), None)
            want_fp8 = None if fp8 == "—" else float(fp8.replace(",", "")) * 1e12
            assert (peak.bf16, peak.float8) == (float(bf16.replace(",", "")) * 1e12, want_fp8), name
            matched.add(next(key for key, *_ in metrics_module.PEAK_TFLOPS if key in name))
    assert matched == {key for key, *_ in metrics_module.PEAK_TFLOPS}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA L4")
    peak = metrics_module.peak_flops(torch.device("cuda", 0), None)
    assert (peak.bf16, peak.float8) == (None, None) and "set metrics.peak_tflops" in peak.source
