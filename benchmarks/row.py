"""One benchmark row in one process: train.py's training run, plus the time spent in the transformer blocks.

    python benchmarks/row.py --bench.warmup 3 [train.py flags]        (or under torchrun for several processes)

Trains exactly as train.py does (same Trainer, same step lines) and, on every step after `--bench.warmup`,
times the transformer blocks' forward and backward inside the real step: events at the first block's input and
the last block's output going forward, and at the gradients of the last block's output and of the first
block's input coming back (CUDA events on a GPU, a clock on a CPU). Embedding, final norm, output layer, loss,
optimizer and data are outside that window, so float8's gain (it only changes the blocks' matmuls) shows
without their fixed cost. Ends with one line that benchmarks/run.py parses:

    blocks: 123.45 ms per step (forward 41.20, backward 82.25; median of 10 steps)

`--bench.profile_steps N` profiles the run's last N steps with torch.profiler (the block timer leaves them out)
and prints where the device time went by kernel category and the costliest kernels:

    kernels: attention 12.3% (66.82 ms), gemm 62.1% (337.16 ms), ..., idle 2.3% (12.34 ms) of 542.83 ms over 2 steps

Kernel categories (`--bench.profile_steps`): from kernel names (cuBLAS/CUTLASS/nvjet GEMMs, flash/cuDNN attention,
and Inductor's fused Triton kernels, named after the ops they fuse). A fused kernel gets the first category whose
words it contains, in the order of CATEGORIES: a norm fused with a cast counts as a norm. "idle" is the profiled
window's time with no kernel running (host overhead, syncs, data); shares are of kernel time plus idle.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from kiln_base.internals import set_inductor_option  # noqa: E402
from trainer.hooks import StepHook, StepOutput  # noqa: E402

# (category, words in the lower-cased kernel name); the first match wins.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("attention", ("flash", "fmha", "attention", "sdpa", "_attn")),
    (
        "gemm",
        (
            "gemm",
            "nvjet",
            "xmma",
            "cutlass",
            "cublas",
            "scaled_mm",
            "wgmma",
            "matmul",
            "_mm_",
            "aten::mm",
            "addmm",
            "linear",
            "mmbackward",
        ),
    ),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lerp", "addcdiv")),
    ("norms", ("rsqrt", "norm")),
    ("casts/amax", ("amax", "float8", "fp8", "to_copy", "clamp", "reciprocal", "abs")),
]
OTHER = "other"


# Inductor's pointwise/reduction/persistent kernels are named after every op they fuse, the matmul that produced
# their input included; they are never GEMMs (its GEMM templates are "triton_tem_").
FUSED = ("triton_poi_", "triton_red_", "triton_per_")


def category(kernel_name: str) -> str:
    name = kernel_name.lower()
    for cat, words in CATEGORIES:
        if cat == "gemm" and name.startswith(FUSED):
            continue
        if any(w in name for w in words):
            return cat
    return OTHER


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Time covered by at least one (start, end) interval: kernels on several streams may overlap."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def breakdown(kernels: list[tuple[str, float, float]], window_us: float) -> dict[str, float]:
    """Microseconds per category (kernel durations summed) and "idle" (the window minus the time any kernel ran)."""
    out: dict[str, float] = {cat: 0.0 for cat, _ in CATEGORIES} | {OTHER: 0.0}
    for name, start, end in kernels:
        out[category(name)] += end - start
    out["idle"] = max(window_us - busy_us((s, e) for _, s, e in kernels), 0.0)
    return out


def format_breakdown(parts: dict[str, float], steps: int) -> str:
    total = sum(parts.values()) or 1.0
    cells = [f"{cat} {100 * us / total:.1f}% ({us / 1e3:.2f} ms)" for cat, us in parts.items()]
    return f"kernels: {', '.join(cells)} of {total / 1e3:.2f} ms over {steps} steps"


def top_kernels(kernels: list[tuple[str, float, float]], n: int = 25) -> list[str]:
    """The `n` kernels with the most total time: name, category, ms, calls."""
    per: dict[str, list[float]] = {}
    for name, start, end in kernels:
        per.setdefault(name, []).append(end - start)
    ranked = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:n]
    return [f"  {sum(d) / 1e3:9.2f} ms {len(d):5}x  [{category(k)}] {k[:140]}" for k, d in ranked]


class _Clock:
    """A point in time on the device's stream (CUDA event) or on the host clock (CPU: ops run synchronously)."""

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        if self.event is not None:
            self.event.record()
        self.t = time.perf_counter()

    def ms_since(self, start: _Clock) -> float:
        if self.event is not None and start.event is not None:
            return start.event.elapsed_time(self.event)
        return 1e3 * (self.t - start.t)


class BlockTimer(StepHook):
    """Forward and backward time of `model.layers` inside each measured training step (all micro-batches)."""

    def __init__(self, model: nn.Module, warmup: int, cuda: bool, last: int | None = None) -> None:
        blocks = list(model.get_submodule("layers").children())
        self.warmup, self.last, self.cuda, self.active = warmup, last, cuda, False
        self.marks: list[dict[str, _Clock]] = []  # one per micro-batch
        self.per_step: list[tuple[float, float]] = []  # (forward ms, backward ms)
        self.handles = [
            blocks[0].register_forward_pre_hook(self._first_block_input),
            blocks[-1].register_forward_hook(self._last_block_output),
        ]

    def _mark(self, name: str) -> None:
        self.marks[-1][name] = _Clock(self.cuda)

    def _first_block_input(self, module: nn.Module, args: tuple) -> None:
        if not self.active or not torch.is_grad_enabled():
            return
        self.marks.append({})
        self._mark("fwd_start")
        x = args[0]
        if x.requires_grad:  # its gradient is the last thing the blocks' backward computes
            x.register_hook(lambda g: self._mark("bwd_end"))

    def _last_block_output(self, module: nn.Module, args: tuple, out: Any) -> None:
        if not self.active or not self.marks or "fwd_end" in self.marks[-1]:
            return
        self._mark("fwd_end")
        if isinstance(out, torch.Tensor) and out.requires_grad:  # its gradient starts the blocks' backward
            out.register_hook(lambda g: self._mark("bwd_start"))

    def pre_step(self, step: int) -> None:
        self.active = step > self.warmup and (self.last is None or step <= self.last)
        self.marks = []

    def post_step(self, out: StepOutput) -> None:
        if not self.active:
            return
        if self.cuda:
            torch.cuda.synchronize()
        fwd = sum(m["fwd_end"].ms_since(m["fwd_start"]) for m in self.marks if "fwd_end" in m)
        bwd = sum(m["bwd_end"].ms_since(m["bwd_start"]) for m in self.marks if "bwd_end" in m and "bwd_start" in m)
        self.per_step.append((fwd, bwd))

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def summary(self) -> str:
        if not self.per_step:
            return "blocks: n/a (no measured step)"
        fwd = statistics.median(f for f, _ in self.per_step)
        bwd = statistics.median(b for _, b in self.per_step)
        total = statistics.median(f + b for f, b in self.per_step)
        return (
            f"blocks: {total:.2f} ms per step (forward {fwd:.2f}, backward {bwd:.2f}; "
            f"median of {len(self.per_step)} steps)"
        )


class KernelProfile(StepHook):
    """torch.profiler over steps `first`..`last`; prints the kernel-time breakdown when they end."""

    def __init__(self, first: int, last: int, cuda: bool) -> None:
        self.first, self.last, self.cuda = first, last, cuda
        self.prof: torch.profiler.profile | None = None
        self.t0 = 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def pre_step(self, step: int) -> None:
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self._sync()
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def post_step(self, out: StepOutput) -> None:
        if self.prof is None or out.step != self.last:
            return
        self._sync()
        window_us = 1e6 * (time.perf_counter() - self.t0)
        self.prof.__exit__(None, None, None)
        device = torch.autograd.DeviceType.CUDA if self.cuda else torch.autograd.DeviceType.CPU
        kernels = [
            (e.name, e.time_range.start, e.time_range.end)
            for e in self.prof.events()
            # Kernels only: record_function ranges (e.g. "Optimizer.step#AdamW.step") also appear on the device
            # timeline as user annotations spanning their kernels. CPU: top-level ops only.
            if e.device_type == device and not e.is_user_annotation and (self.cuda or not e.cpu_parent)
        ]
        print(format_breakdown(breakdown(kernels, window_us), self.last - self.first + 1), flush=True)
        print("\n".join(["top kernels:", *top_kernels(kernels)]), flush=True)
        self.prof = None


def main(argv: list[str]) -> int:
    from kiln_base.config import parse_args
    from kiln_base.errors import UserError
    from trainer.trainer import Trainer

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout
    )
    bench = {"--bench.warmup": 0, "--bench.profile_steps": 0}
    for key in bench:
        if key in argv:
            i = argv.index(key)
            bench[key] = int(argv[i + 1])
            argv = argv[:i] + argv[i + 2 :]
    warmup, profile_steps = bench["--bench.warmup"], bench["--bench.profile_steps"]
    inductor: list[str] = []  # --bench.inductor triton.tile_reductions=false (repeatable)
    while "--bench.inductor" in argv:
        i = argv.index("--bench.inductor")
        inductor.append(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    try:
        trainer = Trainer(parse_args(argv))
    except UserError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    for spec in inductor:  # after the build, so it overrides what kiln set; compilation happens in the first step
        print(f"inductor: {set_inductor_option(spec)}", flush=True)
    cuda = trainer.device.type == "cuda"
    total = trainer.cfg.training.steps
    timer = BlockTimer(trainer.model, warmup, cuda, last=total - profile_steps)
    hooks: list[StepHook] = [timer]
    if profile_steps:
        hooks.append(KernelProfile(total - profile_steps + 1, total, cuda))
    try:
        trainer.train(extra_hooks=hooks)
    except UserError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
    print(timer.summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
