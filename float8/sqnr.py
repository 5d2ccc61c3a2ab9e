"""Per-layer float8 SQNR: how far each Float8Linear's output is from the same matmul in high precision.

SQNR = 20 * log10(||ref|| / ||ref - out||) in dB, where `ref` is F.linear on the same input in fp32 with
the high-precision weight. Higher is better; float8 e4m3 gives ~25-30 dB on well-scaled tensors, and a
layer far below its peers is the one hurting accuracy. Costs an extra fp32 matmul per Linear, so it only
runs on steps that are a multiple of `float8.sqnr_log_freq`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from float8.converter import is_float8_linear

logger = logging.getLogger("kiln")


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    noise = torch.linalg.vector_norm(ref - out).item()
    signal = torch.linalg.vector_norm(ref).item()
    return math.inf if noise == 0 else 20 * math.log10(max(signal, 1e-30) / noise)


def _hp_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The high-precision weight, or None where only float8 or a shard is at hand (float8 all-gather, TP)."""
    inner = getattr(weight, "_tensor", weight)  # torchao's float8 all-gather wrapper keeps the hp tensor
    if type(inner) not in (torch.Tensor, nn.Parameter):
        return None
    return inner


class Float8SQNRMonitor:
    """Forward hooks on every Float8Linear; they measure only while `active` is set."""

    def __init__(self, model: nn.Module) -> None:
        self.active = False
        self.sqnr: dict[str, float] = {}
        self.skipped: set[str] = set()
        self.handles = [
            m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if is_float8_linear(m)
        ]

    def _hook(self, name: str):  # noqa: ANN202
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            if not self.active:
                return
            weight = _hp_weight(module.weight)
            if weight is None or type(inputs[0]) is not torch.Tensor:
                self.skipped.add(name)
                return
            with torch.no_grad(), torch.autocast(inputs[0].device.type, enabled=False):
                bias = None if module.bias is None else module.bias.float()
                ref = F.linear(inputs[0].float(), weight.float(), bias)
                self.sqnr[name] = sqnr_db(ref, output.float())

        return hook

    def log(self, step: int) -> dict[str, float]:
        """Log the step's SQNR per layer, worst first; return and reset them."""
        values, self.sqnr = self.sqnr, {}
        worst = sorted(values.items(), key=lambda kv: kv[1])
        logger.info(f"float8 SQNR step {step} (dB, worst first): " + ", ".join(f"{n} {v:.1f}" for n, v in worst))
        if self.skipped:
            logger.info(f"float8 SQNR: no high-precision weight at hand for {len(self.skipped)} layers (skipped)")
        return values

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
