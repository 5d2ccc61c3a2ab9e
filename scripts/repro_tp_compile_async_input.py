"""Standalone repro (no kiln imports): torch.compile backward with an AsyncCollectiveTensor input.

TP's RowwiseParallel ends with `redistribute(..., async_op=True).to_local()`, which returns an
AsyncCollectiveTensor (ACT). When that tensor is the input of a torch.compile'd region (kiln's first compiled
transformer block, fed by the eager TP embedding), torch 2.13's AOTAutograd unwraps the ACT with trigger_wait(),
which returns the inner tensor without its autograd edge. In backward the region's input gradient then lands on
DTensor's Redistribute node as a plain tensor:

    AttributeError: 'Tensor' object has no attribute '_local_tensor'

Upstream: pytorch/pytorch#179849 added the unwrap; pytorch/pytorch#191113 ("Preserve requires_grad when
unwrapping ACT inputs in process_inputs") restores the edge. Workaround (what kiln does): pass the ACT through
the differentiable `torch.distributed._functional_collectives.wait_tensor` before the compiled region.

    torchrun --nproc_per_node 2 scripts/repro_tp_compile_async_input.py          # compiled: fails in backward
    torchrun --nproc_per_node 2 scripts/repro_tp_compile_async_input.py eager    # reference gradient
    torchrun --nproc_per_node 2 scripts/repro_tp_compile_async_input.py wait     # compiled + wait_tensor: same
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.ones(2, 8, requires_grad=True)  # the region's output requires grad whatever happens to its input
    # Each rank holds a partial sum; reduce-scatter it asynchronously, as RowwiseParallel's output does.
    local = DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Shard(0)], async_op=True).to_local()
    print(f"rank {dist.get_rank()}: region input is {type(local).__name__}")
    if "wait" in sys.argv:
        local = funcol.wait_tensor(local)  # differentiable: a plain tensor with its autograd edge

    def region(t: torch.Tensor) -> torch.Tensor:
        return (t * t * w).sum()

    if "eager" not in sys.argv:
        region = torch.compile(region, fullgraph=True)
    region(local).backward()
    print(f"rank {dist.get_rank()}: ok, x.grad sum {x.grad.sum().item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
