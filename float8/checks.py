"""Float8-in-use checks: at the first step, prove each float8 flag changed what runs, or stop the run.

A float8 flag that silently does nothing (a filter that matched every Linear, a converter that was never
called, FSDP float8 all-gather without FSDP) trains a bf16 model while the user reads float8 numbers. The
Trainer counts `_scaled_mm` calls during its first step (`ScaledMMCounter`) and then calls
`verify_float8_in_use`, which logs what it found and raises ConfigError (exit 2) when a flag had no effect.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from float8.converter import is_float8_linear
from trainer.config import ConfigError, Float8
from trainer.internals import fsdp_param_groups, fsdp_param_owner

logger = logging.getLogger("kiln")


class ScaledMMCounter(TorchDispatchMode):
    """Counts aten._scaled_mm calls (float8 matmuls) while active.

    Float8 tensors are subclasses whose own dispatch issues `_scaled_mm`; returning NotImplemented for
    subclass arguments lets them run first, and their inner ops then come back through this mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if any(t not in (torch.Tensor, nn.Parameter) for t in types):
            return NotImplemented
        if func is torch.ops.aten._scaled_mm.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _float8_all_gather_itemsizes(model: nn.Module) -> dict[str, int]:
    """Element size of what FSDP2 all-gathers for each Float8Linear weight (1 = float8 on the wire).

    Reads FSDP's own all-gather inputs (the tensor subclass's fsdp_pre_all_gather output); for dynamic
    tensorwise scaling that computes the weight amax with one all-reduce, so call it on every rank.
    """
    sizes: dict[str, int] = {}
    float8_modules = {id(m): n for n, m in model.named_modules() if is_float8_linear(m)}
    for module in model.modules():
        for group in fsdp_param_groups(module):
            for fsdp_param in group.fsdp_params:
                owner, param_name = fsdp_param_owner(fsdp_param)
                name = float8_modules.get(id(owner))
                if name is not None and param_name == "weight":  # after a full step: params are sharded
                    sizes[name] = min(t.element_size() for t in fsdp_param.all_gather_inputs)
    return sizes


def verify_float8_in_use(model: nn.Module, cfg: Float8, scaled_mm_calls: int, fsdp_enabled: bool) -> list[str]:
    """Check each enabled float8 flag took effect; return the findings (logged), raise ConfigError if not."""
    if not cfg.enable_float8_linear:
        return []
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    float8 = [n for n, m in model.named_modules() if is_float8_linear(m)]
    if not float8:
        raise ConfigError(
            f"float8.enable_float8_linear is set but none of the {len(linears)} Linears is a Float8Linear "
            f"(float8.filter_fqns={cfg.filter_fqns}); the run would silently train in high precision"
        )
    findings = [f"float8 in use: {len(float8)}/{len(linears)} Linears are Float8Linear"]
    if scaled_mm_calls == 0:
        raise ConfigError(
            "float8.enable_float8_linear: Float8Linear modules exist but no aten._scaled_mm ran in the first "
            "step; the float8 matmuls were bypassed"
        )
    findings.append(f"float8 in use: {scaled_mm_calls} _scaled_mm calls in the first step")
    if cfg.enable_fsdp_float8_all_gather:
        if not fsdp_enabled:
            raise ConfigError(
                "float8.enable_fsdp_float8_all_gather is set but FSDP is not enabled (data-parallel shard "
                "degree 1): nothing is all-gathered; drop the flag or shard over more ranks"
            )
        sizes = _float8_all_gather_itemsizes(model)
        wide = sorted(n for n, s in sizes.items() if s != 1)
        if not sizes or wide:
            raise ConfigError(
                "float8.enable_fsdp_float8_all_gather is set but FSDP all-gathers "
                + (
                    f"{len(wide)} Float8Linear weights in high precision (e.g. {wide[0]})"
                    if wide
                    else "no float8 weight"
                )
            )
        findings.append(f"float8 in use: FSDP all-gathers {len(sizes)} Float8Linear weights as 1-byte float8")
    for line in findings:
        logger.info(line)
    return findings
