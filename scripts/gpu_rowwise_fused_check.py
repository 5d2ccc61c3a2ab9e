"""GPU check of float8.rowwise_fused_cast (float8/rowwise_kernels.py, float8/rowwise_fused.py), in under 90 s.

    python3 scripts/gpu_rowwise_fused_check.py            # from the repository root, on one CUDA GPU

Three parts, each in its own try block (a failing part prints its exception and the script goes on):

(a) bit-exactness against torchao on CUDA at Llama3 8B's shapes (seq 8192): the e4m3 bytes and the scales of kiln's
    amax + cast_rows / cast_cols_t / cast_both against torchao's hp_tensor_to_float8_dynamic along both axes, eager
    and compiled, for
    x [8192, 4096] and [8192, 14336], W [4096, 4096], [1024, 4096], [14336, 4096], [4096, 14336] (bf16, and
    float32 as a weight under autocast is) and G [8192, 4096], [8192, 1024], [8192, 14336].
(b) cast microbenchmark: the same work both ways (both axes, the per-column cast as a contiguous transposed copy):
    kiln's two kernels against torchao's casts compiled with torch.compile; CUDA events, median of 50; GB/s
    counted at the least traffic the work needs (read the bf16 tensor once, write two e4m3 copies: 4 B/element)
    against the H200's ~4.8 TB/s.
(c) one Linear, forward + backward, compiled: x [8192, 4096] bf16 -> 14336, weight bf16 (FSDP's mixed precision):
    bf16, torchao tensorwise, torchao rowwise, kiln's fused rowwise (and whether fused equals rowwise bit for bit).

It prints one table per part, and a last line "SUMMARY: ..." to paste.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kiln_base.internals import float8_data, float8_scale  # noqa: E402

PEAK_GBS = 4800.0  # H200 HBM3e; an H100 SXM has ~3350
E4M3 = torch.float8_e4m3fn
SUMMARY: list[str] = []


def bench(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of fn() over `iters` runs, CUDA events around each."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def torchao_cast(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    f8 = hp_tensor_to_float8_dynamic(
        t,
        E4M3,
        LinearMMConfig(),
        scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=dim,
        round_scales_to_power_of_2=True,
    )
    return float8_data(f8), float8_scale(f8)


def torchao_both(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What kiln's two kernels produce, torchao's way: per-row cast, per-column cast as a transposed copy."""
    q, s = torchao_cast(t, -1)
    qc, sc = torchao_cast(t, 0)
    return q, s, qc.t().contiguous(), sc.t()


def sample(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian rows with magnitudes from 1e-6 to 1e6 (scales of every size), a zero row, a huge column."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows, cols = shape
    t = torch.randn(shape, device="cuda", generator=g) * torch.logspace(-6, 6, rows, device="cuda")[:, None]
    t[rows // 3] = 0
    t[:, cols // 2] *= 1e3
    return t.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """e4m3 data as bytes (compared exactly); scales as they are (float32, compared exactly)."""
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def part_a() -> None:
    from float8.rowwise_kernels import amax, cast_both, cast_cols_t, cast_rows

    print("\n(a) bit-exactness vs torchao (e4m3 bytes and scales, per row and per column)")
    print(f"{'tensor':<24} {'dtype':<9} {'vs eager':<28} {'vs compiled':<28}")
    compiled = torch.compile(torchao_both)
    shapes = [
        ("x", (8192, 4096), torch.bfloat16),
        ("x", (8192, 14336), torch.bfloat16),
        ("W wq/wo", (4096, 4096), torch.bfloat16),
        ("W wk/wv", (1024, 4096), torch.bfloat16),
        ("W w1/w3", (14336, 4096), torch.bfloat16),
        ("W w2", (4096, 14336), torch.bfloat16),
        ("W wq/wo fp32", (4096, 4096), torch.float32),
        ("W w1/w3 fp32", (14336, 4096), torch.float32),
        ("W w2 fp32", (4096, 14336), torch.float32),
        ("G wq/wo/w2", (8192, 4096), torch.bfloat16),
        ("G wk/wv", (8192, 1024), torch.bfloat16),
        ("G w1/w3", (8192, 14336), torch.bfloat16),
    ]
    all_ok = True
    for i, (name, shape, dtype) in enumerate(shapes):
        try:
            t = sample(shape, dtype, seed=i)
            row_amax, col_amax = amax(t)
            ours = (*cast_rows(t, row_amax), *cast_cols_t(t, col_amax))
            both = cast_both(t, row_amax, col_amax)
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ours, both)), "cast_both != cast_rows/cols"
            verdicts = []
            for ref in (torchao_both(t), compiled(t)):
                bad = [
                    f"{what}:{int((bits(a) != bits(b)).sum())}"
                    for what, a, b in zip(("q_row", "s_row", "q_colT", "s_col"), ours, ref)
                    if not torch.equal(bits(a), bits(b))
                ]
                verdicts.append("EQUAL" if not bad else "DIFF " + " ".join(bad))
                all_ok &= not bad
            print(f"{name + ' ' + str(list(shape)):<24} {str(dtype)[6:]:<9} {verdicts[0]:<28} {verdicts[1]:<28}")
        except Exception:
            all_ok = False
            print(f"{name} {list(shape)} {dtype}: FAILED")
            traceback.print_exc()
    SUMMARY.append(f"bit-exact {'all EQUAL' if all_ok else 'NOT all equal'}")


def part_b() -> None:
    from float8.rowwise_kernels import amax, cast_both, cast_rows

    print("\n(b) casts of one bf16 tensor, both axes + transposed copy (median of 50 runs)")
    print(f"    GB/s counted at 4 B/element (read bf16 once, write two e4m3 copies); peak ~{PEAK_GBS:.0f}")
    head = f"{'shape':<16} {'torchao compiled ms':>20} {'GB/s':>7} {'kiln fused ms':>14} {'GB/s':>7} {'speedup':>8}"
    print(f"{head}  {'row only: torchao / kiln ms':>28}")
    both = torch.compile(torchao_both)
    row_only = torch.compile(lambda t: torchao_cast(t, -1))

    def fused(t: torch.Tensor) -> None:
        cast_both(t, *amax(t))

    for shape in [(8192, 4096), (8192, 14336), (4096, 14336), (8192, 1024)]:
        try:
            t = sample(shape, torch.bfloat16, seed=0)
            gb = t.numel() * 4 / 1e9
            ms_ao, ms_k = bench(lambda t=t: both(t)), bench(lambda t=t: fused(t))
            ms_ao_row, ms_k_row = bench(lambda t=t: row_only(t)), bench(lambda t=t: cast_rows(t, amax(t)[0]))
            print(
                f"{str(list(shape)):<16} {ms_ao:>20.3f} {gb / ms_ao * 1e3:>7.0f} {ms_k:>14.3f} {gb / ms_k * 1e3:>7.0f} "
                f"{ms_ao / ms_k:>7.2f}x  {ms_ao_row:>13.3f} / {ms_k_row:.3f}"
            )
            if shape == (8192, 14336):
                SUMMARY.append(f"casts [8192,14336] torchao {ms_ao:.3f} ms vs kiln {ms_k:.3f} ms ({ms_ao / ms_k:.2f}x)")
        except Exception:
            print(f"{list(shape)}: FAILED")
            traceback.print_exc()


def part_b2() -> None:
    """Tile sizes for float8/rowwise_kernels.py's GPU_BLOCKS (rows, columns) per kernel."""
    import float8.rowwise_kernels as k

    print("\n(b2) kiln's kernels on [8192, 14336] bf16 by tile size (rowwise_kernels.GPU_BLOCKS; median of 20)")
    t = sample((8192, 14336), torch.bfloat16, seed=0)
    row_amax, col_amax = k.amax(t)
    runs = {
        "amax": lambda: k.amax(t),
        "rows": lambda: k.cast_rows(t, row_amax),
        "cols": lambda: k.cast_cols_t(t, col_amax),
        "both": lambda: k.cast_both(t, row_amax, col_amax),
    }
    gb = {"amax": 2, "rows": 3, "cols": 3, "both": 4}  # bytes moved per element
    default = dict(k.GPU_BLOCKS)
    for kernel, run in runs.items():
        timings = []
        for blocks in [(32, 64), (64, 64), (64, 128), (128, 64), (32, 256)]:  # each one Triton build (~1 s)
            try:
                k.GPU_BLOCKS = {**default, kernel: blocks}
                timings.append((bench(run, iters=20), blocks))
            except Exception as e:
                print(f"  {kernel} {blocks}: FAILED {type(e).__name__}: {str(e)[:100]}")
        k.GPU_BLOCKS = default
        line = "  ".join(f"{b}: {ms:.3f}" for ms, b in timings)
        if timings:
            ms, blocks = min(timings)
            print(f"  {kernel:<5} ms by tile: {line}")
            rate = t.numel() * gb[kernel] / ms / 1e6
            print(f"        best {blocks} {ms:.3f} ms = {rate:.0f} GB/s (default {default[kernel]})")
            SUMMARY.append(f"best {kernel} tile {blocks}")


def part_c() -> None:
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from float8.rowwise_fused import FusedRowwiseFloat8Linear

    print("\n(c) Linear 4096 -> 14336, x [8192, 4096] bf16, weight bf16, compiled forward + backward (median of 20)")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4096, 14336, bias=False)).to("cuda", torch.bfloat16)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(8192, 14336, device="cuda", dtype=torch.bfloat16)
    flops = 3 * 2 * 8192 * 4096 * 14336
    models = {"bf16": copy.deepcopy(base)}
    for recipe in ("tensorwise", "rowwise"):
        models[recipe] = convert_to_float8_training(
            copy.deepcopy(base), config=Float8LinearConfig.from_recipe_name(recipe)
        )
    fused = copy.deepcopy(models["rowwise"])
    fused[0].__class__ = FusedRowwiseFloat8Linear
    models["rowwise fused (kiln)"] = fused
    results: dict[str, tuple[torch.Tensor, ...]] = {}
    times: dict[str, float] = {}
    print(f"{'variant':<22} {'ms':>8} {'TFLOP/s':>8} {'vs bf16':>8}")
    for name, model in models.items():
        try:
            step = torch.compile(model)
            xx = x.clone().requires_grad_()

            def run(model: torch.nn.Module = model, step=step, xx: torch.Tensor = xx) -> None:
                model.zero_grad(set_to_none=True)
                xx.grad = None
                step(xx).backward(g)

            times[name] = bench(run, iters=20, warmup=3)
            y = step(xx)
            model.zero_grad(set_to_none=True)
            xx.grad = None
            y.backward(g)
            grads = (xx.grad, model[0].weight.grad)
            assert grads[0] is not None and isinstance(grads[1], torch.Tensor)
            results[name] = (y.detach(), grads[0].clone(), grads[1].clone())
            ratio = times["bf16"] / times[name] if "bf16" in times else float("nan")
            print(f"{name:<22} {times[name]:>8.3f} {flops / times[name] / 1e9:>8.0f} {ratio:>7.2f}x")
        except Exception:
            print(f"{name}: FAILED")
            traceback.print_exc()
    if "rowwise" in results and "rowwise fused (kiln)" in results:
        same = [torch.equal(a, b) for a, b in zip(results["rowwise"], results["rowwise fused (kiln)"])]
        print(f"fused == torchao rowwise (compiled): output {same[0]}, grad_input {same[1]}, grad_weight {same[2]}")
        SUMMARY.append(f"Linear fused==rowwise {all(same)}")
    if "rowwise" in times and "rowwise fused (kiln)" in times:
        SUMMARY.append(
            f"Linear fwd+bwd ms: bf16 {times.get('bf16', float('nan')):.2f}, tensorwise "
            f"{times.get('tensorwise', float('nan')):.2f}, rowwise {times['rowwise']:.2f}, fused "
            f"{times['rowwise fused (kiln)']:.2f}"
        )


def main() -> None:
    start = time.time()
    import torchao
    import triton

    print(
        f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"torchao {torchao.__version__}"
    )
    for part in (part_a, part_b, part_b2, part_c):
        try:
            part()
        except Exception:
            print(f"{part.__name__}: FAILED")
            traceback.print_exc()
        sys.stdout.flush()
    print(f"\nSUMMARY: {'; '.join(SUMMARY)} | {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
