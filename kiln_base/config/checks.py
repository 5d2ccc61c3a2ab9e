"""Every config check, in one place, run at the moment its facts are known:

    check_config_alone(cfg)                the config alone (ranges, flag combinations, files and packages): parse time
    check_model_fields(...)                + a model's fields, from any source: before anything computes with them
    check_model_shape(...)                 + the model's shape: the launcher and each rank, before any build
    check_parallel_plan(...)               + the shape, the degrees and the device type: each rank, before the build
    check_float8_device(...)               + what the GPUs and torch can do: each rank, before the build

What the world size and the shape decide about the layout (the degrees, the sequence split, the pipeline's stages,
the memory a rank needs) is the run's plan: kiln_base/config/plan.py computes and checks it (check_world,
plan_run, check_model_memory, check_memory_budget).

Each takes plain values (the caller gathers the facts: torch, the tokenizer, the checkpoint; check_config_alone only
looks for the files and packages the config names), so this module stays standard-library only and instant. A
failed check raises ConfigError: one line naming the key and what is valid.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kiln_base.config.plan import PP, ModelShape, check_microbatches
from kiln_base.config.schema import (
    FLOAT8_EXPERT_RECIPES,
    FROM_CHECKPOINT,
    MODEL_FAMILIES,
    PP_SCHEDULES,
    PP_ZERO_BUBBLE,
    Checkpoint,
    Eval,
    FaultTolerance,
    Float8,
    JobConfig,
    Model,
    Parallelism,
    Range,
    resolve_mixed_precision,
    validation_shape,
)
from kiln_base.errors import ConfigError
from kiln_base.files import object_store_problem, url_scheme


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


def check_config_alone(cfg: JobConfig) -> None:
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
    if cfg.fault_tolerance.enable:
        _check_fault_tolerance(cfg, check_environment=not cfg.job.dry_run and not cfg.job.print_config)
    if cfg.parallelism.pipeline_parallel_degree > 1:
        _check_pipeline_flags(cfg)
    _check_moe_balance_flags(cfg)
    _check_expert_parallel_flags(cfg)
    _check(
        not cfg.checkpoint.create_seed_checkpoint or cfg.checkpoint.enable_checkpoint,
        "checkpoint.create_seed_checkpoint writes step-0 into the checkpoint folder; "
        "add --checkpoint.enable_checkpoint",
    )
    _check(
        not t.skip_nonfinite_steps or cfg.optimizer.implementation == "fused",
        "training.skip_nonfinite_steps skips a step inside the fused optimizer kernel (it leaves the weights and "
        f"AdamW's state untouched); optimizer.implementation is {cfg.optimizer.implementation}: set it to fused",
    )
    src = cfg.checkpoint.initial_load_path
    m = cfg.model
    valid = MODEL_FAMILIES[m.name]
    _check(
        m.flavor in valid or m.flavor == FROM_CHECKPOINT,
        f"model.flavor '{m.flavor}' is not a model.name {m.name} flavor; choose from {', '.join(valid)}, "
        f"{FROM_CHECKPOINT}",
    )
    _check(
        cfg.model.flavor != FROM_CHECKPOINT or src is not None,
        "model.flavor from_checkpoint builds the shape stored with checkpoint.initial_load_path, which is not set",
    )
    _check_checkpoint_urls(cfg.checkpoint, cfg.job.dump_folder)
    _check(
        src is None or url_scheme(src) is not None or os.path.isdir(src),  # a URL: what is there, read at start
        f"checkpoint.initial_load_path: not a folder: {src} (a Hugging Face model folder or a kiln checkpoint)",
    )
    cp = cfg.parallelism.context_parallel_degree
    # A context-parallel rank holds 1/cp of each sequence: its Linears see local batch x seq_len / cp tokens.
    tokens, block = t.local_batch_size * t.seq_len // cp, cfg.float8.block_size
    per_rank = "training.local_batch_size x seq_len" + (f" / context_parallel_degree ({cp})" if cp > 1 else "")
    _check(
        not cfg.float8.enable_float8_linear or block is None or tokens % block == 0,
        f"float8.recipe_name {cfg.float8.recipe}: the weight-gradient GEMM scales blocks of {block} tokens, but "
        f"{per_rank} = {tokens}; make it a multiple of {block}",
    )
    if not cfg.job.dry_run and not cfg.job.print_config:
        found = "not a regular file" if os.path.exists(cfg.model.tokenizer_path) else "file not found"
        _check(
            os.path.isfile(cfg.model.tokenizer_path),
            f"model.tokenizer_path: {found}: {cfg.model.tokenizer_path} "
            "(point it at a tiktoken BPE file such as Llama3's tokenizer.model)",
        )
        val_path = cfg.validation.dataset_path if cfg.validation.enable else None  # read only when validating
        for section, path in (("training", t.dataset_path), ("validation", val_path)):
            _check(
                path is None or os.path.exists(path) or os.path.isfile(path + ".idx"),  # or a Megatron prefix
                f"{section}.dataset_path: not found: {path} (a jsonl/json/parquet/txt file, token files: a Megatron "
                ".bin/.idx prefix or .npy, or a folder)",
            )
        for i, source in enumerate(t.dataset_mix):
            _check(
                os.path.exists(source.path) or os.path.isfile(source.path + ".idx"),
                f"training.dataset_mix[{i}].path: not found: {source.path} (token files: a Megatron .bin/.idx "
                "prefix, a .npy file, or a folder of them)",
            )
        _check(
            not (t.dataset_mix and t.dataset_path is not None),
            "training.dataset_mix and training.dataset_path are both set; give one (a mix of one source is "
            "dataset_path)",
        )
        if cfg.eval.enable:
            _check_eval_files(cfg.eval)
        # find_spec looks the package up without importing it (wandb takes ~2 s to import).
        _check(
            not cfg.metrics.enable_wandb or importlib.util.find_spec("wandb") is not None,
            "metrics.enable_wandb needs the wandb package, which is not installed (pip install 'wandb>=0.17', or "
            "kiln's extra: pip install -e '.[wandb]'); or drop metrics.enable_wandb",
        )


def _check_checkpoint_urls(c: Checkpoint, dump: str) -> None:
    """A URL (`scheme://...`) names object storage, never a folder under job.dump_folder (which would make a local
    folder named `s3:`): checkpoint.folder and checkpoint.initial_load_path take an s3:// (s3fs) or gs:// (gcsfs)
    URL with its package installed (trainer/checkpoint/objects.py), saved in the foreground."""
    _check(
        url_scheme(dump) is None,
        f"job.dump_folder {dump}: a local folder (logs, traces, TensorBoard); a URL is not supported there; keep "
        "checkpoints in object storage with checkpoint.folder s3://BUCKET/PREFIX",
    )
    if c.enable_checkpoint:
        problem = object_store_problem(c.folder)  # also a URL's typo (s3:/b/p): it would be a local folder `s3:`
        _check(problem is None, f"checkpoint.folder {c.folder}: {problem}")
    src = c.initial_load_path
    if src is not None:
        problem = object_store_problem(src)  # a URL kiln reads from (s3://, gs://), with its package
        _check(problem is None, f"checkpoint.initial_load_path {src}: {problem}")


def _check_eval_files(cfg: Eval) -> None:
    """[eval] on: lm-eval installed, the include folders and the task files there. Whether a task name exists, its
    data loads and it is multiple choice needs lm-eval: the eval phase checks it before the first step."""
    _check(
        importlib.util.find_spec("lm_eval") is not None,
        "eval.enable needs lm-eval (lm-evaluation-harness), which is not installed (pip install 'lm-eval==0.4.13', "
        "or kiln's extra: pip install -e '.[eval]'); or drop eval.enable",
    )
    _check(bool(cfg.tasks), "eval.tasks is empty; name at least one task (the bundled one: kiln_cloze)")
    for folder in cfg.include_path:
        _check(os.path.isdir(folder), f"eval.include_path: not a folder: {folder} (a folder of lm-eval task files)")
    for task in cfg.tasks:
        if task.endswith((".yaml", ".yml")):
            _check(os.path.isfile(task), f"eval.tasks: task file not found: {task} (an lm-eval task YAML file)")


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
                ("high_precision_last", cfg.high_precision_last >= 0),
                ("disable_after_step", cfg.disable_after_step > 0),
                ("moe_fqns", bool(cfg.moe_fqns)),
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
    if cfg.auto_filter_small_kn and cfg.block_size is not None:
        raise ConfigError(
            f"float8.auto_filter_small_kn: torchao has no size thresholds for recipe_name {cfg.recipe}; "
            "drop the flag and name the Linears to keep in float8.filter_fqns"
        )
    if cfg.is_nvfp4 and not cfg.emulate:
        raise ConfigError(
            "float8.recipe_name nvfp4 runs emulated only: torchao's NVFP4 training kernels need Triton and a Blackwell "
            "GPU (SM100) and are not wired into kiln; add --float8.emulate (torchao's NVFP4 numerics, high-precision "
            "matmuls, any device)"
        )
    if cfg.is_nvfp4 and cfg.numerics_log_freq:
        raise ConfigError(
            "float8.numerics_log_freq: the numerics observatory has no NVFP4 statistics (it measures float8 casts); "
            "drop the flag with recipe_name nvfp4"
        )
    if cfg.moe_fqns and cfg.recipe not in FLOAT8_EXPERT_RECIPES and not cfg.is_mxfp8:
        raise ConfigError(
            f"float8.moe_fqns: the experts' grouped GEMMs have no {cfg.recipe} recipe (torchao 0.18 runs them float8 "
            "rowwise, with float8.recipe_name tensorwise or rowwise, or MXFP8, with mxfp8_rceil or "
            "mxfp8_rceil_wgrad_with_hp); change float8.recipe_name or drop float8.moe_fqns"
        )
    if cfg.precompute_float8_dynamic_scale_for_fsdp and not cfg.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather "
            "(it precomputes the scales of float8-all-gathered weights)"
        )


FT_LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's: the lighthouse's address, http://host:port


def _check_fault_tolerance(cfg: JobConfig, check_environment: bool) -> None:
    """fault_tolerance.enable: torchft installed, the replica group inside the job, the lighthouse named, and the
    settings kiln's synchronous mode runs (docs/fault_tolerance.md)."""
    ft, p = cfg.fault_tolerance, cfg.parallelism
    _check(
        ft.group_size >= 1,
        "fault_tolerance.group_size must be the number of replica groups (>= 1) with fault_tolerance.enable, got 0",
    )
    _check(
        ft.replica_id < ft.group_size,
        f"fault_tolerance.replica_id must be in [0, group_size) = [0, {ft.group_size}), got {ft.replica_id}",
    )
    _check(
        ft.min_replica_size <= ft.group_size,
        f"fault_tolerance.min_replica_size ({ft.min_replica_size}) must be <= group_size ({ft.group_size}): a step "
        "would never have enough replica groups to commit",
    )
    if ft.semi_sync_method == "diloco":
        _check_diloco(ft)
    steps = cfg.training.steps
    _check(
        ft.semi_sync_method is None or ft.sync_steps <= steps,
        f"fault_tolerance.sync_steps ({ft.sync_steps}) exceeds training.steps ({steps}): under {ft.semi_sync_method} "
        f"the groups' weights would not all meet even once (the whole model has synced first after step sync_steps); "
        f"use sync_steps <= {steps}",
    )
    _check(
        p.data_parallel_replicate_degree == 1,
        f"parallelism.data_parallel_replicate_degree = {p.data_parallel_replicate_degree} with fault_tolerance.enable: "
        "the replica groups are the replicate dimension (fault_tolerance.group_size); set it to 1",
    )
    for key, degree in (
        ("pipeline_parallel_degree", p.pipeline_parallel_degree),
        ("context_parallel_degree", p.context_parallel_degree),
    ):
        _check(
            degree == 1,
            f"parallelism.{key} = {degree}: not supported with fault_tolerance.enable yet (issue 41); inside a replica "
            "group kiln runs FSDP, TP, float8, activation checkpointing and compile",
        )
    if not check_environment:
        return
    _check(
        importlib.util.find_spec("torchft") is not None,
        "fault_tolerance.enable needs the torchft package, which is not installed (pip install 'torchft==0.2.0', or "
        "kiln's extra: pip install -e '.[ft]'); or drop fault_tolerance.enable",
    )
    _check(
        bool(os.environ.get(FT_LIGHTHOUSE_ENV)),
        f"fault_tolerance.enable: {FT_LIGHTHOUSE_ENV} is not set; export {FT_LIGHTHOUSE_ENV}=http://HOST:PORT, the "
        "address of a running torchft_lighthouse (docs/fault_tolerance.md)",
    )


def _check_diloco(ft: FaultTolerance) -> None:
    """DiLoCo's schedule (torchft's rules): the fragments take turns, one every sync_steps / fragments steps, and a
    fragment's sync must end before the next begins. The fragments themselves need the model's shape
    (plan.diloco_fragments)."""
    given = len(ft.module_fqns_per_model_fragment)
    _check(
        not given or ft.num_fragments in (1, given),
        f"fault_tolerance.num_fragments ({ft.num_fragments}) contradicts module_fqns_per_model_fragment, which lists "
        f"{given} fragments; drop num_fragments or make it {given}",
    )
    n = given or ft.num_fragments
    _check(
        ft.sync_steps % n == 0,
        f"fault_tolerance.sync_steps ({ft.sync_steps}) must be a multiple of the {n} DiLoCo fragments (num_fragments "
        "or module_fqns_per_model_fragment): each fragment syncs once every sync_steps, in turn",
    )
    per = ft.sync_steps // n
    _check(
        ft.fragment_sync_delay < per,
        f"fault_tolerance.fragment_sync_delay ({ft.fragment_sync_delay}) must be below sync_steps / fragments = "
        f"{ft.sync_steps} / {n} = {per}: a fragment's sync must end before the next fragment's begins",
    )


def _check_moe_balance_flags(cfg: JobConfig) -> None:
    """What MoE load balancing (trainer/step/moe_balance.py) cannot be combined with."""
    aux, bias, p = cfg.model.moe_aux_loss_coeff, cfg.model.moe_load_balance_coeff, cfg.parallelism
    # The loss is read from the model after each micro-batch's forward; a pipeline's schedule runs the forward
    # and backward of every stage itself, with the last stage's loss only.
    _check(
        not aux or p.pipeline_parallel_degree == 1,
        f"model.moe_aux_loss_coeff {aux} with {PP}degree {p.pipeline_parallel_degree}: the pipeline's schedule "
        "backpropagates the last stage's loss only; use model.moe_load_balance_coeff (the expert bias) instead",
    )
    # The aux loss pools the router statistics over the micro-batch's tokens; a CP rank holds part of each sequence.
    _check(
        not aux or p.context_parallel_degree == 1,
        f"model.moe_aux_loss_coeff {aux} with parallelism.context_parallel_degree {p.context_parallel_degree}: the "
        "aux loss pools each micro-batch's router statistics, which context parallelism splits over ranks; use "
        "model.moe_load_balance_coeff (the expert bias) instead",
    )
    # Under TP each rank of an MoE layer routes its own part of each sequence (parallelisms/parallelize.py).
    _check(
        not aux or p.tensor_parallel_degree == 1,
        f"model.moe_aux_loss_coeff {aux} with parallelism.tensor_parallel_degree {p.tensor_parallel_degree}: the "
        "aux loss pools each micro-batch's router statistics, which an MoE layer under tensor parallelism splits "
        "over the TP ranks (each routes its part of the sequence); use model.moe_load_balance_coeff (the expert "
        "bias) instead",
    )
    _check(
        not bias or not cfg.fault_tolerance.enable,
        f"model.moe_load_balance_coeff {bias} with fault_tolerance.enable: the expert bias is updated from one "
        "replica group's counts and would drift apart between groups; set it to 0 (model.moe_aux_loss_coeff "
        "balances through the averaged gradients)",
    )


def _check_pipeline_flags(cfg: JobConfig) -> None:
    """What pipelining cannot be combined with, and its micro-batches (the split needs the model's shape:
    check_pipeline)."""
    p = cfg.parallelism
    check_microbatches(p, cfg.training.local_batch_size)
    if cfg.validation.enable:  # validation runs through the pipeline too, in micro-batches of the same size
        check_microbatches(p, validation_shape(cfg.validation, cfg.training)[0], "validation.local_batch_size")
    if cfg.eval.enable:  # evaluation batches run through the pipeline in micro-batches of the same size
        check_microbatches(p, cfg.eval.batch_size, "eval.batch_size")
    if p.pipeline_parallel_schedule in PP_ZERO_BUBBLE and cfg.training.compile:
        raise ConfigError(
            f"{PP}schedule {p.pipeline_parallel_schedule} splits each backward into input and weight gradients, "
            "which torch does not run on compiled stages; drop --training.compile or use Interleaved1F1B"
        )
    # A context-parallel rank's micro-batch holds 1/cp of each sequence: its Linears see mbs x seq_len / cp tokens.
    cp = p.context_parallel_degree
    f8, tokens = cfg.float8, p.pipeline_parallel_microbatch_size * cfg.training.seq_len // cp
    block = f8.block_size  # MXFP8 and NVFP4 scale the weight-gradient GEMM's tokens in blocks
    if f8.enable_float8_linear and block is not None and tokens % block:
        per_rank = f"{PP}microbatch_size x training.seq_len" + (f" / context_parallel_degree ({cp})" if cp > 1 else "")
        raise ConfigError(
            f"float8.recipe_name {f8.recipe}: the weight-gradient GEMM scales blocks of {block} tokens of each "
            f"pipeline micro-batch, but {per_rank} = {tokens}; make it a multiple of {block}"
        )
    ac = cfg.activation_checkpoint
    if p.pipeline_parallel_schedule in PP_ZERO_BUBBLE and ac.mode == "selective" and ac.selective_ac_option == "op":
        # Measured: torch's selective checkpoint refuses the second backward ("Trying to backward an extra time").
        raise ConfigError(
            f"{PP}schedule {p.pipeline_parallel_schedule} runs each block's backward twice (input, then weight "
            "gradients), which per-op selective activation checkpointing refuses; use activation_checkpoint.mode "
            "full or none, selective_ac_option N, or Interleaved1F1B"
        )
    if cfg.profiling.saved_activations_report:
        raise ConfigError(
            "profiling.saved_activations_report measures one model's forward and backward; it does not run under "
            f"pipeline parallelism ({PP}degree {p.pipeline_parallel_degree}): measure with the degree at 1"
        )


def _check_expert_parallel_flags(cfg: JobConfig) -> None:
    """What expert parallelism does not have (parallelisms/expert_parallel.py); the degree against the shard degree
    is Degrees.of's, against the experts check_parallel_plan's."""
    p = cfg.parallelism
    etp = p.expert_tensor_parallel_degree
    _check(
        etp == 1,
        f"parallelism.expert_tensor_parallel_degree {etp}: kiln has no tensor parallelism inside the experts (each "
        "expert runs whole on its expert-parallel rank); use 1",
    )
    ac = cfg.activation_checkpoint
    ep = p.expert_parallel_degree
    # Measured (torch 2.13): with the eager dispatch inside, the block compiles inside its (eager) checkpoint
    # (parallelisms/parallelize.py apply_compile), and per-op SAC's recompute then meets other ops than its forward
    # recorded ("_record_function_enter_new ... invocation index 3 ... not found in storage"). (Compiled outside
    # the checkpoint, dynamo ran the checkpoint eagerly and its recompute uncompiled: the same refusal.)
    _check(
        not (ep > 1 and cfg.training.compile and ac.mode == "selective" and ac.selective_ac_option == "op"),
        f"parallelism.expert_parallel_degree {ep} with training.compile and per-op selective activation "
        "checkpointing: the dispatch runs eagerly between each block's compiled graphs, whose recompute per-op SAC "
        "cannot match to its forward; use activation_checkpoint.mode full or none, or selective_ac_option N"
        + " (with tensor parallelism on a CPU only none: TP refuses whole-block AC with compile there)"
        * (p.tensor_parallel_degree > 1),
    )


# ----------------------------------------------------------------------------- the model's shape


SHAPE_OVERRIDES = ("vocab_size", "n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim_multiplier", "multiple_of")

# Every field of models.args.ModelArgs, its type and its valid values, whichever source gave it (a flavor and
# model.* overrides, a Hugging Face config.json, a kiln.json): checked before anything computes with the values.
# Sizes stay below 2**31 (kernels index with int32); how large a model the machine holds is check_model_memory's.
_SIZE = Range(lo=1, hi=2**31 - 1)
MODEL_FIELDS: dict[str, tuple[str, Range | None]] = {
    "dim": ("int", _SIZE),
    "n_layers": ("int", _SIZE),
    "n_heads": ("int", _SIZE),
    "n_kv_heads": ("int or null", _SIZE),
    "vocab_size": ("int", _SIZE),
    "multiple_of": ("int", _SIZE),
    "ffn_dim_multiplier": ("number or null", Range(lo=0, lo_open=True, hi=1_000_000)),
    "norm_eps": ("number", Range(lo=0, lo_open=True, hi=1)),
    "rope_theta": ("number", Range(lo=0, lo_open=True)),
    "rope_scaling": ("bool", None),
    "rope_scaling_factor": ("number", Range(lo=0, lo_open=True)),
    "rope_low_freq_factor": ("number", Range(lo=0, lo_open=True)),
    "rope_high_freq_factor": ("number", Range(lo=0, lo_open=True)),
    "rope_original_max_seq_len": ("int", _SIZE),
    "max_seq_len": ("int", _SIZE),
    "context_len": ("int", _SIZE),
    "depth_init": ("bool", None),
    "tie_word_embeddings": ("bool", None),
    "attn_type": ("str", None),
    "attn_mask_type": ("str", None),
    "bos_id": ("int or null", Range(lo=0, hi=2**31 - 1)),
    # Qwen3: per-head q/k norm, a head_dim of its own, an explicit FFN width; mixture of experts (0 experts: dense).
    "head_dim": ("int or null", Range(lo=1, hi=2**31 - 1)),
    "qk_norm": ("bool", None),
    "ffn_dim": ("int or null", Range(lo=1, hi=2**31 - 1)),
    "moe_num_experts": ("int", Range(lo=0, hi=2**31 - 1)),
    "moe_top_k": ("int", Range(lo=1, hi=2**31 - 1)),
    "moe_hidden_dim": ("int", Range(lo=0, hi=2**31 - 1)),
    "moe_shared_hidden_dim": ("int", Range(lo=0, hi=2**31 - 1)),
    "moe_score_func": ("str", None),
    "moe_route_norm": ("bool", None),
    "moe_route_scale": ("number", Range(lo=0, lo_open=True)),
    "moe_grouped_mm": ("bool", None),
}
MODEL_CHOICES: dict[str, tuple[str, ...]] = {
    "attn_type": ("sdpa", "flex", "varlen"),
    "attn_mask_type": ("causal", "block_causal"),
    "moe_score_func": ("softmax", "sigmoid"),
}


def _of_type(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith("or null")
    if kind.startswith("int"):
        return type(value) is int
    if kind.startswith("number"):
        return type(value) in (int, float)
    if kind.startswith("str"):
        return type(value) is str
    return type(value) is bool


def check_model_fields(values: Mapping[str, Any], where: str) -> None:
    """Each ModelArgs field in `values` (field name -> value) has its type and lies in its range (MODEL_FIELDS),
    before anything divides by a head count or allocates a layer: ConfigError naming `where` and the field."""
    for name, value in values.items():
        if name not in MODEL_FIELDS:
            raise ConfigError(
                f"{where}: model field '{name}' is unknown to this kiln (fields: {', '.join(MODEL_FIELDS)})"
            )
        kind, valid = MODEL_FIELDS[name]
        if not _of_type(value, kind):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ConfigError(f"{where}: model {name} must be {'an' if kind[0] == 'i' else 'a'} {kind}, got {shown}")
        if valid is not None and value is not None and not valid.contains(value):
            raise ConfigError(f"{where}: model {name} must be {valid.describe(value)}, got {value!r}")
        if name in MODEL_CHOICES and value not in MODEL_CHOICES[name]:
            raise ConfigError(f"{where}: model {name} must be one of {', '.join(MODEL_CHOICES[name])}, got {value!r}")
    if values.get("rope_scaling") and values.get("rope_high_freq_factor", 4.0) <= values.get(
        "rope_low_freq_factor", 1.0
    ):
        raise ConfigError(
            f"{where}: rope scaling needs rope_high_freq_factor > rope_low_freq_factor (it divides by their "
            f"difference), got {values.get('rope_high_freq_factor')} and {values.get('rope_low_freq_factor')}"
        )
    experts = values.get("moe_num_experts", 0)
    if experts > 0 and not values.get("moe_top_k", 1) <= experts:
        raise ConfigError(f"{where}: model moe_top_k {values.get('moe_top_k')} exceeds moe_num_experts {experts}")
    if experts > 0 and values.get("moe_hidden_dim", 0) < 1:
        raise ConfigError(f"{where}: model moe_hidden_dim must be >= 1 with moe_num_experts {experts}")


def check_moe_balance(m: Model, experts: int, where: str) -> None:
    """The MoE balancing keys need routed experts: a dense shape (`experts` 0, of `where`) refuses them."""
    for key in ("moe_load_balance_coeff", "moe_aux_loss_coeff"):
        value = getattr(m, key)
        _check(
            not value or experts > 0,
            f"model.{key} {value} balances a mixture of experts, but {where} is dense (no MoE layers); set it to 0",
        )


def check_overrides_match_stored(m: Model, stored: Mapping[str, Any], source: str) -> None:
    """model.flavor from_checkpoint builds the shape stored at `source`: a model.* override may only repeat it."""
    for key in SHAPE_OVERRIDES:
        ours, theirs = getattr(m, key), stored[key]
        if key == "n_kv_heads" and theirs is None:
            theirs = stored["n_heads"]
        if ours is not None and ours != theirs:
            raise ConfigError(f"model.{key} {ours} differs from {source}'s {theirs} (model.flavor from_checkpoint)")


def check_family(name: str, stored: str, source: str) -> None:
    """model.flavor from_checkpoint: the stored model (`stored`: its family, models.args.family_of) must be of
    model.name's family; a Qwen3 folder trained as model.name llama3 would be logged, counted and exported as
    the wrong family."""
    if stored != name:
        raise ConfigError(
            f"checkpoint.initial_load_path {source} holds a {stored} model but model.name is {name}; set model.name "
            f"{stored} (model.flavor from_checkpoint)"
        )


def check_ffn_overrides(m: Model, ffn_dim: int | None) -> None:
    """model.ffn_dim_multiplier and model.multiple_of compute a Llama 3 FFN width; a flavor with its width given
    (Qwen3's ffn_dim) would ignore them silently."""
    for key in ("ffn_dim_multiplier", "multiple_of"):
        if ffn_dim is not None and getattr(m, key) is not None:
            raise ConfigError(
                f"model.{key} is set, but model.name {m.name} flavor {m.flavor} has its FFN width given ({ffn_dim}),"
                " which the Llama 3 FFN rule does not change; drop it"
            )


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
    itself: whole heads of even size (RoPE rotates pairs), whole query groups, room for every token id. The fields
    are in range already (check_model_fields)."""
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
    if shape.head_dim and shape.head_dim % 2:
        raise ConfigError(f"{where}: model head_dim {shape.head_dim} is odd (RoPE rotates pairs)")
    if not shape.head_dim and (shape.dim % shape.n_heads or (shape.dim // shape.n_heads) % 2):
        raise ConfigError(f"{heads}: n_heads must divide dim into heads of even size (RoPE rotates pairs)")
    if shape.n_heads % shape.n_kv_heads:
        raise ConfigError(f"{heads}: n_kv_heads must divide n_heads (each key/value head serves a whole group)")


# ----------------------------------------------------------------------------- the parallel plan


def check_parallel_plan(cfg: JobConfig, shape: ModelShape, device_type: str) -> None:
    """What the degrees, the model's shape and the device type decide together; the launcher (for the device type
    its ranks will have) and each rank, before the build."""
    tp = cfg.parallelism.tensor_parallel_degree
    if tp > 1 and shape.experts and cfg.parallelism.expert_parallel_degree == 1:
        # Under TP an MoE layer's ranks each route their own part of the sequence; the experts are split over them
        # (torchtitan's expert_tensor_parallel_degree 1), never replicated on every TP rank.
        raise ConfigError(
            f"parallelism.tensor_parallel_degree {tp} with a mixture-of-experts model (model.flavor "
            f"{cfg.model.flavor}, {shape.experts} experts) needs expert parallelism over the TP ranks: each TP rank "
            f"routes its own part of the sequence to experts split over them; set parallelism.expert_parallel_degree "
            f"to a multiple of {tp} (e.g. {tp}), or tensor_parallel_degree 1"
        )
    # Colwise wq/wk/wv shard whole heads; w1/w3 colwise and w2 rowwise shard the FFN hidden dim (an MoE's shared
    # experts'; its routed experts are split over EP, not TP).
    ffn = shape.shared_hidden_dim if shape.experts else shape.ffn_hidden_dim
    for what, size in (
        ("n_heads", shape.n_heads),
        ("n_kv_heads", shape.n_kv_heads),
        ("shared experts' hidden dim" if shape.experts else "FFN hidden dim", ffn),
    ):
        if size % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree ({tp}) must divide the model's {what} ({size})")
    cp = cfg.parallelism.context_parallel_degree
    if cp > 1 and shape.attn_type != "sdpa":
        raise ConfigError(
            f"parallelism.context_parallel_degree {cp} with model.flavor {cfg.model.flavor} (document-masked "
            f"attention, attn_type {shape.attn_type}): kiln's context-parallel attention is causal over the whole "
            "sequence and does not split a document mask over its ranks yet; use a causal flavor (without "
            "_flex/_varlen) or context_parallel_degree 1"
        )
    check_float8_blocks(cfg.float8, shape.n_layers)
    check_float8_experts(cfg.float8, shape, cfg.model.flavor, cfg.training.compile)
    ep, experts = cfg.parallelism.expert_parallel_degree, shape.experts
    if ep > 1 and experts == 0:
        raise ConfigError(
            f"parallelism.expert_parallel_degree {ep}: model.flavor {cfg.model.flavor} is dense (no experts to split); "
            "use expert_parallel_degree 1 or an MoE flavor"
        )
    _check(
        experts % ep == 0,
        f"parallelism.expert_parallel_degree ({ep}) must divide the model's {experts} experts (moe_num_experts): "
        "each expert-parallel rank holds the same number of them",
    )
    ft = cfg.fault_tolerance
    # torchft quantizes pseudo-gradients with triton kernels on the GPU; without them it silently sends them unquantized
    _check(
        not (ft.enable and ft.semi_sync_method == "diloco" and ft.should_quantize and device_type != "cuda"),
        f"fault_tolerance.should_quantize needs CUDA GPUs (torchft's triton kernels); this run is on {device_type}: "
        "set it false",
    )
    if shape.attn_type == "varlen" and device_type != "cuda":
        flavor = cfg.model.flavor
        flex = f"model.flavor {flavor.replace('_varlen', '_flex')}" if "_varlen" in flavor else "a _flex flavor"
        raise ConfigError(
            f"model.flavor {flavor}: varlen attention runs flash attention's variable-length kernel, which needs "
            f"CUDA; this run is on {device_type}: use {flex} (the same document mask, through flex attention)"
        )
    param = cfg.training.mixed_precision_param
    if shape.attn_type == "varlen" and resolve_mixed_precision(param, device_type) != "bfloat16":
        raise ConfigError(
            f"model.flavor {cfg.model.flavor}: varlen attention (flash attention) computes in bfloat16 or float16, "
            f"but training.mixed_precision_param is {param}; use bfloat16 (or auto), or a _flex flavor"
        )
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


def check_pipeline_device(p: Parallelism, device_type: str, warmup_sends_to_own_rank: bool) -> None:
    """The V schedule on a CPU needs a torch whose pipeline start-up sends nothing from a rank to itself
    (`warmup_sends_to_own_rank`: kiln_base.internals.pipeline_warmup_sends_to_own_rank); each rank, at the mesh."""
    v = p.pipeline_parallel_degree > 1 and PP_SCHEDULES[p.pipeline_parallel_schedule] == "v"
    if v and device_type == "cpu" and warmup_sends_to_own_rank:
        raise ConfigError(
            f"{PP}schedule {p.pipeline_parallel_schedule}: this torch starts a pipeline by sending between the two "
            "stages a rank holds in the V, which gloo (CPU) cannot (torch 2.13 does not send them); use "
            "InterleavedZeroBubble or Interleaved1F1B on a CPU"
        )


# ----------------------------------------------------------------------------- float8 and the machine

MIN_TORCHAO = (0, 18)  # Float8LinearConfig.from_recipe_name, fp32 output for rowwise, _auto_filter_for_recipe
MIN_FLOAT8_GROUPED_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm: Hopper and Blackwell
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
        if cfg.moe_fqns and not cfg.is_mxfp8 and (rocm or cap < MIN_FLOAT8_GROUPED_CAPABILITY):
            raise ConfigError(
                f"float8.moe_fqns: {name} (capability {cap[0]}.{cap[1]}) has no float8 grouped GEMM "
                "(torch._scaled_grouped_mm needs CUDA 9.0+, Hopper or Blackwell); add --float8.emulate to emulate it, "
                "or drop float8.moe_fqns"
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
    if not cfg.enable_float8_linear or cfg.emulate:
        return
    if cfg.moe_fqns:
        raise ConfigError(
            f"float8.moe_fqns: torchao's {'MXFP8' if cfg.is_mxfp8 else 'float8 rowwise'} grouped GEMMs (the experts) "
            "run on CUDA only; on a CPU add --float8.emulate to emulate them"
        )
    if cfg.recipe == "tensorwise":
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


def check_float8_experts(cfg: Float8, shape: ModelShape, flavor: str, compile_on: bool) -> None:
    """float8.moe_fqns against the model: routed experts to convert, whose GEMM dims (dim, the experts' hidden dim)
    torchao's scaled grouped GEMMs take: multiples of 16 (float8 rowwise: 16-byte aligned float8 rows) or of 32
    (MXFP8: whole scale blocks along both dims, since the input gradient scales along the other one)."""
    if not cfg.enable_float8_linear or not cfg.moe_fqns:
        return
    if not shape.experts:
        raise ConfigError(
            f"float8.moe_fqns {cfg.moe_fqns}: model.flavor {flavor} is dense (no routed experts); drop float8.moe_fqns"
        )
    multiple = 32 if cfg.is_mxfp8 else 16
    dims = {"dim": shape.dim, "moe_hidden_dim": shape.expert_hidden_dim}
    bad = [f"model.{k} {v}" for k, v in dims.items() if v % multiple]
    if bad:
        raise ConfigError(
            f"float8.moe_fqns with recipe_name {cfg.recipe}: the experts' grouped GEMMs need dims divisible by "
            f"{multiple}, but {', '.join(bad)} is not; keep the experts high precision (drop float8.moe_fqns) or "
            f"change the shape"
        )
    if compile_on and cfg.is_mxfp8 and cfg.emulate:
        # torchao's emulated MXFP8 casts fail in inductor's CPU code generation (an AssertionError on tile sizes in
        # the first step, torch 2.13); float8 rowwise's emulation is a custom op that compiled graphs call eagerly.
        raise ConfigError(
            f"float8.moe_fqns with recipe_name {cfg.recipe}, float8.emulate and training.compile: inductor cannot "
            "compile torchao's emulated MXFP8 grouped GEMMs; drop training.compile, or use recipe_name rowwise"
        )


def check_float8_blocks(cfg: Float8, n_layers: int) -> None:
    """The precision policy's block counts against the model, before the build: a count beyond the model's blocks,
    or counts that keep every block in high precision (no Linear left to train in float8; the check after the build
    could only blame float8.filter_fqns), are refused naming the key."""
    if not cfg.enable_float8_linear:
        return
    first_last, last = cfg.high_precision_first_last, cfg.high_precision_last
    for key, value in (("high_precision_first_last", first_last), ("high_precision_last", last)):
        if value > n_layers:
            raise ConfigError(f"float8.{key} {value} is more than the model's {n_layers} transformer blocks")
    last_blocks = cfg.high_precision_last_blocks(n_layers)
    kept = [b for b in range(n_layers) if b < first_last or b >= n_layers - max(first_last, last_blocks)]
    output_kept = any(f in "output" for f in cfg.filter_fqns)  # the one Linear outside the blocks
    if len(kept) == n_layers and output_kept:
        given = (("high_precision_first_last", first_last), ("high_precision_last", last))
        keys = [f"float8.{k} {v}" for k, v in given if v > 0]
        raise ConfigError(
            f"{' and '.join(keys)} keep{'s' * (len(keys) == 1)} all {n_layers} transformer blocks in high precision "
            f"(and float8.filter_fqns the output): no Linear would train in float8; keep fewer blocks (at most "
            f"{n_layers - 1} in all) or drop float8.enable_float8_linear"
        )
