"""The run's plan: what the config, the world size and the model's shape decide about the layout, computed once
(plan_run) and handed to everything that needs it, the launcher's checks, the build, the Trainer and the dry run:

    Degrees          the mesh's degrees (pp, dp_replicate, dp_shard, cp, tp) for this world; the shard counts
    SequenceSplit    how context parallelism cuts every sequence into chunks, and which a rank holds
    PipelinePlan     the model's pipeline stages, which rank runs which, the schedule and its micro-batches
    fragments        DiLoCo's model fragments (fault_tolerance), synchronised across replica groups in turn
    RunPlan          all of the above with the gradient accumulation steps (plan_run)
    memory           what a rank holds: training state (16 bytes a parameter / shards), activations, logits, the
                     CP buffers, the dense CPU document mask; check_model_memory and check_memory_budget use it

Each fact is checked where it is computed (ConfigError: one line naming the key and what is valid). Standard
library only and instant, like the checks (checks.py imports the pipeline's rules from here): the launcher plans
the run before torchrun starts a rank. A new parallelism gives Degrees its degree and the plan its rules; a new
pipeline schedule gives PipelinePlan its stage rule, micro-batch rule and micro-batches in flight
(PP_SCHEDULES in schema.py names its kind), and parallelisms/pipeline.py runs it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from kiln_base.config.schema import (
    BF16_WIRE,
    PP_SCHEDULES,
    ActivationCheckpoint,
    FaultTolerance,
    JobConfig,
    Parallelism,
    Training,
    resolve_mixed_precision,
    validation_shape,
)
from kiln_base.errors import ConfigError

_Split = TypeVar("_Split", bound="SequenceSplit")

# ----------------------------------------------------------------------------- the mesh


def resolve_dp_shard(dp_replicate: int, dp_shard: int, tp: int, world_size: int, *, cp: int = 1, pp: int = 1) -> int:
    """data_parallel_shard_degree for this world size (-1 = the rest); ConfigError unless the degrees multiply to
    the world size. ParallelDims and check_world both call this. The degrees are named in the mesh's order
    (pipeline, replicate, shard, context, tensor); the pipeline and context degrees only where they are on."""
    degrees = {"pipeline_parallel_degree": pp, "data_parallel_replicate_degree": dp_replicate}
    degrees |= {"data_parallel_shard_degree": dp_shard, "context_parallel_degree": cp, "tensor_parallel_degree": tp}
    for name, value in degrees.items():
        if value < 1 and name != "data_parallel_shard_degree":
            raise ConfigError(f"parallelism.{name} must be >= 1, got {value}")
    for name, value in (("pipeline_parallel_degree", pp), ("context_parallel_degree", cp)):
        if value == 1:
            del degrees[name]
    others = {k: v for k, v in degrees.items() if k != "data_parallel_shard_degree"}
    product = math.prod(others.values())
    if dp_shard == -1:
        if world_size % product:
            raise ConfigError(
                f"parallelism: {' x '.join(others)} = {product} does not divide the world size {world_size}"
            )
        dp_shard = degrees["data_parallel_shard_degree"] = world_size // product
    if dp_shard < 1 or product * dp_shard != world_size:
        named = " x ".join(f"{k} ({v})" for k, v in degrees.items())
        raise ConfigError(f"parallelism: {named} must equal the world size {world_size}")
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


@dataclass(frozen=True)
class Degrees:
    """The mesh's degrees for one world, in the mesh's order (pp, dp_replicate, dp_shard, cp, tp), and the counts
    derived from them."""

    pp: int
    dp_replicate: int
    dp_shard: int  # resolved: never -1
    cp: int
    tp: int
    ep: int = 1  # expert parallel: borrowed from dp_shard x cp x tp (= efsdp x ep), not a factor of the world size

    @classmethod
    def of(cls, p: Parallelism, world_size: int) -> Degrees:
        """The degrees for `world_size` ranks (data_parallel_shard_degree -1: the rest), checked to multiply to it;
        expert_parallel_degree must divide the ranks it borrows from: the shard ranks with all their CP and TP ranks
        (torchtitan's rule with expert_tensor_parallel_degree 1: every CP and TP rank routes its own tokens, so an
        EP group holds whole CP x TP groups and ep is a multiple of cp x tp)."""
        tp, cp, pp = p.tensor_parallel_degree, p.context_parallel_degree, p.pipeline_parallel_degree
        dp_shard = resolve_dp_shard(
            p.data_parallel_replicate_degree, p.data_parallel_shard_degree, tp, world_size, cp=cp, pp=pp
        )
        ep = p.expert_parallel_degree
        inner = cp * tp
        if ep > 1 and ep % inner:
            names = " x ".join(
                f"{k} ({v})" for k, v in (("context_parallel_degree", cp), ("tensor_parallel_degree", tp)) if v > 1
            )
            raise ConfigError(
                f"parallelism.expert_parallel_degree ({ep}) must be a multiple of {names}: an expert-parallel group "
                "holds whole context- and tensor-parallel groups (each of their ranks routes its own tokens)"
            )
        if ep > 1 and dp_shard % (ep // inner):
            parts = "".join(
                f" x {k} ({v})" for k, v in (("context_parallel_degree", cp), ("tensor_parallel_degree", tp)) if v > 1
            )
            raise ConfigError(
                f"parallelism.expert_parallel_degree ({ep}) must divide data_parallel_shard_degree ({dp_shard})"
                f"{parts}: expert-parallel ranks are borrowed from the data-parallel shard ranks"
            )
        return cls(pp, p.data_parallel_replicate_degree, dp_shard, cp, tp, ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_degree(self) -> int:
        """Distinct data streams: the ranks of one TP or CP group, and of one pipeline, read the same batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shards(self) -> int:
        """FSDP's shard group: dp_shard x cp (context-parallel ranks hold the same weights and shard them too)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """The ranks that FSDP shards each expert-parallel rank's experts over: dp_shard x cp x tp / ep (without
        EP, FSDP's shard ranks)."""
        return self.dp_shard * self.cp * self.tp // self.ep if self.ep > 1 else self.fsdp_shards

    @property
    def ep_data_ranks(self) -> int:
        """The ranks of one EP group that read different batches (ep / tp): TP ranks route parts of the same
        sequences, so an expert's gradient, summed over the group, is divided by this to be a data-parallel mean."""
        return self.ep // self.tp if self.ep > 1 else 1

    @property
    def param_shards(self) -> int:
        """Ranks one parameter is split over: FSDP's shards x TP (replicas each hold their own copy)."""
        return self.fsdp_shards * self.tp


@dataclass(frozen=True)
class SequenceSplit:
    """How context parallelism cuts one sequence over `cp` ranks: into `n_chunks` equal chunks, of which rank r
    holds `chunks(r)` in that order (parallelisms/context_parallel.py's SequenceLayout cuts tensors by it)."""

    cp: int
    load_balance: bool  # head-tail: 2 cp chunks, rank r holds r and 2 cp - 1 - r

    @classmethod
    def of(cls: type[_Split], p: Parallelism) -> _Split:
        return cls(p.context_parallel_degree, p.context_parallel_load_balancer == "headtail")

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.load_balance else self.cp

    def chunks(self, rank: int) -> tuple[int, ...]:
        return (rank, 2 * self.cp - 1 - rank) if self.load_balance else (rank,)

    def rank_tokens(self, rows: int, seq_len: int) -> int:
        """The tokens a context-parallel rank holds of `rows` sequences of `seq_len`: 1/cp of each."""
        return rows * seq_len // self.cp

    def describe(self) -> str:
        """How the split is made, for messages."""
        if self.load_balance:
            return (
                f"2 x context_parallel_degree = {self.n_chunks} chunks (context_parallel_load_balancer headtail: "
                f"rank i holds chunks i and {self.n_chunks - 1} - i)"
            )
        return f"context_parallel_degree = {self.cp} chunks"


def check_world(cfg: JobConfig, world_size: int) -> tuple[Degrees, BatchPlan]:
    """What the config and the world size decide: the degrees multiply to the world, the global batch divides,
    sequence parallel splits every sequence; the degrees and the batch plan. run_train.sh runs it
    before torchrun starts a rank, each rank in plan_run."""
    degrees = Degrees.of(cfg.parallelism, world_size)
    batch = BatchPlan.of(cfg, degrees)
    check_bf16_wire(cfg.training, degrees.dp_replicate, degrees.dp_shard * degrees.cp)
    check_sequence_split(cfg.training.seq_len, cfg.parallelism)
    if cfg.validation.enable:  # validation batches are split the same way
        check_sequence_split(validation_shape(cfg.validation, cfg.training)[1], cfg.parallelism, "validation.seq_len")
    return degrees, batch


def check_bf16_wire(t: Training, dp_replicate: int, fsdp_ranks: int) -> None:
    """bfloat16_wire is FSDP's reduce-scatter (dp_shard x cp ranks) in bfloat16 with a float32 sum; plain
    replication has none, and its all-reduce would silently stay float32: refused, naming what would work."""
    if t.mixed_precision_reduce == BF16_WIRE and fsdp_ranks == 1 and dp_replicate > 1:
        raise ConfigError(
            f"training.mixed_precision_reduce {BF16_WIRE} sends FSDP's reduce-scatter in bfloat16, and plain "
            f"replication (data_parallel_replicate_degree {dp_replicate}, data_parallel_shard_degree 1) has none: "
            "its all-reduce would run in float32; use float32 or bfloat16, or shard (data_parallel_shard_degree > 1)"
        )


def check_sequence_split(seq_len: int, p: Parallelism, key: str = "training.seq_len") -> None:
    """Context parallelism splits every sequence into chunks (2 x degree with head-tail load balancing), and
    sequence parallel (TP) splits each rank's part again into tensor_parallel_degree pieces: all must be whole.
    `key` names the length (training.seq_len, or validation.seq_len: unset, it is training's)."""
    tp, split = p.tensor_parallel_degree, SequenceSplit.of(p)
    cp, chunks = split.cp, split.n_chunks
    if cp > 1 and seq_len % chunks:
        raise ConfigError(f"{key} ({seq_len}) must split into {split.describe()}; make it a multiple of {chunks}")
    if (seq_len // cp) % tp:  # sequence parallel splits every rank's part of a sequence into tp pieces
        part = f"each context-parallel rank's {seq_len // cp} tokens" if cp > 1 else f"{key} ({seq_len})"
        multiple = cp * math.lcm(tp, 2 if cp > 1 and split.load_balance else 1)
        raise ConfigError(
            f"{part} must be divisible by tensor_parallel_degree ({tp}) (sequence parallel splits them); make "
            f"{key} a multiple of {multiple}"
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
    attn_type: str = "sdpa"  # models.args.ModelArgs.attn_type: sdpa, flex or varlen
    tied: bool = False  # tie_word_embeddings: the output layer is the embedding (Llama 3.2 1B, 3B)
    # Qwen3 (models.args.ModelArgs' fields of the same meaning): a head width of its own (0: dim // n_heads), q/k
    # norms; with experts > 0 an MoE FFN in every block (`ffn_hidden_dim` then unused): `experts` routed SwiGLUs of
    # width expert_hidden_dim, `top_k` per token, a shared SwiGLU of width shared_hidden_dim (0: none).
    head_dim: int = 0
    qk_norm: bool = False
    experts: int = 0
    top_k: int = 0
    expert_hidden_dim: int = 0
    shared_hidden_dim: int = 0

    @property
    def head_width(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def token_ffn_width(self) -> int:
        """The SwiGLU width one token runs through: the dense FFN's, or its k experts' and the shared one's."""
        if self.experts:
            return self.top_k * self.expert_hidden_dim + self.shared_hidden_dim
        return self.ffn_hidden_dim


# ----------------------------------------------------------------------------- the pipeline split

PP = "parallelism.pipeline_parallel_"


@dataclass(frozen=True)
class PipelinePlan:
    """The model cut into pipeline stages (torchtitan's split), and which ranks of a pipeline group run which."""

    stages: tuple[tuple[str, ...], ...]  # each stage's modules (tok_embeddings, layers.N, norm, output), in order
    degree: int  # ranks in a pipeline group
    schedule: str  # a PP_SCHEDULES name
    microbatches: int  # per schedule step: local batch / micro-batch size

    @property
    def stages_per_rank(self) -> int:
        return len(self.stages) // self.degree

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        """The stages rank `pp_rank` of the pipeline group runs: s, s + degree, ... (looped), or r and
        2 x degree - 1 - r (V: the first and the last stage share rank 0)."""
        n = len(self.stages)
        if PP_SCHEDULES[self.schedule] == "v":
            return (pp_rank, n - 1 - pp_rank)
        return tuple(range(pp_rank, n, self.degree))

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs stage `stage`."""
        return next(r for r in range(self.degree) if stage in self.stage_ids(r))

    def blocks(self, pp_rank: int) -> int:
        """Transformer blocks on rank `pp_rank`'s stages."""
        return sum(m.startswith("layers.") for i in self.stage_ids(pp_rank) for m in self.stages[i])

    def has_output(self, pp_rank: int) -> bool:
        """Whether rank `pp_rank` runs the last stage (the output layer, the logits and the loss)."""
        return any("output" in self.stages[i] for i in self.stage_ids(pp_rank))

    def in_flight(self, pp_rank: int) -> int:
        """The micro-batches whose activations rank `pp_rank` keeps at once: every micro-batch of the step under
        GPipe (all forwards first) and, as an upper bound, under the looped and V schedules; at most degree - rank
        under 1F1B (the first rank keeps the most)."""
        if self.schedule == "1F1B":
            return min(self.microbatches, self.degree - pp_rank)
        return self.microbatches


def whole_model_modules(n_layers: int) -> list[str]:
    """The modules a pipeline splits, in the order the model runs them."""
    return ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]


def _auto_stages(n_stages: int, n_layers: int, first_less: int, last_less: int, why: str) -> list[list[str]]:
    """torchtitan's split (generate_llm_fqn_per_model_part, v0.2.2): the embedding counts as `first_less` blocks and
    norm + output as `last_less`, the stages share the blocks evenly and the first stages take one more each."""
    effective = n_layers + first_less + last_less
    if n_stages > effective:
        raise ConfigError(
            f"{why} asks for {n_stages} stages, but the model has {n_layers} blocks (+ {first_less} + {last_less} for "
            f"the embedding and the output: {PP}first/last_stage_less_layers): at most {effective} stages"
        )
    per, extra = divmod(effective, n_stages)
    for key, less in (("first_stage_less_layers", first_less), ("last_stage_less_layers", last_less)):
        if less > per:
            raise ConfigError(
                f"{PP}{key} ({less}) exceeds the {per} blocks of the smallest of the {n_stages} stages ({why}); "
                f"lower it to {per} or less"
            )
    stages, layer = [], 0
    for i in range(n_stages):
        size = per + (i < extra) - (first_less if i == 0 else 0) - (last_less if i == n_stages - 1 else 0)
        if n_stages == 1:
            size = n_layers
        blocks = [f"layers.{j}" for j in range(layer, min(n_layers, layer + size))]
        layer += len(blocks)
        head, tail = ["tok_embeddings"] if i == 0 else [], ["norm", "output"] if i == n_stages - 1 else []
        stages.append(head + blocks + tail)
    return stages


def _split_point_stages(points: list[str], n_layers: int) -> list[list[str]]:
    """torchtitan v0.1.0's split points: each names the block that begins a stage."""
    ids = []
    for point in points:
        head, _, tail = point.partition(".")
        if head != "layers" or not tail.isdigit() or not 0 < int(tail) < n_layers:
            raise ConfigError(
                f"{PP}split_points: '{point}' is not a block that can begin a stage; name layers.1 .. "
                f"layers.{n_layers - 1} (the model has {n_layers} blocks)"
            )
        ids.append(int(tail))
    if ids != sorted(set(ids)):
        raise ConfigError(f"{PP}split_points {','.join(points)}: name each block once, in increasing order")
    bounds = [0, *ids, n_layers]
    stages = [[f"layers.{j}" for j in range(a, b)] for a, b in zip(bounds, bounds[1:], strict=False)]
    stages[0].insert(0, "tok_embeddings")
    stages[-1] += ["norm", "output"]
    return stages


def _check_model_parts(
    parts: list[list[str]], n_layers: int, key: str = "parallelism.module_fqns_per_model_part", part: str = "stage"
) -> list[list[str]]:
    """module_fqns_per_model_part (a pipeline's stages) or module_fqns_per_model_fragment (DiLoCo's fragments):
    every module of the model exactly once, in the order the model runs them."""
    if any(not p for p in parts):
        raise ConfigError(f"{key}: {part} {next(i for i, p in enumerate(parts) if not p)} lists no module")
    flat, whole = [m for p in parts for m in p], whole_model_modules(n_layers)
    if flat != whole:
        wrong = next((f"'{a}' where '{b}' comes" for a, b in zip(flat, whole, strict=False) if a != b), None)
        wrong = wrong or (f"{len(flat)} modules for {len(whole)}")
        raise ConfigError(
            f"{key}: the {part}s must list tok_embeddings, layers.0 .. layers.{n_layers - 1}, norm, output once each, "
            f"in this order (the model has {n_layers} blocks); found {wrong} (on the command line: modules by ',', "
            f"{part}s by ';', e.g. tok_embeddings,layers.0;layers.1,norm,output)"
        )
    return parts


def check_microbatches(p: Parallelism, local_batch_size: int, key: str = "training.local_batch_size") -> int:
    """The micro-batches of one schedule step: local batch / micro-batch size, as the schedule can run them (`key`:
    the batch size's key, training's or validation's)."""
    mbs, name, degree = p.pipeline_parallel_microbatch_size, p.pipeline_parallel_schedule, p.pipeline_parallel_degree
    if local_batch_size % mbs:
        raise ConfigError(
            f"{key} ({local_batch_size}) must be a multiple of {PP}microbatch_size ({mbs}): "
            "the pipeline splits each local batch into micro-batches of that size"
        )
    n = local_batch_size // mbs
    have = f"{key} {local_batch_size} / {PP}microbatch_size {mbs} = {n} micro-batches"
    if name == "1F1B" and n < degree:  # torch's Schedule1F1B refuses fewer micro-batches than stages
        raise ConfigError(f"{PP}schedule 1F1B needs at least {degree} micro-batches (one per stage); {have}")
    rounds = max(1, n // degree)
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and n % rounds:
        raise ConfigError(
            f"{PP}schedule {name} splits a batch's micro-batches into max(1, micro-batches // degree {degree}) = "
            f"{rounds} equal rounds (torch's rule): {have}, which {rounds} does not divide; use a multiple of "
            f"{degree}, or fewer than {2 * degree}"
        )
    return n


def pipeline_plan(p: Parallelism, local_batch_size: int, n_layers: int) -> PipelinePlan:
    """The stages (from module_fqns_per_model_part, split_points, layers_per_stage or the schedule's default: one
    stage per rank, two for looped and V schedules), checked against the degree and the schedule."""
    degree, name = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    kind = PP_SCHEDULES[name]
    lps, first, last = (
        p.pipeline_parallel_layers_per_stage,
        p.pipeline_parallel_first_stage_less_layers,
        p.pipeline_parallel_last_stage_less_layers,
    )
    given = [
        key
        for key, on in (
            ("parallelism.module_fqns_per_model_part", p.module_fqns_per_model_part is not None),
            (f"{PP}split_points", bool(p.pipeline_parallel_split_points)),
            (f"{PP}layers_per_stage", lps is not None),
        )
        if on
    ]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} each say how to split the model; set one of them")
    if p.module_fqns_per_model_part is not None:
        why = "parallelism.module_fqns_per_model_part"
        stages = _check_model_parts(p.module_fqns_per_model_part, n_layers)
    elif p.pipeline_parallel_split_points:
        stages, why = _split_point_stages(p.pipeline_parallel_split_points, n_layers), f"{PP}split_points"
    elif lps is not None:
        n_stages = math.ceil((n_layers + first + last) / lps)
        why = f"{PP}layers_per_stage {lps} (ceil(({n_layers} blocks + {first} + {last}) / {lps}) = {n_stages} stages)"
        stages = _auto_stages(n_stages, n_layers, first, last, why)
    else:
        per_rank = 1 if kind == "single" else 2
        why = f"{PP}degree {degree} with schedule {name} ({per_rank} stage{'s' * (per_rank > 1)} per rank)"
        stages = _auto_stages(degree * per_rank, n_layers, first, last, why)
    n = len(stages)
    if n % degree:
        raise ConfigError(f"{why}: {n} stages do not divide over {PP}degree {degree} ranks; make it a multiple")
    per_rank = n // degree
    wants = {"single": (1, "exactly 1"), "looped": (2, "at least 2"), "v": (2, "exactly 2")}[kind]
    if per_rank != wants[0] and not (kind == "looped" and per_rank > 2):
        raise ConfigError(
            f"{PP}schedule {name} runs {wants[1]} stage{'s' * (wants[0] > 1)} per rank, but {why} gives {n} stages "
            f"for {degree} ranks ({per_rank} per rank); "
            + ("use Interleaved1F1B for several per rank" if kind == "single" else "split into more stages")
        )
    return PipelinePlan(tuple(tuple(s) for s in stages), degree, name, check_microbatches(p, local_batch_size))


def check_pipeline(cfg: JobConfig, shape: ModelShape) -> PipelinePlan | None:
    """With pipelining on: the split of this shape's blocks into stages, or ConfigError; None when it is off."""
    p = cfg.parallelism
    if p.pipeline_parallel_degree == 1:
        return None
    if shape.tied:
        raise ConfigError(
            f"{PP}degree {p.pipeline_parallel_degree}: this model ties its output layer to the embedding table "
            "(Llama 3.2), which a pipeline puts on different stages; train it without pipeline parallelism"
        )
    return pipeline_plan(p, cfg.training.local_batch_size, shape.n_layers)


def diloco_fragments(ft: FaultTolerance, shape: ModelShape) -> tuple[tuple[str, ...], ...] | None:
    """DiLoCo's model fragments, each synchronised in turn (torchtitan's fragment_llm): module_fqns_per_model_fragment
    as given, else num_fragments parts of torchtitan's even split (the pipeline's: the embedding and norm + output
    count as one block each); None without DiLoCo. Every parameter must be in exactly one fragment: one left out
    would never be synchronised and the groups' copies would drift apart for good."""
    if not (ft.enable and ft.semi_sync_method == "diloco"):
        return None
    key = "fault_tolerance.module_fqns_per_model_fragment"
    given = ft.module_fqns_per_model_fragment
    n = len(given) or ft.num_fragments
    if n > 1 and shape.tied:
        raise ConfigError(
            f"fault_tolerance.num_fragments {n}: this model ties its output layer to the embedding table (Llama 3.2), "
            "which DiLoCo's fragments would synchronise twice, from two backups; use num_fragments = 1"
        )
    if given:
        parts = _check_model_parts(given, shape.n_layers, key, "fragment")
    elif n > shape.n_layers + 2:
        raise ConfigError(
            f"fault_tolerance.num_fragments ({n}) exceeds the model's {shape.n_layers} blocks + the embedding + the "
            f"output: at most {shape.n_layers + 2} fragments"
        )
    else:
        parts = _auto_stages(n, shape.n_layers, 1, 1, key)
    return tuple(tuple(p) for p in parts)


# ----------------------------------------------------------------------------- the run's plan


@dataclass(frozen=True)
class RunPlan:
    """The run's layout, computed once (plan_run) from the config, the world size and the model's shape."""

    degrees: Degrees
    sequence: SequenceSplit  # context parallelism's chunks (cp 1: one chunk)
    batch: BatchPlan  # the global batch, who reads which part of it, the tokens each rank computes
    pipeline: PipelinePlan | None  # None without pipeline parallelism
    shape: ModelShape
    fragments: tuple[tuple[str, ...], ...] | None = None  # DiLoCo's model fragments (FQNs); None without DiLoCo

    @property
    def grad_accum_steps(self) -> int:
        """Local batches per optimizer step."""
        return self.batch.grad_accum_steps

    @property
    def global_batch(self) -> int:
        """Sequences one optimizer step trains on, over every data stream (every replica group's)."""
        return self.batch.global_batch


@dataclass(frozen=True)
class BatchPlan:
    """The global batch: who reads which part of it, and the tokens each rank computes of it."""

    local_batch: int  # sequences one data stream reads per micro-batch (training.local_batch_size)
    seq_len: int
    grad_accum_steps: int
    data_streams: int  # distinct data streams: the data-parallel degree x the replica groups (fault tolerance)
    first_stream: int  # this replica group's first stream (replica_id x the data-parallel degree; 0 without it)
    group_streams: int  # the streams of one replica group: the data-parallel degree
    cp: int
    pp: int

    @classmethod
    def of(cls, cfg: JobConfig, degrees: Degrees) -> BatchPlan:
        """Under fault tolerance the replica groups are the replicate dimension of the data streams; the global
        batch must divide into local batches of every stream (grad_accum_steps)."""
        ft, dp, t = cfg.fault_tolerance, degrees.dp_degree, cfg.training
        groups, group = (ft.group_size, ft.replica_id) if ft.enable else (1, 0)
        accum = grad_accum_steps(t, dp * groups)
        return cls(t.local_batch_size, t.seq_len, accum, dp * groups, group * dp, dp, degrees.cp, degrees.pp)

    @property
    def global_batch(self) -> int:
        return self.grad_accum_steps * self.local_batch * self.data_streams

    @property
    def group_batch(self) -> int:
        """Sequences one replica group trains on per step (the global batch without fault tolerance)."""
        return self.grad_accum_steps * self.local_batch * self.group_streams

    def stream(self, dp_rank: int) -> int:
        """The data stream a data-parallel rank of this replica group reads: under fault tolerance the groups split
        every global batch as HSDP's replicas would (group g reads streams g x dp .. g x dp + dp - 1)."""
        return self.first_stream + dp_rank

    @property
    def rank_tokens(self) -> int:
        """Tokens each rank computes per step: a context-parallel rank its 1/cp of each sequence; a pipeline's
        ranks share its tokens, each counting its share (so tps and mfu stay per device, as torchtitan's)."""
        return self.grad_accum_steps * self.local_batch * self.seq_len // self.cp // self.pp


def plan_run(cfg: JobConfig, world_size: int, shape: ModelShape) -> RunPlan:
    """The plan for `world_size` ranks and this model shape, every rule checked (check_world, check_pipeline): the
    launcher for the whole world before torchrun, each rank before its build, the dry run for its simulated world.
    The device-dependent rules are kiln_base.config.check_parallel_plan's."""
    degrees, batch = check_world(cfg, world_size)
    pipeline, fragments = check_pipeline(cfg, shape), diloco_fragments(cfg.fault_tolerance, shape)
    return RunPlan(degrees, SequenceSplit.of(cfg.parallelism), batch, pipeline, shape, fragments)


# ----------------------------------------------------------------------------- memory per rank

# fp32 master weight (4) + fp32 gradient (4) + AdamW's two fp32 moments (8): what training keeps per parameter,
# before activations (docs/config.md's dry run adds those).
TRAINING_BYTES_PER_PARAM = 16


def _layer_params(shape: ModelShape) -> int:
    """Parameters of one block: q/k/v/o (and q/k norms), the SwiGLU or the MoE (router, experts, shared experts),
    two norms."""
    head, dim = shape.head_width, shape.dim
    attention = 2 * dim * shape.n_heads * head + 2 * dim * shape.n_kv_heads * head + 2 * head * shape.qk_norm
    ffn = 3 * dim * shape.ffn_hidden_dim
    if shape.experts:
        ffn = shape.experts * (dim + 3 * dim * shape.expert_hidden_dim) + 3 * dim * shape.shared_hidden_dim
    return attention + ffn + 2 * dim


def model_params(shape: ModelShape) -> int:
    """Parameters of a Llama 3 or Qwen3 model of this shape (embedding, per layer q/k/v/o, SwiGLU or MoE, norms;
    final norm; the output layer unless tied): models.flops.num_params counts the same on a built model."""
    embedding = shape.vocab_size * shape.dim
    return embedding * (1 if shape.tied else 2) + shape.n_layers * _layer_params(shape) + shape.dim


def stage_params(shape: ModelShape, modules: tuple[str, ...] | list[str]) -> int:
    """Parameters of the modules of one pipeline stage (tok_embeddings, layers.N, norm, output)."""
    sizes = {"tok_embeddings": shape.vocab_size * shape.dim, "norm": shape.dim, "output": shape.vocab_size * shape.dim}
    blocks = sum(m.startswith("layers.") for m in modules)
    return blocks * _layer_params(shape) + sum(sizes.get(m, 0) for m in modules)


def pipeline_rank_params(shape: ModelShape, plan: PipelinePlan, pp_rank: int) -> int:
    """Parameters of the stages rank `pp_rank` of a pipeline group holds."""
    return sum(stage_params(shape, plan.stages[i]) for i in plan.stage_ids(pp_rank))


def training_bytes(shape: ModelShape, shards: int, plan: PipelinePlan | None = None) -> int:
    """Bytes one rank holds for weights, gradients and AdamW state with the model split over `shards` ranks (FSDP
    shard degree x TP degree; replicas each hold their own copy); under pipeline parallelism (`plan`) the stages of
    the pipeline rank holding the most. An MoE's routed experts count the same under expert parallelism: each EP
    rank holds E / ep of them and FSDP splits those over efsdp = dp_shard x cp x tp / ep, so they too are split over
    ep x efsdp = dp_shard x cp x tp ranks, as the other weights are (under PP within each stage's ranks; under TP
    the router's gate and the norms are replicated over the TP ranks, a rounding error here;
    tests/trainer/test_dry_run_moe.py holds this against a built model's shards)."""
    params = model_params(shape)
    if plan is not None:
        params = max(pipeline_rank_params(shape, plan, r) for r in range(plan.degree))
    return params * TRAINING_BYTES_PER_PARAM // max(shards, 1)


def check_model_memory(
    shape: ModelShape,
    shards: int,
    tokens: int,
    tp: int,
    ranks_sharing: int,
    capacity: int,
    what: str,
    plan: PipelinePlan | None = None,
    logits_of: str = "",
) -> None:
    """What training must hold fits in `capacity` bytes (`what`: that memory, for the message), or no rank starts
    building: the model's fp32 weights, gradients and AdamW state (16 bytes a parameter, / `shards`: FSDP shard
    degree x TP degree) and the fp32 logits of one micro-batch of `tokens` tokens with their gradient (8 bytes x
    vocabulary a token, / `tp`), for each of the `ranks_sharing` ranks on that memory (a CPU node's ranks share its
    RAM; a GPU is one rank's). A model that cannot fit would allocate for minutes before the OOM killer ends it
    without a word. A lower bound (other activations come on top); a dry run plans any size.

    Under pipeline parallelism (`plan`; `tokens` then a pipeline micro-batch's) each rank holds its stages'
    parameters, and the last stage's rank the logits: one rank on a memory is checked as the pipeline rank that
    needs the most, ranks sharing one (whole pipelines on a CPU node) as the pipeline's mean. `logits_of`: which
    batch the logits are (logit_tokens), for the message."""
    bytes_per = TRAINING_BYTES_PER_PARAM
    logits = tokens * shape.vocab_size * 8 // max(tp, 1)
    if plan is None:
        state = training_bytes(shape, shards)
        need = (state + logits) * ranks_sharing
        held = ""
    else:
        ranks = range(plan.degree)
        needs = [
            pipeline_rank_params(shape, plan, r) * bytes_per // max(shards, 1) + (logits if plan.has_output(r) else 0)
            for r in ranks
        ]
        worst = max(ranks, key=lambda r: needs[r])
        state = pipeline_rank_params(shape, plan, worst) * bytes_per // max(shards, 1)
        need = needs[worst] if ranks_sharing == 1 else sum(needs) * ranks_sharing // plan.degree
        held = f"; pipeline rank {worst} holds {pipeline_rank_params(shape, plan, worst):,} of them"
    if need > capacity:
        gib = 2**30
        raise ConfigError(
            f"the model ({model_params(shape):,} parameters: {shape.n_layers} layers, dim {shape.dim}, vocab "
            f"{shape.vocab_size}{held}) needs at least {need / gib:,.1f} GiB: {state / gib:,.1f} GiB a rank for fp32 "
            f"weights, gradients and AdamW state ({bytes_per} bytes a parameter / {max(shards, 1)} "
            f"shards) and {logits / gib:,.1f} GiB of logits{logits_of}, x {ranks_sharing} rank(s), more than {what} "
            f"({capacity / gib:,.1f} GiB); use a smaller model.* shape, batch or tokenizer, or more ranks "
            "(--job.dry_run plans any size)"
        )


def check_memory_budget(cfg: JobConfig, estimate: Mapping[str, int]) -> None:
    """training.memory_budget_gib against the per-rank estimate (memory_estimate: name -> bytes), each rank before
    anything is allocated."""
    budget = cfg.training.memory_budget_gib
    total = sum(estimate.values())
    if budget is None or total <= budget * 2**30:
        return
    gib = 2**30
    parts = ", ".join(f"{name} {value / gib:.3g}" for name, value in estimate.items())
    p = cfg.parallelism
    raise ConfigError(
        f"training.memory_budget_gib {budget:g}: this rank would need about {total / gib:.3g} GiB ({parts}); "
        f"raise parallelism.context_parallel_degree ({p.context_parallel_degree}), data_parallel_shard_degree or "
        f"pipeline_parallel_degree ({p.pipeline_parallel_degree}), checkpoint more activations "
        f"(activation_checkpoint.mode) or shorten training.seq_len ({cfg.training.seq_len})"
    )


def logit_tokens(cfg: JobConfig, plan: RunPlan) -> tuple[int, str]:
    """The tokens of the largest batch one rank computes logits for at once, and which batch that is: a training
    micro-batch (a pipeline micro-batch under pipeline parallelism) or, with validation on, a validation one (the
    same micro-batch size under a pipeline); a context-parallel rank's 1/cp of each sequence."""
    t, split = cfg.training, plan.sequence
    rows = t.local_batch_size if plan.pipeline is None else cfg.parallelism.pipeline_parallel_microbatch_size
    tokens, which = split.rank_tokens(rows, t.seq_len), ""
    if cfg.validation.enable:
        val_rows, val_seq = validation_shape(cfg.validation, t)
        val_rows = val_rows if plan.pipeline is None else cfg.parallelism.pipeline_parallel_microbatch_size
        if split.rank_tokens(val_rows, val_seq) > tokens:
            tokens = split.rank_tokens(val_rows, val_seq)
            which = f" (a validation batch: {val_rows} x validation.seq_len {val_seq})"
    return tokens, which


def _activation_elems_per_token_layer(shape: ModelShape, ac: ActivationCheckpoint, ep: int = 1) -> float:
    """Elements kept for backward per token per block (flash SDPA, eager), before TP/SP division; q = n_heads x
    head width (dim for Llama 3; Qwen3's MoE flavors have twice dim), kv = n_kv_heads x head width.

    No AC: norm inputs 2*dim, norm outputs feeding the Linears 2*dim, q/k/v 3 projections (q + 2*kv), with q/k
    norms their outputs (q + kv), RoPE'd q/k (q + kv) and SDPA out (q), wo input shared with it, the residual (dim),
    FFN w1/w3 outputs, silu output and the product (4*hidden): ~5*dim + 3*q + 3*kv + 4*hidden. An MoE's hidden is
    its k experts' rows and its shared expert's, and it also keeps each token's k dispatched copies (below).
    Full AC keeps only the block input (dim). Per-op SAC keeps the block input plus every second mm output (wq,
    wv, w1, w2) and SDPA out; in an MoE block the routed experts' grouped GEMMs are not in the save list, so the
    saved mms are wq, wv, the router's gate (E scores) and the shared expert's w3; with expert parallelism (`ep` >
    1) it also keeps the all-to-alls' outputs, the rows received for the experts and the rows combined back, 2 k x
    dim (SAC_SAVE_LIST: the exchange is not redone in backward).
    Selective every N blocks: 1 block in N is fully recomputed.
    """
    dim, q, kv = shape.dim, shape.head_width * shape.n_heads, shape.head_width * shape.n_kv_heads
    hidden = shape.token_ffn_width  # an MoE: the k experts' rows a token adds, and the shared expert's
    # An MoE also keeps each token's k dispatched copies: the rows gathered for the experts (the grouped GEMMs'
    # input) and the experts' output rows (for the product with the routing weights), 2 k x dim. Expert
    # parallelism adds none that backward keeps (its all-to-alls save nothing; the received rows, sorted, are the
    # GEMMs' input), but a rank receives rows in proportion to its experts' load: up to moe_imbalance x as many.
    dispatched = 2 * shape.top_k * dim if shape.experts else 0
    full_block = 5 * dim + 3 * q + 3 * kv + (q + kv) * shape.qk_norm + 4 * hidden + dispatched
    if ac.mode == "none":
        return full_block
    if ac.mode == "full":
        return dim
    if ac.selective_ac_option == "op":
        ffn = shape.experts + shape.shared_hidden_dim if shape.experts else hidden + dim
        return dim + q + kv + ffn + q + (2 * shape.top_k * dim if shape.experts and ep > 1 else 0)
    every = int(ac.selective_ac_option)
    return (dim + (every - 1) * full_block) / every


def _blocks_keeping_inputs(blocks: int, ac: ActivationCheckpoint) -> int:
    """Blocks whose attention inputs (the dense document mask among them) are kept for backward at once: every
    block without AC or with per-op SAC, one (the block being recomputed) under full AC, the blocks not
    recomputed plus one with selective_ac_option N."""
    if ac.mode == "full":
        return min(blocks, 1)
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        recomputed = blocks // int(ac.selective_ac_option)
        return blocks - recomputed + min(recomputed, 1)
    return blocks


def memory_estimate(
    cfg: JobConfig, plan: RunPlan, local_params: int, device_type: str, pp_rank: int = 0
) -> dict[str, int]:
    """Bytes per device (name -> bytes): fp32 master params, fp32 grads, AdamW m+v (fp32) of the `local_params`
    this rank holds (its shards after TP and FSDP; under pipeline parallelism of pipeline rank `pp_rank`'s stages),
    the activations kept for backward, with context parallelism the key/value buffers of one block's attention,
    and on a CPU under a document mask the dense mask each block's attention keeps.

    Activations: tokens = local_batch_size x seq_len / cp per device (under pipeline parallelism a micro-batch's,
    for each micro-batch the rank keeps in flight: PipelinePlan.in_flight); per block
    `_activation_elems_per_token_layer` x the compute dtype's size (training.mixed_precision_param on
    `device_type`: bfloat16 2 bytes, float32 4), divided by tp (TP shards heads/hidden, sequence parallel shards the
    rest); plus the logits kept for the loss: compute-dtype logits + fp32 log-softmax (/ tp with loss parallel). A
    validation batch (forward only, after the step) counts instead when its logits need more. Context parallel
    attention briefly holds other ranks' keys and values (bf16) and, in backward, float32 gradients for them: all
    cp ranks' with `allgather`, two ranks' with `alltoall` (the one in use and the one arriving). On a CPU a
    document-masked (flex) flavor's attention evaluates the mask densely: (batch, 1, seq, seq) in the compute
    dtype, kept by every block that keeps its inputs (models/attention.py). Not included: bf16 copies of the
    weights held for backward (FSDP's unsharded params, autocast's casts), other transient buffers and allocator
    fragmentation: budget ~10-20% on top. On the debug model (seq 64, batch 2, bf16 autocast) the estimate is
    within 10% of the saved-activation report (no AC: 10.8 vs 10.1 MB; per-op SAC: 4.9 vs 5.0 MB).
    """
    t, ac, shape, pipeline = cfg.training, cfg.activation_checkpoint, plan.shape, plan.pipeline
    cp, tp, split = plan.degrees.cp, plan.degrees.tp, plan.sequence
    size = 4 if resolve_mixed_precision(t.mixed_precision_param, device_type) == "float32" else 2
    per_layer = _activation_elems_per_token_layer(shape, ac, plan.degrees.ep) * size / tp
    logits_per_token = (size + 4) * shape.vocab_size / tp
    if pipeline is None:
        rows, in_flight, blocks, has_output = t.local_batch_size, 1, shape.n_layers, True
        what = "one micro-batch"
    else:
        rows, in_flight = cfg.parallelism.pipeline_parallel_microbatch_size, pipeline.in_flight(pp_rank)
        blocks, has_output = pipeline.blocks(pp_rank), pipeline.has_output(pp_rank)
        what = f"{in_flight} pipeline micro-batch{'es' * (in_flight > 1)} in flight"
    running = split.rank_tokens(rows, t.seq_len)  # the micro-batch a block's attention runs on
    logits = logits_per_token if has_output else 0
    activations = int(running * in_flight * (blocks * per_layer + logits))
    if cfg.validation.enable:  # forward only: the logits of one (micro-)batch
        val_rows, val_seq = validation_shape(cfg.validation, t)
        val_rows = val_rows if pipeline is None else rows
        val = int(split.rank_tokens(val_rows, val_seq) * logits)
        if val > activations:
            activations, what = val, f"a validation batch's logits, {val_rows} x {val_seq}"
    estimate = {
        "params (fp32)": 4 * local_params,
        "grads (fp32)": 4 * local_params,
        "optimizer (AdamW m+v fp32)": 8 * local_params,
        f"activations ({what})": activations,
    }
    if cp > 1:
        kv = 2 * shape.head_width * shape.n_kv_heads // tp  # k and v elements per token
        held = cp if cfg.parallelism.context_parallel_rotate_method == "allgather" else 2  # ranks' k/v held at once
        estimate["CP key/value buffers (one block)"] = running * held * kv * (2 + 4)
    if device_type == "cpu" and shape.attn_type == "flex":
        masks = in_flight * _blocks_keeping_inputs(blocks, ac)
        estimate["document mask (dense on a CPU)"] = masks * rows * t.seq_len * t.seq_len * size
    return estimate
