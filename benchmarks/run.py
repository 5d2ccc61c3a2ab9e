"""Benchmark matrix: precision recipe x compile x activation checkpointing, one row per process, in slices.

    python benchmarks/run.py --preset tiny --out /tmp/bench                 # CPU demo, seconds per row
    python benchmarks/run.py --preset llama3_8b_8l --list                   # the rows, with their index and id
    python benchmarks/run.py --preset llama3_8b_8l --rows 0-1 --timeout 280 # a slice that fits a 10-minute command
    python benchmarks/run.py --preset llama3_8b_8l --skip-done              # every row not yet in --out
    python benchmarks/run.py --preset llama3_8b_8l --summary                # the table of all rows in --out
    python benchmarks/run.py --preset llama3_8b_8l --engine torchtitan      # torchtitan 0.2.2, same shape and rows
    python benchmarks/run.py --preset qwen3_30b_a3b_4l --check              # each row's dry run, here on a CPU

Each row runs benchmarks/row.py (train.py's Trainer plus a timer of the transformer blocks) in a fresh process
(torchrun when --nproc > 1) for --warmup + --steps steps with log_freq 1, killed after --timeout seconds.
As soon as a row ends it is appended to `<out>/results.jsonl` (one JSON object per row) and `<out>/results.md`
(one table line), and printed; its log goes to `<out>/logs/`. So a run cut short keeps every finished row, and
later runs with other --rows add to the same files. A row reports the median tps and mfu of the measured steps,
their peak memory, the final loss, the whole step's time (tokens per step / tps) and the transformer blocks'
forward+backward time inside it, and both as speedups over the bf16 row with the same compile/AC/nproc. MFU and
TFLOP/s come under both FLOP conventions (attention counted in full, as torchtitan and PaLM do; causal, as
Megatron-LM does: docs/metrics.md), read from the row's start-up line, so a row compares with either family of
published numbers; a torchtitan row (full) gets its causal figures from a kiln row of the same preset.
`--engine torchtitan` runs the same rows with torchtitan 0.2.2 (gpu_bundle/torchtitan/run.sh, made by
scripts/prepare_gpu_run.py; presets with `torchtitan: True`), into the same files, for side-by-side rows.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The high-precision baselines name their dtype; the float8 rows keep training.mixed_precision_param = auto
# (bf16 around the float8 matmuls on a GPU, float32 on a CPU, where bf16 is the slower: docs/config.md).
PRECISIONS: dict[str, list[str]] = {
    "bf16": [],  # no float8: the baseline (bf16 compute, or fp32 where the preset says so)
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
    # MXFP8 (32-element blocks, e8m0 scales): Blackwell (SM100) only; kiln refuses it on an H100/H200.
    "mxfp8_rceil": ["--float8.enable_float8_linear", "--float8.recipe_name", "mxfp8_rceil"],
}
AC: dict[str, list[str]] = {
    "none": ["--activation_checkpoint.mode", "none"],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "full": ["--activation_checkpoint.mode", "full"],
}
LLAMA3_8B_WIDTHS = [
    "--model.tokenizer_path",
    "assets/tokenizer/tokenizer.model",
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
]
# Qwen3-30B-A3B widths (models/args.py: dim 2048, 32 heads of 128, 4 KV heads, 128 experts of width 768, top 8, no
# shared experts) with Qwen's 151,936-token vocabulary over the bundled tokenizer's ids. float8 converts the
# Linears only (attention's q/k/v/o; the routed experts' grouped GEMMs stay bf16: float8 on the experts is not on
# main yet) and keeps the routers' gates (128 outputs) high precision besides the output layer.
QWEN3_30B_A3B_WIDTHS = [
    *("--model.name", "qwen3", "--model.flavor", "30B-A3B"),
    *("--model.tokenizer_path", "assets/tokenizer/tokenizer.model", "--model.vocab_size", "151936"),
    *("--training.dataset", "kiln_corpus", "--training.seq_len", "4096", "--training.local_batch_size", "2"),
    *("--metrics.enable_tensorboard=false", "--profiling.enable_profiling=false"),
    *("--float8.filter_fqns", "output,router.gate"),
]
PRESETS: dict[str, dict] = {
    # Seconds per row on a CPU: shows the harness and its output, not float8 speed (a CPU has no float8 units).
    "tiny": dict(
        config="train_configs/debug_model.toml",
        nproc=1,
        warmup=1,
        steps=3,
        timeout=600,
        args=["--training.seq_len", "64", "--training.local_batch_size", "2", "--model.n_layers", "2"]
        + ["--training.mixed_precision_param", "float32"],  # fp32 baseline: bf16 is 0.06x fp32 on AVX2
        compile=[False],
        ac=["none"],
        precision=["bf16", "tensorwise", "rowwise"],
    ),
    # The debug model, small enough for 2 CPU cores; MFU is n/a on a CPU.
    "cpu": dict(
        config="train_configs/debug_model.toml",
        nproc=1,
        warmup=2,
        steps=6,
        timeout=900,
        args=["--training.seq_len", "512", "--training.local_batch_size", "4"],
        compile=[False],
        ac=["none", "op"],
        precision=["fp32", "tensorwise", "rowwise", "rowwise_with_gw_hp"],
    ),
    # qwen3 debugmodel_moe (4 layers, 8 experts of width 128, top 2) on a CPU, float32: one rank, or with
    # `--nproc 2 -- --training.local_batch_size 2 --parallelism.expert_parallel_degree 2` EP 2 on the same global
    # batch (docs/performance.md, "MoE on a CPU").
    "cpu_moe": dict(
        config="train_configs/debug_model.toml",
        nproc=1,
        warmup=2,
        steps=8,
        timeout=600,
        args=["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--training.seq_len", "256"]
        + ["--training.local_batch_size", "4", "--training.mixed_precision_param", "float32"],
        compile=[False],
        ac=["none"],
        precision=["bf16"],  # no float8; float32 compute from the args
    ),
    # Qwen3-30B-A3B widths with 4 of its 48 layers on one GPU: 3.1 B parameters (2.4 B of them experts), 50 GB of
    # fp32 weights, gradients and AdamW state; compiled, per-op SAC, 2 x 4096 tokens a step (512 rows per expert
    # on average). bf16 against Linear-only float8 rowwise; MXFP8 where the GPU has it (scripts/gpu_speed.sh moe).
    "qwen3_30b_a3b_4l": dict(
        config="train_configs/llama3_8b.toml",
        nproc=1,
        warmup=3,
        steps=5,
        timeout=400,
        args=["--model.n_layers", "4", *QWEN3_30B_A3B_WIDTHS],
        compile=[True],
        ac=["op"],
        precision=["bf16", "rowwise", "mxfp8_rceil"],
    ),
    # Llama3 8B widths (dim 4096, 32 heads, 8 kv heads, FFN 14336, vocab 128256), 4 layers, seq 8192, one GPU.
    "h200": dict(
        config="train_configs/llama3_8b.toml",
        nproc=1,
        warmup=5,
        steps=15,
        timeout=540,
        args=["--model.n_layers", "4", *LLAMA3_8B_WIDTHS],
        compile=[False, True],
        ac=["none", "op", "full"],
        precision=["bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp"],
    ),
    # Where float8's gain is measurable: Llama3 8B widths with as many layers as one 80 GB GPU holds under per-op
    # SAC (8: 2.8 B parameters, 45 GB of fp32 weights, gradients and AdamW state; ~5 GB of saved activations;
    # the logits of 128,256 tokens x 8192), compiled, seq 8192, local batch 1. The blocks are ~75% of the
    # FLOPs (the output layer and loss stay bf16), and the report shows their time apart from the whole step.
    "llama3_8b_8l": dict(
        config="train_configs/llama3_8b.toml",
        nproc=1,
        warmup=4,
        steps=8,
        timeout=540,
        args=["--model.n_layers", "8", *LLAMA3_8B_WIDTHS],
        compile=[True],
        ac=["op"],
        precision=["bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp"],
        torchtitan=True,  # gpu_bundle/torchtitan/llama3_8b_8l.toml is this shape
    ),
}
TORCHTITAN_RUN = ROOT / "gpu_bundle" / "torchtitan" / "run.sh"
TORCHTITAN_AC = {
    "none": ["--activation_checkpoint.mode", "none"],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "full": ["--activation_checkpoint.mode", "full"],
}

STEP = re.compile(
    r"step: +(?P<step>\d+)  loss: +(?P<loss>[\d.]+)  memory: +(?P<mem>[\d.]+)GiB\([\d.]+%\)  "
    r"tps: (?P<tps>[\d,]+)  mfu: (?P<mfu>n/a|[\d.]+%)"
)
# torchtitan 0.2.2's step line (metrics.disable_color_printing): step, loss, grad_norm, memory, tps, tflops, mfu.
TT_STEP = re.compile(
    r"step: +(?P<step>\d+)  loss: +(?P<loss>[\d.]+)  grad_norm: +[\d.]+  memory: +(?P<mem>[\d.]+)GiB\([\d.]+%\)  "
    r"tps: (?P<tps>[\d,]+)  tflops: [\d,.]+  mfu: (?P<mfu>[\d.]+%)"
)
# kiln's start-up line: both FLOP counts per token and the one its step line's mfu used (trainer/build.py).
FLOPS = re.compile(
    r"FLOPs/token: (?P<full>[\d.]+) G attention full .*?, (?P<causal>[\d.]+) G causal .*?"
    r"MFU and TFLOP/s count (?P<used>full|causal)"
)
ACTIVE = re.compile(r"  active: (?P<active>[\d.]+)GiB")  # kiln's step line on CUDA: peak active memory
MFU_FP8 = re.compile(r"  mfu_fp8: (?P<mfu_fp8>[\d.]+)%")  # kiln's step line with float8 on: against the fp8 peak
BLOCKS = re.compile(r"blocks: (?P<total>[\d.]+) ms per step \(forward (?P<fwd>[\d.]+), backward (?P<bwd>[\d.]+);")


@dataclass
class Row:
    preset: str
    precision: str
    compile: bool
    ac: str
    nproc: int
    warmup: int
    steps: int
    tokens_per_step: int  # per device: local batch x seq_len x gradient accumulation (1 in the presets)
    tps: float | None = None
    mfu: float | None = None  # as the step line printed it (kiln: metrics.attention_flops; torchtitan: full)
    gflops_per_token: float | None = None  # attention counted in full (torchtitan, PaLM)
    gflops_per_token_causal: float | None = None  # attention counted causal (Megatron-LM)
    mfu_full: float | None = None
    mfu_causal: float | None = None
    tflops_full: float | None = None  # per device: tps x FLOPs/token
    tflops_causal: float | None = None
    memory_gib: float | None = None  # peak reserved (both engines' step line)
    memory_active_gib: float | None = None  # peak active (kiln on CUDA)
    mfu_fp8: float | None = None  # kiln with float8: median mfu against the float8 peak
    final_loss: float | None = None
    step_ms: float | None = None  # whole step: tokens_per_step / tps
    blocks_ms: float | None = None  # transformer blocks' forward + backward inside the step
    blocks_fwd_ms: float | None = None
    blocks_bwd_ms: float | None = None
    speedup: float | None = None  # tps over the bf16 row with the same compile/AC/nproc
    blocks_speedup: float | None = None  # bf16 row's blocks_ms over this row's
    measured_steps: int = 0
    error: str | None = None
    wall_s: float | None = None
    date: str = field(default_factory=lambda: datetime.datetime.now().isoformat(timespec="seconds"))
    host: str = field(default_factory=lambda: os.uname().nodename)
    args: list[str] = field(default_factory=list)
    engine: str = "kiln"  # or "torchtitan"
    profile: int = 0  # steps profiled after the measured ones (kiln), their kernel-time line below
    kernels: str | None = None

    @property
    def id(self) -> str:
        return row_id(self.precision, self.compile, self.ac, self.engine)


def row_id(precision: str, compile: bool, ac: str, engine: str = "kiln") -> str:
    name = f"{precision}/{'compile' if compile else 'eager'}/ac-{ac}"
    return name if engine == "kiln" else f"{engine}:{name}"


def _flag(args: list[str], key: str, default: str) -> str:
    """The last value given to `--key` (or `--key=value`) in a train.py argument list."""
    value = default
    for i, a in enumerate(args):
        if a == key and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(key + "="):
            value = a.split("=", 1)[1]
    return value


def train_args(row: Row, preset: dict, extra: list[str], dump: Path) -> list[str]:
    return [
        "--job.config_file",
        preset["config"],
        "--training.steps",
        str(row.warmup + row.steps + row.profile),
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(dump),
        *preset["args"],
        *PRECISIONS[row.precision],
        *AC[row.ac],
        f"--training.compile={str(row.compile).lower()}",
        *extra,
    ]


def run_one(row: Row, preset: dict, extra: list[str], out: Path, timeout: float) -> Row:
    """Train warm-up + measured steps in a fresh process (killed after `timeout` s) and fill `row`."""
    name = row.id.replace("/", "_").replace(":", "_")
    if row.engine == "torchtitan":
        compile_flag = "--compile.enable" if row.compile else "--compile.no-enable"
        row.args = [*TORCHTITAN_AC[row.ac], compile_flag, "--job.dump_folder", str(out / "outputs" / name), *extra]
        cmd = ["bash", str(TORCHTITAN_RUN), row.precision, str(row.warmup + row.steps), *row.args]
    else:
        row.args = train_args(row, preset, extra, out / "outputs" / name)
        script = ["benchmarks/row.py", "--bench.warmup", str(row.warmup), *row.args]
        if row.profile:
            script[1:1] = ["--bench.profile_steps", str(row.profile)]
        if row.nproc > 1:
            # --standalone: a rendezvous on a free local port (a static "localhost:0" endpoint is never reachable)
            cmd = ["torchrun", "--standalone", f"--nproc_per_node={row.nproc}", *script]
        else:
            cmd = [sys.executable, *script]
    t0 = time.perf_counter()
    # A session of its own, so a timeout kills torchrun's workers too.
    # OMP_WAIT_POLICY PASSIVE unless set, as run_train.sh runs train.py: spinning OpenMP threads on shared CPU
    # cores made a one-process row 8x slower (docs/performance.md, "MoE on a CPU").
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        timed_out = True
    row.wall_s = round(time.perf_counter() - t0, 1)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "logs" / f"{name}.log").write_text(output)
    lines = output.splitlines()
    pattern = TT_STEP if row.engine == "torchtitan" else STEP
    steps = [m.groupdict() for m in map(pattern.search, lines) if m]
    measured = [s for s in steps if row.warmup < int(s["step"]) <= row.warmup + row.steps]
    row.measured_steps = len(measured)
    if measured:
        row.tps = statistics.median(float(s["tps"].replace(",", "")) for s in measured)
        mfus = [float(s["mfu"].rstrip("%")) for s in measured if s["mfu"] != "n/a"]
        row.mfu = statistics.median(mfus) if mfus else None
        row.memory_gib = max(float(s["mem"]) for s in measured)
        actives = [float(m["active"]) for m in map(ACTIVE.search, lines) if m and STEP.search(m.string)]
        row.memory_active_gib = max(actives[-len(measured) :]) if actives else None
        fp8 = [float(m["mfu_fp8"]) for m in map(MFU_FP8.search, lines) if m and STEP.search(m.string)]
        row.mfu_fp8 = statistics.median(fp8[-len(measured) :]) if fp8 else None
        row.final_loss = float(measured[-1]["loss"])
        row.step_ms = 1e3 * row.tokens_per_step / row.tps if row.tps else None
    flops = next((m for m in map(FLOPS.search, lines) if m), None)
    if flops:
        row.gflops_per_token, row.gflops_per_token_causal = float(flops["full"]), float(flops["causal"])
        fill_conventions(row, used=flops["used"])
    elif row.engine == "torchtitan":
        fill_conventions(row, used="full")  # torchtitan counts attention in full; FLOPs/token come later
    blocks = next((m for m in map(BLOCKS.search, lines) if m), None)
    if blocks:
        row.blocks_ms, row.blocks_fwd_ms, row.blocks_bwd_ms = (float(blocks[k]) for k in ("total", "fwd", "bwd"))
    row.kernels = next((line for line in lines if line.startswith("kernels: ")), None)
    if timed_out:
        row.error = f"timeout after {timeout:.0f} s ({len(measured)} of {row.steps} measured steps)"
    elif proc.returncode != 0 or not measured:
        tail = [line for line in lines if line.strip()][-1:] or ["no output"]
        row.error = f"exit {proc.returncode}: {tail[0][:200]}"
    return row


def fill_conventions(row: Row, used: str) -> None:
    """MFU and TFLOP/s under both conventions from the measured tps and mfu (which counted `used`)."""
    full, causal = row.gflops_per_token, row.gflops_per_token_causal
    if used == "full":
        row.mfu_full = row.mfu
    if full and causal and row.mfu is not None:
        scale = {"full": full, "causal": causal}[used]
        row.mfu_full, row.mfu_causal = row.mfu * full / scale, row.mfu * causal / scale
    if full and causal and row.tps:
        row.tflops_full, row.tflops_causal = row.tps * full / 1e3, row.tps * causal / 1e3


def add_torchtitan_flops(row: dict, previous: list[dict]) -> None:
    """A torchtitan row's FLOPs/token (hence causal MFU and both TFLOP/s) from a kiln row of its preset: the same
    shape by construction (gpu_bundle's torchtitan configs are the presets')."""
    if row.get("engine") != "torchtitan" or row.get("gflops_per_token"):
        return
    kiln = [p for p in previous if p.get("engine", "kiln") == "kiln" and p["preset"] == row["preset"]]
    kiln = [p for p in kiln if p.get("gflops_per_token")]
    if kiln:
        full, causal = kiln[-1]["gflops_per_token"], kiln[-1]["gflops_per_token_causal"]
        row["gflops_per_token"], row["gflops_per_token_causal"] = full, causal
        if row.get("mfu") is not None:
            row["mfu_causal"] = row["mfu"] * causal / full
        if row.get("tps"):
            row["tflops_full"], row["tflops_causal"] = row["tps"] * full / 1e3, row["tps"] * causal / 1e3


def _same_setup(a: dict, b: dict) -> bool:
    keys = ("preset", "compile", "ac", "nproc", "tokens_per_step", "args_shape")
    return all(a.get(k) == b.get(k) for k in keys) and a.get("engine", "kiln") == b.get("engine", "kiln")


def _shape(row: dict) -> list[str]:
    """The train.py arguments that define the model and batch (not precision, AC or compile)."""
    args, keep = row.get("args", []), ("--model.", "--training.seq_len", "--training.local_batch_size")
    return [a for i, a in enumerate(args) if a.startswith(keep) or (i and args[i - 1].startswith(keep))]


def load_rows(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        r["args_shape"] = _shape(r)
    return rows


def add_speedups(row: dict, previous: list[dict]) -> None:
    """Speedups over the latest successful bf16 row of the same setup (None until one exists)."""
    base = [p for p in previous if p["precision"] == "bf16" and not p.get("error") and _same_setup(p, row)]
    if base and row.get("tps") and base[-1].get("tps"):
        row["speedup"] = row["tps"] / base[-1]["tps"]
    if base and row.get("blocks_ms") and base[-1].get("blocks_ms"):
        row["blocks_speedup"] = base[-1]["blocks_ms"] / row["blocks_ms"]


HEADER = [
    "| preset | row | tps (median) | mfu full / causal | TFLOP/s full / causal | peak GiB | step ms | "
    "blocks fwd+bwd ms | blocks share | vs bf16 (step) | vs bf16 (blocks) | final loss | measured | when |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
]


def md_line(r: dict) -> str:
    def f(v: float | None, spec: str, suffix: str = "") -> str:
        return "—" if v is None else format(v, spec) + suffix

    row = row_id(r["precision"], r["compile"], r["ac"], r.get("engine", "kiln"))
    row += f" (nproc {r['nproc']})" if r["nproc"] > 1 else ""
    if r.get("error") and not r.get("tps"):
        return f"| {r['preset']} | {row} | failed: {r['error']} | | | | | | | | | | | {r['date']} |"
    share = r["blocks_ms"] / r["step_ms"] if r.get("blocks_ms") and r.get("step_ms") else None
    note = f" ({r['error']})" if r.get("error") else ""
    mfu = f"{f(r.get('mfu_full', r.get('mfu')), '.2f', '%')} / {f(r.get('mfu_causal'), '.2f', '%')}"
    tflops = f"{f(r.get('tflops_full'), '.1f')} / {f(r.get('tflops_causal'), '.1f')}"
    return (
        f"| {r['preset']} | {row}{note} | {f(r.get('tps'), ',.0f')} | {mfu} | {tflops} "
        f"| {f(r.get('memory_gib'), '.2f')} | {f(r.get('step_ms'), '.1f')} | {f(r.get('blocks_ms'), '.1f')} "
        f"| {f(share, '.0%')} | {f(r.get('speedup'), '.2f', 'x')} | {f(r.get('blocks_speedup'), '.2f', 'x')} "
        f"| {f(r.get('final_loss'), '.4f')} | {r['measured_steps']}/{r['steps']} | {r['date']} |"
    )


def append_row(out: Path, row: Row) -> dict:
    """Append one finished row to results.jsonl and results.md (with speedups against earlier rows)."""
    previous = load_rows(out)
    record = asdict(row)
    record["args_shape"] = _shape(record)
    add_speedups(record, previous)
    add_torchtitan_flops(record, previous)
    stored = {k: v for k, v in record.items() if k != "args_shape"}
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(stored) + "\n")
    md = out / "results.md"
    with open(md, "a") as f:
        if md.stat().st_size == 0:
            f.write("\n".join(HEADER) + "\n")
        f.write(md_line(record) + "\n")
    return record


def summary(out: Path) -> str:
    """All rows in `out`, latest per (preset, row, nproc), speedups recomputed against the final bf16 rows."""
    latest: dict[tuple, dict] = {}
    for r in load_rows(out):
        latest[(r.get("engine", "kiln"), r["preset"], r["precision"], r["compile"], r["ac"], r["nproc"])] = r
    rows = list(latest.values())
    for r in rows:
        r["speedup"] = r["blocks_speedup"] = None
        add_speedups(r, rows)
        add_torchtitan_flops(r, rows)
    return "\n".join([*HEADER, *(md_line(r) for r in rows)]) + "\n"


def select(rows: list[tuple[str, bool, str]], spec: str | None) -> list[int]:
    """Indices picked by --rows: comma-separated indices, ranges (2-4) or row ids (rowwise/compile/ac-op)."""
    if not spec:
        return list(range(len(rows)))
    ids = [row_id(p, c, a) for p, c, a in rows]
    picked: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if part in ids:
            picked.append(ids.index(part))
        elif re.fullmatch(r"\d+(-\d+)?", part):
            lo, _, hi = part.partition("-")
            picked += list(range(int(lo), int(hi or lo) + 1))
        else:
            raise ValueError(f"--rows: '{part}' is not an index, a range or one of {', '.join(ids)}")
    bad = [i for i in picked if not 0 <= i < len(rows)]
    if bad:
        raise ValueError(f"--rows: index {bad[0]} out of range 0-{len(rows) - 1}")
    return list(dict.fromkeys(picked))


def check_rows(name: str, preset: dict, rows: list[tuple[str, bool, str]], extra: list[str]) -> int:
    """--check: each row's train.py arguments through kiln's dry run in this process (the config parsed and
    checked, the model built on the meta device with its float8 conversion and parallel plan, the memory per device
    estimated for a GPU run of the preset's process count); the plan's summary lines per row (the parameters,
    float8's conversions, the memory per device), exit 1 if any row fails to plan. The GPU's own checks (float8
    or MXFP8 hardware) are the run's."""
    sys.path.insert(0, str(ROOT))
    # Imported here: the rest of the harness only starts processes, and stays light to import.
    from kiln_base.config import parse_args
    from kiln_base.errors import UserError
    from trainer.tools.dry_run import dry_run

    failed = 0
    for precision, compile_, ac in rows:
        row = Row(name, precision, compile_, ac, preset["nproc"], preset["warmup"], preset["steps"], 0)
        argv = [*train_args(row, preset, extra, Path("/tmp/kiln_check")), "--job.dry_run"]
        try:
            plan = dry_run(parse_args(argv), preset["nproc"]).splitlines()
        except UserError as e:
            failed += 1
            print(f"{row.id}: does not plan: {e}", flush=True)
            continue
        keep = ("parameters:", "float8:", "  total ")
        print(f"{row.id}: plans; " + "; ".join(" ".join(line.split()) for line in plan if line.startswith(keep)))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--precision", help="comma list; default: the preset's", default=None)
    ap.add_argument("--ac", help="comma list of none,op,full; default: the preset's", default=None)
    ap.add_argument("--compile", choices=["on", "off", "both"], default=None)
    ap.add_argument("--nproc", type=int, default=None, help="processes (torchrun) per row")
    ap.add_argument("--warmup", type=int, default=None, help="steps before measuring; default: the preset's")
    ap.add_argument("--steps", type=int, default=None, help="measured steps; default: the preset's")
    ap.add_argument("--profile", type=int, default=0, help="kiln: profile this many steps after the measured ones")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per row before it is killed")
    ap.add_argument("--rows", default=None, help="which rows: indices, ranges or ids (see --list); default: all")
    ap.add_argument("--skip-done", action="store_true", help="skip rows already in --out without an error")
    ap.add_argument("--list", action="store_true", help="print the rows (index and id) and exit")
    ap.add_argument(
        "--check", action="store_true", help="dry-run each row's train.py arguments here (no GPU needed) and exit"
    )
    ap.add_argument("--summary", action="store_true", help="print the table of every row in --out and exit")
    ap.add_argument("--out", type=Path, default=None, help="results folder; default benchmarks/results/<preset>")
    ap.add_argument("--engine", choices=["kiln", "torchtitan"], default="kiln", help="torchtitan: gpu_bundle's 0.2.2")
    ap.add_argument("extra", nargs="*", help="more train.py overrides, after --")
    a = ap.parse_args(argv)
    preset = dict(PRESETS[a.preset])
    for key in ("nproc", "warmup", "steps", "timeout"):
        if getattr(a, key) is not None:
            preset[key] = getattr(a, key)
    out = a.out or ROOT / "benchmarks" / "results" / a.preset
    if a.summary:
        print(summary(out), end="")
        return 0
    precisions = a.precision.split(",") if a.precision else preset["precision"]
    acs = a.ac.split(",") if a.ac else preset["ac"]
    compiles = {"on": [True], "off": [False], "both": [False, True], None: preset["compile"]}[a.compile]
    for p in precisions:
        if p not in PRECISIONS:
            ap.error(f"unknown precision '{p}'; choose from {', '.join(PRECISIONS)}")
    for ac in acs:
        if ac not in AC:
            ap.error(f"unknown AC mode '{ac}'; choose from {', '.join(AC)}")
    if a.engine == "torchtitan":
        if not preset.get("torchtitan"):
            ap.error(f"--engine torchtitan: preset {a.preset} has no torchtitan config; use llama3_8b_8l")
        if not TORCHTITAN_RUN.exists():
            ap.error(f"--engine torchtitan: {TORCHTITAN_RUN} missing; run scripts/prepare_gpu_run.py first")
        if "tensorwise+fp8ag" in precisions or preset["nproc"] != 1:
            ap.error("--engine torchtitan: one process, precisions bf16/tensorwise/rowwise/rowwise_with_gw_hp")
    matrix = [(p, c, ac) for c, ac, p in itertools.product(compiles, acs, precisions)]
    if a.list:
        for i, (p, c, ac) in enumerate(matrix):
            print(f"{i:3}  {row_id(p, c, ac, a.engine)}")
        return 0
    try:
        picked = select(matrix, a.rows)
    except ValueError as e:
        ap.error(str(e))
    if a.check:
        return check_rows(a.preset, preset, [matrix[i] for i in picked], a.extra)
    out.mkdir(parents=True, exist_ok=True)
    every = [*preset["args"], *a.extra]
    tokens = int(_flag(every, "--training.local_batch_size", "8")) * int(_flag(every, "--training.seq_len", "2048"))
    done = {
        (r["precision"], r["compile"], r["ac"])
        for r in load_rows(out)
        if not r.get("error")
        and r["preset"] == a.preset
        and r["nproc"] == preset["nproc"]
        and r.get("engine", "kiln") == a.engine
    }
    print(f"preset {a.preset}: {len(picked)} of {len(matrix)} rows -> {out}/results.jsonl, results.md", flush=True)
    for i in picked:
        precision, compile_, ac = matrix[i]
        if a.skip_done and (precision, compile_, ac) in done:
            print(f"[{i}] {row_id(precision, compile_, ac, a.engine)}: already in {out}, skipped", flush=True)
            continue
        row = Row(a.preset, precision, compile_, ac, preset["nproc"], preset["warmup"], preset["steps"], tokens)
        row.engine = a.engine
        row.profile = a.profile if a.engine == "kiln" else 0
        record = append_row(out, run_one(row, preset, a.extra, out, preset["timeout"]))
        print(f"[{i}] {md_line(record)}", flush=True)
    print(f"\nall rows in {out}:\n{summary(out)}", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
