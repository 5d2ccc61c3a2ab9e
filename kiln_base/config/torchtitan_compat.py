"""torchtitan's config keys as kiln reads them: one declarative table, a row per key of torchtitan's JobConfig
in its TOML releases (v0.1.0 .. v0.2.2), so a torchtitan user's TOML file and flags run as they are.

Each row says what kiln does with the key:

    honour   kiln has the key under the same name and meaning: passed through unchanged
    map      kiln has it under another name or shape (`model.converters = ["float8"]` ->
             `float8.enable_float8_linear = true`): translated, and the translation logged once
    ignore   accepted and ignored while the value asks for nothing kiln lacks (`context_parallel_degree = 1`,
             `pipeline_parallel_schedule_csv = ""`); any other value is refused with one line naming the key, the
             value and what kiln offers instead. Keys only read by a feature kiln refuses elsewhere (MoE's
             settings) are ignored whatever their value.

torchtitan's default value of a key is always accepted: a file that spells out every default (torchtitan's
`--job.save_config_file` writes one) must run. Names neither kiln nor torchtitan has stay errors, with the
closest name of either as a suggestion.

`resolve` rewrites the TOML table and the command-line items into kiln's own names before the parser
(parse.py) applies them. docs/migrating-from-torchtitan.md's key table is generated from ROWS
(`python scripts/torchtitan_keys_doc.py`) and tests/kiln_base/test_torchtitan_compat.py keeps the two equal, and ROWS
equal to the keys of torchtitan's JobConfig (tests/fixtures/torchtitan/job_config_keys.json).

kiln's own renamed keys (RENAMED: `float8.sqnr_log_freq` -> `float8.numerics_log_freq`) go through the same
rename rows and `resolve`, apart from ROWS: read as the new key with one warning naming both; the two names
given with different values in one source (the file, or the command line) are a ConfigError.

Standard library only; the parser calls it, and it imports the schema and the value converter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from kiln_base.config.schema import PP_SCHEDULES, JobConfig
from kiln_base.config.values import check_choice, convert, suggest
from kiln_base.errors import ConfigError

__all__ = ["ROWS", "ROWS_LIST", "Key", "resolve", "markdown_table"]

logger = logging.getLogger("kiln")

ALL = ("v0.1.0", "v0.2.0", "v0.2.1", "v0.2.2")
V010, V020, V02, V021, V022 = ALL[:1], ALL[1:2], ALL[1:], ALL[2:], ALL[3:]
V010_020 = ALL[:2]


class Refused(Exception):
    """Raised by a map function: this value asks for something kiln does not do (the message says what instead)."""


# ----------------------------------------------------------------------------- row kinds


@dataclass(frozen=True)
class Honour:
    note: str = ""

    def describe(self) -> str:
        return "honoured" + (f"; {self.note}" if self.note else "")


@dataclass(frozen=True)
class Map:
    """Translate the (converted) torchtitan value into kiln assignments {"section.key": value}."""

    fn: Callable[[Any], dict[str, Any]]
    text: str

    def describe(self) -> str:
        return self.text


@dataclass(frozen=True)
class Ignore:
    """Ignore the key when `accept(value)` (always when accept is None); refuse any other value with `offer`."""

    why: str
    accept: Callable[[Any], bool] | None = None
    accepted: str = ""
    offer: str = ""

    def describe(self) -> str:
        if self.accept is None:
            return f"ignored: {self.why}"
        return f"ignored when {self.accepted} ({self.why}); other values refused: {self.offer}"


@dataclass(frozen=True)
class Key:
    name: str  # dotted, as in torchtitan: section.key or section.sub.key
    releases: tuple[str, ...]
    type: Any  # Python type the value is converted to, strictly (a Literal is str + choices)
    action: Honour | Map | Ignore
    choices: tuple[str, ...] | None = None


def honour(name: str, releases: tuple[str, ...], note: str = "") -> Key:
    return Key(name, releases, None, Honour(note))


def rename(name: str, releases: tuple[str, ...], tp: Any, target: str, choices: tuple[str, ...] | None = None) -> Key:
    return Key(name, releases, tp, Map(lambda v: {target: v}, f"mapped to `{target}`"), choices)


def mapped(name: str, releases: tuple[str, ...], tp: Any, fn: Callable[[Any], dict[str, Any]], text: str) -> Key:
    return Key(name, releases, tp, Map(fn, text))


def ignore_if(name: str, releases: tuple[str, ...], tp: Any, values: tuple, why: str, offer: str) -> Key:
    """Ignored while the value is one of `values` (torchtitan's default among them); refused otherwise."""
    accepted = " or ".join(f"`{show(v)}`" for v in values)
    return Key(name, releases, tp, Ignore(why, lambda v: v in values, accepted, offer))


def ignore_any(name: str, releases: tuple[str, ...], why: str) -> Key:
    return Key(name, releases, None, Ignore(why))


def show(value: Any) -> str:
    """A value as TOML writes it (true, "c4", ["float8"]); None, which TOML lacks, as none."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return repr(value)


# ----------------------------------------------------------------------------- map functions

FLOAT8_CONVERTERS = ("float8", "quantize.linear.float8")  # v0.1.0's name; v0.2's registry name
GROUPED_FLOAT8_CONVERTER = "quantize.grouped_mm.float8"  # v0.2: the experts named by its fqns (float8.moe_fqns)
KILN_TOKENIZER = "assets/tokenizer/tokenizer.model"  # kiln's bundled test tokenizer (Model.tokenizer_path default)
TORCHTITAN_TEST_TOKENIZERS = ("tests/assets/test_tiktoken.model", "tests/assets/tokenizer")  # v0.1.0, v0.2


def _is_torchtitan_test_tokenizer(path: str) -> bool:
    return path.removeprefix("./").rstrip("/") in TORCHTITAN_TEST_TOKENIZERS


def _converters(value: list[str]) -> dict[str, Any]:
    for name in value:
        if name in FLOAT8_CONVERTERS:
            continue
        if name in ("mx", "quantize.linear.mx"):
            raise Refused(
                f"converter '{name}': MX (mxfp8) training is not supported; kiln offers float8: "
                'model.converters = ["float8"] with float8.recipe_name tensorwise, rowwise or rowwise_with_gw_hp'
            )
        if name == GROUPED_FLOAT8_CONVERTER:
            if not any(n in FLOAT8_CONVERTERS for n in value):
                raise Refused(
                    f"converter '{name}' without a Linear float8 converter: kiln's float8 on the experts rides on "
                    'float8.enable_float8_linear; add "quantize.linear.float8" and keep the Linears high precision '
                    "with float8.filter_fqns if wanted"
                )
            continue
        if name.startswith("quantize.grouped_mm."):
            raise Refused(
                f"converter '{name}': kiln runs MXFP8 on the experts as float8.recipe_name mxfp8_rceil with "
                'float8.moe_fqns (e.g. ["experts"]); use "quantize.linear.float8" and those keys'
            )
        raise Refused(f"unknown converter '{name}'; kiln has \"float8\" (float8.enable_float8_linear)")
    return {"float8.enable_float8_linear": any(name in FLOAT8_CONVERTERS for name in value)}


def _pp_schedule(value: str) -> dict[str, Any]:
    """torch's get_schedule_class matches names without regard to case; kiln's key takes torch's spelling."""
    name = next((n for n in PP_SCHEDULES if n.lower() == value.lower()), None)
    if name is None:
        csv = "runs a schedule from a CSV file, which kiln does not read"
        why = {
            "dualpipev": "DualPipeV overlaps expert-parallel communication (MoE), which kiln does not have",
            "pipelineschedulesingle": f"PipelineScheduleSingle {csv}",
            "pipelineschedulemulti": f"PipelineScheduleMulti {csv}",
        }.get(value.lower(), "unknown schedule")
        raise Refused(f"{why}; kiln runs {', '.join(PP_SCHEDULES)}")
    return {"parallelism.pipeline_parallel_schedule": name}


def _tokenizer_path(value: str) -> dict[str, Any]:
    return {"model.tokenizer_path": KILN_TOKENIZER if _is_torchtitan_test_tokenizer(value) else value}


def _hf_assets_path(value: str) -> dict[str, Any]:
    if _is_torchtitan_test_tokenizer(value):
        return {"model.tokenizer_path": KILN_TOKENIZER}
    return {"model.tokenizer_path": value.rstrip("/") + "/original/tokenizer.model"}


def _dataset(value: str) -> dict[str, Any]:
    return {"training.dataset": "kiln_corpus" if value == "c4_test" else value}


def _comm_mode(value: str) -> dict[str, Any]:
    if value == "local_tensor":
        raise Refused("simulating ranks on one device is not supported; --job.dry_run checks a config without GPUs")
    return {"job.dry_run": True} if value == "fake_backend" else {}


def _cp_load_balancer(value: str | None) -> dict[str, Any]:
    if value == "ptrr":
        raise Refused(
            "the per-token round-robin balancer serves torchtitan's flex attention (document masks), which kiln's "
            'context-parallel attention does not run; use "headtail" (or none)'
        )
    return {"parallelism.context_parallel_load_balancer": value}


def _compile_components(value: list[str]) -> bool:
    return "model" in value and set(value) <= {"model", "loss"}


# ----------------------------------------------------------------------------- the table

DUALPIPE_ONLY = "only read by the DualPipeV schedule, which kiln refuses"
DILOCO_ONLY = "read by DiLoCo (semi_sync_method `diloco`); docs/fault_tolerance.md"
MX_ONLY = "only read with an MX converter in model.converters, which kiln refuses"
MOE_ONLY = "only read with the MX grouped-GEMM converter, which kiln refuses (float8.recipe_name mxfp8_rceil instead)"
WORKERS_ONLY = "only read with dataloader worker processes (num_workers > 0), which kiln refuses"
MOE_OFFER = "MoE (expert parallelism) is not supported; kiln trains dense Llama 3"
NO_USER_MODULES = "kiln does not import user modules; its config keys are fixed (train.py --help)"
DRY_RUN_OFFER = "--job.dry_run prints which Linears became Float8Linear, the parallel plan and a memory estimate"
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
OFF = "asks for nothing"

ROWS_LIST: tuple[Key, ...] = (
    # job
    honour("job.config_file", ALL),
    honour("job.dump_folder", ALL),
    honour("job.description", ALL),
    ignore_any("job.use_for_integration_test", V010, "it tags the file for torchtitan's own integration tests"),
    ignore_if(
        "job.print_args", V010, bool, (False,), OFF, "kiln has --job.print_config (prints the merged config and exits)"
    ),
    honour("job.print_config", V02, "kiln prints the merged config and exits (torchtitan printed it and trained)"),
    ignore_if("job.custom_config_module", V02, str, ("",), OFF, NO_USER_MODULES),
    ignore_if("job.save_config_file", V021, str | None, (None,), OFF, "use --job.print_config > FILE (it then exits)"),
    # profiling
    honour("profiling.enable_profiling", ALL),
    honour("profiling.save_traces_folder", ALL),
    honour("profiling.profile_freq", ALL),
    honour("profiling.enable_memory_snapshot", ALL),
    honour("profiling.save_memory_snapshot_folder", ALL),
    ignore_if(
        "profiling.profiler_active",
        V02,
        int,
        (1,),
        "kiln traces 1 step per cycle",
        "kiln traces 1 step after 3 warm-up steps every profiling.profile_freq steps",
    ),
    ignore_if(
        "profiling.profiler_warmup",
        V02,
        int,
        (3,),
        "kiln warms up 3 steps",
        "kiln traces 1 step after 3 warm-up steps every profiling.profile_freq steps",
    ),
    # metrics
    honour("metrics.log_freq", ALL),
    honour("metrics.enable_tensorboard", ALL),
    honour("metrics.disable_color_printing", ALL, "kiln's log lines carry no colours either way"),
    honour("metrics.save_tb_folder", ALL),
    honour("metrics.save_for_all_ranks", ALL),
    honour(
        "metrics.enable_wandb",
        ALL,
        'the same environment variables (WANDB_PROJECT, default "kiln" where torchtitan\'s is "torchtitan"; '
        "WANDB_RUN_NAME, default the dump folder's name; WANDB_TEAM, ...); from the logging rank only, also with "
        "save_for_all_ranks; TensorBoard is written too when both are on; without the wandb package kiln stops "
        "(exit 2) where torchtitan logs an error and trains on",
    ),
    # model
    honour("model.name", ALL),
    honour("model.flavor", ALL),
    mapped(
        "model.tokenizer_path",
        ALL,
        str,
        _tokenizer_path,
        f"honoured; torchtitan's test tokenizer ./tests/assets/test_tiktoken.model -> kiln's bundled {KILN_TOKENIZER}",
    ),
    mapped(
        "model.converters",
        ALL,
        list[str],
        _converters,
        '`"float8"` (or `"quantize.linear.float8"`) -> `float8.enable_float8_linear = true`, no float8 converter -> '
        'false; `"quantize.grouped_mm.float8"` accepted beside it (its fqns -> `float8.moe_fqns`); MX converters '
        "refused",
    ),
    ignore_if("model.print_after_conversion", ALL, bool, (False,), OFF, DRY_RUN_OFFER),
    mapped(
        "model.hf_assets_path",
        V02,
        str,
        _hf_assets_path,
        "-> `model.tokenizer_path = <path>/original/tokenizer.model` (kiln reads Llama 3's tiktoken file, which "
        f"the HF repos keep under original/; weights in the folder are not loaded); torchtitan's test folder "
        f"./tests/assets/tokenizer -> kiln's bundled {KILN_TOKENIZER}",
    ),
    # optimizer
    honour("optimizer.name", ALL),
    honour("optimizer.lr", ALL),
    honour("optimizer.beta1", ALL),
    honour("optimizer.beta2", ALL),
    honour("optimizer.eps", ALL),
    honour("optimizer.weight_decay", ALL),
    honour("optimizer.implementation", ALL),
    ignore_if(
        "optimizer.early_step_in_backward",
        ALL,
        bool,
        (False,),
        OFF,
        "optimizer-in-backward is not supported; kiln steps after the backward and clips gradients",
    ),
    # lr_scheduler
    honour("lr_scheduler.warmup_steps", ALL),
    honour("lr_scheduler.decay_ratio", ALL),
    honour("lr_scheduler.decay_type", ALL),
    rename("lr_scheduler.lr_min", V010, float, "lr_scheduler.min_lr_factor"),
    honour("lr_scheduler.min_lr_factor", V02),
    ignore_if(
        "lr_scheduler.total_steps",
        V022,
        int | None,
        (None,),
        "the schedule spans training.steps",
        "kiln's schedule spans training.steps; use lr_scheduler.decay_ratio for a WSD tail",
    ),
    # training
    mapped(
        "training.dataset",
        ALL,
        str,
        _dataset,
        'honoured; `"c4_test"` (torchtitan\'s bundled C4 sample) -> `"kiln_corpus"` (kiln\'s bundled offline corpus); '
        '`"c4"` is the same allenai/c4 stream',
    ),
    honour("training.dataset_path", ALL),
    honour("training.local_batch_size", ALL),
    honour("training.global_batch_size", ALL),
    honour("training.seq_len", ALL),
    honour("training.max_norm", ALL),
    honour("training.steps", ALL),
    ignore_if(
        "training.enable_cpu_offload",
        ALL,
        bool,
        (False,),
        OFF,
        "FSDP CPU offload is not supported; shard wider (data_parallel_shard_degree) or use activation_checkpoint",
    ),
    ignore_if(
        "training.dtype",
        V02,
        str,
        ("float32",),
        "float32 master weights, as in kiln",
        "all-bfloat16 training is not supported; kiln keeps float32 weights and optimizer state and computes in "
        "training.mixed_precision_param",
    ),
    honour("training.mixed_precision_param", ALL),
    honour("training.mixed_precision_reduce", ALL),
    honour("training.compile", V010),
    honour("training.gc_freq", ALL),
    ignore_if(
        "training.gc_debug",
        ALL,
        bool,
        (False,),
        OFF,
        "GC debugging is not supported; training.gc_freq sets kiln's collection interval",
    ),
    honour("training.seed", V010_020),
    honour("training.deterministic", V010_020),
    ignore_if("training.debug_moe_force_load_balance", V020, bool, (False,), OFF, MOE_OFFER),
    ignore_if(
        "training.dataloader.num_workers",
        V021,
        int,
        (0,),
        "load in the training process, as kiln does",
        "kiln loads data in one background thread; use training.data_prefetch N",
    ),
    ignore_any("training.dataloader.persistent_workers", V021, WORKERS_ONLY),
    ignore_any("training.dataloader.pin_memory", V021, "kiln pins host batches whenever it trains on CUDA"),
    ignore_any("training.dataloader.prefetch_factor", V021, WORKERS_ONLY),
    # parallelism
    honour("parallelism.data_parallel_replicate_degree", ALL),
    honour("parallelism.data_parallel_shard_degree", ALL),
    honour("parallelism.fsdp_reshard_after_forward", ALL),
    honour("parallelism.tensor_parallel_degree", ALL),
    honour("parallelism.disable_loss_parallel", ALL),
    honour("parallelism.enable_async_tensor_parallel", ALL),
    ignore_if(
        "parallelism.enable_compiled_autograd",
        V010_020,
        bool,
        (False,),
        OFF,
        "compiled autograd is not supported; training.compile compiles each block's forward and backward",
    ),
    honour("parallelism.pipeline_parallel_degree", ALL),
    honour("parallelism.pipeline_parallel_split_points", V010),
    honour("parallelism.module_fqns_per_model_part", V02),
    honour("parallelism.pipeline_parallel_first_stage_less_layers", V02),
    honour("parallelism.pipeline_parallel_last_stage_less_layers", V02),
    honour("parallelism.pipeline_parallel_layers_per_stage", ALL),
    mapped(
        "parallelism.pipeline_parallel_schedule",
        ALL,
        str,
        _pp_schedule,
        f"honoured ({', '.join(PP_SCHEDULES)}), names matched without regard to case as torch does; DualPipeV "
        "(for MoE) and the base classes PipelineScheduleSingle / Multi (for CSV schedules) refused",
    ),
    ignore_if(
        "parallelism.pipeline_parallel_schedule_csv",
        ALL,
        str | None,
        ("", None),
        "no schedule file",
        "schedules from a CSV file are not supported; choose parallelism.pipeline_parallel_schedule",
    ),
    honour("parallelism.pipeline_parallel_microbatch_size", ALL),
    ignore_any("parallelism.pipeline_parallel_expert_parallel_overlap", V021, DUALPIPE_ONLY),
    honour("parallelism.context_parallel_degree", ALL, "kiln's own CP attention (CPU and CUDA; docs/parallelisms.md)"),
    honour("parallelism.context_parallel_rotate_method", ALL),
    mapped(
        "parallelism.context_parallel_load_balancer",
        V022,
        str | None,
        _cp_load_balancer,
        'honoured: `"headtail"` or none; `"ptrr"` (torchtitan\'s balancer for flex attention) refused',
    ),
    honour(
        "parallelism.expert_parallel_degree",
        V02,
        "ranks borrowed from the data-parallel shard ranks (and the CP ranks, as torchtitan does); with PP, CP, "
        "TP (EP over the TP ranks) and compile (the dispatch eager between compiled graphs): docs/moe.md",
    ),
    honour("parallelism.expert_tensor_parallel_degree", V02, "1 only: no tensor parallelism inside the experts"),
    ignore_if(
        "parallelism.expert_parallel_comm_backend",
        V021,
        str,
        ("standard",),
        "torch's all-to-all",
        "kiln's expert parallelism sends tokens with torch's all-to-all (\"standard\"); DeepEP is not supported",
    ),
    # checkpoint
    honour("checkpoint.enable_checkpoint", V010),
    rename("checkpoint.enable", V02, bool, "checkpoint.enable_checkpoint"),
    honour("checkpoint.folder", ALL),
    honour("checkpoint.interval", ALL),
    honour(
        "checkpoint.initial_load_path",
        ALL,
        "a kiln checkpoint or, as with torchtitan's initial_load_in_hf, a Hugging Face folder (recognised by its "
        "config.json); model weights only",
    ),
    ignore_if(
        "checkpoint.initial_load_model_weights_only",
        V010,
        bool,
        (True,),
        "kiln loads model weights only from checkpoint.initial_load_path",
        "to resume a full state, put the checkpoint in checkpoint.folder",
    ),
    ignore_if(
        "checkpoint.initial_load_model_only",
        V02,
        bool,
        (True,),
        "kiln loads model weights only from checkpoint.initial_load_path",
        "to resume a full state, put the checkpoint in checkpoint.folder",
    ),
    ignore_any("checkpoint.initial_load_in_hf", V02, "kiln recognises a Hugging Face folder by its config.json"),
    ignore_if(
        "checkpoint.initial_load_in_hf_quantized",
        V02,
        bool,
        (False,),
        OFF,
        "loading quantized HF weights is not supported; convert bf16 weights with scripts/convert_hf.py from_hf",
    ),
    honour("checkpoint.last_save_model_weights_only", V010),
    rename("checkpoint.last_save_model_only", V02, bool, "checkpoint.last_save_model_weights_only"),
    ignore_if(
        "checkpoint.last_save_in_hf",
        V02,
        bool,
        (False,),
        OFF,
        "export after training: scripts/convert_hf.py to_hf CHECKPOINT HF_DIR (config, tokenizer, shards)",
    ),
    honour("checkpoint.export_dtype", ALL),
    honour(
        "checkpoint.create_seed_checkpoint",
        ALL,
        "any number of ranks (one seed gives the same model in every layout, so a seed checkpoint is optional)",
    ),
    honour("checkpoint.async_mode", ALL),
    honour("checkpoint.keep_latest_k", ALL),
    honour("checkpoint.load_step", ALL),
    ignore_if(
        "checkpoint.exclude_from_loading",
        ALL,
        list[str],
        ([],),
        "load everything",
        "partial loads are not supported; kiln loads a full checkpoint or a weights-only one",
    ),
    ignore_if(
        "checkpoint.enable_ft_dataloader_checkpoints",
        V02,
        bool,
        (True,),
        "under fault_tolerance.enable each replica group saves its data-loader position in its own checkpoints",
        "kiln always checkpoints each replica group's data-loader position (no group re-reads or skips samples)",
    ),
    ignore_if(
        "checkpoint.enable_first_step_checkpoint",
        V02,
        bool,
        (False,),
        OFF,
        "not supported; checkpoint.interval 1 saves after the first step",
    ),
    ignore_if(
        "checkpoint.load_only",
        V02,
        bool,
        (False,),
        OFF,
        "load-only runs are not supported; kiln saves every checkpoint.interval steps when checkpointing is on",
    ),
    # activation_checkpoint
    honour("activation_checkpoint.mode", ALL, "`memory_budget` (v0.2) is not a kiln mode and is refused"),
    honour("activation_checkpoint.selective_ac_option", ALL),
    ignore_if(
        "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
        V02,
        list[str],
        (["moe.router.gate"], []),
        "torchtitan's default, the MoE router's gate: kiln's per-op SAC treats its mm as any other",
        "per-op SAC recomputes every second mm in kiln; forcing mm shapes by FQN is not supported",
    ),
    ignore_if(
        "activation_checkpoint.early_stop", V02, bool, (False,), OFF, "early-stop recomputation is not supported"
    ),
    ignore_any("activation_checkpoint.memory_budget", V02, "only read with mode memory_budget, which kiln refuses"),
    ignore_if(
        "activation_checkpoint.visualize_memory_budget_pareto",
        V02,
        bool,
        (False,),
        OFF,
        "not supported; profiling.saved_activations_report lists the bytes saved for backward by op",
    ),
    ignore_any(
        "activation_checkpoint.preserve_rng_state",
        V021,
        "Llama 3 has no dropout: recomputation draws no random numbers",
    ),
    ignore_if(
        "activation_checkpoint.determinism_check",
        V021,
        str,
        ("default",),
        "torch's default check",
        "kiln uses torch.utils.checkpoint's default determinism check",
    ),
    ignore_if(
        "activation_checkpoint.debug",
        V021,
        bool,
        (False,),
        OFF,
        "not supported; profiling.saved_activations_report lists the bytes saved for backward by op",
    ),
    # compile (v0.2)
    rename("compile.enable", V02, bool, "training.compile"),
    Key(
        "compile.components",
        V02,
        list[str],
        Ignore(
            "kiln compiles each transformer block; the loss stays eager",
            _compile_components,
            '`["model", "loss"]` or `["model"]`',
            'kiln compiles the model\'s transformer blocks (training.compile); use ["model"] or ["model", "loss"]',
        ),
    ),
    ignore_if("compile.backend", V02, str, ("inductor",), "kiln compiles with inductor", "kiln compiles with inductor"),
    # float8 (v0.1.0: the same section as kiln's)
    honour("float8.enable_fsdp_float8_all_gather", V010),
    honour("float8.precompute_float8_dynamic_scale_for_fsdp", V010),
    ignore_if(
        "float8.force_recompute_fp8_weight_in_bwd",
        V010,
        bool,
        (False,),
        OFF,
        "not supported (torchao dropped it); activation checkpointing decides what is recomputed",
    ),
    honour("float8.recipe_name", V010),
    honour("float8.filter_fqns", V010, "kiln's default is [\"output\"], torchtitan's []"),
    honour("float8.emulate", V010),
    # mx (v0.1.0)
    ignore_any("mx.use_fp8_dim1_cast_triton_kernel", V010, MX_ONLY),
    ignore_any("mx.recipe_name", V010, MX_ONLY),
    ignore_any("mx.filter_fqns", V010, MX_ONLY),
    # quantize (v0.2): float8 moved under quantize.linear.float8
    *(
        rename(f"quantize.linear.float8.{key}", V02, tp, f"float8.{key}", choices)
        for key, tp, choices in (
            ("enable_fsdp_float8_all_gather", bool, None),
            ("precompute_float8_dynamic_scale_for_fsdp", bool, None),
            ("recipe_name", str | None, RECIPES),
            ("filter_fqns", list[str], None),
            ("emulate", bool, None),
        )
    ),
    ignore_any("quantize.linear.mx.mxfp8_dim1_cast_kernel_choice", V02, MX_ONLY),
    ignore_any("quantize.linear.mx.recipe_name", V02, MX_ONLY),
    ignore_any("quantize.linear.mx.filter_fqns", V02, MX_ONLY),
    rename("quantize.grouped_mm.float8.fqns", V02, list[str], "float8.moe_fqns"),
    ignore_any("quantize.grouped_mm.mx.recipe_name", V02, MOE_ONLY),
    ignore_any("quantize.grouped_mm.mx.fqns", V02, MOE_ONLY),
    # comm
    honour("comm.init_timeout_seconds", ALL),
    honour("comm.train_timeout_seconds", ALL),
    ignore_if(
        "comm.trace_buf_size",
        ALL,
        int,
        (0, 20000),
        "0 = off; 20000 = torchtitan's default",
        "kiln leaves NCCL's flight recorder to the environment: export TORCH_NCCL_TRACE_BUFFER_SIZE=N",
    ),
    ignore_any("comm.save_traces_folder", V02, "flight-recorder dumps: kiln leaves them to the environment"),
    ignore_any("comm.save_traces_file_prefix", V02, "flight-recorder dumps: kiln leaves them to the environment"),
    mapped(
        "comm.mode",
        V021,
        str,
        _comm_mode,
        '`"default"` ignored; `"fake_backend"` (check a config without GPUs) -> `job.dry_run = true`; '
        '`"local_tensor"` refused',
    ),
    # memory_estimation
    ignore_if("memory_estimation.enabled", V010, bool, (False,), OFF, DRY_RUN_OFFER),
    ignore_if("memory_estimation.enable", V02, bool, (False,), OFF, DRY_RUN_OFFER),
    ignore_any("memory_estimation.disable_fake_mode", ALL, "only read with memory estimation on, which kiln refuses"),
    # fault_tolerance: kiln's [fault_tolerance], the same keys and meanings (docs/fault_tolerance.md)
    honour("fault_tolerance.enable", ALL, "synchronous mode; docs/fault_tolerance.md"),
    *(
        honour(f"fault_tolerance.{key}", releases)
        for key, releases in (
            ("replica_id", ALL),
            ("group_size", ALL),
            ("min_replica_size", ALL),
            ("process_group", V02),
            ("process_group_timeout_ms", V02),
        )
    ),
    honour(
        "fault_tolerance.semi_sync_method",
        ALL,
        "unset: synchronous; `local_sgd`: LocalSGD; `diloco`: DiLoCo (torchft's, outer SGD as torchtitan's)",
    ),
    honour("fault_tolerance.sync_steps", V010, "LocalSGD's and DiLoCo's steps between syncs"),
    *(
        honour(f"fault_tolerance.{key}", V010, DILOCO_ONLY)
        for key in ("should_quantize", "fragment_sync_delay", "fragment_update_alpha")
    ),
    # experimental
    ignore_if("experimental.custom_import", ALL, str, ("",), OFF, NO_USER_MODULES),
    ignore_if("experimental.custom_args_module", ALL, str, ("",), OFF, NO_USER_MODULES),
    # validation (v0.2): kiln's [validation] section, the same keys and meanings
    honour("validation.enable", V02),
    honour(
        "validation.dataset",
        V02,
        '`"c4_validation"` is the same allenai/c4 validation stream; kiln\'s default is `"kiln_corpus_validation"`, '
        "the bundled corpus's held-out split",
    ),
    honour("validation.dataset_path", V02),
    honour("validation.local_batch_size", V02, "kiln's default (unset) is training.local_batch_size"),
    honour("validation.seq_len", V02, "kiln's default (unset) is training.seq_len"),
    honour("validation.freq", V02),
    honour(
        "validation.steps",
        V02,
        "each validation reads the set from its start; a set shorter than `steps` is validated whole, with a warning",
    ),
    ignore_if(
        "validation.dataloader.num_workers",
        V021,
        int,
        (0,),
        "load in the training process, as kiln does",
        "kiln loads validation data in one background thread, as training's (training.data_prefetch)",
    ),
    ignore_any("validation.dataloader.persistent_workers", V021, WORKERS_ONLY),
    ignore_any("validation.dataloader.pin_memory", V021, "kiln pins host batches whenever it trains on CUDA"),
    ignore_any("validation.dataloader.prefetch_factor", V021, WORKERS_ONLY),
    # debug (v0.2.1+): training.seed and training.deterministic moved here
    rename("debug.seed", V021, int | None, "training.seed"),
    rename("debug.deterministic", V021, bool, "training.deterministic"),
    ignore_if(
        "debug.deterministic_warn_only",
        V021,
        bool,
        (False,),
        OFF,
        "kiln's training.deterministic is strict (a non-deterministic op is an error); there is no warn-only mode",
    ),
    ignore_if("debug.moe_force_load_balance", V021, bool, (False,), OFF, MOE_OFFER),
)

ROWS: dict[str, Key] = {row.name: row for row in ROWS_LIST}
assert len(ROWS) == len(ROWS_LIST), "a torchtitan key appears twice in ROWS_LIST"

# kiln's own keys that were renamed: the old name is read as the new one, with a warning naming both. The same
# rename rows as torchtitan's, kept apart from ROWS (which lists torchtitan's keys and nothing else).
RENAMED: dict[str, tuple[str, Any]] = {  # old name -> (new name, type)
    # the numerics observatory (float8/numerics.py) replaced the SQNR monitor and its key; it logs the same
    # output SQNR (output_sqnr_db) plus the per-operand statistics, at the same frequency
    "float8.sqnr_log_freq": ("float8.numerics_log_freq", int),
}
DEPRECATED: dict[str, Key] = {old: rename(old, (), tp, new) for old, (new, tp) in RENAMED.items()}


# ----------------------------------------------------------------------------- resolution


def _unknown(name: str, where: str, kiln: list[str]) -> ConfigError:
    """An unknown name, with the closest kiln or torchtitan name (kiln's first when both are as close)."""
    known = list(dict.fromkeys([*kiln, *ROWS]))
    sections = list(dict.fromkeys(k.split(".")[0] for k in known))
    section = name.split(".")[0]
    if section not in sections:
        return ConfigError(f"{where}: unknown section '{section}'{suggest(section, sections)}")
    in_section = [k for k in known if k.split(".")[0] == section]
    return ConfigError(f"{where}: unknown key '{name}'{suggest(name, in_section)}")


def _flatten(values: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """A TOML section's items with nested tables ([quantize.linear.float8]) as dotted names."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _negated(name: str) -> str | None:
    """`a.no_b` / `a.no-b` (a bare --a.no-b flag) -> `a.b`; None if the last part has no such prefix."""
    head, _, last = name.rpartition(".")
    if last.startswith(("no_", "no-")):
        return f"{head}.{last[3:]}"
    return None


def _translate(row: Key, raw: Any, where: str) -> tuple[dict[str, Any], str | None]:
    """kiln assignments for a torchtitan key's raw value, and the line to log (None: nothing to say)."""
    action = row.action
    if isinstance(action, Ignore) and action.accept is None:
        return {}, f"{row.name} = {show(raw)} ignored: {action.why}"
    value = convert(raw, row.type, where)
    check_choice(value, row.choices, where)
    if isinstance(action, Ignore):
        if action.accept is not None and not action.accept(value):
            raise ConfigError(f"{where} = {show(value)}: {action.offer}")
        return {}, f"{row.name} = {show(value)} ignored: {action.why}"
    assert isinstance(action, Map), row
    try:
        assigned = action.fn(value)
    except Refused as e:
        raise ConfigError(f"{where} = {show(value)}: {e}") from None
    if assigned == {row.name: value}:
        return assigned, None
    if not assigned:
        return {}, f"{row.name} = {show(value)} ignored"
    return assigned, f"{row.name} = {show(value)} -> " + ", ".join(f"{k} = {show(v)}" for k, v in assigned.items())


def resolve(
    toml: dict[str, Any], cli: list[tuple[str, str, Any]], source: str | None
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str, Any]]]:
    """Rewrite a TOML table and CLI (section, key, raw) items into kiln's names only.

    kiln keys pass through untouched (a bare CLI flag stays bare for
    the parser to resolve), torchtitan keys are translated by their ROWS entry and each translation is
    logged once (the last value of a key wins, as it does in the config). Raises ConfigError for a refused
    value and for a name neither kiln nor torchtitan has.
    """
    kiln = [f"{s.name}.{f.name}" for s in fields(JobConfig) for f in fields(s.default_factory)]  # type: ignore[arg-type]
    kiln_set = set(kiln)
    notes: dict[str, str] = {}
    warnings: dict[str, str] = {}
    spelled: dict[str, tuple[Any, str]] = {}  # within one source: old or new name -> (value, where), last wins

    def apply(name: str, raw: Any, where: str) -> dict[str, Any]:
        row = ROWS.get(name) or DEPRECATED.get(name)
        if row is None or isinstance(row.action, Honour):
            if name not in kiln_set:
                raise _unknown(name, where, kiln)
            for new, tp in RENAMED.values():
                if name == new:
                    spelled[name] = (convert(raw, tp, where), where)
            return {name: raw}
        assigned, note = _translate(row, raw, where)
        if name in DEPRECATED:
            ((new, value),) = assigned.items()
            spelled[name] = (value, where)
            warnings[name] = f"{name} is deprecated, read as {new} = {show(value)}: rename it to {new}"
            return assigned
        if note:
            notes[name] = note
        else:
            notes.pop(name, None)
        return assigned

    def check_both_spellings() -> None:
        """An old name and its new name given in the same source (the file, or the command line) must agree;
        across sources the command line wins, as for every key."""
        for old, (new, _) in RENAMED.items():
            if old in spelled and new in spelled and spelled[old][0] != spelled[new][0]:
                (a, where_a), (b, where_b) = spelled[old], spelled[new]
                raise ConfigError(
                    f"{where_a} = {show(a)} and {where_b} = {show(b)} disagree: {old} is the deprecated name of "
                    f"{new}; give {new} only"
                )
        spelled.clear()

    out_toml: dict[str, Any] = {}
    for section, values in toml.items():
        if not isinstance(values, dict):
            out_toml[section] = values  # not a [section] table: the parser reports it
            continue
        for name, raw in _flatten(values, f"{section}."):
            for target, value in apply(name, raw, f"{source}: {name}").items():
                s, _, k = target.partition(".")
                out_toml.setdefault(s, {})[k] = value
    check_both_spellings()

    out_cli: list[tuple[str, str, Any]] = []
    for section, key, raw in cli:
        name = f"{section}.{key}"
        where = f"--{name}"
        if raw is None:  # a bare flag: --s.k (true) or --s.no-k (false)
            plain = _negated(name)
            if name in kiln_set or plain in kiln_set:
                out_cli.append((section, key, None))  # the parser resolves kiln's own bare flags
                continue
            row = ROWS.get(name) or ROWS.get(plain or "") or DEPRECATED.get(name) or DEPRECATED.get(plain or "")
            if row is None:
                raise _unknown(plain or name, f"--{plain or name}", kiln)
            if row.type is not bool and not (isinstance(row.action, Ignore) and row.action.accept is None):
                raise ConfigError(f"--{row.name}: needs a value")
            name, where, raw = row.name, f"--{row.name}", row.name == name
        # An unset optional value travels as "none": the parser reads a None value as a bare flag.
        for target, value in apply(name, raw, where).items():
            target_section, _, target_key = target.partition(".")
            out_cli.append((target_section, target_key, "none" if value is None else value))
    check_both_spellings()

    for note in notes.values():
        logger.info(f"torchtitan key {note}")
    for warning in warnings.values():
        logger.warning(warning)
    return out_toml, out_cli


# ----------------------------------------------------------------------------- documentation


def _releases(releases: tuple[str, ...]) -> str:
    if releases == ALL:
        return "all"
    return releases[0] if len(releases) == 1 else f"{releases[0]}–{releases[-1]}"


def markdown_table() -> str:
    """The key-by-key table of docs/migrating-from-torchtitan.md, one row per torchtitan key."""
    lines = ["| torchtitan key | releases | kiln |", "| --- | --- | --- |"]
    for row in ROWS_LIST:
        lines.append(f"| `{row.name}` | {_releases(row.releases)} | {row.action.describe().replace('|', '/')} |")
    return "\n".join(lines) + "\n"
