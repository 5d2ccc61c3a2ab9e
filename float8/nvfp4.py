"""NVFP4 training, emulated: torchao's NVFP4 recipe with quantize-dequantize and high-precision matmuls.

torchao 0.18's NVFP4 training linear (torchao.prototype.moe_training.nvfp4_training) runs Triton kernels only: on a
CPU its first forward stops with "triton_rht_amax requires torch 2.10.0+ and triton installed", and its quantize
kernels use SM100 instructions (cvt.rn/cvt.rs ... e2m1x2). What does run on a CPU is torchao's NVFP4 format code
(torchao.prototype.mx_formats: the e2m1 codec, the e4m3 block-scale rule, the per-tensor scale) and its randomized
Hadamard transform matrix. This module builds the recipe from those, operand by operand as torchao's Triton path
quantizes them (nvfp4_linear.nvfp4_mm_triton), and runs each GEMM as a float32 matmul of the dequantized operands:

| GEMM | left operand | right operand |
| --- | --- | --- |
| forward: x @ W^T | x: 1 x 16 blocks along K, round to nearest | W: 16 x 16 tiles, round to nearest |
| grad_input: dy @ W | dy: 1 x 16 blocks along N, stochastic rounding | W^T: the same 16 x 16 tiles (same values) |
| grad_weight: dy^T @ x | dy^T: Hadamard along M, 1 x 16, stochastic | x^T: Hadamard along M, 1 x 16, nearest |

Every operand has two scales: a float32 per-tensor scale amax / (448 x 6) and one e4m3 scale per block of 16
(block amax / 6, divided by the per-tensor scale, rounded to e4m3); elements are e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6).
The 16-point randomized Hadamard transform (H/4 with a fixed random sign vector) is applied to both wgrad operands
along the token dim, so their product is unchanged in exact arithmetic while outliers spread over 16 values.
Round-to-nearest is torchao's own codec (`f32_to_f4_unpacked`, checked bit-exact against `NVFP4Tensor`);
stochastic rounding is the one piece torchao only has in PTX (cvt.rs): here a value between two neighbouring e2m1
values rounds up with probability proportional to its distance from the lower one, drawn from torch's default
generator (the Trainer reseeds it per step with nvfp4, so resumed runs draw the same numbers).

Emulation keeps x and W in high precision for backward (torchao saves the 4-bit codes), so memory is that of a
high-precision Linear; only the numerics are NVFP4's. Each GEMM is one call of the custom op `kiln::nvfp4_gemm`,
opaque to torch.compile (inductor does not generate code for the quantizer), and counted by the first-step check.
The module that swaps Linears for it is float8/converter.py (`NVFP4Linear`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kiln_base.config import NVFP4_BLOCK

# Operand casts: 1 x 16 blocks along the last dim rounded to nearest or stochastically, or 16 x 16 tiles (weights).
NEAREST, STOCHASTIC, NEAREST_TILES = "nearest", "stochastic", "nearest_16x16"
CASTS = (NEAREST, STOCHASTIC, NEAREST_TILES)
# The randomized Hadamard transform's sign vector: one fixed pattern of signs for every Linear and rank (torchao draws
# a random one per module and makes TP ranks agree); fixed, so checkpoints and layouts need no extra state.
RHT_SIGNS = (1, -1, 1, 1, -1, 1, -1, -1, 1, 1, 1, -1, -1, 1, -1, 1)

# The first-step check's counter while it watches (float8/checks.py): called with True when a GEMM is traced into
# a compiled graph (fake tensors), False when it runs. A context variable, set only inside `counting_gemms`.
_COUNTER: contextvars.ContextVar[Callable[[bool], None] | None] = contextvars.ContextVar("nvfp4_gemms", default=None)


@contextlib.contextmanager
def counting_gemms(count: Callable[[bool], None]) -> Iterator[None]:
    """Call `count(traced)` for every NVFP4 GEMM run (or traced into a compiled graph) inside the block."""
    token = _COUNTER.set(count)
    try:
        yield
    finally:
        _COUNTER.reset(token)


def _e2m1_values(device: torch.device) -> torch.Tensor:
    """The non-negative e2m1 values in order, decoded by torchao's codec: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32

    return f4_unpacked_to_f32(torch.arange(8, dtype=torch.uint8, device=device))


def _round_e2m1(v: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """v (float32, already in [-6, 6]) on the e2m1 grid: torchao's round-to-nearest-even, or stochastic rounding."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    if not stochastic:
        return f4_unpacked_to_f32(f32_to_f4_unpacked(v))
    grid = _e2m1_values(v.device)
    mag = v.abs()
    i = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, 6)  # grid[i] <= |v| < grid[i + 1] (6 stays 6)
    lo, hi = grid[i], grid[i + 1]
    up = torch.rand_like(mag) * (hi - lo) < mag - lo  # P(up) = (|v| - lo) / (hi - lo)
    return torch.where(up, hi, lo).copysign(v)


def fake_quantize(x: torch.Tensor, cast: str) -> torch.Tensor:
    """x (2-D) quantized to NVFP4 and dequantized, in float32. Blocks run along the last dim (1 x 16), or are 16 x 16
    tiles with NEAREST_TILES, whose result for x.t() is this result transposed.

    The scale arithmetic is torchao's `nvfp4_quantize` with a per-tensor scale, step for step (so NEAREST equals
    `NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(amax)).dequantize()` bit for bit); an
    all-zero tensor takes a per-tensor scale of 1, as torchao's kernels do, and stays zero.
    """
    from torchao.prototype.mx_formats.constants import F4_E2M1_MAX, F8E4M3_MAX
    from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

    assert cast in CASTS, cast
    assert x.ndim == 2 and x.shape[-1] % NVFP4_BLOCK == 0, f"NVFP4 needs K divisible by 16, got {tuple(x.shape)}"
    rows, cols = x.shape
    xf = x.float()
    amax = xf.abs().amax()
    per_tensor = per_tensor_amax_to_scale(amax)
    per_tensor = torch.where(amax > 0, per_tensor, torch.ones_like(per_tensor))
    b = NVFP4_BLOCK
    if cast == NEAREST_TILES:
        assert rows % b == 0, f"16 x 16 tiles need rows divisible by 16, got {tuple(x.shape)}"
        blocks = xf.view(rows // b, b, cols // b, b)
        block_amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    else:
        blocks = xf.view(rows, cols // b, b)
        block_amax = blocks.abs().amax(dim=-1, keepdim=True)
    e4m3_min = torch.finfo(torch.float8_e4m3fn).tiny
    block_scale = (block_amax / F4_E2M1_MAX) / per_tensor
    block_scale = block_scale.clamp(min=e4m3_min, max=F8E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scaled = (blocks * ((1.0 / per_tensor) / block_scale)).clamp(-F4_E2M1_MAX, F4_E2M1_MAX)
    q = _round_e2m1(scaled, stochastic=cast == STOCHASTIC)
    return (q * (per_tensor * block_scale)).view(rows, cols)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x (2-D, last dim divisible by 16) times torchao's 16-point randomized Hadamard matrix, block by block along the
    last dim. The matrix is orthogonal, so hadamard(a) @ hadamard(b).T == a @ b.T in exact arithmetic."""
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix

    rht = get_rht_matrix(RHT_SIGNS, str(x.device), torch.float32, NVFP4_BLOCK)
    rows, cols = x.shape
    return (x.float().view(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK) @ rht).view(rows, cols)


@torch.library.custom_op("kiln::nvfp4_gemm", mutates_args=())
def nvfp4_gemm(a: torch.Tensor, b: torch.Tensor, a_cast: str, b_cast: str, rht: bool) -> torch.Tensor:
    """One emulated NVFP4 GEMM: a (m x k) @ b (n x k)^T, both quantized along k (`rht`: after the Hadamard
    transform along k), multiplied in float32. A custom op: compiled graphs call it as one opaque kernel."""
    count = _COUNTER.get()
    if count is not None:
        count(False)
    if rht:
        a, b = hadamard(a), hadamard(b)
    return fake_quantize(a, a_cast) @ fake_quantize(b, b_cast).t()


@nvfp4_gemm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, a_cast: str, b_cast: str, rht: bool) -> torch.Tensor:
    count = _COUNTER.get()
    if count is not None:
        count(True)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)


class _NVFP4Matmul(torch.autograd.Function):
    """x @ w.T with the three GEMMs of torchao's NVFP4 recipe (table in the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, w)
        ctx.x_shape = x.shape
        y = torch.ops.kiln.nvfp4_gemm(x2, w, NEAREST, NEAREST_TILES, False)
        return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x2, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        gemm = torch.ops.kiln.nvfp4_gemm
        dx = gemm(dy2, w.t().contiguous(), STOCHASTIC, NEAREST_TILES, False)
        dw = gemm(dy2.t().contiguous(), x2.t().contiguous(), STOCHASTIC, NEAREST, True)
        return dx.to(x2.dtype).view(ctx.x_shape), dw.to(w.dtype)


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias) with emulated NVFP4 GEMMs; plain tensors (TP: each rank's shards)."""
    return _NVFP4Matmul.apply(x, weight)


def sqnr_db(x: torch.Tensor, cast: str = NEAREST) -> float:
    """20 log10(|x| / |x - fake_quantize(x)|): how well NVFP4 holds x, in dB (tests and docs)."""
    err = (x.float() - fake_quantize(x, cast)).norm()
    return math.inf if err == 0 else 20 * math.log10((x.float().norm() / err).item())
