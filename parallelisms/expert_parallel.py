"""Expert parallelism: each MoE layer's routed experts split over `ep` ranks, the tokens sent to their experts' ranks.

The ranks are borrowed from the data-parallel shard ranks (torchtitan's dp2ep): dp_shard = efsdp x ep, ep innermost
(consecutive ranks, one node's links). With context parallelism, whose ranks join FSDP's shard group, they are
borrowed from dp_shard x cp, torchtitan's rule: an EP group is ep / cp shard ranks with all their CP ranks (ep a
multiple of cp), each CP rank routing and sending its own part of the sequences; efsdp = dp_shard x cp / ep. Under
pipeline parallelism each stage's MoE layers dispatch over the EP groups of that stage's ranks (the mesh's pp
dimension stays outside). Every rank routes its own tokens as on one rank (models/moe.py: the pairs
sorted by expert, `counts` [E] of them per expert); the `E / ep` experts `r * E/ep ..` live on EP rank r. The
routed experts' call (x sorted by expert, counts) -> rows in the same order becomes, on each rank:

    1. exchange the counts: an all-to-all of `counts` gives received[s * L + j], the rows rank s sends for this
       rank's local expert j (L = E / ep local experts);
    2. dispatch: an all-to-all of the rows with uneven splits (rank s's rows for rank r's experts are contiguous,
       since they are sorted by expert); one host sync, for the split sizes;
    3. permute: the received rows come by source rank, then local expert; sort them by local expert (stable: by
       source within an expert) and run this rank's experts on them (models/moe.py swiglu_experts, with the
       experts' grouped GEMM: float8 on the experts runs here as on one rank);
    4. unpermute and combine: the inverse permutation and the reverse all-to-all bring every row back to the rank
       and the place it came from.

Both all-to-alls are differentiable (kiln_base.internals.all_to_all_rows: the backward is the
reverse all-to-all), so the gradients of the inputs, the router and the experts are those of one
rank. Dropless: every row reaches its expert, however uneven the routing.

Weights: each expert weight [E, ...] is a DTensor sharded on dim 0 (the experts) over the `ep` mesh, so a
checkpoint holds the whole [E, ...] tensor under the same name in every layout (DCP reads the placements);
fully_shard then shards it again over `efsdp` (parallelize.apply_fsdp). An expert's gradient sums the tokens of all
`ep` ranks; it is divided by `ep` in the backward (mean_over_ep), and FSDP's average over the experts' group
(efsdp, and dp_replicate) makes it the mean over every data-parallel (and CP) rank, as a dense weight's is.

Not composed yet (refused in kiln_base/config/checks.py): tensor parallelism and torch.compile (the split sizes
are a host sync, a graph break under fullgraph).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kiln_base.config import Degrees
from kiln_base.internals import all_to_all_counts, all_to_all_rows
from models.moe import GroupedExperts, MoE, swiglu_experts

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class ExpertParallelExperts(nn.Module):
    """A GroupedExperts whose experts are split over `ep_mesh`: the same call, the same parameter names (w1, w2, w3:
    DTensors Shard(0) over the experts), the same result."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        assert experts.num_experts % ep_mesh.size() == 0, "the plan refuses experts that do not divide over EP"
        self.num_experts = experts.num_experts  # all of them: the router's counts are [E]
        self.use_grouped_mm = experts.use_grouped_mm
        self.gemm = experts.gemm  # float8 on the experts (converted before EP): the local experts run it too
        self.ep_mesh = ep_mesh
        for name in EXPERT_WEIGHTS:  # on the meta device before init: distributing allocates nothing
            self.register_parameter(name, nn.Parameter(distribute_tensor(getattr(experts, name), ep_mesh, [Shard(0)])))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (rows, dim): this rank's rows sorted by expert, `counts` [E] int64 of them per expert -> (rows, dim)."""
        group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
        local = self.num_experts // ep
        with torch.no_grad():
            received = all_to_all_counts(counts, group)  # [ep * L]: source rank s, local expert j
            received = received.view(ep, local)
            # The split sizes as Python ints: all_to_all needs them on the host (a device-to-host sync on a GPU).
            send = counts.view(ep, local).sum(dim=1).tolist()
            recv = received.sum(dim=1).tolist()
            # Received rows by (source, local expert) -> by (local expert, source): each row's segment s * L + j,
            # sorted by j * ep + s (stable, so each segment keeps its order).
            segment = torch.repeat_interleave(torch.arange(ep * local, device=x.device), received.reshape(-1))
            order = torch.argsort(segment % local * ep + segment // local, stable=True)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=x.device)
        rows = all_to_all_rows(x, recv, send, group)
        w1, w2, w3 = (mean_over_ep(local_weight(getattr(self, name)), ep) for name in EXPERT_WEIGHTS)
        out = swiglu_experts(rows[order], received.sum(dim=0), w1, w2, w3, self.use_grouped_mm, gemm=self.gemm)
        return all_to_all_rows(out[inverse], send, recv, group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def mean_over_ep(w: torch.Tensor, ep: int) -> torch.Tensor:
    """`w`, whose gradient is divided by `ep`. An expert's gradient sums the tokens of all `ep` ranks (each rank's
    loss is its own tokens' mean): / ep makes it their mean, as a dense weight's gradient is after FSDP's average
    over the data-parallel ranks; the experts' FSDP group (efsdp, and dp_replicate) then averages over the rest.
    Here rather than in FSDP's divide factor: a factor other than the group size is a PREMUL_SUM reduce-scatter,
    which gloo does not run."""
    return _ScaleGrad.apply(w, 1.0 / ep)


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of an expert weight (to_local: differentiable, the gradient lands in the DTensor's)."""
    return w.to_local() if isinstance(w, DTensor) else w


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Give every MoE layer of `model` (meta device, before FSDP) expert-parallel experts over `ep_mesh`; the number
    of layers changed."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        assert isinstance(moe.experts, GroupedExperts)
        moe.register_module("experts", ExpertParallelExperts(moe.experts, ep_mesh))
    return len(layers)


def expert_shard_placement(num_experts: int, degrees: Degrees) -> Callable[[nn.Parameter], Shard] | None:
    """FSDP's placement of the experts' weights over efsdp: dim 0 (the default, None) while every rank keeps whole
    experts, else dim 1 (torchtitan's rule: with efsdp x ep > E, dim 0 would leave ranks without rows)."""
    if degrees.efsdp * degrees.ep <= num_experts:
        return None
    return lambda param: Shard(1)
