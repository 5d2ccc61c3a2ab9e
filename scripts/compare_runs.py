"""Compare training logs step by step: loss and grad norm, max/mean relative difference vs --rtol.

The first log is the reference: relative difference = |b - a| / |a| per step; each further log is compared
with it. `--plot out.png` draws the loss curves and each run's relative loss gap to the first (needs
matplotlib: `pip install -e '.[plots]'`).

    python scripts/compare_runs.py bf16.log float8.log --rtol 0.05
    python scripts/compare_runs.py bf16.log tensorwise.log mxfp8.log --plot docs/loss.png

Reads kiln's (and torchtitan's) step lines, `step: N  loss: X ... grad_norm: Y`, from anywhere in a line
(torchrun prefixes like `[rank0]:` are fine; ANSI colours are stripped). Only steps present in both logs
are compared. Exit status: 0 within tolerance, 1 past it, 2 for unreadable input.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+\w.]+)")
GRAD_NORM = re.compile(r"grad_norm:\s*([-+\w.]+)")


def parse_log(path: str) -> dict[int, tuple[float, float | None]]:
    """{step: (loss, grad_norm or None)}; a later line for the same step wins (resumed runs)."""
    out: dict[int, tuple[float, float | None]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = ANSI.sub("", line)
            m = STEP.search(line)
            if m:
                g = GRAD_NORM.search(line)
                out[int(m.group(1))] = (float(m.group(2)), float(g.group(1)) if g else None)
    return out


def rel_diff(ref: float, x: float) -> float:
    """|x - ref| / |ref|: the first log is the reference (e.g. the bf16 run)."""
    return abs(x - ref) / max(abs(ref), 1e-12)


def compare(a: dict[int, tuple[float, float | None]], b: dict[int, tuple[float, float | None]]) -> dict[str, dict]:
    """Per metric: max and mean relative difference over the common steps, and the step of the max."""
    steps = sorted(set(a) & set(b))
    result = {}
    for i, metric in enumerate(("loss", "grad_norm")):
        diffs = [(rel_diff(a[s][i], b[s][i]), s) for s in steps if a[s][i] is not None and b[s][i] is not None]
        if diffs:
            worst = max(diffs)
            result[metric] = {"max": worst[0], "max_step": worst[1], "mean": sum(d for d, _ in diffs) / len(diffs)}
    return result


def plot(runs: dict[str, dict[int, tuple[float, float | None]]], path: str) -> None:
    """Loss curves (top) and each run's relative loss gap to the first, in % (bottom), as a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    ref = runs[names[0]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 5.2), sharex=True, height_ratios=(2, 1))
    for i, (name, log) in enumerate(runs.items()):
        steps, color = sorted(log), f"C{i}"  # one colour per run in both panels
        top.plot(steps, [log[s][0] for s in steps], label=name, linewidth=1, color=color)
        if i:
            common = sorted(set(log) & set(ref))
            gaps = [100 * (log[s][0] - ref[s][0]) / abs(ref[s][0]) for s in common]
            bottom.plot(common, gaps, label=name, linewidth=1, color=color)
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel(f"gap to {names[0]} (%)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", help="two or more logs; the first is the reference")
    ap.add_argument("--rtol", type=float, default=0.05, help="max allowed relative difference (default 0.05)")
    ap.add_argument("--grad-norm-rtol", type=float, default=None, help="separate tolerance for grad norms")
    ap.add_argument("--plot", default=None, help="write loss curves and gaps to this PNG (needs matplotlib)")
    ap.add_argument("--labels", default=None, help="comma-separated run names for the plot (default: file names)")
    args = ap.parse_args(argv)
    if len(args.logs) < 2:
        print("compare_runs: error: give at least two logs (the first is the reference)", file=sys.stderr)
        return 2
    labels = args.labels.split(",") if args.labels else [os.path.basename(p) for p in args.logs]
    if len(labels) != len(args.logs):
        print(f"compare_runs: error: {len(labels)} labels for {len(args.logs)} logs", file=sys.stderr)
        return 2
    try:
        logs = [parse_log(p) for p in args.logs]
    except OSError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    a = logs[0]
    failed = False
    for path, b in zip(args.logs[1:], logs[1:]):
        common = sorted(set(a) & set(b))
        if not common:
            print(
                f"compare_runs: error: no common step lines ({len(a)} in {args.logs[0]}, {len(b)} in {path})",
                file=sys.stderr,
            )
            return 2
        print(
            f"{path}: compared {len(common)} steps ({common[0]}..{common[-1]})"
            if len(logs) > 2
            else f"compared {len(common)} steps ({common[0]}..{common[-1]})"
        )
        for metric, r in compare(a, b).items():
            tol = args.rtol if metric == "loss" or args.grad_norm_rtol is None else args.grad_norm_rtol
            verdict = "ok" if r["max"] <= tol else "FAIL"
            failed |= verdict == "FAIL"
            stats = f"max rel diff {r['max']:.4%} (step {r['max_step']})  mean {r['mean']:.4%}"
            print(f"{metric:<10} {stats}  rtol {tol:.2%}  {verdict}")
    if args.plot:
        try:
            plot(dict(zip(labels, logs)), args.plot)
        except ImportError:
            print("compare_runs: error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
