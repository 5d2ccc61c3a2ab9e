"""The build, as named phases; the Trainer calls them in order, and the dry run shares the model phases:

    float8_converter   [float8] -> the converter (torchao and the GPUs checked first, before any process group)
    process_group      the default group and this rank's device; lost-peer watch
    model_args         flavor + model.* overrides (or the shape stored with checkpoint.initial_load_path) -> ModelArgs
    run_plan           the run's plan (kiln_base.config.plan_run: degrees, sequence split, pipeline stages) for this
                       world and shape, checked against the device
    parallel_dims      the plan's degrees as ParallelDims; the device mesh
    check_fits         the model's training state fits this rank's memory (host RAM on a CPU, the GPU's on CUDA)
    data               the tokenizer's batches, this data-parallel rank's slice
    build_model        ModelArgs -> model on the meta device -> float8 conversion -> (the plan's pipeline stages) ->
                       parallelize (CP, TP, AC, compile, FSDP); this rank's ContextParallel, made once
    materialize        to_empty + the layout-independent init (one seed, one model) on the device
    step               the step object (trainer/step/step.py): the compute precision, the loss, under pipeline
                       parallelism the stages as torch PipelineStages and their schedule (PipelineStep); an MoE
                       model's load balancing (trainer/step/moe_balance.py)
    validator          [validation] on: held-out batches and the loss of the current weights on them (the step's
                       forward)
    downstream_eval    [eval] on: the lm-eval tasks (loaded now) scored through the step's forward
    checkpointer       the run's checkpoint folder (claimed), what is saved, the settings a resume is checked against
    wrap_step          after the resume: what wraps the step (fault tolerance, the non-finite skip) and the guard

Before the model: the checkpoint folder is claimed (claim_checkpoint_folder) and the other output folders are
checked writable (check_output_folders).

Each phase is a function of what it needs, never of the Trainer; the optimizer and LR schedule come from
trainer/components/optim.py (Trainer._build calls them between `materialize` and `step`); the hooks phase is
`trainer.hooks.build_hooks`. A step-level feature is built in `step` or `wrap_step`: the loop never changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.optim.lr_scheduler import LambdaLR

from float8.converter import Float8Converter, build_float8_converter
from float8.environment import check_cpu_float8
from kiln_base.config import (
    CPU_BF16_COST,
    FROM_CHECKPOINT,
    SHAPE_OVERRIDES,
    JobConfig,
    Model,
    PipelinePlan,
    RunPlan,
    Training,
    check_family,
    check_ffn_overrides,
    check_model_memory,
    check_model_shape,
    check_moe_balance,
    check_overrides_match_stored,
    check_parallel_plan,
    check_pipeline_device,
    check_same_model,
    logit_tokens,
    plan_run,
    resolve_mixed_precision,
)
from kiln_base.errors import ConfigError
from kiln_base.files import output_location, writable_dir_problem
from kiln_base.internals import pipeline_warmup_sends_to_own_rank
from models import ModelArgs, Transformer, active_params, flops_per_token, moe_layers, num_params
from models.args import FAMILIES, family_of, first_difference
from models.flops import CONVENTIONS as FLOP_CONVENTIONS
from parallelisms.context_parallel import ContextParallel, build_context_parallel
from parallelisms.grad_reduce import reduction_line
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import loss_parallel_enabled, parallelize_llama
from parallelisms.pipeline import Pipeline, StagedModel, stage_model
from parallelisms.seeded_init import init_layout_independent
from trainer.checkpoint.folder import FolderClaim
from trainer.checkpoint.initial_load import InitialSource, check_not_inside
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.objects import claim_folder
from trainer.checkpoint.resume import TrainState, file_sha256, training_settings
from trainer.components.dist import PeerWatch, init_distributed
from trainer.components.loss import build_loss_fn
from trainer.components.tokenizer import Tokenizer
from trainer.data.documents import DocumentMask
from trainer.data.text import DataLoader, build_dataloader, build_validation_loader
from trainer.data.tokens import (
    TokenFileLoader,
    build_token_loader,
    build_token_validation_loader,
    uses_token_files,
)
from trainer.evaluation.downstream import DownstreamEval
from trainer.evaluation.validate import Validator
from trainer.step.guards import NonFiniteGuard, NonFiniteSkip
from trainer.step.moe_balance import MoEBalance
from trainer.step.step import PipelineStep, StepWrapper, TrainStep

logger = logging.getLogger("kiln")

float8_converter = build_float8_converter  # the float8 phase: None when float8 is off


def process_group(cfg: JobConfig) -> tuple[torch.device, PeerWatch | None]:
    """The default process group (nccl on CUDA, gloo on a CPU; a world of one without torchrun), this rank's
    device, and the watch that names lost ranks when a collective fails (train.py)."""
    device = init_distributed(cfg.comm.init_timeout_seconds)
    peers = PeerWatch.maybe_start()
    if device.type == "cpu":
        check_cpu_float8(cfg.float8)
    return device, peers


def model_args(
    m: Model, seq_len: int, tokenizer_words: int, source: InitialSource | None = None, bos_id: int | None = None
) -> ModelArgs:
    """The shape to build: model.name's flavor's with the vocabulary from the tokenizer (or model.vocab_size) and the
    model.* overrides; with model.flavor from_checkpoint the shape stored with checkpoint.initial_load_path
    (`source`), which must be of model.name's family and which the overrides may only repeat. With a named flavor,
    a source must hold the same model. Checked, every field first (types and ranges), whichever source gave it:
    the launcher runs this before torchrun starts a rank (train.check_config), each rank before it builds.

    `seq_len`: the longest sequence the run feeds (the RoPE table's length); `bos_id`: the tokenizer's BOS, where
    a document starts under a document-masked flavor."""
    if m.flavor == FROM_CHECKPOINT:
        assert source is not None, "config checks require checkpoint.initial_load_path with from_checkpoint"
        check_family(m.name, family_of(source.args), source.path)
        check_overrides_match_stored(m, dataclasses.asdict(source.args), source.path)
        args = dataclasses.replace(source.args, max_seq_len=seq_len, bos_id=bos_id)
        args.check_fields(source.path)
        check_model_shape(m, args.shape(), tokenizer_words, source.path)
        check_moe_balance(m, args.moe_num_experts, source.path)
        return args
    flavor = FAMILIES[m.name][m.flavor]  # the config checks made sure the family has it
    check_ffn_overrides(m, flavor.ffn_dim)
    overrides = {key: getattr(m, key) for key in SHAPE_OVERRIDES if getattr(m, key) is not None}
    args = dataclasses.replace(
        flavor,
        **{"vocab_size": tokenizer_words, **overrides, "max_seq_len": seq_len, "bos_id": bos_id},
    )
    args.check_fields(f"flavor {m.flavor} + model.* overrides")
    check_model_shape(m, args.shape(), tokenizer_words)
    check_moe_balance(m, args.moe_num_experts, f"flavor {m.flavor}")
    if source is not None:
        check_same_model(m.flavor, source.path, first_difference(source.args, args))
    return args


def memory_capacity(device: torch.device) -> tuple[int, str]:
    """The bytes one rank's training state must fit in, and what they are: the GPU's memory on CUDA, else the
    host's RAM (the smaller of the physical memory and a cgroup v2 limit, in a container)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the memory of {props.name} ({device})"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f:
            ram = min(ram, int(f.read().strip()))  # "max" (no limit) is a ValueError
    return ram, "this machine's RAM"


def check_fits(cfg: JobConfig, plan: RunPlan, ranks_sharing: int, device: torch.device) -> None:
    """The model's fp32 weights, gradients and AdamW state split over the plan's parameter shards (FSDP x TP), and
    the logits of the largest micro-batch (training's or validation's), for the `ranks_sharing` ranks on one
    memory, fit that memory (kiln_base.config.check_model_memory; under pipeline parallelism each rank's stages and
    a pipeline micro-batch); skipped by a dry run, which plans any size and prints its own estimate."""
    capacity, what = memory_capacity(device)
    tokens, which = logit_tokens(cfg, plan)
    shards, tp = plan.degrees.param_shards, plan.degrees.tp
    check_model_memory(plan.shape, shards, tokens, tp, ranks_sharing, capacity, what, plan.pipeline, which)


def run_plan(cfg: JobConfig, args: ModelArgs, world_size: int, device_type: str) -> RunPlan:
    """The run's plan for this world and shape (kiln_base.config.plan_run), and the rules that also need the device
    type (its ranks' in the launcher): the launcher and each rank, before anything is built."""
    plan = plan_run(cfg, world_size, args.shape())
    check_parallel_plan(cfg, plan.shape, device_type)
    check_pipeline_device(cfg.parallelism, device_type, pipeline_warmup_sends_to_own_rank())
    return plan


def parallel_dims(plan: RunPlan, device_type: str) -> ParallelDims:
    """The plan's degrees as ParallelDims, and the device mesh they build."""
    dims = ParallelDims.of(plan.degrees)
    dims.build_mesh(device_type)
    return dims


def document_mask(flavor: str, args: ModelArgs, tokenizer: Tokenizer) -> DocumentMask | None:
    """What a document-masked model needs of token-file data (trainer/data/documents.py); None for causal."""
    return None if args.attn_mask_type == "causal" else DocumentMask(flavor, tokenizer.eos_id)


def data(
    cfg: JobConfig,
    tokenizer: Tokenizer,
    plan: RunPlan,
    dims: ParallelDims,
    device: torch.device,
    documents: DocumentMask | None = None,
) -> DataLoader | TokenFileLoader:
    """This data-parallel rank's slice of every global batch (the ranks of one TP or CP group, and of one pipeline,
    read the same batches: the `dp` mesh leaves tp, cp and pp out; a CP rank keeps its part of each sequence:
    TrainStep.local_batch). Token files (docs/data.md) or text tokenized on the fly, decided here once; under fault
    tolerance each replica group reads its share of the global batch (the plan's data streams). `documents`: a
    document-masked model's; token-file batches then carry each token's document id (text batches: the model counts
    BOS tokens)."""
    stream, streams = plan.batch.stream(dims.dp_mesh.get_local_rank()), plan.batch.data_streams
    pin = device.type == "cuda"
    if uses_token_files(cfg.training):
        return build_token_loader(cfg.training, tokenizer.n_words, stream, streams, plan.global_batch, pin, documents)
    return build_dataloader(cfg.training, tokenizer, stream, streams, pin_memory=pin)


def validator(
    cfg: JobConfig,
    tokenizer: Tokenizer,
    dims: ParallelDims,
    device: torch.device,
    step: TrainStep,
    documents: DocumentMask | None = None,
) -> Validator | None:
    """With validation.enable, the validator: this data-parallel rank's slice of the validation set's batches
    (opened afresh each validation; token files with document ids under `documents`, as training's), the step's
    forward and loss, the average over the ranks."""
    if not cfg.validation.enable:
        return None
    dp_rank = dims.dp_mesh.get_local_rank()

    def open_loader() -> DataLoader | TokenFileLoader:
        v, pin = cfg.validation, device.type == "cuda"
        if uses_token_files(v):
            words = tokenizer.n_words
            return build_token_validation_loader(v, cfg.training, words, dp_rank, dims.dp_degree, pin, documents)
        return build_validation_loader(v, cfg.training, tokenizer, dp_rank, dims.dp_degree, pin)

    return Validator(open_loader, step.evaluate, step.global_mean, cfg.validation.steps, device)


def downstream_eval(
    cfg: JobConfig, tokenizer: Tokenizer, device: torch.device, step: TrainStep
) -> DownstreamEval | None:
    """With eval.enable ([eval]), the tasks (loaded now: a task that cannot run stops the run before its first step)
    and kiln's model behind lm-eval's interface, scoring through the step's forward in the step's batch layout."""
    if not cfg.eval.enable:
        return None
    from trainer.evaluation.downstream import build_downstream_eval  # lm-eval: an optional extra

    layout = step.eval_layout(compiled=cfg.training.compile)
    return build_downstream_eval(cfg.eval, tokenizer, step.log_likelihood, layout, cfg.training.seq_len, device)


@dataclass(kw_only=True)
class BuiltModel:
    model: nn.Module  # on the meta device, float8-converted and parallelized: the Transformer, or under pipeline
    # parallelism this rank's stages as one module (parallelisms/pipeline.py StagedModel)
    parts: list[nn.Module]  # what FSDP and the init treat as whole models: [model], or the stage models
    args: ModelArgs
    n_params: int  # before sharding: the whole model's
    n_active_params: int  # what one token computes with (models.active_params: an MoE's top k experts); dense: n_params
    flops_per_token: float  # at the configured seq_len under metrics.attention_flops (MFU's numerator per token)
    flops_per_token_by_convention: dict[str, int]  # "full" (6N + 12LHQT) and "causal" (6N + 6LHQT)
    linear_fqns: list[str]  # every nn.Linear (Float8Linear included) of the parts, named before AC/compile wrapping
    tp_plan: dict[str, ParallelStyle]  # module FQN -> TP style applied; empty without TP
    pipeline: PipelinePlan | None = None  # the stages and the schedule; None without pipeline parallelism
    stage_ids: tuple[int, ...] = (0,)  # the stages `parts` are, under pipeline parallelism
    # state-dict keys (whole tensors' shapes) held by the other ranks of this rank's pipeline: a checkpoint of the
    # whole model is checked and loaded against them too (trainer/checkpoint/manager.py check_matches)
    held_elsewhere: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    cp: ContextParallel | None = None  # this rank's context parallelism (the blocks' attention, the batch's split)


def build_model(
    cfg: JobConfig,
    args: ModelArgs,
    dims: ParallelDims,
    float8: Float8Converter | None,
    *,
    pipeline: PipelinePlan | None = None,
    stage_ids: tuple[int, ...] | None = None,
) -> BuiltModel:
    """The model on the meta device, float8-converted (when a converter is given) and parallelized: the one
    model-build path, shared by the Trainer and the dry run. Under pipeline parallelism (`pipeline`: the run plan's
    stages) the float8-converted model is cut into stages and each of this rank's stages (or `stage_ids`: the dry
    run plans every stage) is parallelized like a whole model. Context parallelism's object is made here, once:
    every block's attention runs through it, and the Trainer splits each batch with it."""
    with torch.device("meta"):
        model = Transformer(args)
    if float8 is not None:
        float8.convert(model)
    n_params, n_active = num_params(model), active_params(model)
    flops = {c: flops_per_token(args, model, cfg.training.seq_len, c) for c in FLOP_CONVENTIONS}
    plan = pipeline
    if plan is None:
        parts: list[Transformer] = [model]
        ids: tuple[int, ...] = (0,)
        elsewhere: dict[str, tuple[int, ...]] = {}
    else:
        ids = stage_ids if stage_ids is not None else plan.stage_ids(dims.pp_mesh.get_local_rank())
        parts = [stage_model(model, plan.stages[i]) for i in ids]
        local = {k for part in parts for k in part.state_dict()}
        elsewhere = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in local}
    linear_fqns = [n for part in parts for n, mod in part.named_modules() if isinstance(mod, nn.Linear)]
    tp_plan: dict[str, ParallelStyle] = {}
    cp = build_context_parallel(dims, cfg.parallelism)
    for part in parts:
        tp_plan |= parallelize_llama(
            part, dims, cfg.training, cfg.parallelism, cfg.activation_checkpoint, cfg.float8, cp=cp
        )
    return BuiltModel(
        model=parts[0] if plan is None else StagedModel(parts),
        parts=list(parts),
        args=args,
        n_params=n_params,
        n_active_params=n_active,
        flops_per_token=flops[cfg.metrics.attention_flops],
        flops_per_token_by_convention=flops,
        linear_fqns=linear_fqns,
        tp_plan=tp_plan,
        pipeline=plan,
        stage_ids=ids,
        held_elsewhere=elsewhere,
        cp=cp,
    )


def local_params(model: nn.Module) -> int:
    """Parameters this rank holds: each one's local shard (a DTensor's after TP and FSDP), for the memory estimate."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def log_precision(param: str, precision: str, device_type: str) -> None:
    """One start-up line with the compute dtype chosen, and one warning when bf16 is forced on a CPU."""
    how = f"training.mixed_precision_param = {param}" + (f" on {device_type}" if param == "auto" else "")
    logger.info(f"Mixed precision: {precision} compute, float32 master weights and optimizer state ({how})")
    if precision == "bfloat16" and device_type == "cpu":
        logger.warning(f"bfloat16 compute on a CPU, as asked: {CPU_BF16_COST}; auto (float32) is faster there")


def compute_precision(t: Training, dims: ParallelDims, device_type: str) -> contextlib.AbstractContextManager:
    """The autocast that gives the compute dtype (without FSDP's MixedPrecisionPolicy, autocast gives bf16 compute
    over fp32 master weights); logs the dtype and every gradient reduction's precision."""
    precision = resolve_mixed_precision(t.mixed_precision_param, device_type)
    log_precision(t.mixed_precision_param, precision, device_type)
    logger.info(reduction_line(t, dims.dp_replicate, dims.degrees.fsdp_shards, dims.tp, device_type, dims.pp))
    autocast = not dims.fully_shard_enabled and precision == "bfloat16"  # FSDP above shards over dp_shard x cp
    return torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


def step(
    cfg: JobConfig,
    plan: RunPlan,
    built: BuiltModel,
    dims: ParallelDims,
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: LambdaLR,
    dataloader: DataLoader | TokenFileLoader,
    float8: Float8Converter | None,
) -> TrainStep:
    """The step object, its variant chosen here once: the whole model (TrainStep) or, under pipeline parallelism,
    this rank's stages as torch PipelineStages and their schedule (PipelineStep; under a document mask every stage
    is handed the document ids, or token ids, its mask is built from). The loss is compiled with the model, except
    over vocab-sharded logits (TP loss parallel)."""
    t = cfg.training
    amp = compute_precision(t, dims, device.type)
    vocab_sharded = loss_parallel_enabled(dims, cfg.parallelism)
    loss_fn = build_loss_fn(t.compile and not vocab_sharded)
    pipeline = None
    if built.pipeline is not None:
        mbs, masks = cfg.parallelism.pipeline_parallel_microbatch_size, built.args.attn_mask_type != "causal"
        group = dims.pp_mesh.get_group()
        pipeline = Pipeline(built.parts, built.pipeline, built.stage_ids, group, device, loss_fn, mbs, masks)
    variant = TrainStep if pipeline is None else PipelineStep
    return variant(
        model=built.model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=dataloader, dims=dims,
        grad_accum_steps=plan.grad_accum_steps, loss_fn=loss_fn, amp=amp, loss_parallel=vocab_sharded, cp=built.cp,
        max_norm=t.max_norm, device=device, float8=float8, pipeline=pipeline,
        wrappers=[moe_balance(cfg.model, built, dims, device)] if built.args.moe else [],
    )  # fmt: skip


def moe_balance(m: Model, built: BuiltModel, dims: ParallelDims, device: torch.device) -> MoEBalance:
    """An MoE model's load balancing (trainer/step/moe_balance.py): the aux loss from the whole model's router
    statistics (refused under pipeline parallelism), the counts summed over the ranks holding different tokens."""
    bias, aux = m.moe_load_balance_coeff, m.moe_aux_loss_coeff
    logger.info(
        f"MoE load balancing: expert bias {f'step {bias}' if bias else 'off'} (model.moe_load_balance_coeff), "
        f"aux loss {f'x {aux}' if aux else 'off'} (model.moe_aux_loss_coeff); logged: moe_imbalance"
        + (", aux_loss" if aux else "")
    )
    return MoEBalance(
        moe_layers(built.model),
        bias_coeff=m.moe_load_balance_coeff,
        aux_coeff=m.moe_aux_loss_coeff,
        device=device,
        model=cast(Transformer, built.model) if built.pipeline is None else None,
        count_group=dims.routing_mesh.get_group() if dims.dp_enabled or dims.cp_enabled or dims.tp_enabled else None,
        pp_group=dims.pp_group,
    )


def wrap_step(cfg: JobConfig, plan: RunPlan, step: TrainStep, state: TrainState) -> NonFiniteGuard:
    """What wraps the step, after the resume (`state.step`: the step resumed at): fault tolerance across replica
    groups ([fault_tolerance], its quorum compares the resumed step) and training.skip_nonfinite_steps (from the
    LR schedule as resumed); returns the non-finite guard the hooks check (the skip is one)."""
    t, wrappers = cfg.training, list[StepWrapper]()
    if cfg.fault_tolerance.enable:
        from trainer.step.fault_tolerance import ReplicaGroup  # torchft: an optional extra

        init_sync = t.seed is None  # unseeded groups drew different weights: the first quorum syncs them
        timeout = cfg.comm.init_timeout_seconds
        ft = cfg.fault_tolerance
        group = ReplicaGroup(
            ft, step.model, step.optimizer, step.lr_scheduler, state, plan.batch.group_batch, timeout, init_sync,
            plan.fragments,
        )  # fmt: skip
        wrappers.append(group)
    guard: NonFiniteGuard = NonFiniteGuard(step.device)
    if t.skip_nonfinite_steps:  # skipped on every rank if any rank's loss or norm is non-finite (no host sync)
        skip = NonFiniteSkip(
            step.device, step.optimizer, step.lr_scheduler, t.steps, t.skip_nonfinite_steps, step.dataloader
        )
        guard = skip
        wrappers.append(skip)
    step.wrappers = [*wrappers, *step.wrappers]  # the step phase's own (an MoE's balancing) run last
    return guard


def flops_line(flops: dict[str, int], chosen: str, moe: bool = False) -> str:
    """Both FLOP counts per token and which one MFU and TFLOP/s use, for the start-up line and the dry run; for
    an MoE that they count the active parameters (a token's top k experts), not all."""
    active = "; an MoE's FLOPs count its active parameters (each token's top k experts)" if moe else ""
    return (
        f"FLOPs/token: {flops['full'] / 1e9:.3f} G attention full (torchtitan, PaLM), {flops['causal'] / 1e9:.3f} G "
        f"causal (Megatron-LM); MFU and TFLOP/s count {chosen} (metrics.attention_flops){active}"
    )


def active_text(built: BuiltModel) -> str:
    """What follows the parameter count on the start-up line and in the dry run: for an MoE, that it is the total
    and how many of them a token computes with (MFU's count); nothing for a dense model."""
    if not built.args.moe:
        return ""
    share = built.n_active_params / built.n_params
    return f" total, {built.n_active_params:,} active per token ({share:.1%})"


def init_seed(seed: int | None) -> int:
    """The seed of the initial weights: training.seed, or when unset one drawn at random on rank 0 and shared, so
    that every rank initialises the same model (logged, to repeat the run)."""
    if seed is not None:
        return seed
    drawn = torch.tensor([random.SystemRandom().randrange(2**63)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(drawn, src=0)  # a CPU tensor: gloo, also under "cuda:nccl,cpu:gloo"
    logger.info(f"Initial weights from seed {int(drawn)} (training.seed unset; set it to repeat this model)")
    return int(drawn)


def materialize(parts: list[nn.Module], device: torch.device, seed: int) -> None:
    """Allocate the meta model's shards (each pipeline stage's) on `device` and fill them with the values the whole
    model would hold on one device for `seed`, whatever the layout (parallelisms/seeded_init.py); the model is left
    in training mode."""
    for part in parts:
        part.to_empty(device=device)
        init_layout_independent(part, seed, device)
        part.train()


def checkpointer(
    cfg: JobConfig,
    claim: FolderClaim | None,
    source: InitialSource | None,
    states: dict[str, Any],
    held_elsewhere: dict[str, tuple[int, ...]] | None = None,
) -> CheckpointManager:
    """The run's checkpoint manager over `states` (model, optimizer, LR schedule, data loader, train state);
    `held_elsewhere`: the model keys other pipeline stages save (BuiltModel.held_elsewhere)."""
    folder = checkpoint_folder(cfg)
    if source is not None and cfg.checkpoint.enable_checkpoint:
        check_not_inside(source, folder)
    return CheckpointManager(cfg.checkpoint, folder, states, claim=claim, held_elsewhere=held_elsewhere)


def checkpoint_folder(cfg: JobConfig) -> str:
    """job.dump_folder/checkpoint.folder, or checkpoint.folder itself when it is a URL (object storage: never a
    local folder under the dump folder); under fault tolerance each replica group saves its own checkpoints (its
    data-loader position among them) in a folder of its own."""
    folder, ft = output_location(cfg.job.dump_folder, cfg.checkpoint.folder), cfg.fault_tolerance
    return os.path.join(folder, f"ft_replica_{ft.replica_id}") if ft.enable else folder


def check_output_folders(cfg: JobConfig, device_type: str) -> None:
    """The folders this run writes besides its checkpoints (profiler traces, CUDA memory snapshots, TensorBoard)
    are created and take a file now, on every rank: a read-only dump folder once ended a run in a segfault at its
    first profiler trace."""
    p, m, dump = cfg.profiling, cfg.metrics, cfg.job.dump_folder
    snapshots = p.enable_memory_snapshot and device_type == "cuda"  # CPU runs write none (profiling.py warns)
    for on, key, sub in (
        (p.enable_profiling, "profiling.save_traces_folder", p.save_traces_folder),
        (snapshots, "profiling.save_memory_snapshot_folder", p.save_memory_snapshot_folder),
        (m.enable_tensorboard, "metrics.save_tb_folder", m.save_tb_folder),
    ):
        folder = os.path.join(dump, sub)
        problem = writable_dir_problem(folder) if on else None
        if problem is not None:
            raise ConfigError(f"{key}: {folder} (under job.dump_folder) {problem}")


def claim_checkpoint_folder(cfg: JobConfig) -> FolderClaim | None:
    """With checkpoints on, the run's folder is locked now: a busy, read-only or non-directory folder fails at
    start, not hours in."""
    return claim_folder(checkpoint_folder(cfg)) if cfg.checkpoint.enable_checkpoint else None


def run_settings(
    cfg: JobConfig, args: ModelArgs, global_batch: int, loader: DataLoader | TokenFileLoader
) -> dict[str, Any]:
    """What a resume is checked against (trainer/checkpoint/resume.py): shapes, batch, data, tokenizer."""
    fingerprint = loader.fingerprint(cfg.training)
    return training_settings(cfg, args, global_batch, fingerprint, file_sha256(cfg.model.tokenizer_path))
