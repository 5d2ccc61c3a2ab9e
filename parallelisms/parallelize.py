"""parallelize_llama: the one place a meta-device model gets its parallel plan.

Order matters and follows torchtitan: (float8 conversion happens before this) -> TP -> AC -> compile -> FSDP.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parallelisms.activation_checkpoint import apply_ac
from parallelisms.parallel_dims import ParallelDims
from trainer.config import ActivationCheckpoint, Parallelism, Training

DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def apply_compile(model: nn.Module) -> None:
    """Compile each transformer block separately: blocks are identical, so one graph serves all."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=True))


def apply_fsdp(model: nn.Module, parallel_dims: ParallelDims, training: Training, parallelism: Parallelism) -> None:
    """fully_shard each block, then the root; HSDP (replicate x shard) when dp_replicate > 1."""
    mesh = parallel_dims.mesh
    dp_mesh = mesh["dp_replicate", "dp_shard"] if parallel_dims.dp_replicate_enabled else mesh["dp_shard"]
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPE[training.mixed_precision_param], reduce_dtype=DTYPE[training.mixed_precision_reduce]
    )
    policy = parallelism.fsdp_reshard_after_forward
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # By default the last block keeps its params: backward needs them right away.
        reshard = {"always": True, "never": False}.get(policy, i < len(blocks) - 1)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=policy == "always")


def parallelize_llama(
    model: nn.Module,
    parallel_dims: ParallelDims,
    training: Training,
    parallelism: Parallelism,
    ac: ActivationCheckpoint,
) -> None:
    if parallel_dims.tp_enabled:
        raise NotImplementedError("tensor parallelism")
    apply_ac(model, ac)
    if training.compile:
        apply_compile(model)
    if parallel_dims.dp_enabled:
        apply_fsdp(model, parallel_dims, training, parallelism)
