"""float8 on the MoE routed experts: their three grouped GEMMs (w1, w3, then w2 over each expert's rows) as torchao's
scaled grouped GEMMs, chosen by `float8.moe_fqns`; the converter (float8/converter.py) gives each chosen experts
module a `LowPrecisionGroupedGemm` in place of models/moe.py's high-precision `GroupedGemm`.

What runs (torchao 0.18's MoE training, `torchao.prototype.moe_training`):
- float8 rowwise (float8.recipe_name tensorwise or rowwise: torchao's only float8 grouped recipe, FP8_ROWWISE, what
  torchtitan's `quantize.grouped_mm.float8` runs whatever the Linears' recipe): on a GPU torchao's
  `_to_fp8_rowwise_then_scaled_grouped_mm` (Triton casts, torch._scaled_grouped_mm: CUDA, SM 9.0+). torchao has no
  emulated variant of it, so with `float8.emulate` (every CPU run) kiln's `_EmulatedFloat8GroupedMM` runs instead:
  the same casts (power-of-2 scales per row of the tokens, per column of each expert's weight, per column within
  each expert's rows for the weight gradient; e4m3, saturated) through torchao's own PyTorch cast functions
  (`tensor_to_scale`, `amax_to_scale`, `to_fp8_saturated`), dequantised, then torch._grouped_mm in the compute
  dtype. The dequantised values are exact (e4m3 times a power of 2), so the emulation differs from the kernel only
  in the order of the float32 sums.
- MXFP8 (recipe_name mxfp8_rceil, mxfp8_rceil_wgrad_with_hp): torchao's `_to_mxfp8_then_scaled_grouped_mm`, SM100
  kernels; with `float8.emulate` the same function under torchao's own EMULATED kernel preference (torch casts to
  e4m3 with e8m0 scales per 32 elements, dequantised to bf16, torch._grouped_mm in bf16). That emulation computes
  in bf16 only, so a float32 run's operands are rounded to bf16 before the MXFP8 cast and its output (bf16) is
  cast back: as on a GPU, where training computes in bf16.

Each expert's rows are padded with zero rows to a multiple of `group_multiple` (models/moe.py `padded_groups`):
16 for float8 (16-byte aligned float8 rows, torch._scaled_grouped_mm's rule; torchtitan's token group alignment),
32 for MXFP8 (the weight gradient scales blocks of 32 tokens: a block must not straddle two experts).
The output is in the input's dtype (torchao's float8 rowwise GEMM writes bf16, cast back; kiln's float32 runs stay
float32 around the GEMMs).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from kiln_base.config import Float8
from kiln_base.internals import grouped_mm, torchao_float8_rowwise_grouped_mm, torchao_mxfp8_grouped_mm
from models.moe import GroupedGemm, grouped_mm_runs

if TYPE_CHECKING:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig

E4M3 = torch.float8_e4m3fn
FLOAT8_GROUP_MULTIPLE = 16  # rows per expert: float8 rows 16-byte aligned
MXFP8_GROUP_MULTIPLE = 32  # rows per expert: whole MXFP8 blocks along the tokens (weight gradient)

# The first-step check's counter while it watches (float8/checks.py): called with True when a grouped GEMM is traced
# into a compiled graph, False when it runs. A context variable, set only inside `counting_grouped_gemms`.
_COUNTER: contextvars.ContextVar[Callable[[bool], None] | None] = contextvars.ContextVar("grouped_gemms", default=None)


@contextlib.contextmanager
def counting_grouped_gemms(count: Callable[[bool], None]) -> Iterator[None]:
    """Call `count(traced)` for every low-precision grouped GEMM run (or traced) inside the block."""
    token = _COUNTER.set(count)
    try:
        yield
    finally:
        _COUNTER.reset(token)


@torch.library.custom_op("kiln::low_precision_grouped_gemm_offsets", mutates_args=())
def _traced_offsets(offs: torch.Tensor) -> torch.Tensor:
    """A copy of a low-precision grouped GEMM's group ends (E int32 values), which the GEMM then reads: in a
    compiled graph the op stays (opaque to dynamo), and its fake kernel, run while the graph is traced, reports the
    GEMM to the first-step counter."""
    return offs.clone()


@_traced_offsets.register_fake
def _(offs: torch.Tensor) -> torch.Tensor:
    count = _COUNTER.get()
    if count is not None:
        count(True)
    return torch.empty_like(offs)


def _report(offs: torch.Tensor) -> torch.Tensor:
    """A low-precision grouped GEMM to the first-step counter: run, or traced into a compiled graph."""
    if torch.compiler.is_compiling():  # dynamo cannot trace a context variable: the custom op reads it
        return torch.ops.kiln.low_precision_grouped_gemm_offsets(offs)
    count = _COUNTER.get()
    if count is not None:
        count(False)
    return offs


def _rowwise_cast(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x through torchao's float8 rowwise cast along `dim` (one scale per slice: e4m3's largest value over the
    slice's amax, rounded down to a power of 2; saturated), dequantised: the values the float8 GEMM multiplies."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(
        x, E4M3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim, round_scales_to_power_of_2=True
    )
    return (to_fp8_saturated(x.float() * scale, E4M3).float() / scale).to(x.dtype)


def _per_group_colwise_cast(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (rows, n) cast as torchao casts the weight gradient's operands: one scale per column within each group of
    rows (`offs`: group ends), dequantised. No host sync (torchao's reference loops over offs.tolist())."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    rows, n = x.shape
    positions = torch.arange(rows, device=x.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, positions, right=True).clamp(max=offs.numel() - 1)
    index = group[:, None].expand(rows, n)
    amax = x.new_zeros(offs.numel(), n, dtype=torch.float32).scatter_reduce(0, index, x.abs().float(), "amax")
    scale = amax_to_scale(amax, E4M3, round_scales_to_power_of_2=True)[group]
    return (to_fp8_saturated(x.float() * scale, E4M3).float() / scale).to(x.dtype)


# The names of the emulated float8 rowwise grouped GEMM's three GEMMs (torchao 0.18's `_Float8GroupedMM` computes
# the same three); each one's casts are in emulated_float8_grouped_mm.
_OUTPUT, _GRAD_INPUT, _GRAD_WEIGHT = "output", "grad_input", "grad_weight"


@torch.library.custom_op("kiln::emulated_float8_grouped_mm", mutates_args=())
def emulated_float8_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, gemm: str) -> torch.Tensor:
    """One GEMM of the float8 rowwise grouped GEMM, its operands cast to float8 and dequantised, multiplied with
    torch._grouped_mm in a's dtype. A custom op: a compiled graph calls it as one eager kernel (float32
    torch._grouped_mm has no meta kernel under torch.compile; the casts are what the emulation must keep).
    - output: a (rows, k) @ b (E, k, n) -> (rows, n); a's rows scaled along k, each expert's weight per output
      column (along k)
    - grad_input: a = grad (rows, n), b = the weight (E, k, n) -> (rows, k): grad's rows along n, each expert's
      weight per row of w_t (along n)
    - grad_weight: a (rows, k), b = grad (rows, n) -> (E, k, n): both scaled per column within each expert's rows
      (the contraction)"""
    if gemm == _OUTPUT:
        return grouped_mm(_rowwise_cast(a, -1), _rowwise_cast(b, -2).to(a.dtype), offs)
    if gemm == _GRAD_INPUT:
        return grouped_mm(_rowwise_cast(a, -1), _rowwise_cast(b, -1).to(a.dtype).transpose(-2, -1), offs)
    assert gemm == _GRAD_WEIGHT, gemm
    return grouped_mm(_per_group_colwise_cast(a, offs).t(), _per_group_colwise_cast(b, offs), offs)


@emulated_float8_grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, gemm: str) -> torch.Tensor:
    if gemm == _OUTPUT:
        return a.new_empty(a.shape[0], b.shape[-1])
    if gemm == _GRAD_INPUT:
        return a.new_empty(a.shape[0], b.shape[-2])
    return a.new_empty(offs.shape[0], a.shape[1], b.shape[1])


class _EmulatedFloat8GroupedMM(torch.autograd.Function):
    """torchao's float8 rowwise grouped GEMM (`_Float8GroupedMM`, torchao 0.18) with its three GEMMs' operands cast
    as torchao casts them and multiplied dequantised in high precision: a (rows, k), b_t (E, k, n), offs (E,)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b_t, offs)
        return torch.ops.kiln.emulated_float8_grouped_mm(a, b_t, offs, _OUTPUT)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        a, b_t, offs = ctx.saved_tensors
        grad = grad.to(a.dtype)
        gemm = torch.ops.kiln.emulated_float8_grouped_mm
        grad_a = gemm(grad, b_t, offs, _GRAD_INPUT)
        grad_b = gemm(a, grad, offs, _GRAD_WEIGHT)
        return grad_a, grad_b.to(b_t.dtype), None


class LowPrecisionGroupedGemm(GroupedGemm):
    """The experts' grouped GEMM in float8 rowwise or MXFP8 (see the module docstring); one per converted experts
    module, read-only after the conversion."""

    def __init__(self, cfg: Float8, mxfp8_config: MXFP8TrainingOpConfig | None = None) -> None:
        """`mxfp8_config`: the MXFP8 recipes' torchao config (the converter's, EMULATED with float8.emulate)."""
        assert cfg.is_mxfp8 == (mxfp8_config is not None), "MXFP8 experts need torchao's MXFP8 config"
        self.mxfp8_config = mxfp8_config
        self.emulated = cfg.emulate
        self.group_multiple = MXFP8_GROUP_MULTIPLE if cfg.is_mxfp8 else FLOAT8_GROUP_MULTIPLE
        self.name = cfg.recipe if cfg.is_mxfp8 else "float8 rowwise"

    def runs(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """torchao's grouped GEMMs take float32 or bf16 operands on a GPU, and MXFP8's emulation on a CPU too
        (dims checked at start-up: float8.moe_fqns); kiln's float8 emulation ends in torch._grouped_mm in the
        operands' dtype, called eagerly (a custom op, also in a compiled graph), so torch._grouped_mm's eager rule
        (models/moe.py grouped_mm_runs) is its rule."""
        if self.emulated and self.mxfp8_config is None:
            return grouped_mm_runs(x, *weights, eager=True)
        return x.device.type in ("cpu", "cuda") and all(
            t.dtype in (torch.float32, torch.bfloat16) for t in (x, *weights)
        )

    def __call__(self, x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        offs = _report(offs)
        if self.mxfp8_config is not None and self.emulated:
            # torchao's MXFP8 emulation dequantises to bf16 and multiplies in bf16 (any other out_dtype is refused on
            # a CPU): float32 operands go in as bf16, the result comes back in x's dtype.
            out = torchao_mxfp8_grouped_mm(x.to(torch.bfloat16), w_t.to(torch.bfloat16), offs, self.mxfp8_config)
            return out.to(x.dtype)
        if self.mxfp8_config is not None:
            return torchao_mxfp8_grouped_mm(x, w_t, offs, self.mxfp8_config)
        if self.emulated:
            return _EmulatedFloat8GroupedMM.apply(x, w_t, offs)
        return torchao_float8_rowwise_grouped_mm(x, w_t, offs)

    def __repr__(self) -> str:
        return f"LowPrecisionGroupedGemm({self.name}{', emulated' if self.emulated else ''})"


def is_low_precision_experts(module: torch.nn.Module) -> bool:
    """Whether `module` (GroupedExperts, or an expert-parallel one) runs its grouped GEMMs in low precision."""
    return isinstance(getattr(module, "gemm", None), LowPrecisionGroupedGemm)


def is_experts(module: torch.nn.Module) -> bool:
    """Whether `module` holds routed experts with a grouped GEMM (GroupedExperts or an expert-parallel one)."""
    return isinstance(getattr(module, "gemm", None), GroupedGemm)
