"""The build, as named phases; the Trainer calls them in order, and the dry run shares the model phases:

    float8_converter   [float8] -> the converter (torchao and the GPUs checked first, before any process group)
    process_group      the default group and this rank's device; lost-peer watch
    model_args         flavor + model.* overrides (or the shape stored with checkpoint.initial_load_path) -> ModelArgs
    parallel_dims      degrees checked against the world, the shape and the device; the device mesh
    data               the tokenizer's batches, this data-parallel rank's slice
    build_model        ModelArgs -> model on the meta device -> float8 conversion -> parallelize (CP, TP, AC, compile,
                       FSDP)
    materialize        to_empty + the layout-independent init (one seed, one model) on the device
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
    check_model_shape,
    check_overrides_match_stored,
    check_parallel_plan,
    check_same_model,
    check_world,
)
from models import LLAMA3_FLAVORS, ModelArgs, Transformer, flops_per_token, num_params
from models.args import first_difference
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_llama
from parallelisms.seeded_init import init_layout_independent
from trainer.components.checkpoint import CheckpointManager
from trainer.components.checkpoint_folder import FolderClaim
from trainer.components.data import DataLoader, build_dataloader, dataset_fingerprint
from trainer.components.dist import PeerWatch, init_distributed
from trainer.components.initial_load import InitialSource, check_not_inside
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
    dims = ParallelDims(
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
        world,
        cp=p.context_parallel_degree,
    )
    dims.build_mesh(device_type)
    return dims


def data(cfg: JobConfig, tokenizer: Tokenizer, dims: ParallelDims, device: torch.device) -> DataLoader:
    """This data-parallel rank's slice of every global batch (ranks of one TP or CP group read the same batches;
    a CP rank keeps its part of each sequence: Trainer.local_batch)."""
    dp_rank = dims.dp_mesh.get_local_rank()
    return build_dataloader(cfg.training, tokenizer, dp_rank, dims.dp_degree, pin_memory=device.type == "cuda")


@dataclass
class BuiltModel:
    model: Transformer  # on the meta device, float8-converted and parallelized
    args: ModelArgs
    n_params: int  # before sharding: the whole model's
    flops_per_token: float  # 6N + 12LHQT at the configured seq_len (MFU's numerator per token)
    linear_fqns: list[str]  # every nn.Linear (Float8Linear included), named before AC/compile wrapping
    tp_plan: dict[str, ParallelStyle]  # module FQN -> TP style applied; empty without TP


def build_model(cfg: JobConfig, args: ModelArgs, dims: ParallelDims, float8: Float8Converter | None) -> BuiltModel:
    """The model on the meta device, float8-converted (when a converter is given) and parallelized: the one
    model-build path, shared by the Trainer and the dry run."""
    with torch.device("meta"):
        model = Transformer(args)
    if float8 is not None:
        float8.convert(model)
    linear_fqns = [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    n_params, flops = num_params(model), flops_per_token(args, model, cfg.training.seq_len)
    tp_plan = parallelize_llama(model, dims, cfg.training, cfg.parallelism, cfg.activation_checkpoint, cfg.float8)
    return BuiltModel(model, args, n_params, flops, linear_fqns, tp_plan)


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


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate the meta model's shards on `device` and fill them with the values the whole model would hold on one
    device for `seed`, whatever the layout (parallelisms/seeded_init.py); the model is left in training mode."""
    model.to_empty(device=device)
    init_layout_independent(model, seed, device)
    model.train()


def checkpointer(
    cfg: JobConfig,
    claim: FolderClaim | None,
    source: InitialSource | None,
    states: dict[str, Any],
) -> CheckpointManager:
    """The run's checkpoint manager over `states` (model, optimizer, LR schedule, data loader, train state)."""
    folder = checkpoint_folder(cfg)
    if source is not None and cfg.checkpoint.enable_checkpoint:
        check_not_inside(source, folder)
    return CheckpointManager(cfg.checkpoint, folder, states, claim=claim)


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
