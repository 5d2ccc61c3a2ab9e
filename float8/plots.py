"""PNG heatmaps (layer x step) of the float8 numerics observatory's JSONL: the lowest operand SQNR and the highest
operand underflow of each layer at each logged step. matplotlib is optional (`pip install -e '.[plots]'`) and
imported only here, when a heatmap is drawn."""

from __future__ import annotations

import json
import math

OPERANDS = ("input", "weight", "grad_output")


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def heatmap_grids(records: list[dict]) -> tuple[list[str], list[int], list[list[float]], list[list[float]]]:
    """(layers, steps, min SQNR dB [layer][step], max underflow % [layer][step]); NaN where not measured."""
    layers = list(dict.fromkeys(r["layer"] for r in records))
    steps = sorted({r["step"] for r in records})
    sqnr = [[math.nan] * len(steps) for _ in layers]
    under = [[math.nan] * len(steps) for _ in layers]
    li, si = {n: i for i, n in enumerate(layers)}, {s: i for i, s in enumerate(steps)}
    for r in records:
        ops = [r[o] for o in OPERANDS if o in r]
        if ops:
            finite = [o["sqnr_db"] for o in ops if o["sqnr_db"] is not None]  # null = exact: left blank
            sqnr[li[r["layer"]]][si[r["step"]]] = min(finite) if finite else math.nan
            under[li[r["layer"]]][si[r["step"]]] = 100 * max(o["underflow"] for o in ops)
    return layers, steps, sqnr, under


def write_heatmap(jsonl_path: str, png_path: str) -> None:
    """Two panels, layers down, logged steps across: lowest SQNR over the operands, highest underflow (%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, steps, sqnr, under = heatmap_grids(read_jsonl(jsonl_path))
    height = 1.2 + 0.16 * len(layers)
    fig, axes = plt.subplots(1, 2, figsize=(9, height), sharey=True)
    for ax, grid, title, cmap in (
        (axes[0], sqnr, "lowest operand SQNR (dB)", "viridis"),
        (axes[1], under, "highest operand underflow (%)", "magma_r"),
    ):
        im = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=6)
        ax.set_xlabel("step", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.05)
    axes[0].set_yticks(range(len(layers)), layers, fontsize=6)
    fig.tight_layout()
    fig.savefig(png_path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    write_heatmap(sys.argv[1], sys.argv[2])
