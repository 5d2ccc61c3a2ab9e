"""The global gradient norm and the clip by it: the same number in every layout.

torch's float32 CPU norm of a whole gradient accumulates its error with the tensor's size (the debug model's
(2256, 256) output layer: ~8e-5 off the float64 value; 187M parameters: 7e-4), and a shard's (FSDP, TP, a pipeline
stage) is off by a different amount, so the float32 norm, and the clipping coefficient with it, depended on the
layout. Here each gradient's squares are summed in float64 (squared_sum: float32 norms of its rows, squared and
summed in float64); a DTensor's sum is reduced over its mesh by DTensor (one reduction per mesh: expert-parallel
experts have their own), a pipeline rank's is summed over the pipeline group. Every layout then logs one process's
norm to ~1e-8 (tests/parallelisms/test_grad_norm_layouts.py; the cost: docs/parallelisms.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


def squared_sum(grad: torch.Tensor) -> torch.Tensor:
    """The sum of `grad`'s squares (a float64 scalar; a DTensor one for a DTensor): float32 norms of its rows (the
    last dimension: a few thousand elements, which float32 sums to ~1e-7), squared and summed in float64. As fast as
    torch's float32 norm of the whole tensor, and within 1e-9 of the float64 value where that is 7e-4 off (187M
    parameters); casting every gradient to float64 instead costs 8x (docs/parallelisms.md)."""
    return torch.linalg.vector_norm(grad, 2, dim=-1).double().square().sum()


def total_norm(grads: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of all `grads` (plain tensors or DTensors), accumulated in float64, as a plain float64 scalar on
    every rank; `pp_group`: under pipeline parallelism the ranks holding the other stages' gradients."""
    if not grads:
        device = torch.device("cpu")
        squared = torch.zeros((), dtype=torch.float64, device=device)
    else:
        # One sum per mesh: DTensor adds only DTensors of one mesh (expert-parallel experts live on their own).
        by_mesh: dict[object, list[torch.Tensor]] = {}
        for g in grads:
            by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(squared_sum(g))
        parts = [torch.stack(sums).sum() for sums in by_mesh.values()]
        squared = torch.stack([p.full_tensor() if isinstance(p, DTensor) else p for p in parts]).sum()
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    return squared.sqrt()


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None, foreach: bool
) -> torch.Tensor:
    """Clip the gradients to `max_norm` by their global norm (total_norm) and return that norm (float64; the same on
    every rank). `pp_group`: under pipeline parallelism the pipeline's ranks, else None."""
    params = [p for p in parameters if p.grad is not None]
    norm = total_norm([p.grad for p in params if p.grad is not None], pp_group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=foreach)
    return norm
