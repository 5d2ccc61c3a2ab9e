"""Gradient reductions in the precision `training.mixed_precision_reduce` states.

Three reductions sum gradients over ranks; each runs as the mode says:

| reduction | float32 | bfloat16 | bfloat16_wire |
| --- | --- | --- | --- |
| FSDP reduce-scatter (dp_shard) | float32 | bfloat16 | bfloat16 on the wire, float32 sum (`Bf16WireReduceScatter`) |
| HSDP all-reduce (dp_replicate) | float32 | bfloat16 | float32 |
| TP all-reduce of partial gradients | float32 | bfloat16 | float32 |

FSDP2's `MixedPrecisionPolicy(reduce_dtype)` sets the first two. The third (the norm weights under sequence
parallel, whose gradients are partial sums over the sequence shards) is FSDP's Partial -> Replicate redistribute,
which torch runs in the gradient's dtype whatever reduce_dtype says (pytorch#190626): kiln casts such gradients to
reduce_dtype first (kiln_base/internals.py, `fsdp_reduce_tp_partial_grads_in_reduce_dtype`).

bfloat16_wire sends each rank's gradient as bfloat16 and sums in float32. With bfloat16 parameters the local
gradients are bfloat16 numbers already, so nothing is rounded: the result is the float32 sum, at half the bytes.
The HSDP all-reduce's inputs are float32 sums of several ranks (no longer bfloat16 numbers), and the TP partial
gradients are a few KB: both stay float32. Activation reductions of TP (the all-gathers and reduce-scatters of
sequence parallel, forward and backward) run in the compute dtype in every mode, as in torchtitan and Megatron-LM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from kiln_base.config import BF16_WIRE, Training, resolve_mixed_precision
from kiln_base.internals import FSDPReduceScatter

# What FSDP's MixedPrecisionPolicy gets: bfloat16_wire accumulates in float32 (its wire is the custom reduce-scatter).
REDUCE_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, BF16_WIRE: torch.float32}


class Bf16WireReduceScatter(FSDPReduceScatter):
    """FSDP2 reduce-scatter with bfloat16 on the wire and a float32 sum (training.mixed_precision_reduce
    bfloat16_wire), installed with `FSDPModule.set_custom_reduce_scatter`.

    FSDP hands it a float32 buffer (reduce_dtype float32) holding each parameter's gradient. Each rank casts it to
    bfloat16 (exact when the gradients are bfloat16, i.e. with bfloat16 parameters), an all-to-all sends rank r
    the r-th chunk of every rank's buffer, and r sums the world's chunks in float32, in rank order. Bytes on the
    wire: (world - 1) / world of the buffer per rank, as a ring reduce-scatter, at 2 bytes an element instead of 4;
    the all-to-all buffer and the sum cost one extra buffer of the rank's input in memory.
    """

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        world = group.size()
        sent = input_tensor.to(torch.bfloat16)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
        total = received.view(world, -1).to(torch.float32).sum(dim=0)
        if op == dist.ReduceOp.AVG:  # FSDP's default: the gradient of the mean loss over data-parallel ranks
            total /= world
        else:
            assert op == dist.ReduceOp.SUM, f"bfloat16_wire reduce-scatter: unsupported reduce op {op}"
        output_tensor.copy_(total)
        return None


def reduction_line(training: Training, dp_replicate: int, dp_shard: int, tp: int, device_type: str, pp: int = 1) -> str:
    """The start-up line naming each gradient reduction this run makes and its precision. A pipeline (`pp` > 1)
    reduces no gradient: each of its ranks holds other stages' parameters (only the gradient norm's square is
    summed over them, in float32)."""
    mode = training.mixed_precision_reduce
    wire = {"float32": "float32", "bfloat16": "bfloat16", BF16_WIRE: "bfloat16 on the wire, float32 sum"}[mode]
    plain = "bfloat16" if mode == "bfloat16" else "float32"
    parts = []
    if dp_shard > 1:
        parts.append(f"FSDP reduce-scatter over {dp_shard} ranks: {wire}")
    if dp_replicate > 1:
        why = " (its inputs are float32 sums already)" if mode == BF16_WIRE else ""
        parts.append(f"HSDP all-reduce over {dp_replicate} replicas: {plain}{why}")
    if tp > 1:
        if dp_shard * dp_replicate > 1:
            fix = " (pytorch#190626 worked around)" if plain == "float32" else ""
            parts.append(f"TP all-reduce of partial gradients (norm weights) over {tp} ranks: {plain}{fix}")
        else:  # no FSDP: autocast computes over float32 master weights, whose gradients are float32
            compute = resolve_mixed_precision(training.mixed_precision_param, device_type)
            parts.append(
                f"TP all-reduce of partial gradients (norm weights) over {tp} ranks: float32 (no FSDP: {compute} "
                "compute under autocast, float32 parameters and gradients)"
            )
    if pp > 1:
        parts.append(
            f"none over the {pp} pipeline ranks (each holds its own stages' gradients; the gradient norm sums their "
            "squares in float64)"
        )
    what = "; ".join(parts) if parts else "none (one data-parallel rank, no TP)"
    return f"Gradient reductions (training.mixed_precision_reduce = {mode}): {what}"
