"""float8 environment checks (torchao version, GPU capability), run by the converter before the model is built.

The config-only float8 checks (flag combinations) live with the config in trainer/config.py. torch is imported
inside the check so that importing this module stays light.
"""

from __future__ import annotations

import importlib.metadata
import re

from trainer.config import Float8
from trainer.errors import ConfigError

MIN_TORCHAO = (0, 18)  # Float8LinearConfig.from_recipe_name, fp32 output for rowwise, _auto_filter_for_recipe
MIN_CUDA_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (SM 8.9), Hopper (9.0), Blackwell
MIN_ROCM_CAPABILITY = (9, 4)  # gfx942 (MI300X) is the first AMD GPU with float8 matmuls
MIN_MXFP8_CAPABILITY = (10, 0)  # MXFP8 block-scaled matmuls: Blackwell (B200, GB200) and later


def _version_tuple(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_float8_environment(cfg: Float8) -> None:
    """torchao present and recent enough; float8-capable GPUs unless emulating. Cheap: imports no torchao."""
    need = ".".join(map(str, MIN_TORCHAO))
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"float8.enable_float8_linear needs torchao, which is not installed (pip install 'torchao>={need}')"
        ) from None
    if _version_tuple(version) < MIN_TORCHAO:
        raise ConfigError(
            f"float8.enable_float8_linear needs torchao>={need}, found {version} (pip install -U 'torchao>={need}')"
        )
    import torch

    if cfg.emulate or not torch.cuda.is_available():
        return  # CPU: torch._scaled_mm has a CPU kernel, so float8 runs (slowly); see check_cpu_float8
    minimum = MIN_ROCM_CAPABILITY if torch.version.hip else MIN_CUDA_CAPABILITY
    for i in range(torch.cuda.device_count()):
        cap = tuple(torch.cuda.get_device_capability(i))
        if cfg.is_mxfp8 and (torch.version.hip or cap < MIN_MXFP8_CAPABILITY):
            raise ConfigError(
                f"float8.recipe_name {cfg.recipe}: {torch.cuda.get_device_name(i)} (capability {cap[0]}.{cap[1]}) has "
                "no MXFP8 matmuls (needs 10.0+, Blackwell); add --float8.emulate to emulate them, or use recipe_name "
                "rowwise"
            )
        if cap < minimum:
            raise ConfigError(
                f"float8.enable_float8_linear: {torch.cuda.get_device_name(i)} (capability {cap[0]}.{cap[1]}) has "
                f"no float8 matmuls (needs {minimum[0]}.{minimum[1]}+, e.g. H100, L4, MI300X); "
                "add --float8.emulate to emulate them, or turn float8 off"
            )


def check_cpu_float8(cfg: Float8) -> None:
    """Training float8 on a CPU: the rowwise recipes need a CPU `_scaled_mm` that takes per-row scales (torch 2.11's
    asserts per-tensor ones, torch 2.13's has them). Called by the Trainer on CPU only: a dry run plans for GPUs."""
    if not cfg.enable_float8_linear or cfg.emulate or cfg.recipe == "tensorwise":
        return
    if cfg.is_mxfp8:
        raise ConfigError(
            f"float8.recipe_name {cfg.recipe}: MXFP8 kernels need a Blackwell GPU (SM100); on a CPU add "
            "--float8.emulate to emulate them"
        )
    from trainer.internals import cpu_scaled_mm_supports_rowwise

    if not cpu_scaled_mm_supports_rowwise():
        import torch

        raise ConfigError(
            f"float8.recipe_name {cfg.recipe}: torch {torch.__version__}'s CPU float8 matmul takes per-tensor scales "
            "only; use recipe_name tensorwise, add --float8.emulate, or torch >= 2.13 on a CPU"
        )
