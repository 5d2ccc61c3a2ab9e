"""What a checkpoint save costs the training loop, per checkpoint.async_mode: the stall of a save step, in ms (that
step's time minus a normal step's), and whether a save waits for the previous one's background write.

    python benchmarks/checkpoint_stall.py [--dim 512] [--layers 8] [--interval 4] [--steps 13] [--verbose]

One run per async_mode, each in a fresh process (the Trainer, one rank, float32, seq 32, batch 2; the debug config
with --model.dim/--model.n_layers: 27.5 M parameters, a 357 MB full checkpoint by default), saving every
`--interval` steps. A step's time is wall clock from one step's start to the next one's, so it holds the save kiln
makes after the step (the checkpoint hook) and, under async, the publication of a finished background write.
Normal step: the median of steps 2 .. interval-1 (before any save; step 1 warms up). Beside a write: the median
of the later steps that save nothing (under async a background write shares the cores with them). The last step
is not measured: its save is always synchronous (nothing runs after it). kiln's own line for each save
(`Saved checkpoint ... in 2.10 s: 357 MB, training stalled 40 ms (30 ms of it waiting for its write to finish)`)
gives the size, the save's whole time, and the part a later step spent waiting for the write: the next save (one
in flight at a time) or the end of training came before the write had finished.

Wall clock on a shared machine measures the other jobs too: run it on an idle one, and read the spread.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("disabled", "async", "async_with_pinned_mem")
SAVED = re.compile(
    r"Saved checkpoint \S*step-(\d+) in ([\d.]+) s(?: \(async\))?: ([\d.]+) (MB|GB).*?training stalled (\d+) ms"
    r"(?: \((\d+) ms of it waiting)?"
)


def train_args(dim: int, layers: int, steps: int, interval: int, mode: str, dump: str) -> list[str]:
    return [
        *("--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder", dump),
        *("--model.dim", str(dim), "--model.n_layers", str(layers), "--training.steps", str(steps)),
        *(
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.mixed_precision_param",
            "float32",
        ),
        *("--activation_checkpoint.mode", "none", "--metrics.log_freq", "1000"),
        *("--checkpoint.enable_checkpoint", "--checkpoint.interval", str(interval), "--checkpoint.async_mode", mode),
    ]


def one_run(argv: list[str]) -> None:
    """In the child: train, and print one JSON line with each step's time and kiln's save lines."""
    sys.path.insert(0, str(ROOT))
    from kiln_base.config import parse_args
    from trainer.hooks import StepHook
    from trainer.trainer import Trainer

    class Clock(StepHook):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def pre_step(self, step: int) -> None:
            self.starts.append(time.perf_counter())

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.basicConfig(level=logging.WARNING)
    log = logging.getLogger("kiln")
    log.setLevel(logging.INFO)
    log.addHandler(Lines())
    trainer = Trainer(parse_args(argv))
    clock = Clock()
    try:
        trainer.train(extra_hooks=[clock])
    finally:
        trainer.close()
    step_ms = [1e3 * (b - a) for a, b in zip(clock.starts, clock.starts[1:])]  # steps 1..N-1
    saves = [line for line in lines if line.startswith(("Saved checkpoint", "Checkpoint "))]
    print("RESULT " + json.dumps({"step_ms": step_ms, "saves": saves}))


def measure(mode: str, interval: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="kiln-stall-") as dump:
        argv = train_args(args.dim, args.layers, args.steps, interval, mode, dump)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
        out = subprocess.run(
            [sys.executable, __file__, "--one", *argv], env=env, capture_output=True, text=True, check=False
        )
    result = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    if out.returncode != 0 or result is None:
        raise SystemExit(f"{mode} interval {interval} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    data = json.loads(result[len("RESULT ") :])
    step_ms = data["step_ms"]  # step_ms[i] is step i + 1's
    save_steps = list(range(interval, args.steps, interval))
    normal = statistics.median(step_ms[1 : interval - 1])  # steps 2 .. interval-1: before any save
    beside = [t for i, t in enumerate(step_ms, 1) if i > interval and i % interval != 0]
    stalls = [step_ms[s - 1] - normal for s in save_steps]
    saved = [SAVED.search(line) for line in data["saves"]]
    found = [m for m in saved if m is not None]
    waits = [int(m.group(6) or 0) for m in found if int(m.group(1)) < args.steps]
    size = found[0].group(3) + " " + found[0].group(4) if found else "?"
    return {
        "mode": mode,
        "normal_ms": normal,
        "beside_ms": statistics.median(beside) if beside else float("nan"),
        "stall_ms": stalls,
        "waited_ms": waits,
        "save_s": [float(m.group(2)) for m in found if int(m.group(1)) < args.steps],
        "kiln_stall_ms": [int(m.group(5)) for m in found if int(m.group(1)) < args.steps],
        "size": size,
        "lines": data["saves"],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one_run(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--interval", type=int, default=4, help="checkpoint.interval (at least 3)")
    parser.add_argument("--steps", type=int, default=13, help="steps per run; the last one's save is not measured")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--verbose", action="store_true", help="print kiln's save lines too")
    args = parser.parse_args()
    if args.interval < 3 or args.steps <= args.interval:
        parser.error("--interval needs 3 or more (steps 2 .. interval-1 are the normal ones), --steps more than it")
    print(
        "| async_mode | checkpoint | normal step | beside a write | stall per save step (step - normal) | "
        "kiln's stall | of it waiting for the write | save's whole time |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def ms(values: list) -> str:
        return ", ".join(f"{v:.0f}" for v in values) + " ms"

    for mode in args.modes.split(","):
        r = measure(mode, args.interval, args)
        print(
            f"| {mode} | {r['size']} | {r['normal_ms']:.0f} ms | {r['beside_ms']:.0f} ms | {ms(r['stall_ms'])} | "
            f"{ms(r['kiln_stall_ms'])} | {ms(r['waited_ms'])} | " + ", ".join(f"{s:.2f}" for s in r["save_s"]) + " s |",
            flush=True,
        )
        if args.verbose:
            for line in r["lines"]:
                print("    " + line)


if __name__ == "__main__":
    main()
