"""Step metrics: loss, memory, tokens/s per device, MFU, grad norm, lr — in torchtitan's log-line shape.

    step: 10  loss:  7.1234  memory:  1.23GiB(4.56%)  tps: 12,345  mfu: 12.34%  grad_norm: ...

With validation on, a validation step's line ends with `val_loss: 7.3012  val_ppl: 1483.09`
(trainer/evaluation/validate.py); the scalar writers (TensorBoard, W&B) get kiln/val_loss and kiln/val_ppl at that step.

memory is the peak reserved device memory since the last log line and its share of capacity; on CPU it
is the process's peak RSS and its share of system RAM (said once at start-up). MFU is measured against
the *bf16 dense* peak even for float8 runs, so float8 and bf16 runs compare on one scale (docs/metrics.md).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln_base.config import Metrics
from models.flops import CONVENTIONS as FLOP_CONVENTIONS
from trainer.components.scalar_writers import ScalarWriters

logger = logging.getLogger("kiln")

# Dense peak TFLOP/s per device (no sparsity), from the vendors' data sheets.
# (name substring as reported by torch.cuda.get_device_name, bf16 peak, float8 peak or None).
PEAK_TFLOPS: list[tuple[str, float, float | None]] = [
    ("A100", 312.0, None),
    ("H100 NVL", 835.0, 1671.0),
    ("H100 PCIe", 756.0, 1513.0),
    ("H100", 989.0, 1979.0),  # SXM; after the PCIe/NVL entries so those match first
    ("H200 NVL", 835.5, 1670.5),  # data sheet: 1,671 bf16 / 3,341 fp8 TFLOPS with sparsity, halved
    ("H200", 989.0, 1979.0),  # SXM; after the NVL entry
    ("B200", 2250.0, 4500.0),
    ("MI300X", 1307.0, 2615.0),
    ("MI325X", 1307.0, 2615.0),
]


@dataclass(frozen=True)
class PeakFlops:
    bf16: float | None  # FLOP/s; None = unknown, MFU is printed as n/a
    float8: float | None
    source: str


def peak_flops(device: torch.device, override_tflops: float | None) -> PeakFlops:
    """bf16 (and float8) dense peak for `device`; a config override wins, CPU without one is unknown."""
    if override_tflops is not None:
        return PeakFlops(override_tflops * 1e12, 2 * override_tflops * 1e12, "metrics.peak_tflops")
    if device.type != "cuda":
        return PeakFlops(None, None, f"no peak known for {device.type}; set metrics.peak_tflops")
    name = torch.cuda.get_device_name(device)
    for key, bf16, fp8 in PEAK_TFLOPS:
        if key in name:
            return PeakFlops(bf16 * 1e12, fp8 * 1e12 if fp8 else None, name)
    return PeakFlops(None, None, f"unknown GPU '{name}'; set metrics.peak_tflops")


class MemoryMonitor:
    """Peak device memory since the last reset: reserved bytes on CUDA, process RSS on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.capacity = torch.cuda.get_device_properties(device).total_memory
            self.kind = "peak reserved CUDA memory / device capacity"
        else:
            self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self.kind = "peak RSS of this process / system RAM (CPU run)"

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def peak_active_bytes(self) -> int | None:
        """Peak bytes held by live tensors (CUDA); reserved adds the caching allocator's cached blocks."""
        if self.device.type == "cuda":
            return torch.cuda.memory_stats(self.device).get("active_bytes.all.peak", 0)
        return None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def format_step_line(
    step: int,
    loss: float,
    mem_gib: float,
    mem_pct: float,
    tps: float,
    mfu: float | None,
    grad_norm: float,
    lr: float,
    extra: str = "",
) -> str:
    mfu_s = "n/a" if mfu is None else f"{mfu:.2f}%"
    return (
        f"step: {step:2}  loss: {loss:7.4f}  memory: {mem_gib:5.2f}GiB({mem_pct:.2f}%)  "
        f"tps: {round(tps):,}  mfu: {mfu_s}  grad_norm: {grad_norm:7.4f}  lr: {lr:.4e}{extra}"
    )


class MetricsLogger:
    """Accumulates tokens and timings between log steps and prints one line per log step.

    Reading the loss forces a host-device sync, so it only happens on log steps.
    """

    def __init__(
        self,
        cfg: Metrics,
        device: torch.device,
        flops_per_token: float,
        writer: ScalarWriters | None,
        is_logging_rank: bool,
        float8: bool = False,
        data_tokens: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """`flops_per_token` is counted under cfg.attention_flops (models/flops.py); mfu and tflops use it.
        `data_tokens`: tokens read so far from each source of a token-file mix (logged as data_tokens/NAME)."""
        self.cfg = cfg
        self.data_tokens = data_tokens
        self.float8 = float8  # also report mfu_fp8, against the float8 peak
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(device, cfg.peak_tflops)
        self.memory = MemoryMonitor(device)
        self.is_logging_rank = is_logging_rank
        self.tokens = 0
        self.data_time = 0.0
        self._steps_since_log = 0
        self.t_last = time.perf_counter()
        self.writer = writer  # TensorBoard and W&B (scalar_writers.py); the numerics report writes through it too
        if is_logging_rank:
            fp8 = ", mfu_fp8 against the float8 peak" if float8 else ""
            logger.info(
                f"Metrics: memory = {self.memory.kind}; mfu against bf16 peak ({self.peak.source}){fp8}; "
                f"FLOPs with {FLOP_CONVENTIONS[cfg.attention_flops]} (metrics.attention_flops)"
            )

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.log_freq == 0

    def log(
        self,
        step: int,
        total_steps: int,
        loss: float,
        grad_norm: float,
        lr: float,
        validation: tuple[float, float] | None = None,
        scalars: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Log one line (on the logging rank) and return the metrics; resets the interval counters.
        `validation`: this step's validation loss and perplexity, if it validated; `scalars`: the step's further
        values (StepResult.scalars: an MoE's aux_loss and moe_imbalance), shown after lr under their names."""
        now = time.perf_counter()
        elapsed = max(now - self.t_last, 1e-9)
        tps = self.tokens / elapsed
        mfu = None if self.peak.bf16 is None else 100.0 * tps * self.flops_per_token / self.peak.bf16
        peak = self.memory.peak_bytes()
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "memory_gib": peak / 2**30,
            "memory_pct": 100.0 * peak / self.memory.capacity,
            "tflops": tps * self.flops_per_token / 1e12,
            "data_loading_pct": 100.0 * self.data_time / elapsed,
        }
        if mfu is not None:
            metrics["mfu"] = mfu
        active = self.memory.peak_active_bytes()
        if active is not None:
            metrics["memory_active_gib"] = active / 2**30
        mfu_fp8 = None if self.peak.float8 is None else 100.0 * tps * self.flops_per_token / self.peak.float8
        if self.float8 and mfu_fp8 is not None:
            metrics["mfu_fp8"] = mfu_fp8
        if validation is not None:
            metrics["val_loss"], metrics["val_ppl"] = validation
        metrics |= scalars or {}
        by_source = self.data_tokens() if self.data_tokens is not None else {}
        for name, n in by_source.items():
            metrics[f"data_tokens/{name}"] = float(n)
        if self.is_logging_rank:
            steps_per_s = self._steps_since_log / elapsed if self._steps_since_log else 0.0
            eta = (total_steps - step) / steps_per_s if steps_per_s else 0.0
            extra = "".join(f"  {name}: {value:.4f}" for name, value in (scalars or {}).items())
            extra += f"  data: {metrics['data_loading_pct']:.1f}%  eta: {_hms(eta)}"
            if active is not None:
                extra += f"  active: {metrics['memory_active_gib']:.2f}GiB"
            if self.float8:  # how far from the float8 ceiling; mfu itself stays on the bf16 scale
                extra += "  mfu_fp8: " + ("n/a" if mfu_fp8 is None else f"{mfu_fp8:.2f}%")
            if validation is not None:
                extra += f"  val_loss: {validation[0]:7.4f}  val_ppl: {validation[1]:.2f}"
            if len(by_source) > 1:  # the mix so far, as shares of the tokens read
                total = max(sum(by_source.values()), 1)
                extra += "  mix: " + " ".join(f"{name} {100 * n / total:.2f}%" for name, n in by_source.items())
            logger.info(
                format_step_line(
                    step, loss, metrics["memory_gib"], metrics["memory_pct"], tps, mfu, grad_norm, lr, extra
                )
            )
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(f"kiln/{k}", v, step)
            self.writer.flush()
        self.tokens, self.data_time, self._steps_since_log = 0, 0.0, 0
        self.memory.reset()
        self.t_last = time.perf_counter()
        return metrics

    def discount(self, seconds: float) -> None:
        """Leave `seconds` spent outside training (a validation) out of the next line's tokens/s and MFU."""
        self.t_last += seconds

    def count_step(self, tokens: int, data_time: float) -> None:
        """One optimizer step: its tokens on this device (all micro-batches) and seconds spent waiting for data."""
        self.tokens += tokens
        self.data_time += data_time
        self._steps_since_log += 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _hms(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"
