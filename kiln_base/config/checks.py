"""Every config check, in one place, run at the moment its facts are known:

    check_config(cfg)                      the config alone (ranges, flag combinations, files named): parse time
    check_world(cfg, world_size)           + the world size: the launcher before torchrun, each rank at start
    check_model_shape(...)                 + the model's shape: the launcher and each rank, before any build
    check_parallel_plan(...)               + the shape, the degrees and the device type: each rank, before the build
    check_float8_device(...)               + what the GPUs and torch can do: each rank, before the build

Each takes plain values (the caller gathers the facts: torch, the tokenizer, the checkpoint), so this module stays
standard-library only and instant. A failed check raises ConfigError: one line naming the key and what is valid.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kiln_base.config.schema import FROM_CHECKPOINT, MXFP8_BLOCK, Float8, JobConfig, Model, Parallelism, Training
from kiln_base.errors import ConfigError


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


def check_config(cfg: JobConfig) -> None:
    """What the config alone decides (ranges, flag combinations, the files it names); parse_args runs it."""
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
    _check_float8_flags(cfg.float8)
    src = cfg.checkpoint.initial_load_path
    _check(
        cfg.model.flavor != FROM_CHECKPOINT or src is not None,
        "model.flavor from_checkpoint builds the shape stored with checkpoint.initial_load_path, which is not set",
    )
    _check(
        src is None or os.path.isdir(src),
        f"checkpoint.initial_load_path: not a folder: {src} (a Hugging Face model folder or a kiln checkpoint)",
    )
    cp = cfg.parallelism.context_parallel_degree
    tokens = t.local_batch_size * t.seq_len // cp  # a context-parallel rank holds 1/cp of each sequence
    per_rank = "training.local_batch_size x seq_len" + (f" / context_parallel_degree ({cp})" if cp > 1 else "")
    _check(
        not (cfg.float8.enable_float8_linear and cfg.float8.is_mxfp8) or tokens % MXFP8_BLOCK == 0,
        f"float8.recipe_name {cfg.float8.recipe}: the weight-gradient GEMM scales blocks of {MXFP8_BLOCK} tokens, but "
        f"{per_rank} = {tokens}; make it a multiple of {MXFP8_BLOCK}",
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


def _check_float8_flags(cfg: Float8) -> None:
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


def resolve_dp_shard(dp_replicate: int, dp_shard: int, tp: int, world_size: int, cp: int = 1) -> int:
    """data_parallel_shard_degree for this world size (-1 = the rest); ConfigError unless the degrees multiply to
    the world size. ParallelDims and check_world both call this."""
    for name, value in (
        ("data_parallel_replicate_degree", dp_replicate),
        ("context_parallel_degree", cp),
        ("tensor_parallel_degree", tp),
    ):
        if value < 1:
            raise ConfigError(f"parallelism.{name} must be >= 1, got {value}")
    others = dp_replicate * cp * tp
    named = "data_parallel_replicate_degree x " + ("context_parallel_degree x " if cp > 1 else "")
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(
                f"parallelism: {named}tensor_parallel_degree = {others} does not divide the world size {world_size}"
            )
        dp_shard = world_size // others
    if dp_shard < 1 or dp_replicate * dp_shard * cp * tp != world_size:
        cp_part = f"context_parallel_degree ({cp}) x " if cp > 1 else ""
        raise ConfigError(
            f"parallelism: data_parallel_replicate_degree ({dp_replicate}) x data_parallel_shard_degree "
            f"({dp_shard}) x {cp_part}tensor_parallel_degree ({tp}) must equal the world size {world_size}"
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


def check_world(cfg: JobConfig, world_size: int) -> None:
    """What the config and the world size decide: the degrees multiply to the world, the global batch divides,
    sequence parallel splits every sequence. run_train.sh runs it before torchrun starts a rank; ParallelDims too."""
    p = cfg.parallelism
    tp, cp = p.tensor_parallel_degree, p.context_parallel_degree
    dp_shard = resolve_dp_shard(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, tp, world_size, cp)
    grad_accum_steps(cfg.training, p.data_parallel_replicate_degree * dp_shard)
    check_sequence_split(cfg.training.seq_len, p)


def check_sequence_split(seq_len: int, p: Parallelism) -> None:
    """Context parallelism splits every sequence into chunks (2 x degree with head-tail load balancing), and
    sequence parallel (TP) splits each rank's part again into tensor_parallel_degree pieces: all must be whole."""
    tp, cp = p.tensor_parallel_degree, p.context_parallel_degree
    if cp > 1:
        chunks = 2 * cp if p.context_parallel_load_balancer else cp
        how = (
            f"2 x context_parallel_degree = {chunks} chunks (context_parallel_load_balancer headtail: rank i holds "
            f"chunks i and {chunks - 1} - i)"
            if p.context_parallel_load_balancer
            else f"context_parallel_degree = {cp} chunks"
        )
        if seq_len % chunks:
            raise ConfigError(f"training.seq_len ({seq_len}) must split into {how}; make it a multiple of {chunks}")
    if (seq_len // cp) % tp:  # sequence parallel splits every rank's part of a sequence into tp pieces
        part = f"each context-parallel rank's {seq_len // cp} tokens" if cp > 1 else f"training.seq_len ({seq_len})"
        multiple = cp * math.lcm(tp, 2 if cp > 1 and p.context_parallel_load_balancer else 1)
        raise ConfigError(
            f"{part} must be divisible by tensor_parallel_degree ({tp}) (sequence parallel splits them); make "
            f"training.seq_len a multiple of {multiple}"
        )


# ----------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class ModelShape:
    """What the checks need of a model's shape; models.args.ModelArgs.shape() gives it (this module cannot import
    models/, which sits above it)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # n_heads when the flavor has plain multi-head attention
    ffn_hidden_dim: int
    vocab_size: int


SHAPE_OVERRIDES = ("vocab_size", "n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim_multiplier", "multiple_of")


def check_overrides_match_stored(m: Model, stored: Mapping[str, Any], source: str) -> None:
    """model.flavor from_checkpoint builds the shape stored at `source`: a model.* override may only repeat it."""
    for key in SHAPE_OVERRIDES:
        ours, theirs = getattr(m, key), stored[key]
        if key == "n_kv_heads" and theirs is None:
            theirs = stored["n_heads"]
        if ours is not None and ours != theirs:
            raise ConfigError(f"model.{key} {ours} differs from {source}'s {theirs} (model.flavor from_checkpoint)")


def check_same_model(flavor: str, source: str, difference: tuple[str, Any, Any] | None) -> None:
    """checkpoint.initial_load_path with a named flavor: the stored model must be the flavor's (`difference`: the
    first field that differs, its value there and here; models.args.first_difference)."""
    if difference is not None:
        field_name, there, here = difference
        raise ConfigError(
            f"checkpoint.initial_load_path {source} holds another model than model.flavor {flavor}: {field_name} is "
            f"{there!r} there but {here!r} here; set model.flavor from_checkpoint to train the stored shape"
        )


def check_model_shape(m: Model, shape: ModelShape, tokenizer_words: int, source: str = "") -> None:
    """The shape to build (flavor + model.* overrides, or the one stored at `source`) against the tokenizer and
    itself: whole heads of even size (RoPE rotates pairs), whole query groups, room for every token id."""
    if shape.vocab_size < tokenizer_words:
        if source:
            raise ConfigError(
                f"{source} has a vocabulary of {shape.vocab_size}, smaller than model.tokenizer_path's "
                f"{tokenizer_words} tokens: another tokenizer's model"
            )
        raise ConfigError(
            f"model.vocab_size ({shape.vocab_size}) is smaller than the tokenizer's {tokenizer_words} tokens"
        )
    where = source or f"flavor {m.flavor} + overrides"
    heads = f"model.dim {shape.dim}, model.n_heads {shape.n_heads}, model.n_kv_heads {shape.n_kv_heads} ({where})"
    if shape.dim % shape.n_heads or (shape.dim // shape.n_heads) % 2:
        raise ConfigError(f"{heads}: n_heads must divide dim into heads of even size (RoPE rotates pairs)")
    if shape.n_heads % shape.n_kv_heads:
        raise ConfigError(f"{heads}: n_kv_heads must divide n_heads (each key/value head serves a whole group)")


# ----------------------------------------------------------------------------- the parallel plan


def check_parallel_plan(cfg: JobConfig, shape: ModelShape, device_type: str) -> None:
    """What the degrees, the model's shape and the device type decide together; the launcher (for the device type
    its ranks will have) and each rank, before the build."""
    tp = cfg.parallelism.tensor_parallel_degree
    # Colwise wq/wk/wv shard whole heads; w1/w3 colwise and w2 rowwise shard the FFN hidden dim.
    for what, size in (
        ("n_heads", shape.n_heads),
        ("n_kv_heads", shape.n_kv_heads),
        ("FFN hidden dim", shape.ffn_hidden_dim),
    ):
        if size % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree ({tp}) must divide the model's {what} ({size})")
    t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    if p.enable_async_tensor_parallel:
        if device_type != "cuda":
            raise ConfigError(
                "parallelism.enable_async_tensor_parallel needs CUDA (symmetric memory); this run is on "
                f"{device_type} (gloo)"
            )
        if tp == 1 or not t.compile:
            raise ConfigError(
                "parallelism.enable_async_tensor_parallel needs tensor_parallel_degree > 1 and training.compile "
                "(the TP overlap is an inductor pass)"
            )
    block_ac = ac.mode == "full" or (ac.mode == "selective" and ac.selective_ac_option != "op")
    if block_ac and tp > 1 and t.compile and device_type == "cpu":
        # Known failure on the CPU build (torch 2.13), with FSDP too: a compiled TP block under whole-block
        # checkpointing fails in its first forward (AOTAutograd saves a DeviceMesh among the tensors for
        # backward). No AC and per-op SAC compile and train.
        raise ConfigError(
            f"tensor parallel + training.compile + activation_checkpoint.mode {ac.mode}"
            + (f" (selective_ac_option {ac.selective_ac_option})" if ac.mode == "selective" else "")
            + " fails in the first forward on CPU (a torch bug, docs/parallelisms.md); use activation_checkpoint"
            ".mode none or selective_ac_option op, or drop --training.compile"
        )


def check_memory_budget(cfg: JobConfig, estimate: Mapping[str, int]) -> None:
    """training.memory_budget_gib against the per-rank estimate (trainer/tools/dry_run.py's memory_estimate: name ->
    bytes), each rank before anything is allocated."""
    budget = cfg.training.memory_budget_gib
    total = sum(estimate.values())
    if budget is None or total <= budget * 2**30:
        return
    gib = 2**30
    parts = ", ".join(f"{name} {value / gib:.3g}" for name, value in estimate.items())
    p = cfg.parallelism
    raise ConfigError(
        f"training.memory_budget_gib {budget:g}: this rank would need about {total / gib:.3g} GiB ({parts}); "
        f"raise parallelism.context_parallel_degree ({p.context_parallel_degree}) or data_parallel_shard_degree, "
        "checkpoint more activations (activation_checkpoint.mode) or shorten training.seq_len "
        f"({cfg.training.seq_len})"
    )


# ----------------------------------------------------------------------------- float8 and the machine

MIN_TORCHAO = (0, 18)  # Float8LinearConfig.from_recipe_name, fp32 output for rowwise, _auto_filter_for_recipe
MIN_CUDA_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (SM 8.9), Hopper (9.0), Blackwell
MIN_ROCM_CAPABILITY = (9, 4)  # gfx942 (MI300X) is the first AMD GPU with float8 matmuls
MIN_MXFP8_CAPABILITY = (10, 0)  # MXFP8 block-scaled matmuls: Blackwell (B200, GB200) and later


def check_torchao(cfg: Float8, torchao_version: str | None) -> None:
    """float8 needs torchao, recent enough (`torchao_version`: the installed one, None when absent)."""
    if not cfg.enable_float8_linear:
        return
    need = ".".join(map(str, MIN_TORCHAO))
    if torchao_version is None:
        raise ConfigError(
            f"float8.enable_float8_linear needs torchao, which is not installed (pip install 'torchao>={need}')"
        )
    m = re.match(r"(\d+)\.(\d+)", torchao_version)
    if m is None or (int(m.group(1)), int(m.group(2))) < MIN_TORCHAO:
        raise ConfigError(
            f"float8.enable_float8_linear needs torchao>={need}, found {torchao_version} "
            f"(pip install -U 'torchao>={need}')"
        )


def check_float8_gpus(cfg: Float8, gpus: list[tuple[str, tuple[int, int]]], rocm: bool) -> None:
    """Every GPU (name, compute capability) has the float8 (MXFP8: block-scaled) matmuls the recipe needs, unless
    emulating."""
    if not cfg.enable_float8_linear or cfg.emulate:
        return
    minimum = MIN_ROCM_CAPABILITY if rocm else MIN_CUDA_CAPABILITY
    for name, cap in gpus:
        if cfg.is_mxfp8 and (rocm or cap < MIN_MXFP8_CAPABILITY):
            raise ConfigError(
                f"float8.recipe_name {cfg.recipe}: {name} (capability {cap[0]}.{cap[1]}) has no MXFP8 matmuls (needs "
                "10.0+, Blackwell); add --float8.emulate to emulate them, or use recipe_name rowwise"
            )
        if cap < minimum:
            raise ConfigError(
                f"float8.enable_float8_linear: {name} (capability {cap[0]}.{cap[1]}) has no float8 matmuls (needs "
                f"{minimum[0]}.{minimum[1]}+, e.g. H100, L4, MI300X); add --float8.emulate to emulate them, or turn "
                "float8 off"
            )


def check_float8_cpu(cfg: Float8, torch_version: str, cpu_rowwise: bool) -> None:
    """Training float8 on a CPU: MXFP8 only emulated; the rowwise recipes need a CPU `_scaled_mm` that takes per-row
    scales (`cpu_rowwise`: torch 2.11's asserts per-tensor ones, torch 2.13's has them). A dry run plans for GPUs
    and skips this."""
    if not cfg.enable_float8_linear or cfg.emulate or cfg.recipe == "tensorwise":
        return
    if cfg.is_mxfp8:
        raise ConfigError(
            f"float8.recipe_name {cfg.recipe}: MXFP8 kernels need a Blackwell GPU (SM100); on a CPU add "
            "--float8.emulate to emulate them"
        )
    if not cpu_rowwise:
        raise ConfigError(
            f"float8.recipe_name {cfg.recipe}: torch {torch_version}'s CPU float8 matmul takes per-tensor scales "
            "only; use recipe_name tensorwise, add --float8.emulate, or torch >= 2.13 on a CPU"
        )
