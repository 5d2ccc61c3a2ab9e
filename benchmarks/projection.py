"""Project the per-GPU tokens/s of the full Llama 3 8B (32 layers) under FSDP on 8 GPUs from one GPU's measured parts.

    python benchmarks/projection.py --results benchmarks/results/llama3_8b_8l          # every row with a profile
    python benchmarks/projection.py --results DIR --precision tensorwise --gpus 8 --link-gbs 350

This is a projection, not a measurement. One GPU runs the `llama3_8b_8l` preset (8B widths, 8 layers, seq 8192,
local batch 1); its row (benchmarks/run.py with `--profile`) gives:

- the 8 blocks' forward + backward time inside the step (`blocks_ms`),
- the optimizer's kernel time per step (the profile's "optimizer" category: AdamW and the gradient-norm kernels),
- the rest of the step (embedding, final norm, output layer, loss, data, host gaps): step - blocks - optimizer.

The 32-layer, 8-GPU step is then, per GPU (each GPU still trains seq 8192 x local batch 1):

    blocks x 32/8  +  rest  +  optimizer x (8B parameters / GPUs) / (8-layer parameters)  +  exposed communication

Assumptions, stated because they decide the figure:
- FSDP2 (kiln's groups: the embedding, each block, the final norm with the output layer) prefetches the next
  group's all-gather and overlaps each reduce-scatter with the next group's backward, so only the embedding's and
  the first block's all-gathers before the first forward, and their reduce-scatters after the last backward, are
  exposed. The script checks that one block's communication fits in its compute (else the excess counts too).
- Communication time is bytes x (n-1)/n / the link's bus bandwidth (`--link-gbs`, default 350 GB/s: NCCL's
  all-gather bus bandwidth on 8 NVLink-4 H100/H200s is ~350-370 GB/s); weights gathered in bf16 (fp8 with
  `--fp8-allgather`), gradients reduced in fp32 (kiln's default `training.mixed_precision_reduce`).
- Compute kernels run as fast beside NCCL's as alone (`--comm-slowdown` adds a fraction to the blocks' time).
- The measuring GPU's speed: an H200 measures memory-bound kernels (optimizer, casts, norms) faster than an H100
  (4.8 vs 3.35 TB/s); GEMMs and attention run at the same clocks. The figure is for the GPU that measured it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Published per-GPU figures for Llama 3 8B pretraining at seq 8192 (the anchors users compare against).
ANCHORS = [
    ("Megatron-Core, 8 x H100, FP8 (issue 42's anchor: 744 TFLOP/s causal)", 14451),
    ("torchtitan, 8 x H100 (500 W), FSDP + compile + float8, local batch 2 (benchmarks/, 2024-12)", 8532),
    ("torchtitan, 32 x H200, FSDP + compile + float8 all-gather, local batch 2 (benchmarks/, 2025-06)", 10938),
]
SEQ = 8192
OPTIMIZER = re.compile(r"optimizer [\d.]+% \((?P<ms>[\d.]+) ms\)")
STEPS = re.compile(r"over (?P<n>\d+) steps")


@dataclass(frozen=True)
class Shape:
    params: int  # all parameters (the optimizer updates every one)
    block_params: int  # one transformer block
    embedding_params: int  # FSDP's first group (parallelisms/parallelize.py's apply_fsdp)
    head_params: int  # the final norm and the output layer: FSDP's last group

    @property
    def n_layers(self) -> int:
        return round((self.params - self.embedding_params - self.head_params) / self.block_params)


def shape(n_layers: int, vocab_size: int = 128256) -> Shape:
    import torch

    from models import LLAMA3_FLAVORS, Transformer

    args = replace(LLAMA3_FLAVORS["8B"], n_layers=n_layers, vocab_size=vocab_size)
    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in next(iter(model.layers.children())).parameters())
    embedding = model.tok_embeddings.weight.numel()
    return Shape(total, block, embedding, total - n_layers * block - embedding)


@dataclass(frozen=True)
class Parts:
    """One measured row's parts, ms per step on one GPU."""

    precision: str
    step_ms: float
    blocks_ms: float
    optimizer_ms: float


def parts_of(row: dict) -> Parts | None:
    kernels = row.get("kernels") or ""
    opt, steps = OPTIMIZER.search(kernels), STEPS.search(kernels)
    if not (row.get("blocks_ms") and row.get("step_ms") and opt and steps):
        return None
    return Parts(row["precision"], row["step_ms"], row["blocks_ms"], float(opt["ms"]) / int(steps["n"]))


@dataclass(frozen=True)
class Projection:
    blocks_ms: float
    rest_ms: float
    optimizer_ms: float
    exposed_comm_ms: float
    block_comm_ms: float  # one block's all-gathers + reduce-scatter, to compare with its compute
    step_ms: float

    @property
    def tps(self) -> float:
        return SEQ / (self.step_ms / 1e3)


def project(
    p: Parts,
    measured: Shape,
    full: Shape,
    gpus: int = 8,
    link_gbs: float = 350.0,
    fp8_allgather: bool = False,
    comm_slowdown: float = 0.0,
) -> Projection:
    layers_measured, layers_full = measured.n_layers, full.n_layers
    blocks = p.blocks_ms * layers_full / layers_measured * (1 + comm_slowdown)
    rest = p.step_ms - p.blocks_ms - p.optimizer_ms
    optimizer = p.optimizer_ms * (full.params / gpus) / measured.params
    share = (gpus - 1) / gpus

    def ms(params: int, bytes_per: float) -> float:
        return params * bytes_per * share / (link_gbs * 1e9) * 1e3

    gather = 1.0 if fp8_allgather else 2.0  # bytes per block weight on the wire (bf16, or float8 all-gather)
    # forward gather + backward re-gather (reshard after forward) + an fp32 reduce-scatter, per block
    block_comm = 2 * ms(full.block_params, gather) + ms(full.block_params, 4.0)
    block_compute = blocks / layers_full
    # Nothing runs before the embedding's and the first block's all-gathers, nor after the first block's and the
    # embedding's reduce-scatters; the head (norm + output) is gathered during the last block's forward and reduced
    # during its backward; every other block's collectives overlap a neighbour's compute.
    exposed = ms(full.embedding_params, 2.0) + ms(full.block_params, gather)
    exposed += ms(full.block_params, 4.0) + ms(full.embedding_params, 4.0)
    exposed += layers_full * max(block_comm - block_compute, 0.0)
    exposed += max(ms(full.head_params, 2.0) + ms(full.head_params, 4.0) - block_compute, 0.0)
    return Projection(blocks, rest, optimizer, exposed, block_comm, blocks + rest + optimizer + exposed)


def table(rows: list[dict], gpus: int, link_gbs: float, comm_slowdown: float) -> str:
    measured, full = shape(8), shape(32)
    lines = [
        f"PROJECTION (not a measurement): Llama 3 8B, 32 layers, FSDP on {gpus} GPUs, seq {SEQ}, local batch 1, "
        f"from one GPU's llama3_8b_8l rows; link {link_gbs:.0f} GB/s, compute slowed {comm_slowdown:.0%} by NCCL",
        "| row | measured 8L step / blocks / optimizer ms | projected blocks + rest + optimizer + exposed comm ms "
        "| one block's comm / compute ms | projected tokens/s per GPU |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        p = parts_of(row)
        if p is None:
            continue
        for fp8_ag in (False, True) if p.precision == "tensorwise" else (False,):
            pr = project(p, measured, full, gpus, link_gbs, fp8_ag, comm_slowdown)
            name = p.precision + (" + fp8 all-gather" if fp8_ag else "")
            lines.append(
                f"| {name} | {p.step_ms:.1f} / {p.blocks_ms:.1f} / {p.optimizer_ms:.1f} "
                f"| {pr.blocks_ms:.1f} + {pr.rest_ms:.1f} + {pr.optimizer_ms:.1f} + {pr.exposed_comm_ms:.1f} "
                f"= {pr.step_ms:.1f} | {pr.block_comm_ms:.1f} / {pr.blocks_ms / 32:.1f} | {pr.tps:,.0f} |"
            )
    lines.append("Published figures (measured, per GPU):")
    lines += [f"  {tps:>7,}  {what}" for what, tps in ANCHORS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "llama3_8b_8l")
    ap.add_argument("--precision", default=None, help="comma list; default: every profiled row")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--link-gbs", type=float, default=350.0, help="collective bus bandwidth, GB/s")
    ap.add_argument("--comm-slowdown", type=float, default=0.0, help="fraction added to block time by NCCL")
    a = ap.parse_args(argv)
    path = a.results / "results.jsonl"
    if not path.exists():
        ap.error(f"{path} not found: run benchmarks/run.py --preset llama3_8b_8l --profile 2 first")
    latest: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else None
        if row and row.get("engine", "kiln") == "kiln" and parts_of(row):
            latest[row["precision"]] = row
    wanted = a.precision.split(",") if a.precision else list(latest)
    print(table([latest[p] for p in wanted if p in latest], a.gpus, a.link_gbs, a.comm_slowdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
