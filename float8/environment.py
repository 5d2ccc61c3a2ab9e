"""What the machine offers float8 (torchao's version, the GPUs' compute capabilities, the CPU float8 matmul),
gathered here and judged by the config checks (kiln_base/config/checks.py), before the model is built.

torch is imported inside the functions, so importing this module stays light.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

from kiln_base.config import (
    Float8,
    check_float8_cpu,
    check_float8_gpus,
    check_rowwise_fused_cast_machine,
    check_torchao,
)


def torchao_version() -> str | None:
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_float8_environment(cfg: Float8) -> None:
    """torchao present and recent enough; float8-capable GPUs unless emulating. Cheap: imports no torchao."""
    if not cfg.enable_float8_linear:
        return
    check_torchao(cfg, torchao_version())
    import torch

    if torch.cuda.is_available():  # a CPU runs float8 through torch._scaled_mm's CPU kernel: check_cpu_float8
        gpus = [
            (torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())
        ]
        check_float8_gpus(cfg, gpus, rocm=torch.version.hip is not None)
        _check_fused_cast_machine(cfg, "cuda", rocm=torch.version.hip is not None)


def _check_fused_cast_machine(cfg: Float8, device: str, rocm: bool = False) -> None:
    """float8.rowwise_fused_cast's Triton kernels: installed, and on a CPU run by Triton's interpreter."""
    check_rowwise_fused_cast_machine(
        cfg,
        device=device,
        rocm=rocm,
        triton=importlib.util.find_spec("triton") is not None,
        interpreter=os.environ.get("TRITON_INTERPRET") == "1",
    )


def check_cpu_float8(cfg: Float8) -> None:
    """Training float8 on a CPU (the Trainer, on CPU only: a dry run plans for GPUs)."""
    if not cfg.enable_float8_linear:
        return
    import torch

    from kiln_base.internals import cpu_scaled_mm_supports_rowwise

    rowwise_matmul = cfg.emulate or cfg.recipe == "tensorwise" or cfg.is_mxfp8 or cpu_scaled_mm_supports_rowwise()
    check_float8_cpu(cfg, torch.__version__, rowwise_matmul)
    _check_fused_cast_machine(cfg, "cpu")
