"""An MoE's load imbalance over a run, with and without balancing (docs/moe.md, "Load balancing: measured").

    python benchmarks/moe_balance.py [--settings none,bias=1e-3,aux=0.01] [--out DIR] [train.py arguments ...]

Trains qwen3 `debugmodel_moe` once per setting, each in a fresh one-rank process (train.py, the debug config's
corpus and seed 42, so every setting starts from the same weights and reads the same batches), 100 steps of 4 x 256
tokens in float32 with every step logged unless the arguments say otherwise, and reads `moe_imbalance` from each
step line: over the MoE layers the largest max/mean of a layer's tokens per expert (1.0 is perfect balance;
experts / top_k = 4 means every token chose the same experts). Settings: `none` (no balancing), `bias=C`
(model.moe_load_balance_coeff C: the auxiliary-loss-free expert bias), `aux=C` (model.moe_aux_loss_coeff C), joined
by `+` to combine them (`bias=1e-3+aux=0.01`). Prints one markdown row per setting: the imbalance at steps 1, 10,
50 and the last, its mean over the last 20 steps, the final loss and the run's wall time; each run's log goes to
--out.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"bias": "--model.moe_load_balance_coeff", "aux": "--model.moe_aux_loss_coeff"}
STEP = re.compile(r"step: +(?P<step>\d+)  loss: +(?P<loss>[\d.]+).*moe_imbalance: (?P<imbalance>[\d.]+)")
RUN = [
    *("--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")),
    *("--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--training.steps", "100"),
    *("--training.seq_len", "256", "--training.local_batch_size", "4", "--training.mixed_precision_param", "float32"),
    *("--activation_checkpoint.mode", "none", "--metrics.log_freq", "1"),
]


def setting_args(setting: str) -> list[str]:
    """train.py arguments of one setting: none, bias=C, aux=C, or several joined by '+'."""
    if setting == "none":
        return []
    args = []
    for part in setting.split("+"):
        name, _, value = part.partition("=")
        if name not in KEYS or not value:
            raise ValueError(f"--settings: '{part}' is not none, bias=C or aux=C")
        args += [KEYS[name], str(float(value))]
    return args


def imbalance_row(setting: str, log: str) -> str:
    """One markdown row from a run's step lines: imbalance at steps 1, 10, 50 and the last, the mean of the last
    20 steps, the final loss."""
    steps = {int(m["step"]): (float(m["imbalance"]), float(m["loss"])) for m in map(STEP.search, log.splitlines()) if m}
    if not steps:
        last_line = [line for line in log.splitlines() if line.strip()][-1:] or ["no output"]
        return f"| {setting} | failed: {last_line[0][:160]} | | | | | |"
    last = max(steps)
    at = [f"{steps[s][0]:.3f}" if s in steps else "—" for s in (1, 10, 50, last)]
    late = statistics.mean(steps[s][0] for s in sorted(steps)[-20:])
    return f"| {setting} | {' | '.join(at)} | {late:.3f} | {steps[last][1]:.4f} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="none,bias=1e-3,aux=0.01", help="comma list of none, bias=C, aux=C")
    p.add_argument("--out", type=Path, default=Path("/tmp/kiln_moe_balance"), help="logs and dump folders")
    a, rest = p.parse_known_args(argv)
    settings = a.settings.split(",")
    try:
        extra = {s: setting_args(s) for s in settings}
    except ValueError as e:
        p.error(str(e))
    print("| setting | step 1 | step 10 | step 50 | last step | mean of the last 20 | final loss | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for setting in settings:
        name = re.sub(r"[^\w.=+-]", "_", setting)
        cmd = [sys.executable, "train.py", *RUN, "--job.dump_folder", str(a.out / name), *extra[setting], *rest]
        t0 = time.perf_counter()
        # OMP_WAIT_POLICY PASSIVE unless set, as run_train.sh: spinning OpenMP threads on shared cores cost 8x.
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"{name}.log").write_text(log)
        print(f"{imbalance_row(setting, log)} {time.perf_counter() - t0:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
