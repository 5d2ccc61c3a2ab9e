"""One seed, one model: initialise a parallelized model so that every layout holds the same values.

Each rank fills its own shard (FSDP, TP, HSDP replicas, pipeline stages) with exactly the values that the
whole tensor would hold on one device. The whole tensor of a parameter is defined by the seed and the parameter's
name alone: its rows are cut into chunks of ~4M elements, and chunk k is drawn from a generator seeded with
(training.seed, FQN, k) by the model's own init rule for that parameter (models/llama3.py `param_inits`). A rank
draws only the chunks that overlap its shard: under FSDP over N ranks about 1/N of each tensor (a TP shard of
columns draws the full rows it needs). No communication, and never more than one chunk of a parameter beyond the
rank's own shard in memory: a 405B model initialises without any device holding it whole.

The values depend on the device type's generator (CPU or CUDA draw different streams from the same seed), not on
the number of ranks, the mesh or the stage split.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from kiln_base.internals import local_tensor_or_self, shard_offset, unwrapped_fqn
from models.llama3 import ParamInit

CHUNK_ELEMS = 1 << 20  # elements per chunk of rows: small enough to draw cheaply, large enough to batch the work


def chunk_seed(seed: int, fqn: str, chunk: int) -> int:
    """A 63-bit generator seed for (training seed, parameter name, row chunk), stable across processes."""
    digest = hashlib.blake2b(f"{seed}/{fqn}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def draw_shard(
    init: ParamInit,
    seed: int,
    fqn: str,
    full_shape: tuple[int, ...],
    shape: tuple[int, ...],
    offset: tuple[int, ...],
    device: torch.device,
    generator: torch.Generator,
) -> torch.Tensor:
    """The values of the slice `offset : offset + shape` of parameter `fqn`'s whole tensor (shape `full_shape`),
    drawing only the row chunks that overlap it. Returns a float32 tensor of `shape`.

    A 3-D parameter (an MoE's routed experts, [E, out, in]) is drawn as the 2-D tensor [E x out, in] its memory
    is: a shard of whole experts (FSDP's and expert parallelism's dim 0) is then a block of whole rows."""
    assert len(full_shape) in (1, 2, 3), f"{fqn}: layout-independent init handles 1-D to 3-D parameters"
    if len(full_shape) == 3:
        per, flat_shape = full_shape[1], (full_shape[0] * full_shape[1], full_shape[2])
        if tuple(shape[1:]) == tuple(full_shape[1:]):
            flat = draw_shard(
                init, seed, fqn, flat_shape, (shape[0] * per, shape[2]), (offset[0] * per, 0), device, generator
            )
            return flat.view(shape)
        # Part of each expert (FSDP on dim 1 when there are fewer experts than ranks to shard them over): each
        # local expert's rows and columns of the same [E x out, in] tensor.
        return torch.stack([
            draw_shard(
                init, seed, fqn, flat_shape, tuple(shape[1:]), ((offset[0] + e) * per + offset[1], offset[2]),
                device, generator,
            )
            for e in range(shape[0])
        ])  # fmt: skip
    rows, cols = full_shape[0], (full_shape[1] if len(full_shape) == 2 else 1)
    local_rows, local_cols = shape[0], (shape[1] if len(shape) == 2 else 1)
    row0, col0 = offset[0], (offset[1] if len(offset) == 2 else 0)
    shard = torch.empty(local_rows, local_cols, device=device, dtype=torch.float32)
    chunk_rows = max(1, CHUNK_ELEMS // cols)
    for k in range(row0 // chunk_rows, (row0 + local_rows - 1) // chunk_rows + 1):
        start, stop = k * chunk_rows, min(rows, (k + 1) * chunk_rows)
        values = torch.empty(stop - start, cols, device=device, dtype=torch.float32)
        generator.manual_seed(chunk_seed(seed, fqn, k))
        init.fill_(values, generator)
        lo, hi = max(start, row0), min(stop, row0 + local_rows)
        shard[lo - row0 : hi - row0] = values[lo - start : hi - start, col0 : col0 + local_cols]
    return shard.view(shape)


@torch.no_grad()
def init_layout_independent(model: nn.Module, seed: int, device: torch.device) -> None:
    """Fill every parameter of `model` (materialised with to_empty, possibly sharded) with its layout-independent
    values, and compute its buffers. `model` must define `init_buffers(device)` and `param_inits()`."""
    model.init_buffers(device)  # type: ignore[operator]
    inits = model.param_inits()  # type: ignore[operator]
    generator = torch.Generator(device=device)
    for name, param in model.named_parameters():
        fqn = unwrapped_fqn(name)
        shape, offset = shard_offset(param) if isinstance(param, DTensor) else (tuple(param.shape), (0,) * param.dim())
        if 0 in shape:
            continue  # an FSDP rank past the last row
        values = draw_shard(inits[fqn], seed, fqn, tuple(param.shape), shape, offset, device, generator)
        local_tensor_or_self(param).copy_(values)
