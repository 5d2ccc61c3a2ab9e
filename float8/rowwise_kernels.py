"""Fused rowwise float8 casts (Triton): torchao's dense rowwise numerics in two kernels instead of six casts.

torchao's rowwise recipe (e4m3 everywhere, one scale per row, scales rounded down to powers of two) casts each
operand of a Linear twice: x and W along the contraction dim K for the output GEMM, and G (the output gradient),
W and x along the other dim for the backward GEMMs, the latter as a transposed copy because `torch._scaled_mm`
wants its left operand row-major and its right operand column-major. Each cast is an amax pass, a scale kernel and
a cast pass; Inductor fuses some of them, but one step still spends 56 ms in casts on one H200
(docs/performance.md). Two kernels cover all of it:

- `row_cast(T)` for a bf16 T [R, C]: one program per block of rows loops over the columns twice. The first loop
  takes the row amax and, with an atomic max per column, the column amax of the whole tensor; the second loop
  (from L2 when the row block still sits there) writes T scaled by its row's power-of-two scale in e4m3, row-major.
  Outputs: the e4m3 rows, the row scales [R, 1], and the column amax (kept for `col_cast_t`).
- `col_cast_t(T, col_amax)`: tiles of T, each scaled by its column's scale and written transposed: T^T [C, R] in
  e4m3, contiguous (the row-major left operand of grad_weight's GEMM, or, transposed back, the column-major right
  operand of grad_input's), with the column scales [C, 1].

The Linear (float8/rowwise_fused.py) calls `row_cast` on x and W in forward and on G in backward, and `col_cast_t`
on G, W and x in backward, with the column amax that the forward's `row_cast` already found: each bf16 tensor is
read twice (once more when its row block fell out of L2), where torchao reads each about four times.

Bit-exact with torchao (float8_utils.amax_to_scale, to_fp8_saturated) for bf16 and float32 operands (a float32
weight under autocast), by doing what torchao does, step by step:
- amax: the max of |t| in float32 is exact (bf16 values are float32 values, and max does not round).
- scale: float32(448 / max(amax, 1e-12)) in float64, then exp2(floor(log2(s))) with the functions Inductor's code
  for torchao's cast calls (libdevice's). For bf16 operands any accurate log2 gives the same power of two: for
  amax = m 2^e (m with 8 significant bits), 448 / amax = 7 2^(6-e) / m is never within 0.4% below a power of two
  unless it is one. For float32 operands s can lie one ulp below a power of two, where the power of two depends on
  log2's last bit: there the same libdevice call is what keeps the scales equal.
- cast: t in float32 times the scale (a power of two: exact), clamped to +-448, rounded to e4m3 (nearest even).
- Non-finite inputs: a NaN row is not guaranteed to match torchao (the kernels' max may drop NaN).

Triton is imported when this module is imported, and this module only by the fused Linear's first call. On a CPU the
kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is first imported): the tests use it.
The Triton used is the one the GPU image's torch ships (torch 2.11: Triton 3.x); only long-standing language
features are used (tl.atomic_max on int32, bitcasts, tl.trans).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.language.extra import libdevice

from kiln_base.internals import triton_max_combine

# tl.max's own combine function. The kernels call tl.reduce with it rather than tl.max: tl.max, tl.zeros and the
# other helpers of triton.language.standard are jit functions whose interpreted or compiled form was fixed when
# Triton was first imported (torch imports it early, before a test can set TRITON_INTERPRET), so a kernel that must
# also run in the interpreter uses builtins only. The interpreter recognises this combine function and reduces with
# NumPy; a GPU compiles exactly what tl.max compiles.
_MAX = triton_max_combine()

# Triton kernels read module globals only as constexprs.
FP8_MAX = tl.constexpr(448.0)  # torch.finfo(torch.float8_e4m3fn).max
EPS = tl.constexpr(1e-12)  # torchao.float8.float8_utils.EPS

# Tile sizes: (row_cast's rows per program, its columns per loop step, col_cast_t's square tile). The interpreter
# runs every program in Python, so it gets fewer, larger ones (the tests' shapes still leave partial tiles).
GPU_BLOCKS = (16, 256, 64)
INTERPRETER_BLOCKS = (64, 256, 128)


@triton.jit
def _pow2_scale(amax, INTERPRETED: tl.constexpr):
    """torchao's amax_to_scale with round_scales_to_power_of_2, for float32 amax: the division in float64, then
    exp2(floor(log2(s))) with the functions Inductor's code for torchao calls (libdevice's on a GPU; NumPy's in the
    interpreter, matching torch's CPU log2)."""
    amax64 = tl.maximum(amax.to(tl.float64), tl.full(amax.shape, EPS, tl.float64))
    s = (tl.full(amax.shape, FP8_MAX, tl.float64) / amax64).to(tl.float32)
    if INTERPRETED:
        return tl.exp2(tl.floor(tl.log2(s)))
    else:
        return libdevice.exp2(libdevice.floor(libdevice.log2(s)))


@triton.jit
def _to_e4m3(x, INTERPRETED: tl.constexpr):
    """torchao's to_fp8_saturated: clamp to the e4m3 range, round to nearest even.

    With INTERPRETED the rounding happens in float32 first, so the conversion only re-encodes e4m3 values:
    |x| + P - P rounds |x| to a multiple of ulp(P) (IEEE addition rounds to nearest even), and P = 2^(e + 20)
    for |x| in [2^e, 2^(e+1)) makes that ulp e4m3's spacing 2^(e - 3) (2^-9 below e4m3's smallest normal 2^-6).
    The interpreter needs it: its float32 -> e4m3 conversion rounds ties away and drops the carry of a mantissa that
    rounds up (127.99 -> 64, Triton 3.7). A GPU converts in one instruction (cvt.rn.satfinite), so it runs without.
    """
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    if INTERPRETED:
        a = tl.abs(x)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        p = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)
        r = (a + p) - p
        sign = x.to(tl.int32, bitcast=True) & -0x80000000  # by bits: -0.0 must stay -0.0, as in torch's cast
        x = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def _row_cast_kernel(
    t_ptr,
    q_ptr,
    row_scale_ptr,
    col_amax_ptr,
    R,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    # Loop 1: the row amax, and each column's amax over this row block merged into the global one. Amaxes are
    # >= 0, so their float32 bit patterns order as int32s do: an integer atomic max is a float max.
    amax = tl.full([BLOCK_R], 0.0, tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        mask = row_ok[:, None] & col_ok[None, :]
        t = tl.load(t_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
        a = tl.abs(t.to(tl.float32))
        amax = tl.maximum(amax, tl.reduce(a, 1, _MAX))
        col_max = tl.reduce(a, 0, _MAX).to(tl.int32, bitcast=True)
        tl.atomic_max(col_amax_ptr + cols, col_max, mask=col_ok, sem="relaxed")  # ordered by the kernel's end
    scale = _pow2_scale(amax, INTERPRETED)
    tl.store(row_scale_ptr + rows, scale, mask=row_ok)
    # Loop 2: the cast, row-major.
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < C)[None, :]
        offsets = rows[:, None] * C + cols[None, :]
        t = tl.load(t_ptr + offsets, mask=mask, other=0.0)
        tl.store(q_ptr + offsets, _to_e4m3(t.to(tl.float32) * scale[:, None], INTERPRETED), mask=mask)


@triton.jit
def _col_cast_t_kernel(
    t_ptr, col_amax_ptr, qt_ptr, col_scale_ptr, R, C, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_ok, col_ok = rows < R, cols < C
    amax = tl.load(col_amax_ptr + cols, mask=col_ok, other=0).to(tl.float32, bitcast=True)
    scale = _pow2_scale(amax, INTERPRETED)
    if tl.program_id(0) == 0:
        tl.store(col_scale_ptr + cols, scale, mask=col_ok)
    t = tl.load(t_ptr + rows[:, None] * C + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    q_t = tl.trans(_to_e4m3(t.to(tl.float32) * scale[None, :], INTERPRETED))  # [BLOCK cols, BLOCK rows]
    tl.store(qt_ptr + cols[:, None] * R + rows[None, :], q_t, mask=col_ok[:, None] & row_ok[None, :])


def _interpreted(t: torch.Tensor) -> bool:
    """Round in float32 before the e4m3 conversion off the GPU (Triton's interpreter: see `_to_e4m3`)."""
    return t.device.type != "cuda"


@triton_op("kiln::fp8_row_cast", mutates_args=())
def row_cast(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 t [R, C] (contiguous) -> (e4m3 t scaled per row [R, C], row scales [R, 1] float32, column amax [C] as
    float32 bit patterns in int32, for `col_cast_t`)."""
    R, C = t.shape
    q = torch.empty((R, C), dtype=torch.float8_e4m3fn, device=t.device)
    row_scale = torch.empty((R, 1), dtype=torch.float32, device=t.device)
    col_amax = torch.zeros((C,), dtype=torch.int32, device=t.device)
    block_r, block_c, _ = INTERPRETER_BLOCKS if _interpreted(t) else GPU_BLOCKS
    grid = (triton.cdiv(R, block_r),)
    wrap_triton(_row_cast_kernel)[grid](
        t, q, row_scale, col_amax, R, C, BLOCK_R=block_r, BLOCK_C=block_c, INTERPRETED=_interpreted(t)
    )
    return q, row_scale, col_amax


@triton_op("kiln::fp8_col_cast_t", mutates_args=())
def col_cast_t(t: torch.Tensor, col_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 t [R, C] (contiguous) and its column amax from `row_cast` -> (e4m3 t^T scaled per column of t, [C, R]
    contiguous, column scales [C, 1] float32)."""
    R, C = t.shape
    q_t = torch.empty((C, R), dtype=torch.float8_e4m3fn, device=t.device)
    col_scale = torch.empty((C, 1), dtype=torch.float32, device=t.device)
    block = (INTERPRETER_BLOCKS if _interpreted(t) else GPU_BLOCKS)[2]
    grid = (triton.cdiv(R, block), triton.cdiv(C, block))
    wrap_triton(_col_cast_t_kernel)[grid](t, col_amax, q_t, col_scale, R, C, BLOCK=block, INTERPRETED=_interpreted(t))
    return q_t, col_scale
