"""Benchmark matrix: precision recipe x compile x activation checkpointing, one command.

    python benchmarks/run.py --preset cpu            # debug model on the CPU, a few minutes
    python benchmarks/run.py --preset h200           # Llama3 8B widths (4 layers) at seq 8192 on one GPU

Each configuration runs `train.py` in a fresh process (torchrun when --nproc > 1) for warm-up + measured steps with
log_freq 1; the table reports the median tps and mfu of the measured steps, their peak memory, the final loss, and
the speedup over the high-precision baseline row (bf16, else fp32) with the same compile and AC settings. Results go
to benchmarks/results/ as markdown and JSON.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The high-precision baselines name their dtype; the float8 rows keep training.mixed_precision_param = auto
# (bf16 around the float8 matmuls on a GPU, float32 on a CPU, where bf16 is the slower: docs/config.md).
PRECISIONS: dict[str, list[str]] = {
    "bf16": ["--training.mixed_precision_param", "bfloat16"],
    "fp32": ["--training.mixed_precision_param", "float32"],
    "tensorwise": ["--float8.enable_float8_linear", "--float8.recipe_name", "tensorwise"],
    "tensorwise+fp8ag": [
        "--float8.enable_float8_linear",
        "--float8.recipe_name",
        "tensorwise",
        "--float8.enable_fsdp_float8_all_gather",
        "--float8.precompute_float8_dynamic_scale_for_fsdp",
    ],
    "rowwise": ["--float8.enable_float8_linear", "--float8.recipe_name", "rowwise"],
    "rowwise_with_gw_hp": ["--float8.enable_float8_linear", "--float8.recipe_name", "rowwise_with_gw_hp"],
}
AC: dict[str, list[str]] = {
    "none": ["--activation_checkpoint.mode", "none"],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "full": ["--activation_checkpoint.mode", "full"],
}
PRESETS: dict[str, dict] = {
    # The debug model, small enough for 2 CPU cores; MFU is n/a on a CPU.
    "cpu": dict(
        config="train_configs/debug_model.toml",
        nproc=1,
        warmup=2,
        steps=6,
        args=["--training.seq_len", "512", "--training.local_batch_size", "4"],
        compile=[False],
        ac=["none", "op"],
        precision=["fp32", "tensorwise", "rowwise", "rowwise_with_gw_hp"],
    ),
    # Llama3 8B widths (dim 4096, 32 heads, 8 kv heads, FFN 14336, vocab 128256), 4 layers so it fits one GPU.
    "h200": dict(
        config="train_configs/llama3_8b.toml",
        nproc=1,
        warmup=5,
        steps=15,
        args=[
            "--model.tokenizer_path",
            "assets/tokenizer/tokenizer.model",
            "--model.n_layers",
            "4",
            "--model.vocab_size",
            "128256",
            "--training.dataset",
            "kiln_corpus",
            "--training.seq_len",
            "8192",
            "--training.local_batch_size",
            "1",
            "--metrics.enable_tensorboard=false",
            "--profiling.enable_profiling=false",
        ],
        compile=[False, True],
        ac=["none", "op", "full"],
        precision=["bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp"],
    ),
}

STEP = re.compile(
    r"step: +(?P<step>\d+)  loss: +(?P<loss>[\d.]+)  memory: +(?P<mem>[\d.]+)GiB\([\d.]+%\)  "
    r"tps: (?P<tps>[\d,]+)  mfu: (?P<mfu>n/a|[\d.]+%)"
)


@dataclass
class Row:
    precision: str
    compile: bool
    ac: str
    tps: float | None = None
    mfu: float | None = None
    memory_gib: float | None = None
    final_loss: float | None = None
    speedup: float | None = None
    error: str | None = None


def run_one(row: Row, preset: dict, extra: list[str], log_dir: Path) -> Row:
    """Train warm-up + measured steps in a fresh process and fill `row` from its step lines."""
    total = preset["warmup"] + preset["steps"]
    args = [
        "--job.config_file",
        preset["config"],
        "--training.steps",
        str(total),
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(log_dir / "outputs"),
        *preset["args"],
        *PRECISIONS[row.precision],
        *AC[row.ac],
        f"--training.compile={str(row.compile).lower()}",
        *extra,
    ]
    if preset["nproc"] > 1:
        cmd = ["torchrun", f"--nproc_per_node={preset['nproc']}", "--rdzv_endpoint=localhost:0", "train.py", *args]
    else:
        cmd = [sys.executable, "train.py", *args]
    name = f"{row.precision}-compile{int(row.compile)}-ac_{row.ac}"
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (log_dir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    steps = [m.groupdict() for m in map(STEP.search, proc.stdout.splitlines()) if m]
    measured = [s for s in steps if int(s["step"]) > preset["warmup"]]
    if proc.returncode != 0 or not measured:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        row.error = f"exit {proc.returncode}: {tail[0][:200]}"
        return row
    row.tps = statistics.median(float(s["tps"].replace(",", "")) for s in measured)
    mfus = [float(s["mfu"].rstrip("%")) for s in measured if s["mfu"] != "n/a"]
    row.mfu = statistics.median(mfus) if mfus else None
    row.memory_gib = max(float(s["mem"]) for s in measured)
    row.final_loss = float(measured[-1]["loss"])
    return row


def add_speedups(rows: list[Row]) -> None:
    """Speed-up over the high-precision baseline (bf16 if it ran, else fp32) with the same compile and AC."""
    name = next((p for p in ("bf16", "fp32") if any(r.precision == p for r in rows)), None)
    base = {(r.compile, r.ac): r.tps for r in rows if r.precision == name and r.tps}
    for r in rows:
        if r.tps and base.get((r.compile, r.ac)):
            r.speedup = r.tps / base[(r.compile, r.ac)]


def to_markdown(rows: list[Row], header: str) -> str:
    def fmt(v: float | None, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    lines = [
        header,
        "",
        "| precision | compile | AC | tps (median) | mfu | peak memory GiB | final loss | vs baseline |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.precision} | {r.compile} | {r.ac} | failed: {r.error} | | | | |")
            continue
        mfu = "n/a" if r.mfu is None else f"{r.mfu:.2f}%"
        lines.append(
            f"| {r.precision} | {r.compile} | {r.ac} | {fmt(r.tps, ',.0f')} | {mfu} | {fmt(r.memory_gib, '.2f')} "
            f"| {fmt(r.final_loss, '.4f')} | {fmt(r.speedup, '.2f')}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--precision", help="comma list; default: the preset's", default=None)
    ap.add_argument("--ac", help="comma list of none,op,full; default: the preset's", default=None)
    ap.add_argument("--compile", choices=["on", "off", "both"], default=None)
    ap.add_argument("--nproc", type=int, default=None, help="processes (torchrun) per run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("extra", nargs="*", help="more train.py overrides, after --")
    a = ap.parse_args()
    preset = dict(PRESETS[a.preset])
    if a.nproc:
        preset["nproc"] = a.nproc
    precisions = a.precision.split(",") if a.precision else preset["precision"]
    acs = a.ac.split(",") if a.ac else preset["ac"]
    compiles = {"on": [True], "off": [False], "both": [False, True], None: preset["compile"]}[a.compile]
    for p in precisions:
        if p not in PRECISIONS:
            ap.error(f"unknown precision '{p}'; choose from {', '.join(PRECISIONS)}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = a.out / f"{a.preset}-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for compile_, ac, precision in itertools.product(compiles, acs, precisions):
        row = run_one(Row(precision, compile_, ac), preset, a.extra, log_dir)
        print(
            f"{precision:>20} compile={compile_!s:5} ac={ac:4} tps={row.tps} mem={row.memory_gib} "
            f"loss={row.final_loss} {row.error or ''}",
            flush=True,
        )
        rows.append(row)
    add_speedups(rows)
    header = (
        f"### preset `{a.preset}`, {datetime.date.today()}, {preset['warmup']} warm-up + {preset['steps']} "
        f"measured steps, nproc {preset['nproc']}, `{' '.join(preset['args'] + a.extra)}`"
    )
    md = to_markdown(rows, header)
    (log_dir / "results.md").write_text(md)
    (log_dir / "results.json").write_text(
        json.dumps(
            {
                "preset": a.preset,
                "date": str(datetime.date.today()),
                "settings": preset,
                "host": os.uname().nodename,
                "rows": [asdict(r) for r in rows],
            },
            indent=2,
        )
    )
    print(md)
    print(f"written: {log_dir}/results.md and results.json")


if __name__ == "__main__":
    main()
