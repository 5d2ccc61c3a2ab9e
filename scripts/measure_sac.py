"""Measure per-op SAC on the debug model: bytes kept for backward by op, and what the recompute redoes.

    python scripts/measure_sac.py --recipe rowwise [--no-amax] [--seq-len 2048]

Runs one bf16 forward/backward of the debug model (one process, per-op SAC on every block) and reports, from
the policy's own decisions: bytes of outputs kept by SAC per op, the ops recomputed in backward (with the
elements the amax/max reductions re-read), the bytes saved by autograd outside checkpointed regions, and the
median forward+backward wall time. `--no-amax` drops aten.amax from the save list (the question in
docs/parallelisms.md: should rowwise amax outputs be saved?); `--save-abs` adds aten.abs (the mistake of torchtitan
PR #808).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parallelisms.activation_checkpoint as ac  # noqa: E402
from kiln_base.config import ActivationCheckpoint  # noqa: E402
from models import LLAMA3_FLAVORS, Transformer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", choices=["none", "tensorwise", "rowwise"], default="rowwise")
    p.add_argument("--no-amax", action="store_true", help="remove aten.amax from SAC_SAVE_LIST")
    p.add_argument(
        "--save-abs", action="store_true", help="add aten.abs to the save list (torchtitan PR #808's mistake)"
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    save_list = ac.SAC_SAVE_LIST
    if a.no_amax:
        save_list = save_list - {torch.ops.aten.amax.default}
    if a.save_abs:
        save_list = save_list | {torch.ops.aten.abs.default}
    stats = ac.SACStats()
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=2256, max_seq_len=a.seq_len)
    torch.manual_seed(0)
    model = Transformer(args)
    if a.recipe != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from float8.converter import prepare_cpu_float8

        prepare_cpu_float8()  # torch's CPU float8 matmul, as kiln's build uses

        convert_to_float8_training(
            model, config=Float8LinearConfig.from_recipe_name(a.recipe), module_filter_fn=lambda m, fqn: fqn != "output"
        )
    with torch.no_grad():
        model.init_weights()
    model.to(torch.bfloat16)  # rowwise float8 matmuls produce bf16
    ac.apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"), stats, save_list)
    tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq_len))

    outside = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        outside += t.nbytes
        return t

    times = []
    for _ in range(a.repeats):
        for d in (stats.kept_bytes, stats.recomputed, stats.recomputed_numel):
            d.clear()  # report the last pass only
        outside = 0
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)

    print(
        f"recipe={a.recipe} amax_saved={not a.no_amax} abs_saved={a.save_abs} seq_len={a.seq_len} batch={a.batch} "
        f"threads={torch.get_num_threads()}"
    )
    print(f"kept by SAC: {sum(stats.kept_bytes.values()) / 2**20:.3f} MiB")
    for op, b in sorted(stats.kept_bytes.items(), key=lambda kv: -kv[1]):
        print(f"  {str(op):60s} {b / 2**10:12.1f} KiB")
    print(f"saved outside checkpointed blocks: {outside / 2**20:.3f} MiB")
    for op in (torch.ops.aten.amax.default, torch.ops.aten.max.default):
        if stats.recomputed[op]:
            n, numel = stats.recomputed[op], stats.recomputed_numel[op]
            print(f"recomputed {op}: {n} calls re-reading {numel / 1e6:.2f} M elements")
    print(f"recomputed ops in total: {sum(stats.recomputed.values())}")
    print(f"forward+backward: median {statistics.median(times) * 1e3:.0f} ms over {a.repeats}")


if __name__ == "__main__":
    main()
