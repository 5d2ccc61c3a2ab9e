"""Float8 collectives over gloo (CPU): gloo has no float8 dtypes, so float8 buffers travel as uint8 views.

An all-gather only moves bytes, so sending a float8 buffer viewed as uint8 is exact. Two places put float8
buffers on the wire, and each gets the same treatment:

- FSDP2 float8 all-gather: FSDP2 packs a group's all-gather inputs into one buffer. When the group also holds
  a high-precision parameter (a norm weight), FSDP2 itself uses a uint8 buffer; when every parameter of the
  group is float8 the buffer is float8 and gloo fails with "Invalid scalar type". `Float8AsUint8AllGather`,
  installed with `FSDPModule.set_custom_all_gather`, views such buffers as uint8.
- Float8 tensor parallel: torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput all-gather
  DTensor(Float8TrainingTensor) activations; torchao unwraps them and calls the functional all-gather on the
  float8 payload. `enable_float8_tp_on_cpu` wraps torchao's handler so a CPU payload goes as uint8.

On CUDA/nccl neither is used: nccl moves float8 natively.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kiln_base.internals import FSDPAllGather, all_gather_single, float8_data, float8_ops_table, float8_with_data

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


class Float8AsUint8AllGather(FSDPAllGather):
    """FSDP2 all-gather that sends float8 buffers as uint8 (same bytes); other dtypes pass through."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if input_tensor.dtype in FLOAT8_DTYPES:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def enable_float8_tp_on_cpu() -> None:
    """Make torchao's float8 all-gather handler send CPU float8 payloads as uint8 (idempotent).

    torchao dispatches `all_gather_into_tensor` on a Float8TrainingTensor through its op table; we wrap
    that entry. The wrapper only changes CPU tensors (which always go through gloo); CUDA is untouched.
    """
    table = float8_ops_table()
    # Both the legacy c10d_functional and the current _c10d_functional op are registered by torchao.
    for op in [op for op in table if "all_gather_into_tensor" in str(op)]:
        original = table[op]
        if getattr(original, "_kiln_uint8_on_cpu", False):
            continue

        def all_gather_float8(aten_op: Any, args: tuple, kwargs: dict | None = None, _orig: Any = original) -> Any:
            fp8 = args[0]
            if float8_data(fp8).device.type != "cpu":
                return _orig(aten_op, args, kwargs)
            data = float8_data(fp8).contiguous()
            out = aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {})).view(data.dtype)
            return float8_with_data(fp8, out)

        all_gather_float8._kiln_uint8_on_cpu = True  # type: ignore[attr-defined]  # marks the table entry as kiln's
        table[op] = all_gather_float8
