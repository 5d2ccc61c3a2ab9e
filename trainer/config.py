"""kiln's configuration: one dataclass per TOML section, merged as defaults < TOML file < CLI.

Section and key names follow torchtitan so its users' TOML files read the same. Every value, from the
file or the command line, is converted strictly to the field's type; any user mistake raises ConfigError,
which the entry point prints as one line and exits with status 2 before anything heavy is built.

This module imports only the standard library so config handling stays instant.
"""

from __future__ import annotations

import difflib
import math
import os
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from trainer import torchtitan_compat
from trainer.errors import ConfigError

__all__ = ["ConfigError", "JobConfig", "parse_args", "to_toml", "format_help"]

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key: lo <= v <= hi (strict where `lo_open`/`hi_open`), or one of `also`
    (a sentinel such as -1 = automatic). Floats must be finite as well; ints must fit in int64 unless `hi` says
    otherwise (they end up in tensors and C++ APIs)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    also: tuple[int, ...] = ()
    note: str = ""  # what the sentinel or bound means, appended to the description

    def contains(self, v: float) -> bool:
        if v in self.also and not isinstance(v, float):
            return True
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        hi = self.hi if self.hi is not None else (INT64_MAX if isinstance(v, int) else None)
        return hi is None or (v < hi if self.hi_open else v <= hi)

    def describe(self, value: float | None = None) -> str:
        """'in [0, 1)', '>= 1', '-1 or >= 1 (note)'; an int past int64 is told about the implicit bound."""
        hi_bound = self.hi
        if hi_bound is None and isinstance(value, int) and value > INT64_MAX:
            hi_bound = INT64_MAX
        lo, hi = _num(self.lo), _num(hi_bound)
        if self.lo is not None and hi_bound is not None:
            text = f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {lo}"
        elif hi_bound is not None:
            text = f"{'<' if self.hi_open else '<='} {hi}"
        else:
            text = "a finite number"
        if isinstance(value, float) and (self.lo is None) != (hi_bound is None):  # one-sided: say inf is out
            text = f"a finite number {text}"
        if self.also:
            text = " or ".join(str(a) for a in self.also) + " or " + text
        return f"{text} ({self.note})" if self.note else text


def _num(x: float | None) -> str:
    return "" if x is None else str(x) if isinstance(x, int) else f"{x:g}"


AT_LEAST_1 = Range(lo=1)  # counts, sizes, frequencies
AT_LEAST_0 = Range(lo=0)
POSITIVE = Range(lo=0, lo_open=True)  # floats: > 0 and finite
FRACTION = Range(lo=0, hi=1)
TIMEOUT = Range(lo=1, hi=10**9, note="seconds")  # 10**9 s (31 years): far inside timedelta's and c10d's limits


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None, valid: Range | None = None) -> Any:
    """A dataclass field carrying its help text, allowed values (`choices`) or numeric range (`valid`)."""
    meta = {"help": help, "choices": choices, "valid": valid}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


DTYPES = ("bfloat16", "float32")

# bf16 autocast against float32 on CPUs, debug model (DESIGN.md): no CPU measured so far runs bf16 faster.
CPU_BF16_COST = "bf16 ran at 0.06x float32's speed on an AVX2 CPU and 0.57x on an AVX512-BF16 CPU without AMX"


def resolve_mixed_precision(param: str, device_type: str) -> str:
    """The compute dtype name for training.mixed_precision_param on this device type.

    `auto` is whichever measured faster: bfloat16 on CUDA (tensor cores), float32 on a CPU (see
    CPU_BF16_COST); an explicit dtype is honoured everywhere. The Trainer (autocast), FSDP's
    MixedPrecisionPolicy and the dry run all call this, so `auto` means the same thing in each.
    """
    if param != "auto":
        return param
    return "bfloat16" if device_type == "cuda" else "float32"


FROM_CHECKPOINT = "from_checkpoint"  # model.flavor: build the shape stored with checkpoint.initial_load_path


@dataclass
class Job:
    config_file: str | None = _f(None, "TOML file to read; CLI flags override its values.")
    dump_folder: str = _f("./outputs", "Folder for checkpoints, traces and TensorBoard logs.")
    description: str = _f("kiln job", "Free-text description printed at start-up.")
    print_config: bool = _f(False, "Print the merged configuration as TOML and exit.")
    dry_run: bool = _f(False, "Build on the meta device, print the plan (params, FLOPs, mesh, float8) and exit.")


@dataclass
class Model:
    name: str = _f("llama3", "Model family.", ("llama3",))
    flavor: str = _f(
        "debugmodel",
        "Model shape: Llama 3 (8B, 70B, 405B), 3.1 (llama3 rope scaling, 131072 context), 3.2 (tied embeddings), or "
        "from_checkpoint: the shape stored with checkpoint.initial_load_path (HF config.json or kiln.json).",
        (
            "debugmodel",
            "8B",
            "70B",
            "405B",
            "3.1-8B",
            "3.1-70B",
            "3.1-405B",
            "3.2-1B",
            "3.2-3B",
            FROM_CHECKPOINT,
        ),
    )
    tokenizer_path: str = _f("assets/tokenizer/tokenizer.model", "tiktoken BPE file (Llama3 tokenizer.model format).")
    n_layers: int | None = _f(
        None, "Override the flavor's layer count (benchmarks: 8B widths, fewer layers).", valid=AT_LEAST_1
    )
    vocab_size: int | None = _f(
        None, "Pad the vocabulary to this size (>= the tokenizer's); unset = the tokenizer's size.", valid=AT_LEAST_1
    )
    dim: int | None = _f(None, "Override the flavor's model width (benchmarks, numerics studies).", valid=AT_LEAST_1)
    n_heads: int | None = _f(None, "Override the flavor's attention heads (must divide model.dim).", valid=AT_LEAST_1)
    n_kv_heads: int | None = _f(
        None, "Override the flavor's key/value heads (grouped-query attention; must divide n_heads).", valid=AT_LEAST_1
    )
    ffn_dim_multiplier: float | None = _f(
        None, "Override the flavor's FFN multiplier: hidden = multiplier x 8/3 dim, rounded up.", valid=POSITIVE
    )
    multiple_of: int | None = _f(
        None, "Override the flavor's FFN rounding: the hidden size is a multiple of this.", valid=AT_LEAST_1
    )


@dataclass
class Optimizer:
    name: str = _f("AdamW", "Optimizer.", ("AdamW", "Adam"))
    lr: float = _f(8e-4, "Peak learning rate.", valid=POSITIVE)
    beta1: float = _f(0.9, "Adam beta1.", valid=Range(lo=0, hi=1, hi_open=True))
    beta2: float = _f(0.95, "Adam beta2.", valid=Range(lo=0, hi=1, hi_open=True))
    eps: float = _f(1e-8, "Adam epsilon.", valid=POSITIVE)
    weight_decay: float = _f(0.1, "Decoupled weight decay.", valid=AT_LEAST_0)
    implementation: str = _f(
        "fused",
        "Kernel: fused (one kernel, CUDA/CPU), foreach (batched), for-loop.",
        ("fused", "foreach", "for-loop"),
    )


@dataclass
class LRScheduler:
    warmup_steps: int = _f(200, "Linear warm-up steps from ~0 to optimizer.lr.", valid=AT_LEAST_0)
    decay_ratio: float | None = _f(
        None,
        "Fraction of steps spent decaying at the end (WSD); unset decays over all post-warmup steps.",
        valid=FRACTION,
    )
    decay_type: str = _f("linear", "Shape of the decay.", ("linear", "sqrt", "cosine"))
    min_lr_factor: float = _f(0.0, "Final learning rate as a fraction of optimizer.lr.", valid=FRACTION)


@dataclass
class Training:
    dataset: str = _f("kiln_corpus", "Registered dataset name (kiln_corpus, c4).")
    dataset_path: str | None = _f(None, "Local file or folder (jsonl/json/parquet/txt); overrides the registry path.")
    local_batch_size: int = _f(8, "Sequences per device per micro-batch.", valid=AT_LEAST_1)
    global_batch_size: int = _f(
        -1,
        "Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree. "
        "A multiple of that product gives gradient accumulation.",
        valid=Range(lo=1, also=(-1,), note="-1 = local_batch_size x data-parallel degree"),
    )
    seq_len: int = _f(2048, "Tokens per sequence.", valid=AT_LEAST_1)
    data_prefetch: int = _f(
        2, "Batches a background thread prepares ahead of the step (0 = load in the step).", valid=AT_LEAST_0
    )
    steps: int = _f(10000, "Optimizer steps to train.", valid=AT_LEAST_1)
    max_norm: float = _f(
        1.0,
        "Gradient-norm clipping threshold (<= 0 disables clipping).",
        valid=Range(note="<= 0 disables clipping"),
    )
    mixed_precision_param: str = _f(
        "auto",
        "Compute dtype of parameters in forward/backward (FSDP param_dtype, autocast otherwise); "
        "master weights and optimizer state stay float32. auto = bfloat16 on CUDA, float32 on CPU "
        "(measured faster there; docs/config.md).",
        ("auto", *DTYPES),
    )
    mixed_precision_reduce: str = _f("float32", "Gradient reduction dtype under FSDP.", DTYPES)
    compile: bool = _f(False, "torch.compile each transformer block.")
    gc_freq: int = _f(50, "Run Python's garbage collector every N steps (automatic GC is disabled).", valid=AT_LEAST_1)
    seed: int | None = _f(
        None, "Random seed; same seed, same init.", valid=Range(lo=0, hi=2**64 - 1, note="torch.manual_seed's range")
    )
    deterministic: bool = _f(False, "Use deterministic algorithms (bitwise-repeatable runs; slower).")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _f(1, "DDP/HSDP replicas (across nodes).", valid=AT_LEAST_1)
    data_parallel_shard_degree: int = _f(
        -1,
        "FSDP shards; -1 = what remains of the world size.",
        valid=Range(lo=1, also=(-1,), note="-1 = the rest of the world size"),
    )
    fsdp_reshard_after_forward: str = _f(
        "default",
        "Free unsharded params after forward: default (yes, except the root), always, never.",
        ("default", "always", "never"),
    )
    tensor_parallel_degree: int = _f(1, "Tensor-parallel degree (within a node).", valid=AT_LEAST_1)
    disable_loss_parallel: bool = _f(False, "Gather logits before the loss instead of a vocab-parallel loss.")
    enable_async_tensor_parallel: bool = _f(False, "Async TP (CUDA + compile only).")


@dataclass
class Checkpoint:
    enable_checkpoint: bool = _f(False, "Save and resume DCP checkpoints.")
    folder: str = _f("checkpoint", "Checkpoint folder, relative to job.dump_folder.")
    interval: int = _f(500, "Save every N steps (and at the last step).", valid=AT_LEAST_1)
    keep_latest_k: int = _f(
        0,
        "Keep only the newest K checkpoints (0 = keep all; never deletes the only good one).",
        valid=Range(lo=0, note="0 = keep all"),
    )
    async_mode: str = _f("disabled", "Save in the background.", ("disabled", "async", "async_with_pinned_mem"))
    initial_load_path: str | None = _f(
        None,
        "Start from these weights when the checkpoint folder has nothing to resume: a Hugging Face Llama folder "
        "(config.json + safetensors) or a kiln checkpoint (step folder or checkpoint folder; model only).",
    )
    load_step: int = _f(
        -1, "Load this step instead of the latest (-1 = latest).", valid=Range(lo=0, also=(-1,), note="-1 = latest")
    )
    model_weights_only: bool = _f(False, "Save only model weights (no optimizer/data state).")
    export_dtype: str = _f("float32", "dtype of weights-only saves.", ("float32", "bfloat16", "float16"))
    last_save_model_weights_only: bool = _f(False, "Make the final save weights-only, in export_dtype.")


@dataclass
class ActivationCheckpoint:
    mode: str = _f("selective", "Recompute activations in backward.", ("none", "selective", "full"))
    selective_ac_option: str = _f("2", "With mode=selective: 'op' for per-op SAC, or N to checkpoint every Nth block.")


# MXFP8 (torchao.prototype.moe_training's MXFP8TrainingOpConfig recipes): e4m3 elements in blocks of 32 along the
# contraction dim, one power-of-two (e8m0) scale per block, rounded up (rceil); real kernels need Blackwell (SM100).
MXFP8_RECIPES = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp")
MXFP8_BLOCK = 32


@dataclass
class Float8:
    enable_float8_linear: bool = _f(False, "Swap nn.Linear for torchao Float8Linear.")
    recipe_name: str | None = _f(
        None,
        "torchao recipe; unset = tensorwise with the flags below. mxfp8_* = MXFP8 (32-element blocks, e8m0 scales; "
        "Blackwell SM100, or --float8.emulate).",
        ("tensorwise", "rowwise", "rowwise_with_gw_hp", *MXFP8_RECIPES),
    )
    enable_fsdp_float8_all_gather: bool = _f(False, "FSDP2 all-gathers weights in float8 (tensorwise only).")
    precompute_float8_dynamic_scale_for_fsdp: bool = _f(
        False, "One all-reduce of all weight amaxes after the optimizer step (needs float8 all-gather)."
    )
    filter_fqns: list[str] = _f(["output"], "Linears whose name contains one of these stay high precision.")
    emulate: bool = _f(False, "Emulate float8 matmuls (CPU tests, GPUs below SM 8.9).")
    auto_filter_small_kn: bool = _f(
        False, "Also keep Linears whose GEMM is too small to gain in high precision (torchao's H100 thresholds)."
    )

    numerics_log_freq: int = _f(
        0,
        "Every N steps record each float8 Linear's operands (input, weight, grad_output): amax, scale, underflow and "
        "saturation fractions, SQNR; the step runs eagerly; 0 = off.",
        valid=Range(lo=0, note="0 = off"),
    )
    numerics_alarm_sqnr_db: float = _f(
        20.0, "Warn once per layer when an operand's float8 SQNR falls below this many dB.", valid=POSITIVE
    )
    numerics_alarm_underflow: float = _f(
        0.05,
        "Warn once per layer when more than this fraction of an operand's nonzero elements underflow to zero.",
        valid=Range(lo=0, hi=1),
    )
    high_precision_first_last: int = _f(
        0, "Keep the first N and the last N transformer blocks in high precision.", valid=Range(lo=0)
    )
    disable_after_step: int = _f(
        0,
        "From the step after this one, every float8 Linear runs in high precision (the end of training); 0 = never.",
        valid=Range(lo=0, note="0 = never"),
    )

    @property
    def is_mxfp8(self) -> bool:
        return self.recipe in MXFP8_RECIPES

    @property
    def recipe(self) -> str:
        """The recipe in effect: an unset recipe_name means tensorwise scaling."""
        return self.recipe_name or "tensorwise"


@dataclass
class Metrics:
    log_freq: int = _f(10, "Log metrics every N steps.", valid=AT_LEAST_1)
    enable_tensorboard: bool = _f(False, "Write TensorBoard scalars.")
    save_tb_folder: str = _f("tb", "TensorBoard folder, relative to job.dump_folder.")
    save_for_all_ranks: bool = _f(False, "Write TensorBoard from every rank, not only the logging rank.")
    disable_color_printing: bool = _f(False, "Plain log lines (no ANSI colours).")
    peak_tflops: float | None = _f(
        None, "Peak bf16 dense TFLOP/s per device for MFU; unset = look up the GPU.", valid=POSITIVE
    )


@dataclass
class Profiling:
    enable_profiling: bool = _f(False, "Capture torch profiler traces.")
    save_traces_folder: str = _f("profile_traces", "Trace folder, relative to job.dump_folder.")
    profile_freq: int = _f(10, "Capture a trace every N steps.", valid=AT_LEAST_1)
    enable_memory_snapshot: bool = _f(False, "Dump CUDA memory snapshots.")
    save_memory_snapshot_folder: str = _f("memory_snapshot", "Snapshot folder, relative to job.dump_folder.")
    saved_activations_report: bool = _f(
        False, "Run one eager training step, print the bytes kept for backward by producing op, and exit."
    )


@dataclass
class Comm:
    init_timeout_seconds: int = _f(300, "Timeout for process-group init and the steps that may compile.", valid=TIMEOUT)
    train_timeout_seconds: int = _f(100, "Collective timeout of every other step.", valid=TIMEOUT)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)


# ----------------------------------------------------------------------------- value conversion

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _section_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _convert(value: Any, tp: Any, where: str, toml: bool = False) -> Any:
    """Convert a TOML or CLI value to type `tp`, strictly: "ten" is not an int, 1.5 is not an int.

    From TOML (`toml`), booleans and numbers must be TOML's own: `compile = "yes"` or `steps = "10"` is a
    mistake (a quoted value is a string), while the command line, where everything is a string, may say
    `--training.compile true` or `--training.steps 10`.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, where, toml)
    if origin is list:
        (inner,) = args
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(v, inner, where, toml) for v in value]
    if toml and isinstance(value, str) and tp in (bool, int, float):
        kind = {bool: "boolean (true or false, unquoted)", int: "integer (unquoted)", float: "number (unquoted)"}
        raise ConfigError(f"{where}: expected a TOML {kind[tp]}, got the string {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported config type {tp} at {where}")


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(options)}"


def _lookup(cfg: JobConfig, section: str, key: str, where: str) -> tuple[Any, Any]:
    """Return (section object, field type) for section.key, or raise with the closest valid name."""
    sections = [f.name for f in fields(JobConfig)]
    if section not in sections:
        raise ConfigError(f"{where}: unknown section '{section}'{_suggest(section, sections)}")
    obj = getattr(cfg, section)
    hints = _section_types(type(obj))
    if key not in hints:
        full = [f"{section}.{k}" for k in hints]
        raise ConfigError(f"{where}: unknown key '{section}.{key}'{_suggest(f'{section}.{key}', full)}")
    return obj, hints[key]


def _set(cfg: JobConfig, section: str, key: str, raw: Any, where: str, toml: bool = False) -> None:
    obj, tp = _lookup(cfg, section, key, where)
    value = _convert(raw, tp, where, toml)
    choices = next(f.metadata.get("choices") for f in fields(obj) if f.name == key)
    if choices and value is not None and value not in choices:
        raise ConfigError(f"{where}: '{value}' is not a valid choice; choose from {', '.join(choices)}")
    setattr(obj, key, value)


# ----------------------------------------------------------------------------- sources


# The kiln checkout (or editable install): where the default config and the bundled assets live.
KILN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve_input_path(path: str) -> str:
    """An existing file the user names, as an absolute path.

    Relative paths are taken from the current directory (where the user launched kiln); when nothing is there
    but kiln's own folder has it, kiln's copy: the shipped configs name the bundled tokenizer and corpus as
    `assets/...`, and `CONFIG_FILE=train_configs/x.toml` works from any directory. The current directory wins
    when both exist; the start-up log prints the path chosen.
    """
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        return os.path.normpath(path)
    here = os.path.abspath(path)
    bundled = os.path.join(KILN_ROOT, path)
    return bundled if not os.path.exists(here) and os.path.exists(bundled) else here


def resolve_output_path(path: str) -> str:
    """A folder kiln writes to, as an absolute path: relative to the current directory, never kiln's."""
    return os.path.abspath(os.path.expanduser(path))


def _resolve_paths(cfg: JobConfig) -> None:
    """Make every user path absolute once, at parse time, so no later code depends on the current directory."""
    cfg.job.dump_folder = resolve_output_path(cfg.job.dump_folder)
    cfg.model.tokenizer_path = resolve_input_path(cfg.model.tokenizer_path)
    if cfg.training.dataset_path is not None:
        cfg.training.dataset_path = resolve_input_path(cfg.training.dataset_path)
    if cfg.checkpoint.initial_load_path is not None:
        cfg.checkpoint.initial_load_path = resolve_output_path(cfg.checkpoint.initial_load_path)


def _load_toml(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        raise ConfigError(f"--job.config_file {path} is a directory; give a TOML file")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if raw.startswith(b"\xef\xbb\xbf"):  # TOML forbids a BOM; tomllib's own message would be "Invalid statement"
        raise ConfigError(f"{path}: starts with a UTF-8 byte-order mark (BOM); save the file as UTF-8 without BOM")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}); TOML files must be UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # message already carries "(at line N, column M)"
        raise ConfigError(f"{path}: malformed TOML: {e}") from None


def _parse_cli(argv: list[str]) -> list[tuple[str, str, Any]]:
    """Split argv into (section, key, raw value) triples.

    Accepts `--s.k v`, `--s.k=v`, bare `--s.flag` (true) and `--s.no-flag` / `--s.no_flag` (false).
    Whether a bare flag is boolean is decided later, against the field's type.
    """
    out: list[tuple[str, str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}'; use --section.key value (see --help)")
        name, eq, text = arg[2:].partition("=")
        val: str | None = text
        section, _, key = name.partition(".")
        i += 1
        if not eq:
            if i < len(argv) and not argv[i].startswith("--"):
                val = argv[i]
                i += 1
            else:
                val = None  # bare flag: resolved against the field type below
        out.append((section, key.replace("-", "_") if key.startswith("no-") else key, val))
    return out


def _apply_cli(cfg: JobConfig, items: list[tuple[str, str, Any]]) -> None:
    for section, key, val in items:
        where = f"--{section}.{key}"
        negated = val is None and key.startswith("no_")
        if negated:
            key = key[3:]
        if val is None:
            obj, tp = _lookup(cfg, section, key, where)
            if tp is not bool:
                raise ConfigError(f"--{section}.{key}: needs a value")
            val = not negated
        _set(cfg, section, key, val, f"--{section}.{key}")


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig: dataclass defaults < TOML file (--job.config_file) < CLI overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(format_help())
        raise SystemExit(0)
    items = _parse_cli(argv)
    cfg = JobConfig()
    # The last --job.config_file wins, like any key given twice: run_train.sh passes CONFIG_FILE first, so a
    # --job.config_file on its command line overrides it.
    config_file = next((v for s, k, v in reversed(items) if (s, k) == ("job", "config_file")), None)
    if config_file:
        given, config_file = config_file, resolve_input_path(config_file)
        if not os.path.isfile(config_file) and not os.path.isabs(os.path.expanduser(given)):
            raise ConfigError(
                f"config file not found: {given} (relative paths are looked up in the current directory "
                f"{os.getcwd()}, then in kiln's folder {KILN_ROOT})"
            )
    toml = _load_toml(config_file) if config_file else {}
    # torchtitan's key names (v0.1.0 .. v0.2.2) -> kiln's, before anything is set: see trainer/torchtitan_compat.py
    toml, items = torchtitan_compat.resolve(cfg, toml, items, config_file, _convert)
    if config_file:
        for section, values in toml.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{config_file}: '{section}' must be a [section] table")
            for key, raw in values.items():
                _set(cfg, section, key, raw, f"{config_file}: {section}.{key}", toml=True)
    _apply_cli(cfg, items)
    cfg.job.config_file = config_file or None
    _resolve_paths(cfg)
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- validation


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_ranges(cfg: JobConfig) -> None:
    """Every numeric key against its declared Range: one line naming the key, the valid range and the value."""
    for section in fields(JobConfig):
        obj = getattr(cfg, section.name)
        for f in fields(obj):
            valid, value = f.metadata.get("valid"), getattr(obj, f.name)
            if valid is not None and value is not None and not valid.contains(value):
                raise ConfigError(f"{section.name}.{f.name} must be {valid.describe(value)}, got {value!r}")


def validate(cfg: JobConfig) -> None:
    """Checks that need only the config itself (files, ranges, combinations); no torch here."""
    t = cfg.training
    check_ranges(cfg)
    freq = cfg.profiling.profile_freq
    _check(
        not cfg.profiling.enable_profiling or freq >= 4,
        f"profiling.profile_freq must be >= 4 with profiling on (3 warm-up steps + 1 traced), got {freq}",
    )
    opt = cfg.activation_checkpoint.selective_ac_option
    _check(
        opt == "op" or (opt.isdigit() and int(opt) > 0),
        f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got '{opt}'",
    )
    _validate_float8(cfg.float8)
    src = cfg.checkpoint.initial_load_path
    _check(
        cfg.model.flavor != FROM_CHECKPOINT or src is not None,
        "model.flavor from_checkpoint builds the shape stored with checkpoint.initial_load_path, which is not set",
    )
    _check(
        src is None or os.path.isdir(src),
        f"checkpoint.initial_load_path: not a folder: {src} (a Hugging Face model folder or a kiln checkpoint)",
    )
    tokens = t.local_batch_size * t.seq_len
    _check(
        not (cfg.float8.enable_float8_linear and cfg.float8.is_mxfp8) or tokens % MXFP8_BLOCK == 0,
        f"float8.recipe_name {cfg.float8.recipe}: the weight-gradient GEMM scales blocks of {MXFP8_BLOCK} tokens, but "
        f"training.local_batch_size x seq_len = {tokens}; make it a multiple of {MXFP8_BLOCK}",
    )
    if not cfg.job.dry_run and not cfg.job.print_config:
        _check(
            os.path.isfile(cfg.model.tokenizer_path),
            f"model.tokenizer_path: file not found: {cfg.model.tokenizer_path} "
            "(point it at a tiktoken BPE file such as Llama3's tokenizer.model)",
        )
        if t.dataset_path is not None:
            _check(
                os.path.exists(t.dataset_path),
                f"training.dataset_path: not found: {t.dataset_path} (a jsonl/json/parquet/txt file or folder)",
            )


def _validate_float8(cfg: Float8) -> None:
    """Reject float8 flag combinations that torchao would reject late (or silently ignore)."""
    if not cfg.enable_float8_linear:
        stray = [
            f"float8.{name}"
            for name, on in (
                ("recipe_name", cfg.recipe_name is not None),
                ("enable_fsdp_float8_all_gather", cfg.enable_fsdp_float8_all_gather),
                ("precompute_float8_dynamic_scale_for_fsdp", cfg.precompute_float8_dynamic_scale_for_fsdp),
                ("emulate", cfg.emulate),
                ("auto_filter_small_kn", cfg.auto_filter_small_kn),
                ("numerics_log_freq", cfg.numerics_log_freq > 0),
                ("high_precision_first_last", cfg.high_precision_first_last > 0),
                ("disable_after_step", cfg.disable_after_step > 0),
            )
            if on
        ]
        if stray:
            raise ConfigError(
                f"{', '.join(stray)} set but float8 is off; add --float8.enable_float8_linear or drop the flag"
            )
        return
    if cfg.enable_fsdp_float8_all_gather and cfg.recipe != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather needs tensorwise scaling, but float8.recipe_name is "
            f"'{cfg.recipe}' (weights are scaled per row); turn the all-gather off or use recipe_name tensorwise"
        )
    if cfg.auto_filter_small_kn and cfg.is_mxfp8:
        raise ConfigError(
            f"float8.auto_filter_small_kn: torchao has no size thresholds for recipe_name {cfg.recipe}; "
            "drop the flag and name the Linears to keep in float8.filter_fqns"
        )
    if cfg.precompute_float8_dynamic_scale_for_fsdp and not cfg.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather "
            "(it precomputes the scales of float8-all-gathered weights)"
        )


def resolve_dp_shard(dp_replicate: int, dp_shard: int, tp: int, world_size: int) -> int:
    """data_parallel_shard_degree for this world size (-1 = the rest); ConfigError unless the degrees multiply to
    the world size. ParallelDims and the launcher's pre-flight check (validate_world) both call this."""
    for name, value in (("data_parallel_replicate_degree", dp_replicate), ("tensor_parallel_degree", tp)):
        if value < 1:
            raise ConfigError(f"parallelism.{name} must be >= 1, got {value}")
    others = dp_replicate * tp
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree x tensor_parallel_degree = {others} "
                f"does not divide the world size {world_size}"
            )
        dp_shard = world_size // others
    if dp_shard < 1 or dp_replicate * dp_shard * tp != world_size:
        raise ConfigError(
            f"parallelism: data_parallel_replicate_degree ({dp_replicate}) x data_parallel_shard_degree "
            f"({dp_shard}) x tensor_parallel_degree ({tp}) must equal the world size {world_size}"
        )
    return dp_shard


def grad_accum_steps(t: Training, dp_degree: int) -> int:
    """Micro-batches per optimizer step: global batch / (local batch x data-parallel degree), which must divide."""
    per_step = t.local_batch_size * dp_degree
    global_bs = per_step if t.global_batch_size == -1 else t.global_batch_size
    if global_bs % per_step:
        raise ConfigError(
            f"training.global_batch_size ({global_bs}) must be a multiple of local_batch_size x "
            f"data-parallel degree ({t.local_batch_size} x {dp_degree} = {per_step})"
        )
    return global_bs // per_step


def validate_world(cfg: JobConfig, world_size: int) -> None:
    """Checks that need only the config and the world size; run_train.sh runs them before torchrun starts a rank
    (the model-shape checks of parallelisms/ need torch and run in the Trainer)."""
    p = cfg.parallelism
    tp = p.tensor_parallel_degree
    dp_shard = resolve_dp_shard(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, tp, world_size)
    grad_accum_steps(cfg.training, p.data_parallel_replicate_degree * dp_shard)
    if cfg.training.seq_len % tp:  # sequence parallel splits every sequence into tp pieces
        raise ConfigError(
            f"training.seq_len ({cfg.training.seq_len}) must be divisible by tensor_parallel_degree ({tp})"
        )


# ----------------------------------------------------------------------------- output


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: JobConfig) -> str:
    """The merged config as TOML (keys set to None are written as comments: TOML has no null)."""
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"# {k} = (unset)" if v is None else f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def format_help() -> str:
    lines = [
        "usage: train.py [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Precedence: defaults < TOML file < command line. Booleans: --s.flag, --s.no-flag, --s.flag=false.",
        "Lists: comma-separated (--float8.filter_fqns output,w2).",
    ]
    for sf in fields(JobConfig):
        lines.append(f"\n[{sf.name}]")
        factory = sf.default_factory
        assert callable(factory), sf.name  # every section is a default_factory field
        for f in fields(factory()):
            default = f.default_factory() if callable(f.default_factory) else f.default
            choices = f.metadata.get("choices")
            extra = f" {{{','.join(choices)}}}" if choices else ""
            lines.append(f"  --{sf.name}.{f.name}{extra}  (default: {default})\n      {f.metadata['help']}")
    return "\n".join(lines)
