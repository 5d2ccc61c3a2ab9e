"""kiln's configuration schema: one dataclass per TOML section, each field with its help, choices and range.

Section and key names follow torchtitan so its users' TOML files read the same. The parser (parse.py) fills these
from defaults < TOML file < command line; the checks (checks.py) hold every rule between values. Standard library
only, so config handling stays instant.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kiln_base.errors import ConfigError

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
MAX_REPLICA_GROUPS = 4096  # far above TorchFT jobs' (tens to hundreds); 2**62 read samples for ever
TIMEOUT = Range(lo=1, hi=10**9, note="seconds")  # 10**9 s (31 years): far inside timedelta's and c10d's limits


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None, valid: Range | None = None) -> Any:
    """A dataclass field carrying its help text, allowed values (`choices`) or numeric range (`valid`)."""
    meta = {"help": help, "choices": choices, "valid": valid}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


DTYPES = ("bfloat16", "float32")
# Gradient reductions (training.mixed_precision_reduce): a dtype, or bfloat16 on the wire with a float32 sum.
BF16_WIRE = "bfloat16_wire"
REDUCE_DTYPES = ("float32", "bfloat16", BF16_WIRE)

# bf16 autocast against float32 on CPUs, debug model (docs/config.md, "Mixed precision"): no CPU measured so far
# runs bf16 faster.
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


# metrics.attention_flops: the two conventions for counting attention matmul FLOPs (models/flops.py).
ATTENTION_FLOPS = ("full", "causal")

FROM_CHECKPOINT = "from_checkpoint"  # model.flavor: build the shape stored with checkpoint.initial_load_path

# Meta's published shapes (models/args.py builds each). Every one also comes as document-masked variants that
# differ only in attention (torchtitan's naming: debugmodel_flex_attn, debugmodel_varlen_attn, 8B_flex, 8B_varlen).
BASE_FLAVORS = ("debugmodel", "8B", "70B", "405B", "3.1-8B", "3.1-70B", "3.1-405B", "3.2-1B", "3.2-3B")
ATTENTION_VARIANTS = ("flex", "varlen")  # models.args: attn_type, with attn_mask_type block_causal


def attention_flavor(base: str, attn_type: str) -> str:
    """The flavor name of `base` with `attn_type` attention: torchtitan's `debugmodel_flex_attn`, `8B_flex`."""
    return f"{base}_{attn_type}_attn" if base == "debugmodel" else f"{base}_{attn_type}"


FLAVORS = (*BASE_FLAVORS, *(attention_flavor(b, a) for a in ATTENTION_VARIANTS for b in BASE_FLAVORS))
# Qwen3 (torchtitan's flavor names; models/args.py QWEN3_FLAVORS): dense, and mixture-of-experts (*_moe, *-A*B).
QWEN3_FLAVOR_NAMES = ("debugmodel", "debugmodel_moe", "0.6B", "1.7B", "4B", "8B", "14B", "32B", "30B-A3B", "235B-A22B")
# model.name -> the names of its flavors, the one table of model families (models/args.py FAMILIES holds each
# flavor's ModelArgs under the same names). model.flavor is checked against its family's (check_config_alone).
MODEL_FAMILIES: dict[str, tuple[str, ...]] = {"llama3": FLAVORS, "qwen3": QWEN3_FLAVOR_NAMES}


@dataclass
class Job:
    config_file: str | None = _f(None, "TOML file to read; CLI flags override its values.")
    dump_folder: str = _f("./outputs", "Folder for checkpoints, traces and TensorBoard logs.")
    description: str = _f("kiln job", "Free-text description printed at start-up.")
    print_config: bool = _f(False, "Print the merged configuration as TOML and exit.")
    dry_run: bool = _f(False, "Build on the meta device, print the plan (params, FLOPs, mesh, float8) and exit.")


@dataclass
class Model:
    name: str = _f(
        "llama3", "Model family: llama3 (Llama 3, 3.1, 3.2) or qwen3 (Qwen3, dense and MoE).", tuple(MODEL_FAMILIES)
    )
    flavor: str = _f(
        "debugmodel",
        "Model shape, one of model.name's flavors. llama3: debugmodel, 8B, 70B, 405B, 3.1-* (llama3 rope scaling, "
        "131072 context), 3.2-* (tied embeddings); <flavor>_flex (debugmodel_flex_attn) and <flavor>_varlen "
        "(debugmodel_varlen_attn, CUDA only): the same shape with document-masked attention (block_causal: no "
        "attention across the BOS that starts a document). qwen3: debugmodel, 0.6B ... 32B; MoE debugmodel_moe, "
        "30B-A3B, 235B-A22B. from_checkpoint: the shape stored with checkpoint.initial_load_path (HF config.json "
        "or kiln.json).",
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
    # Mixture-of-experts load balancing (docs/moe.md): training settings, not the model's shape; a dense model
    # refuses them (check_moe_balance).
    moe_load_balance_coeff: float = _f(
        0.0,
        "MoE: the auxiliary-loss-free balancing step (DeepSeek-V3; torchtitan's load_balance_coeff, 1e-3 there): "
        "after each optimizer step each expert's routing bias moves by this towards balance, from the "
        "tokens-per-expert counts summed over the data-parallel ranks. 0 = off (the bias stays 0; a non-zero bias "
        "has no Hugging Face counterpart, so it refuses the HF export).",
        valid=AT_LEAST_0,
    )
    moe_aux_loss_coeff: float = _f(
        0.0,
        "MoE: the auxiliary balance loss (transformers' Qwen3-MoE load_balancing_loss_func, router_aux_loss_coef: "
        "0.001 in Qwen's configs) times this is added to each micro-batch's backpropagated loss; the logged loss "
        "stays the cross-entropy, the aux loss is logged as aux_loss. 0 = off.",
        valid=AT_LEAST_0,
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
class DatasetSource:
    """One weighted source of training.dataset_mix: a [[training.dataset_mix]] table in TOML, or PATH:WEIGHT or
    PATH:WEIGHT:MAX_EPOCHS on the command line (docs/data.md)."""

    path: str = _f("", "Token files: a Megatron prefix, its .bin or .idx, a .npy file, or a folder of them.")
    weight: float = _f(1.0, "Share of the training tokens (weights are normalised to sum to 1).", valid=POSITIVE)
    max_epochs: float | None = _f(
        None, "Refuse the run if it would read this source more times than this; unset = no cap.", valid=POSITIVE
    )

    @classmethod
    def from_cli(cls, text: str, where: str) -> DatasetSource:
        """PATH:WEIGHT or PATH:WEIGHT:MAX_EPOCHS (split from the right, so a path may hold ':')."""
        parts = text.rsplit(":", 2)
        try:
            if len(parts) == 3:
                return cls(parts[0], float(parts[1]), float(parts[2]))
            path, weight = text.rsplit(":", 1)
            return cls(path, float(weight))
        except ValueError:
            pass
        raise ConfigError(f"{where}: expected PATH:WEIGHT or PATH:WEIGHT:MAX_EPOCHS, got {text!r}")


@dataclass
class Training:
    dataset: str = _f("kiln_corpus", "Registered dataset name (kiln_corpus, c4).")
    dataset_path: str | None = _f(
        None,
        "Local text (jsonl/json/parquet/txt file or folder) or token files (a Megatron .bin/.idx prefix, .npy, or "
        "a folder of them: docs/data.md); overrides the registry path.",
    )
    dataset_mix: list[DatasetSource] = _f(
        [],
        "Weighted token-file sources, instead of dataset_path: [[training.dataset_mix]] tables with path, weight "
        "and optional max_epochs; on the command line PATH:WEIGHT[:MAX_EPOCHS],... (docs/data.md).",
    )
    allow_data_change: bool = _f(
        False,
        "Resume a checkpoint saved with other data (files, mix weights, seed): the new data continues from the "
        "checkpoint's sample number instead of the run being refused.",
    )
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
    mixed_precision_reduce: str = _f(
        "float32",
        "Precision of every gradient reduction (FSDP reduce-scatter, HSDP all-reduce, TP all-reduce of partial "
        "gradients): float32, bfloat16, or bfloat16_wire (bfloat16 on the wire, float32 sum; docs/parallelisms.md).",
        REDUCE_DTYPES,
    )
    compile: bool = _f(False, "torch.compile each transformer block.")
    gc_freq: int = _f(50, "Run Python's garbage collector every N steps (automatic GC is disabled).", valid=AT_LEAST_1)
    seed: int | None = _f(
        None, "Random seed; same seed, same init.", valid=Range(lo=0, hi=2**64 - 1, note="torch.manual_seed's range")
    )
    deterministic: bool = _f(False, "Use deterministic algorithms (bitwise-repeatable runs; slower).")
    skip_nonfinite_steps: int = _f(
        0,
        "0 = a non-finite loss or grad norm stops the run (exit 1). N > 0: a step whose loss or grad norm is "
        "non-finite on any rank is skipped on every rank (no optimizer, no LR-scheduler step; its batch is not "
        "trained on) and logged; N consecutive skipped steps stop the run as 0 does. Needs optimizer.implementation "
        "fused (docs/debugging.md).",
        valid=AT_LEAST_0,
    )
    memory_budget_gib: float | None = _f(
        None,
        "Memory one rank may use, in GiB: before any weight is allocated, the dry run's per-rank estimate (weights, "
        "gradients, optimizer state, one micro-batch's activations, context-parallel buffers) must fit in it, or "
        "the run stops (exit 2) naming the estimate; unset = no check.",
        valid=POSITIVE,
    )


# torch.distributed.pipelining's schedules kiln runs (torch's names), by the stages each rank holds: "single" one;
# "looped" two or more, stage s on rank s mod degree; "v" exactly two, rank r holding stages r and 2 x degree - 1 - r.
# tests/parallelisms/test_pipeline.py checks this table against torch's schedule classes.
PP_SCHEDULES = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "looped",
    "LoopedBFS": "looped",
    "InterleavedZeroBubble": "looped",
    "ZBVZeroBubble": "v",
}
# Zero-bubble schedules split each backward into input and weight gradients; torch refuses compiled stages there.
PP_ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


@dataclass
class Validation:
    """torchtitan's [validation]: the loss on held-out data every `freq` steps, outside training (no gradients, no
    change to the training data's position, the RNG or the weights)."""

    enable: bool = _f(False, "Measure the loss on held-out data at step 1 and every validation.freq steps.")
    dataset: str = _f(
        "kiln_corpus_validation",
        "Registered dataset name: kiln_corpus_validation (the bundled corpus's held-out split), c4_validation "
        "(allenai/c4 en, split validation, streamed).",
    )
    dataset_path: str | None = _f(
        None,
        "Local text (jsonl/json/parquet/txt file or folder) or token files (Megatron prefix, .bin/.idx, .npy, or a "
        "folder of them); overrides validation.dataset.",
    )
    local_batch_size: int | None = _f(
        None, "Sequences per device per validation batch; unset = training.local_batch_size.", valid=AT_LEAST_1
    )
    seq_len: int | None = _f(None, "Tokens per validation sequence; unset = training.seq_len.", valid=AT_LEAST_1)
    freq: int = _f(10, "Validate at step 1 and every N steps.", valid=AT_LEAST_1)
    steps: int = _f(
        -1,
        "Validation batches per validation (each over all data-parallel ranks), from the set's start; -1 = the "
        "whole set. A set shorter than this is validated whole, with a warning.",
        valid=Range(lo=1, also=(-1,), note="-1 = the whole validation set"),
    )


def validation_shape(v: Validation, t: Training) -> tuple[int, int]:
    """(local batch size, seq_len) of validation batches: validation's keys, training's where they are unset."""
    batch = t.local_batch_size if v.local_batch_size is None else v.local_batch_size
    return batch, t.seq_len if v.seq_len is None else v.seq_len


@dataclass
class Eval:
    """[eval]: downstream multiple-choice accuracy in the loop: lm-evaluation-harness tasks from local files, scored
    by the sharded model (trainer/evaluation/downstream.py, docs/evaluation.md). Needs the eval extra."""

    enable: bool = _f(
        False,
        "Score the eval.tasks (acc, acc_norm) at step 1, every eval.freq steps and at the last step; needs lm-eval "
        "(pip install -e '.[eval]').",
    )
    freq: int = _f(100, "Evaluate at step 1, every N steps and at the last step.", valid=AT_LEAST_1)
    tasks: list[str] = _f(
        ["kiln_cloze"],
        "lm-eval multiple-choice tasks: names of tasks under eval.include_path (or lm-eval's own, with their data in "
        "the HF datasets cache), or paths of task YAML files. kiln_cloze: the bundled task (assets/eval).",
    )
    include_path: list[str] = _f(
        ["assets/eval"], "Folders of lm-eval task YAML files (lm_eval --include_path); the default holds kiln_cloze."
    )
    limit: int = _f(
        -1,
        "Examples per task (its first N documents); -1 = all.",
        valid=Range(lo=1, also=(-1,), note="-1 = every example"),
    )
    batch_size: int = _f(
        16, "Sequences (one per context and choice) per forward on each data-parallel rank.", valid=AT_LEAST_1
    )


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
    context_parallel_degree: int = _f(
        1,
        "Context parallelism: every sequence is split over this many ranks, which exchange keys and values in "
        "attention; they also join FSDP's shard group. 1 = off.",
        valid=AT_LEAST_1,
    )
    context_parallel_rotate_method: str = _f(
        "allgather",
        "How context-parallel ranks exchange keys/values: allgather (all at once) or alltoall (one rank's shard "
        "per step, passed round a ring).",
        ("allgather", "alltoall"),
    )
    context_parallel_load_balancer: str | None = _f(
        "headtail",
        "Context-parallel split of a sequence: headtail = 2 x degree chunks, rank i holds chunks i and "
        '2 x degree - 1 - i (equal causal-attention work per rank); none (or "") = one contiguous chunk per rank.',
        ("headtail",),
    )
    expert_parallel_degree: int = _f(
        1,
        "Expert parallelism (MoE models): each MoE layer's routed experts are split over this many ranks, borrowed "
        "from the data-parallel shard ranks (it must divide data_parallel_shard_degree and the number of experts; "
        "with context parallelism it is a multiple of context_parallel_degree and divides dp_shard x cp), "
        "and tokens travel to their experts' ranks by all-to-all. 1 = off.",
        valid=AT_LEAST_1,
    )
    expert_tensor_parallel_degree: int = _f(
        1,
        "Tensor parallelism inside the experts (torchtitan's key): kiln runs only 1 (each expert whole on its rank).",
        valid=AT_LEAST_1,
    )
    pipeline_parallel_degree: int = _f(
        1,
        "Pipeline-parallel degree: ranks the model's layers are split over, in stages (the slowest links, across "
        "nodes); 1 = off, and the other pipeline_parallel_* keys are then not read.",
        valid=AT_LEAST_1,
    )
    pipeline_parallel_schedule: str = _f(
        "1F1B",
        "torch.distributed.pipelining schedule. GPipe and 1F1B run one stage per rank; Interleaved1F1B, LoopedBFS "
        "and InterleavedZeroBubble two or more (stage s on rank s mod degree); ZBVZeroBubble exactly two, in a V.",
        tuple(PP_SCHEDULES),
    )
    pipeline_parallel_layers_per_stage: int | None = _f(
        None,
        "Transformer blocks per (virtual) stage, the embedding and the output counting as first/last_stage_less_"
        "layers blocks: ceil((n_layers + both) / this) stages. Unset: one stage per rank (two for the looped and V "
        "schedules).",
        valid=AT_LEAST_1,
    )
    pipeline_parallel_first_stage_less_layers: int = _f(
        1, "Blocks the first stage holds fewer than the others (the embedding counts as this many).", valid=AT_LEAST_0
    )
    pipeline_parallel_last_stage_less_layers: int = _f(
        1, "Blocks the last stage holds fewer than the others (norm + output count as this many).", valid=AT_LEAST_0
    )
    pipeline_parallel_split_points: list[str] = _f(
        [],
        "Blocks that begin a stage, e.g. layers.4,layers.8 (3 stages); the embedding goes to the first stage, norm "
        "and output to the last. Replaces the automatic split.",
    )
    module_fqns_per_model_part: list[list[str]] | None = _f(
        None,
        'The modules of each stage, in order (TOML: [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]; '
        "command line: stages separated by ';'); every module exactly once. Replaces the automatic split.",
    )
    pipeline_parallel_microbatch_size: int = _f(
        1,
        "Sequences per pipeline micro-batch: training.local_batch_size / this micro-batches flow through the stages "
        "each step (and each gradient-accumulation micro-batch).",
        valid=AT_LEAST_1,
    )


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
    create_seed_checkpoint: bool = _f(
        False,
        "Write the initial weights as a full checkpoint step-0 and exit (torchtitan's meaning; any layout: the same "
        "training.seed gives the same model in every layout, so none is needed to compare layouts).",
    )


@dataclass
class ActivationCheckpoint:
    mode: str = _f("selective", "Recompute activations in backward.", ("none", "selective", "full"))
    selective_ac_option: str = _f("2", "With mode=selective: 'op' for per-op SAC, or N to checkpoint every Nth block.")


# MXFP8 (torchao.prototype.moe_training's MXFP8TrainingOpConfig recipes): e4m3 elements in blocks of 32 along the
# contraction dim, one power-of-two (e8m0) scale per block, rounded up (rceil); real kernels need Blackwell (SM100).
MXFP8_RECIPES = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp")
MXFP8_BLOCK = 32
# float8.moe_fqns: the Linear recipes whose experts run torchao's float8 rowwise grouped GEMMs (its only float8
# grouped recipe, FP8_ROWWISE; MXFP8 recipes run MXFP8 grouped GEMMs)
FLOAT8_EXPERT_RECIPES = ("tensorwise", "rowwise")
# NVFP4 (torchao's NVFP4 training recipe, emulated): e2m1 elements in blocks of 16 with an e4m3 scale each, times one
# float32 scale per tensor; weights in 16 x 16 tiles, gradients stochastically rounded (float8/nvfp4.py).
NVFP4 = "nvfp4"
NVFP4_BLOCK = 16
# Published NVFP4 practice (NVIDIA's NVFP4 pretraining recipe, torchtitan's NVFP4 converter): keep the last ~15% of
# the transformer blocks in high precision.
NVFP4_HIGH_PRECISION_LAST_FRACTION = 0.15


@dataclass
class Float8:
    enable_float8_linear: bool = _f(False, "Swap nn.Linear for torchao Float8Linear.")
    recipe_name: str | None = _f(
        None,
        "torchao recipe; unset = tensorwise with the flags below. mxfp8_* = MXFP8 (32-element blocks, e8m0 scales; "
        "Blackwell SM100, or --float8.emulate). nvfp4 = NVFP4 (4-bit e2m1, 16-element blocks; --float8.emulate).",
        ("tensorwise", "rowwise", "rowwise_with_gw_hp", *MXFP8_RECIPES, NVFP4),
    )
    enable_fsdp_float8_all_gather: bool = _f(False, "FSDP2 all-gathers weights in float8 (tensorwise only).")
    precompute_float8_dynamic_scale_for_fsdp: bool = _f(
        False, "One all-reduce of all weight amaxes after the optimizer step (needs float8 all-gather)."
    )
    filter_fqns: list[str] = _f(
        ["output"], "Linears (and routed experts) whose name contains one of these stay high precision."
    )
    moe_fqns: list[str] = _f(
        [],
        "Routed experts whose name contains one of these (e.g. experts) run their grouped GEMMs in low precision: "
        "float8 rowwise with recipe_name tensorwise or rowwise, MXFP8 with mxfp8_*; [] = the experts stay high "
        "precision (torchtitan's quantize.grouped_mm.float8.fqns; docs/moe.md).",
    )
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
    high_precision_last: int = _f(
        -1,
        "Keep the last N transformer blocks in high precision; -1 = the recipe's default: the last 15% of the "
        "blocks (rounded) with nvfp4, none with the float8 recipes.",
        valid=Range(lo=0, also=(-1,), note="-1 = the recipe's default"),
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
    def is_nvfp4(self) -> bool:
        return self.recipe == NVFP4

    @property
    def block_size(self) -> int | None:
        """Elements per scale along the contraction dim for the block-scaled recipes (MXFP8 32, NVFP4 16)."""
        return MXFP8_BLOCK if self.is_mxfp8 else NVFP4_BLOCK if self.is_nvfp4 else None

    def high_precision_last_blocks(self, n_layers: int) -> int:
        """How many of the last blocks stay in high precision: high_precision_last, or the recipe's default (nvfp4:
        15% of the blocks, rounded half up: 5 of Llama 3 8B's 32, 1 of the debug model's 6, 0 of 1-3 blocks)."""
        if self.high_precision_last >= 0:
            return self.high_precision_last
        return math.floor(NVFP4_HIGH_PRECISION_LAST_FRACTION * n_layers + 0.5) if self.is_nvfp4 else 0

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
    enable_wandb: bool = _f(
        False,
        "Log the TensorBoard scalars to Weights & Biases from the logging rank (needs the wandb package; project, "
        "run name and team from WANDB_PROJECT, WANDB_RUN_NAME, WANDB_TEAM).",
    )
    disable_color_printing: bool = _f(False, "Plain log lines (no ANSI colours).")
    peak_tflops: float | None = _f(
        None, "Peak bf16 dense TFLOP/s per device for MFU; unset = look up the GPU.", valid=POSITIVE
    )
    attention_flops: str = _f(
        "full",
        "How MFU and TFLOP/s count the attention matmuls: full (every query-key pair: torchtitan, PaLM) or causal "
        "(half of them, what a causal mask computes: Megatron-LM). docs/metrics.md.",
        ATTENTION_FLOPS,
    )


@dataclass
class Profiling:
    enable_profiling: bool = _f(False, "Capture torch profiler traces.")
    save_traces_folder: str = _f("profile_traces", "Trace folder, relative to job.dump_folder.")
    profile_freq: int = _f(10, "Capture a trace every N steps.", valid=AT_LEAST_1)
    enable_memory_snapshot: bool = _f(False, "Dump CUDA memory snapshots.")
    save_memory_snapshot_folder: str = _f("memory_snapshot", "Snapshot folder, relative to job.dump_folder.")
    saved_activations_report: bool = _f(
        False,
        "Run one training step, print the bytes kept for backward by producing op, and exit (compiled regions are "
        "read from their partitioned graphs).",
    )


@dataclass
class Comm:
    init_timeout_seconds: int = _f(300, "Timeout for process-group init and the steps that may compile.", valid=TIMEOUT)
    train_timeout_seconds: int = _f(100, "Collective timeout of every other step.", valid=TIMEOUT)


@dataclass
class FaultTolerance:
    """torchtitan's [fault_tolerance] (TorchFT): the job is `group_size` replica groups, each its own run_train.sh
    job, meeting each step in a quorum through torchft's lighthouse (TORCHFT_LIGHTHOUSE); docs/fault_tolerance.md."""

    enable: bool = _f(
        False,
        "Train as one replica group of a TorchFT job: gradients averaged across the live groups each step, a group "
        "that dies is left out, a restarted one heals from a live peer (needs torchft: pip install -e '.[ft]').",
    )
    process_group: str = _f("gloo", "The process group across replica groups.", ("gloo", "nccl"))
    process_group_timeout_ms: int = _f(
        10000,
        "A collective across replica groups that takes longer fails (its step is not committed); also the bound on "
        "reaching the lighthouse.",
        valid=Range(lo=1, hi=10**12),
    )
    replica_id: int = _f(0, "This replica group's index, in [0, group_size).", valid=AT_LEAST_0)
    group_size: int = _f(
        0,
        "The number of replica groups (each splits off its part of the global batch).",
        # every step's global batch is group_size x the group's batch: the loaders read it whole (text: each window)
        valid=Range(lo=0, hi=MAX_REPLICA_GROUPS, note="replica groups; each reads 1/group_size of every global batch"),
    )
    min_replica_size: int = _f(1, "Live replica groups a step needs to commit.", valid=AT_LEAST_1)
    semi_sync_method: str | None = _f(
        None,
        "Semi-synchronous training: local_sgd (groups train alone, their weights averaged every sync_steps) or diloco "
        "(groups train alone; every sync_steps the averaged change of each model fragment is an outer Nesterov SGD "
        "step, lr 0.7, momentum 0.9, as torchtitan's); unset: synchronous.",
        ("local_sgd", "diloco"),
    )
    sync_steps: int = _f(
        5, "local_sgd, diloco: optimizer steps between syncs (of each DiLoCo fragment).", valid=AT_LEAST_1
    )
    should_quantize: bool = _f(
        False, "DiLoCo: quantize the pseudo-gradients before the all-reduce (torchft's triton kernels: CUDA only)."
    )
    fragment_sync_delay: int = _f(
        0,
        "DiLoCo: inner steps between sending a fragment's pseudo-gradient and applying its average (the Streaming "
        "DiLoCo paper's tau); below sync_steps / fragments.",
        valid=AT_LEAST_0,
    )
    fragment_update_alpha: float = _f(
        0.0,
        "DiLoCo: after a fragment's sync, its weights = (1 - alpha) x the new global + alpha x this group's local "
        "(0: every group takes the global weights; below 1).",
        valid=Range(lo=0, hi=1, hi_open=True, note="1 keeps each group's own weights: they would never meet"),
    )
    num_fragments: int = _f(
        1,
        "DiLoCo: model fragments synchronised in turn, one every sync_steps / num_fragments steps (blocks split "
        "evenly, as torchtitan's).",
        valid=AT_LEAST_1,
    )
    module_fqns_per_model_fragment: list[list[str]] = _f(
        [], "DiLoCo: the modules of each fragment, every module once (empty: num_fragments even parts)."
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)
