"""Fused rowwise float8 casts (Triton): torchao's dense rowwise numerics in two kernels instead of six casts.

torchao's rowwise recipe (e4m3 everywhere, one scale per row, scales rounded down to powers of two) casts each
operand of a Linear twice: x and W along the contraction dim K for the output GEMM, and G (the output gradient),
W and x along the other dim for the backward GEMMs, the latter as a transposed copy because `torch._scaled_mm`
wants its left operand row-major and its right operand column-major. Each cast is an amax pass, a scale kernel and
a cast pass; Inductor fuses some of them, but one step still spends 56 ms in casts on one H200
(docs/performance.md). Two kernels cover all of it, both over a grid of tiles (all SMs busy for any shape):

- `amax(T)` for T [R, C] (bf16, or a float32 weight): each tile's row and column maxima of |T|, merged into the
  whole tensor's with atomic maxima (R + C int32s). One read of T.
- the cast kernel, given the amaxes: each tile read once, scaled by its row's power-of-two scale and written
  row-major in e4m3 (`cast_rows`), and/or scaled by its column's scale and written transposed, T^T [C, R]
  contiguous (`cast_cols_t`; `cast_both` does both from the same read). The first tile of each row (column)
  writes the scales, [R, 1] ([C, 1]).

The Linear (float8/rowwise_fused.py): forward amax + cast_rows of x and of W; backward amax + cast_both of G, and
cast_cols_t of W and of x with the column amax their forward amax pass already found. Traffic per element: x and W
read twice in forward and once in backward, G twice; each e4m3 copy written once. A first version (a row pass that
looped over whole rows, one program per 16 rows) ran at 160-820 GB/s on an H200, too few programs for small R.

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

# Tile sizes (rows, columns) per kernel. The interpreter runs every program in Python, so it gets fewer, larger
# tiles (the tests' shapes still leave partial ones). The transposed store wants square tiles.
GPU_BLOCKS = {"amax": (64, 128), "rows": (32, 256), "cols": (64, 64), "both": (64, 64)}
INTERPRETER_BLOCKS = {"amax": (128, 128), "rows": (128, 128), "cols": (128, 128), "both": (128, 128)}


@triton.jit
def _amax(a, AXIS: tl.constexpr, INTERPRETED: tl.constexpr):
    """max along AXIS: tl.max on a GPU; in the interpreter tl.reduce with tl.max's combine function (see _MAX).
    (Inductor copies a kernel's jit dependencies into its own module under their own names, so the GPU branch must
    not name _MAX: it failed to build as `NameError: _MAX is not defined` on torch 2.11.)"""
    if INTERPRETED:
        return tl.reduce(a, AXIS, _MAX)
    else:
        return tl.max(a, axis=AXIS)


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
def _amax_kernel(
    t_ptr, row_amax_ptr, col_amax_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr
):
    # One tile's row and column maxima, merged into the global ones. Amaxes are >= 0, so their float32 bit
    # patterns order as int32s do: an integer atomic max is a float max.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < R, cols < C
    t = tl.load(t_ptr + rows[:, None] * C + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    a = tl.abs(t.to(tl.float32))
    row_max = _amax(a, 1, INTERPRETED).to(tl.int32, bitcast=True)
    col_max = _amax(a, 0, INTERPRETED).to(tl.int32, bitcast=True)
    tl.atomic_max(row_amax_ptr + rows, row_max, mask=row_ok, sem="relaxed")  # ordered by the kernel's end
    tl.atomic_max(col_amax_ptr + cols, col_max, mask=col_ok, sem="relaxed")


@triton.jit
def _cast_kernel(
    t_ptr,
    row_amax_ptr,
    col_amax_ptr,
    q_ptr,
    row_scale_ptr,
    qt_ptr,
    col_scale_ptr,
    R,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # One tile, read once: with ROWS scaled per row and stored row-major, with COLS scaled per column and stored
    # transposed (T^T contiguous). The first tile of each row (column) also writes the row's (column's) scale.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < R, cols < C
    mask = row_ok[:, None] & col_ok[None, :]
    t = tl.load(t_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROWS:
        amax = tl.load(row_amax_ptr + rows, mask=row_ok, other=0).to(tl.float32, bitcast=True)
        scale = _pow2_scale(amax, INTERPRETED)
        if tl.program_id(1) == 0:
            tl.store(row_scale_ptr + rows, scale, mask=row_ok)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], _to_e4m3(t * scale[:, None], INTERPRETED), mask=mask)
    if COLS:
        amax = tl.load(col_amax_ptr + cols, mask=col_ok, other=0).to(tl.float32, bitcast=True)
        scale = _pow2_scale(amax, INTERPRETED)
        if tl.program_id(0) == 0:
            tl.store(col_scale_ptr + cols, scale, mask=col_ok)
        q_t = tl.trans(_to_e4m3(t * scale[None, :], INTERPRETED))  # [BLOCK_C cols, BLOCK_R rows]
        tl.store(qt_ptr + cols[:, None] * R + rows[None, :], q_t, mask=col_ok[:, None] & row_ok[None, :])


def _interpreted(t: torch.Tensor) -> bool:
    """Round in float32 before the e4m3 conversion off the GPU (Triton's interpreter: see `_to_e4m3`)."""
    return t.device.type != "cuda"


def _blocks(t: torch.Tensor, kernel: str) -> tuple[int, int]:
    return (INTERPRETER_BLOCKS if _interpreted(t) else GPU_BLOCKS)[kernel]


def _cast(
    t: torch.Tensor, row_amax: torch.Tensor, col_amax: torch.Tensor, rows: bool, cols: bool, kernel: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cast kernel's launch; outputs not asked for are empty."""
    R, C = t.shape
    q = torch.empty((R, C) if rows else (0,), dtype=torch.float8_e4m3fn, device=t.device)
    row_scale = torch.empty((R, 1) if rows else (0,), dtype=torch.float32, device=t.device)
    q_t = torch.empty((C, R) if cols else (0,), dtype=torch.float8_e4m3fn, device=t.device)
    col_scale = torch.empty((C, 1) if cols else (0,), dtype=torch.float32, device=t.device)
    block_r, block_c = _blocks(t, kernel)
    grid = (triton.cdiv(R, block_r), triton.cdiv(C, block_c))
    wrap_triton(_cast_kernel)[grid](
        t,
        row_amax,
        col_amax,
        q,
        row_scale,
        q_t,
        col_scale,
        R,
        C,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        ROWS=rows,
        COLS=cols,
        INTERPRETED=_interpreted(t),
    )
    return q, row_scale, q_t, col_scale


@triton_op("kiln::fp8_amax", mutates_args=())
def amax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] (contiguous, bf16 or float32) -> (row amax [R], column amax [C]), float32 bit patterns in int32."""
    R, C = t.shape
    row_amax = torch.zeros((R,), dtype=torch.int32, device=t.device)
    col_amax = torch.zeros((C,), dtype=torch.int32, device=t.device)
    block_r, block_c = _blocks(t, "amax")
    grid = (triton.cdiv(R, block_r), triton.cdiv(C, block_c))
    wrap_triton(_amax_kernel)[grid](
        t, row_amax, col_amax, R, C, BLOCK_R=block_r, BLOCK_C=block_c, INTERPRETED=_interpreted(t)
    )
    return row_amax, col_amax


@triton_op("kiln::fp8_cast_rows", mutates_args=())
def cast_rows(t: torch.Tensor, row_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e4m3 t scaled per row [R, C], row scales [R, 1] float32): torchao's cast along dim -1."""
    q, row_scale, _, _ = _cast(t, row_amax, row_amax, rows=True, cols=False, kernel="rows")
    return q, row_scale


@triton_op("kiln::fp8_cast_cols_t", mutates_args=())
def cast_cols_t(t: torch.Tensor, col_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e4m3 t^T scaled per column of t, [C, R] contiguous, column scales [C, 1] float32): torchao's cast along
    dim 0, transposed."""
    _, _, q_t, col_scale = _cast(t, col_amax, col_amax, rows=False, cols=True, kernel="cols")
    return q_t, col_scale


@triton_op("kiln::fp8_cast_both", mutates_args=())
def cast_both(
    t: torch.Tensor, row_amax: torch.Tensor, col_amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both casts from one read of t: (cast_rows's outputs, cast_cols_t's outputs)."""
    return _cast(t, row_amax, col_amax, rows=True, cols=True, kernel="both")
