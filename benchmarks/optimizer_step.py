"""Time one AdamW step over a model's parameters with each kernel choice, against the memory-bandwidth bound.

    python benchmarks/optimizer_step.py --flavor 8B --n-layers 8 --vocab-size 128256      # the llama3_8b_8l shape
    python benchmarks/optimizer_step.py --flavor debugmodel --steps 3                   # seconds on a CPU

The optimizer step is memory-bound: per parameter, AdamW with fp32 weights, gradients and state reads 16 bytes
(weight, gradient, exp_avg, exp_avg_sq) and writes 12 (weight and both moments); with bf16 moments 12 and 8. The
bound is those bytes at the device's copy rate, measured here by a large `copy_` (read + write). Each variant
runs on the same parameters (shapes of the model's real parameter list, so the kernels see its tensor sizes):

- fused:                 torch's fused AdamW (kiln's default, `optimizer.implementation fused`)
- foreach:               torch's multi-tensor AdamW (`optimizer.implementation foreach`)
- fused_opt_states_bf16: fused AdamW with bf16 exp_avg / exp_avg_sq created before the first step (torchtitan's
                         `optimizer.implementation fused_opt_states_bf16`); torch 2.11's fused kernel refuses them
- compiled:              the foreach step compiled by torch.compile (Inductor fuses it into a few kernels)

Prints one line per variant: median ms per step, GB moved, GB/s, and the share of the copy rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from models import LLAMA3_FLAVORS, Transformer  # noqa: E402
from trainer.components.optim import build_optimizer  # noqa: E402

VARIANTS = ("fused", "foreach", "fused_opt_states_bf16", "compiled")


def param_shapes(flavor: str, n_layers: int | None, vocab_size: int) -> list[torch.Size]:
    args = replace(LLAMA3_FLAVORS[flavor], vocab_size=vocab_size)
    if n_layers is not None:
        args = replace(args, n_layers=n_layers)
    with torch.device("meta"):
        model = Transformer(args)
    return [p.shape for p in model.parameters()]


def _timer(device: torch.device):
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def begin() -> None:
            start.record()

        def finish() -> float:
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return begin, finish
    t0 = [0.0]

    def begin_cpu() -> None:
        t0[0] = time.perf_counter()

    def finish_cpu() -> float:
        return 1e3 * (time.perf_counter() - t0[0])

    return begin_cpu, finish_cpu


def copy_rate(device: torch.device, numel: int, steps: int) -> float:
    """Bytes per second of a large fp32 copy (read + write), the bound a memory-bound kernel can reach."""
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    begin, finish = _timer(device)
    times = []
    for _ in range(steps + 1):
        begin()
        dst.copy_(src)
        times.append(finish())
    return 2 * 4 * numel / (statistics.median(times[1:]) / 1e3)


def step_bytes(numel: int, state_bytes: int) -> int:
    """Bytes one AdamW step moves: read weight + gradient (fp32) and both moments, write weight and both moments."""
    return numel * (4 + 4 + 2 * state_bytes) + numel * (4 + 2 * state_bytes)


def run_variant(variant: str, shapes: list[torch.Size], device: torch.device, steps: int) -> tuple[float, int]:
    """Median ms of one optimizer step, and the bytes it moves."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(s, device=device).normal_(generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p).normal_(generator=gen) * 1e-3
    from kiln_base.config import Optimizer

    impl = {"compiled": "foreach", "fused_opt_states_bf16": "fused"}.get(variant, variant)
    opt = build_optimizer(params, Optimizer(implementation=impl, lr=3e-4))
    if variant == "fused_opt_states_bf16":
        for p in params:
            opt.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=device)
            opt.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
            opt.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
    # compiled: Inductor fuses the foreach math (the lr is constant here; in training a tensor lr and
    # capturable=True would avoid a recompile per lr change).
    step = torch.compile(opt.step) if variant == "compiled" else opt.step
    begin, finish = _timer(device)
    times = []
    for _ in range(steps + 2):  # the first two: state allocation, compilation
        begin()
        step()
        times.append(finish())
    moments = opt.state[params[0]]["exp_avg"].dtype
    numel = sum(p.numel() for p in params)
    del opt, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[2:]), step_bytes(numel, torch.empty((), dtype=moments).element_size())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="debugmodel", choices=sorted(LLAMA3_FLAVORS))
    ap.add_argument("--n-layers", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=2256)
    ap.add_argument("--steps", type=int, default=10, help="measured steps per variant (median)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = param_shapes(a.flavor, a.n_layers, a.vocab_size)
    numel = sum(s.numel() for s in shapes)
    rate = copy_rate(device, min(numel, 1 << 28), a.steps)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{a.flavor} n_layers={a.n_layers}: {len(shapes)} tensors, {numel:,} parameters on {name}")
    print(f"copy rate (fp32 copy_, read + write): {rate / 1e9:,.0f} GB/s")
    print("| variant | ms per step | GB moved | GB/s | of copy rate |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for variant in a.variants.split(","):
        if variant not in VARIANTS:
            ap.error(f"unknown variant '{variant}'; choose from {', '.join(VARIANTS)}")
        try:
            ms, moved = run_variant(variant, shapes, device, a.steps)
        except Exception as e:  # one variant failing (a kernel this torch lacks) must not hide the others
            print(f"| {variant} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |", flush=True)
            continue
        gbs = moved / (ms / 1e3) / 1e9
        print(f"| {variant} | {ms:.2f} | {moved / 1e9:.1f} | {gbs:,.0f} | {gbs * 1e9 / rate:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
