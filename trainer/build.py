"""The build, as named phases; the Trainer calls them in order, and the dry run shares the model phases:

    float8_converter   [float8] -> the converter (torchao and the GPUs checked first, before any process group)
    process_group      the default group and this rank's device; lost-peer watch
    model_args         flavor + model.* overrides (or the shape stored with checkpoint.initial_load_path) -> ModelArgs
    parallel_dims      degrees checked against the world, the shape and the device; the device mesh
    data               the tokenizer's batches, this data-parallel rank's slice
    build_model        ModelArgs -> model on the meta device -> float8 conversion -> (pipeline stages) -> parallelize
                       (TP, AC, compile, FSDP)
    materialize        to_empty + the layout-independent init (one seed, one model) on the device
    pipeline           under pipeline parallelism: the stages as torch PipelineStages and their schedule
    optimizer          AdamW + the LR schedule
    checkpointer       the run's checkpoint folder (claimed), what is saved, the settings a resume is checked against

Each phase is a function of what it needs, never of the Trainer; the hooks phase is `trainer.hooks.build_hooks`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from float8.converter import Float8Converter, build_float8_converter
from float8.environment import check_cpu_float8
from kiln_base.config import (
    FROM_CHECKPOINT,
    SHAPE_OVERRIDES,
    JobConfig,
    Model,
    PipelinePlan,
    check_model_shape,
    check_overrides_match_stored,
    check_parallel_plan,
    check_pipeline,
    check_pipeline_device,
    check_same_model,
    check_world,
)
from kiln_base.internals import pipeline_warmup_sends_to_own_rank
from models import LLAMA3_FLAVORS, ModelArgs, Transformer, flops_per_token, num_params
from models.args import first_difference
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_llama
from parallelisms.pipeline import Pipeline, StagedModel, stage_model
from parallelisms.seeded_init import init_layout_independent
from trainer.components.checkpoint import CheckpointManager
from trainer.components.checkpoint_folder import FolderClaim
from trainer.components.data import DataLoader, build_dataloader, dataset_fingerprint
from trainer.components.dist import PeerWatch, init_distributed
from trainer.components.initial_load import InitialSource, check_not_inside
from trainer.components.loss import LossFn
from trainer.components.resume import file_sha256, training_settings
from trainer.components.tokenizer import Tokenizer

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


def model_args(m: Model, seq_len: int, tokenizer_words: int, source: InitialSource | None = None) -> ModelArgs:
    """The shape to build: the flavor's with the vocabulary from the tokenizer (or model.vocab_size) and the model.*
    overrides; with model.flavor from_checkpoint the shape stored with checkpoint.initial_load_path (`source`),
    which the overrides may only repeat. With a named flavor, a source must hold the same model. Checked."""
    if m.flavor == FROM_CHECKPOINT:
        assert source is not None, "config checks require checkpoint.initial_load_path with from_checkpoint"
        check_overrides_match_stored(m, dataclasses.asdict(source.args), source.path)
        args = dataclasses.replace(source.args, max_seq_len=seq_len)
        check_model_shape(m, args.shape(), tokenizer_words, source.path)
        return args
    overrides = {key: getattr(m, key) for key in SHAPE_OVERRIDES if getattr(m, key) is not None}
    args = dataclasses.replace(
        LLAMA3_FLAVORS[m.flavor], **{"vocab_size": tokenizer_words, **overrides, "max_seq_len": seq_len}
    )
    check_model_shape(m, args.shape(), tokenizer_words)
    if source is not None:
        check_same_model(m.flavor, source.path, first_difference(source.args, args))
    return args


def parallel_dims(cfg: JobConfig, args: ModelArgs, device_type: str) -> ParallelDims:
    """The degrees for this world, checked against the world size, the model's shape and the device; the mesh."""
    world = dist.get_world_size()
    check_world(cfg, world)
    check_parallel_plan(cfg, args.shape(), device_type)
    p = cfg.parallelism
    check_pipeline_device(p, device_type, pipeline_warmup_sends_to_own_rank())
    dims = ParallelDims(
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
        world,
        pp=p.pipeline_parallel_degree,
    )
    dims.build_mesh(device_type)
    return dims


def data(cfg: JobConfig, tokenizer: Tokenizer, dims: ParallelDims, device: torch.device) -> DataLoader:
    """This data-parallel rank's slice of every global batch (the ranks of one TP group, and of one pipeline, read
    the same batches: the `dp` mesh leaves tp and pp out)."""
    dp_rank = dims.dp_mesh.get_local_rank()
    return build_dataloader(cfg.training, tokenizer, dp_rank, dims.dp_degree, pin_memory=device.type == "cuda")


@dataclass
class BuiltModel:
    model: nn.Module  # on the meta device, float8-converted and parallelized: the Transformer, or under pipeline
    # parallelism this rank's stages as one module (parallelisms/pipeline.py StagedModel)
    parts: list[nn.Module]  # what FSDP and the init treat as whole models: [model], or the stage models
    args: ModelArgs
    n_params: int  # before sharding: the whole model's
    flops_per_token: float  # 6N + 12LHQT at the configured seq_len (MFU's numerator per token)
    linear_fqns: list[str]  # every nn.Linear (Float8Linear included) of the parts, named before AC/compile wrapping
    tp_plan: dict[str, ParallelStyle]  # module FQN -> TP style applied; empty without TP
    pipeline: PipelinePlan | None = None  # the stages and the schedule; None without pipeline parallelism
    stage_ids: tuple[int, ...] = (0,)  # the stages `parts` are, under pipeline parallelism
    # state-dict keys (whole tensors' shapes) held by the other ranks of this rank's pipeline: a checkpoint of the
    # whole model is checked and loaded against them too (trainer/components/checkpoint.py check_matches)
    held_elsewhere: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


def build_model(
    cfg: JobConfig,
    args: ModelArgs,
    dims: ParallelDims,
    float8: Float8Converter | None,
    stage_ids: tuple[int, ...] | None = None,
) -> BuiltModel:
    """The model on the meta device, float8-converted (when a converter is given) and parallelized: the one
    model-build path, shared by the Trainer and the dry run. Under pipeline parallelism the float8-converted model
    is cut into stages (kiln_base.config.pipeline_plan) and each of this rank's stages (or `stage_ids`: the dry run
    plans every stage) is parallelized like a whole model."""
    with torch.device("meta"):
        model = Transformer(args)
    if float8 is not None:
        float8.convert(model)
    n_params, flops = num_params(model), flops_per_token(args, model, cfg.training.seq_len)
    plan = check_pipeline(cfg, args.shape())
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
    for part in parts:
        tp_plan |= parallelize_llama(part, dims, cfg.training, cfg.parallelism, cfg.activation_checkpoint, cfg.float8)
    whole = parts[0] if plan is None else StagedModel(parts)
    return BuiltModel(whole, list(parts), args, n_params, flops, linear_fqns, tp_plan, plan, ids, elsewhere)


def pipeline(built: BuiltModel, dims: ParallelDims, device: torch.device, loss_fn: LossFn) -> Pipeline | None:
    """Under pipeline parallelism, this rank's stages as torch PipelineStages and the schedule that runs them."""
    if built.pipeline is None:
        return None
    group = dims.pp_mesh.get_group()
    return Pipeline(built.parts, built.pipeline, built.stage_ids, group, device, loss_fn)


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
    return os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)


def claim_checkpoint_folder(cfg: JobConfig) -> FolderClaim | None:
    """With checkpoints on, the run's folder is locked now: a busy, read-only or non-directory folder fails at
    start, not hours in."""
    return FolderClaim(checkpoint_folder(cfg)) if cfg.checkpoint.enable_checkpoint else None


def run_settings(cfg: JobConfig, args: ModelArgs, global_batch: int, loader: DataLoader) -> dict[str, Any]:
    """What a resume is checked against (trainer/components/resume.py): shapes, batch, data, tokenizer."""
    fingerprint = dataset_fingerprint(cfg.training, loader.windows.shard_files)
    return training_settings(cfg, args, global_batch, fingerprint, file_sha256(cfg.model.tokenizer_path))
