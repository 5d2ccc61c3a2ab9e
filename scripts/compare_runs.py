"""Compare two training logs step by step: loss and grad norm, max/mean relative difference vs --rtol.

The first log is the reference: relative difference = |b - a| / |a| per step.

    python scripts/compare_runs.py bf16.log float8.log --rtol 0.05

Reads kiln's (and torchtitan's) step lines, `step: N  loss: X ... grad_norm: Y`, from anywhere in a line
(torchrun prefixes like `[rank0]:` are fine; ANSI colours are stripped). Only steps present in both logs
are compared. Exit status: 0 within tolerance, 1 past it, 2 for unreadable input.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log_a")
    ap.add_argument("log_b")
    ap.add_argument("--rtol", type=float, default=0.05, help="max allowed relative difference (default 0.05)")
    ap.add_argument("--grad-norm-rtol", type=float, default=None, help="separate tolerance for grad norms")
    args = ap.parse_args(argv)
    try:
        a, b = parse_log(args.log_a), parse_log(args.log_b)
    except OSError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    common = sorted(set(a) & set(b))
    if not common:
        print(
            f"compare_runs: error: no common step lines ({len(a)} in {args.log_a}, {len(b)} in {args.log_b})",
            file=sys.stderr,
        )
        return 2
    print(f"compared {len(common)} steps ({common[0]}..{common[-1]})")
    failed = False
    for metric, r in compare(a, b).items():
        tol = args.rtol if metric == "loss" or args.grad_norm_rtol is None else args.grad_norm_rtol
        verdict = "ok" if r["max"] <= tol else "FAIL"
        failed |= verdict == "FAIL"
        stats = f"max rel diff {r['max']:.4%} (step {r['max_step']})  mean {r['mean']:.4%}"
        print(f"{metric:<10} {stats}  rtol {tol:.2%}  {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
