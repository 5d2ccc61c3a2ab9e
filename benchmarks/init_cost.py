"""What the layout-independent init (parallelisms/seeded_init.py) costs one rank, for a flavor and a layout.

    python benchmarks/init_cost.py --flavor 8B --fsdp 8 [--tp 1] [--rank 0] [--device cpu]

Builds the flavor on the meta device (nothing allocated), works out the shard each parameter has on rank `--rank`
of FSDP `--fsdp` x TP `--tp` (FSDP shards dim 0 evenly, TP shards colwise Linears on dim 0 and rowwise Linears
(wo, w2) on dim 1, as kiln's plan does), and times drawing exactly those values through the same `draw_shard` the
Trainer uses, one parameter at a time, discarding each after drawing. Prints the seconds and the elements drawn
against the rank's own elements (the overdraw of whole row chunks and of TP column shards).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln_base.internals import unwrapped_fqn  # noqa: E402
from models import LLAMA3_FLAVORS, Transformer  # noqa: E402
from parallelisms.seeded_init import CHUNK_ELEMS, draw_shard  # noqa: E402

ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")  # TP shards their input features (dim 1)
LLAMA3_VOCAB = 128256


def shard_of(
    shape: tuple[int, ...], fqn: str, fsdp: int, tp: int, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, offset) of `fqn` on `rank` (rank = dp_index * tp + tp_index)."""
    shape_l, offset = list(shape), [0] * len(shape)
    dp_index, tp_index = divmod(rank, tp)
    if tp > 1 and fqn.startswith("layers.") and len(shape) == 2:
        dim = 1 if fqn.endswith(ROWWISE) else 0
        shape_l[dim] //= tp
        offset[dim] = tp_index * shape_l[dim]
    if fsdp > 1:
        per = -(-shape_l[0] // fsdp)  # FSDP2's even split, the last ranks short
        start = min(dp_index * per, shape_l[0])
        offset[0] += start
        shape_l[0] = max(0, min(per, shape_l[0] - start))
    return tuple(shape_l), tuple(offset)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="8B", choices=sorted(LLAMA3_FLAVORS))
    p.add_argument("--fsdp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    args = dataclasses.replace(LLAMA3_FLAVORS[a.flavor], vocab_size=LLAMA3_VOCAB)
    with torch.device("meta"):
        model = Transformer(args)
    inits, device = model.param_inits(), torch.device(a.device)
    generator = torch.Generator(device=device)
    drawn = own = 0
    t0 = time.perf_counter()
    for name, param in model.named_parameters():
        fqn = unwrapped_fqn(name)
        shape, offset = shard_of(tuple(param.shape), fqn, a.fsdp, a.tp, a.rank)
        if 0 in shape:
            continue
        cols = param.shape[1] if param.dim() == 2 else 1
        chunk_rows = max(1, CHUNK_ELEMS // cols)
        first, last = offset[0] // chunk_rows, (offset[0] + shape[0] - 1) // chunk_rows
        drawn += min(param.shape[0], (last + 1) * chunk_rows) * cols - first * chunk_rows * cols
        own += shape[0] * (shape[1] if len(shape) == 2 else 1)
        draw_shard(inits[fqn], 0, fqn, tuple(param.shape), shape, offset, device, generator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(
        f"{a.flavor} rank {a.rank} of FSDP {a.fsdp} x TP {a.tp} on {a.device} ({torch.get_num_threads()} threads): "
        f"{seconds:.1f} s; drew {drawn / 1e9:.2f} G elements for its own {own / 1e9:.2f} G "
        f"({drawn / own:.2f}x); {drawn / seconds / 1e6:.0f} M elements/s"
    )


if __name__ == "__main__":
    main()
