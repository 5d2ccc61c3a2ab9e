"""float8 checks that run before anything heavy: config-only ones (from trainer.config.validate) and the
environment ones (torchao version, GPU capability) that the converter runs before the model is built.

Config-only checks import nothing beyond the standard library; torch is imported inside the environment check.
"""

from __future__ import annotations

import importlib.metadata
import re

from trainer.config import ConfigError, Float8

MIN_TORCHAO = (0, 18)  # Float8LinearConfig.from_recipe_name, fp32 output for rowwise, _auto_filter_for_recipe
MIN_CUDA_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (SM 8.9), Hopper (9.0), Blackwell
MIN_ROCM_CAPABILITY = (9, 4)  # gfx942 (MI300X) is the first AMD GPU with float8 matmuls


def validate_float8(cfg: Float8) -> None:
    """Reject float8 flag combinations that torchao would reject late (or silently ignore)."""
    if not cfg.enable_float8_linear:
        stray = [
            f"float8.{name}"
            for name, on in (
                ("recipe_name", cfg.recipe_name is not None),
                ("enable_fsdp_float8_all_gather", cfg.enable_fsdp_float8_all_gather),
                ("precompute_float8_dynamic_scale_for_fsdp", cfg.precompute_float8_dynamic_scale_for_fsdp),
                ("emulate", cfg.emulate),
                ("auto_filter_small_kn", cfg.auto_filter_small_kn),
                ("sqnr_log_freq", cfg.sqnr_log_freq > 0),
            )
            if on
        ]
        if stray:
            raise ConfigError(
                f"{', '.join(stray)} set but float8 is off; add --float8.enable_float8_linear or drop the flag"
            )
        return
    recipe = cfg.recipe_name or "tensorwise"
    if cfg.enable_fsdp_float8_all_gather and recipe != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather needs tensorwise scaling, but float8.recipe_name is '{recipe}' "
            "(weights are scaled per row); turn the all-gather off or use recipe_name tensorwise"
        )
    if cfg.precompute_float8_dynamic_scale_for_fsdp and not cfg.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather "
            "(it precomputes the scales of float8-all-gathered weights)"
        )


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
        return  # CPU: torch._scaled_mm has a CPU kernel, so float8 runs (slowly) without emulation
    minimum = MIN_ROCM_CAPABILITY if torch.version.hip else MIN_CUDA_CAPABILITY
    for i in range(torch.cuda.device_count()):
        cap = tuple(torch.cuda.get_device_capability(i))
        if cap < minimum:
            raise ConfigError(
                f"float8.enable_float8_linear: {torch.cuda.get_device_name(i)} (capability {cap[0]}.{cap[1]}) has "
                f"no float8 matmuls (needs {minimum[0]}.{minimum[1]}+, e.g. H100, L4, MI300X); "
                "add --float8.emulate to emulate them, or turn float8 off"
            )
