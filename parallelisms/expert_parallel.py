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

Under tensor parallelism (torchtitan's expert_tensor_parallel_degree 1) the TP ranks join the EP group too: an MoE
layer takes its input sequence-sharded, as the block's norms leave it, and each TP rank routes and dispatches its
own part of the sequence like a data rank (`MoEOnLocalTokens`); the router's weight is replicated over the TP
ranks, its gradient summed over their tokens (`ReplicatedOnLocalTokens`); shared experts run column-/row-wise
over all the TP ranks' tokens (parallelize.apply_tp). An expert's gradient is divided by the group's data ranks,
ep / tp, not by ep: its TP ranks' tokens are parts of the same sequences.

Under torch.compile the layer's dispatch, experts and combine (ExpertParallelExperts.forward) run eagerly: the split
sizes are a host sync, which a graph cannot hold. The rest of the block (attention, router, the routing weights,
shared experts) is compiled around them, its shapes fixed by the tokens, so the varying rows per expert recompile
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from kiln_base.config import Degrees
from kiln_base.internals import all_to_all_counts, all_to_all_rows
from models.moe import GroupedExperts, MoE, swiglu_experts

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class ExpertParallelExperts(nn.Module):
    """A GroupedExperts whose experts are split over `ep_mesh`: the same call, the same parameter names (w1, w2, w3:
    DTensors Shard(0) over the experts), the same result."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh, data_ranks: int) -> None:
        """`data_ranks`: the ranks of the EP group that read different batches (ep / tp: under TP the group's TP
        ranks route parts of the same sequences), which an expert's summed gradient is divided by."""
        super().__init__()
        assert experts.num_experts % ep_mesh.size() == 0, "the plan refuses experts that do not divide over EP"
        self.num_experts = experts.num_experts  # all of them: the router's counts are [E]
        self.use_grouped_mm = experts.use_grouped_mm
        self.gemm = experts.gemm  # float8 on the experts (converted before EP): the local experts run it too
        self.ep_mesh, self.data_ranks = ep_mesh, data_ranks
        for name in EXPERT_WEIGHTS:  # on the meta device before init: distributing allocates nothing
            self.register_parameter(name, nn.Parameter(distribute_tensor(getattr(experts, name), ep_mesh, [Shard(0)])))

    @torch.compiler.disable  # under training.compile: eager between the block's graphs (parallelize.apply_compile)
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
        w1, w2, w3 = (mean_over_ep(local_weight(getattr(self, name)), self.data_ranks) for name in EXPERT_WEIGHTS)
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
    """`w`, whose gradient is divided by `ep` (the EP group's data ranks). An expert's gradient sums the tokens of
    all the group's ranks (each data rank's loss is its own tokens' mean; TP ranks hold parts of the same
    sequences, whose gradients add up to their data rank's): / ep makes it the data ranks' mean, as a dense weight's
    gradient is after FSDP's average over the data-parallel ranks; the experts' FSDP group (efsdp, and
    dp_replicate) then averages over the rest.
    Here rather than in FSDP's divide factor: a factor other than the group size is a PREMUL_SUM reduce-scatter,
    which gloo does not run."""
    return _ScaleGrad.apply(w, 1.0 / ep)


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of an expert weight (to_local: differentiable, the gradient lands in the DTensor's)."""
    return w.to_local() if isinstance(w, DTensor) else w


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, data_ranks: int) -> int:
    """Give every MoE layer of `model` (meta device, before FSDP) expert-parallel experts over `ep_mesh`, whose
    `data_ranks` read different batches (ExpertParallelExperts); the number of layers changed."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        assert isinstance(moe.experts, GroupedExperts)
        moe.register_module("experts", ExpertParallelExperts(moe.experts, ep_mesh, data_ranks))
    return len(layers)


def expert_shard_placement(num_experts: int, degrees: Degrees) -> Callable[[nn.Parameter], Shard] | None:
    """FSDP's placement of the experts' weights over efsdp: dim 0 (the default, None) while every rank keeps whole
    experts, else dim 1 (torchtitan's rule: with efsdp x ep > E, dim 0 would leave ranks without rows)."""
    if degrees.efsdp * degrees.ep <= num_experts:
        return None
    return lambda param: Shard(1)


class MoEOnLocalTokens(ParallelStyle):
    """TP for an MoE layer: its input, sequence-sharded (Shard(1)) by the block's norm, enters as this rank's own
    tokens (a plain tensor; the router, dispatch and experts run on them as on a data rank), and its output is this
    rank's part of the sequence, as the attention's row-wise output is for the residual. The routing statistics
    stay this rank's."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def local_input(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            (x,) = args
            assert isinstance(x, DTensor) and x.placements == (Shard(1),), "the norm leaves the sequence sharded"
            return (x.to_local(),)

        module.register_forward_pre_hook(local_input)
        return module


class ReplicatedOnLocalTokens(ParallelStyle):
    """TP for a Linear fed this rank's tokens (rows) only, the MoE router's gate: its weight replicated over the TP
    ranks, its input the rows Shard(0), so the weight's gradient is the sum over every TP rank's rows (a Partial
    gradient, reduced by FSDP or in the optimizer's DTensor ops); its output this rank's rows, a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for key, param in list(module.named_parameters(recurse=False)):  # meta before init: allocates nothing
            module.register_parameter(key, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()])))

        def rows(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(DTensor.from_local(a, device_mesh, [Shard(0)], run_check=False) for a in args)

        module.register_forward_pre_hook(rows)
        module.register_forward_hook(lambda _, __, out: out.to_local())
        return module
