"""torchao's rowwise Float8Linear with its casts fused (`float8.rowwise_fused_cast`): the same numerics, fewer passes.

The three GEMMs of a Linear y = x W^T, in torchao's rowwise recipe (all e4m3, per-row scales rounded down to
powers of two; `torch._scaled_mm` wants a row-major left and a column-major right operand):

    output       y  = x @ W^T   x scaled per row (along K),   W scaled per row (along K)
    grad_input   gx = G @ W     G scaled per row (along N),   W scaled per column (along N)
    grad_weight  gW = G^T @ x   G scaled per column (along M), x scaled per column (along M)

torchao casts each operand separately, six casts of three tensors. Here (float8/rowwise_kernels.py: `amax` reads
a tensor once for its row and column amaxes; the cast kernels read it once more and write one or both casts):

    forward   amax(x), cast_rows(x)          x_e4m3 with x's row scales; x's column amax kept
              amax(W), cast_rows(W)          W_e4m3 with W's row scales; W's column amax kept
    backward  amax(G), cast_both(G)          G_e4m3 and G^T_e4m3 (contiguous: grad_weight's row-major left operand)
              cast_cols_t(W, W's col amax)   W^T_e4m3 (its transpose is grad_input's column-major right operand)
              cast_cols_t(x, x's col amax)   x^T_e4m3 (likewise for grad_weight)

The column amaxes come with the forward's amax pass, so the backward's column casts of W and x are one read each.
Saved for backward: x and W (as torchao saves them) and the two column amaxes (K + N floats): no float8 copy of W
stays alive, so FSDP frees the unsharded weight after forward as before. Under per-op SAC the casts are not in the
save list (their outputs are as large as x or W): the recompute re-runs `amax` and `cast_rows` where torchao re-runs
its forward casts.

The GEMMs are torchao's own: the e4m3 operands are wrapped in Float8TrainingTensors with the Linear's
LinearMMConfig and roles, so `torch.mm` dispatches to the same `torch._scaled_mm` calls (per-GEMM fast
accumulation, the tensorwise-kernel-plus-rescale path where fast accumulation is off, emulation) and per-op SAC sees
the same aten.mm as with torchao. Operands in bf16 or float32 (a float32 weight under autocast, one GPU without FSDP)
take the fused path; other dtypes (fp16) run torchao's forward unchanged.
"""

from __future__ import annotations

import torch
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, LinearMMConfig

FUSED_DTYPES = (torch.bfloat16, torch.float32)


def _f8(
    data: torch.Tensor, scale: torch.Tensor, hp: torch.Tensor, role: GemmInputRole, cfg: LinearMMConfig
) -> Float8TrainingTensor:
    """One GEMM operand cast from the high-precision `hp`: `scale` [rows, 1] (axiswise_dim -1) or [1, cols]
    (axiswise_dim 0), as torchao builds it."""
    dim = -1 if scale.shape[-1] == 1 else 0
    return Float8TrainingTensor(data, scale, hp.dtype, cfg, gemm_input_role=role, axiswise_dim=dim)


@torch.compiler.allow_in_graph  # as torchao's matmul_with_hp_or_float8_args: AOTAutograd traces it, dynamo does not
class FusedRowwiseMatmul(torch.autograd.Function):
    """y = x @ W^T with torchao's rowwise numerics, the casts by float8/rowwise_kernels.py."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, cfg: LinearMMConfig) -> torch.Tensor:
        from float8.rowwise_kernels import amax, cast_rows

        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        weight = weight.contiguous()
        x_row_amax, x_col_amax = amax(x2)
        w_row_amax, w_col_amax = amax(weight)
        x_e4m3, x_scale = cast_rows(x2, x_row_amax)
        w_e4m3, w_scale = cast_rows(weight, w_row_amax)
        ctx.save_for_backward(x2, weight, x_col_amax, w_col_amax)
        ctx.cfg, ctx.x_shape = cfg, x.shape
        out = torch.mm(
            _f8(x_e4m3, x_scale, x, GemmInputRole.INPUT, cfg),
            _f8(w_e4m3.t(), w_scale.t(), weight, GemmInputRole.WEIGHT, cfg),
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        from float8.rowwise_kernels import amax, cast_both, cast_cols_t

        x2, weight, x_col_amax, w_col_amax = ctx.saved_tensors
        cfg = ctx.cfg
        g = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        g_e4m3, g_scale, gt_e4m3, gt_scale = cast_both(g, *amax(g))
        wt_e4m3, wt_scale = cast_cols_t(weight, w_col_amax)
        xt_e4m3, xt_scale = cast_cols_t(x2, x_col_amax)
        grad_input = torch.mm(
            _f8(g_e4m3, g_scale, g, GemmInputRole.GRAD_OUTPUT, cfg),
            _f8(wt_e4m3.t(), wt_scale.t(), weight, GemmInputRole.WEIGHT, cfg),
        )
        grad_weight = torch.mm(
            _f8(gt_e4m3, gt_scale, g, GemmInputRole.GRAD_OUTPUT, cfg),
            _f8(xt_e4m3.t(), xt_scale.t(), x2, GemmInputRole.INPUT, cfg),
        )
        return grad_input.reshape(ctx.x_shape), grad_weight, None


class FusedRowwiseFloat8Linear(Float8Linear):
    """torchao's Float8Linear (rowwise recipe) whose casts run in float8/rowwise_kernels.py's two fused kernels.

    Same parameters and config as the Float8Linear it replaces (`float8.converter` swaps the class after torchao's
    conversion); bf16 and float32 operands take the fused path, other dtypes torchao's."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled():  # as Float8Linear.forward does
            input = input.to(torch.get_autocast_dtype("cuda"))
        if not (input.dtype in FUSED_DTYPES and self.weight.dtype in FUSED_DTYPES):
            return super().forward(input)
        output = FusedRowwiseMatmul.apply(input, self.weight, self.linear_mm_config)
        return output if self.bias is None else output + self.bias.to(output.dtype)
