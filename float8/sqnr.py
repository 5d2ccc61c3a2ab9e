"""Per-layer float8 SQNR: how far each Float8Linear's output is from the same matmul in high precision.

SQNR = 20 * log10(||ref|| / ||ref - out||) in dB, where `ref` is F.linear on the same input in fp32 with
the high-precision weight. Higher is better; float8 e4m3 gives ~25-30 dB on well-scaled tensors, and a
layer far below its peers is the one hurting accuracy. Costs an extra fp32 matmul per Linear, so it only
runs on steps that are a multiple of `float8.sqnr_log_freq`.

The hooks run inside `torch.compile`d blocks (fullgraph) too, so they only do tensor math: each stores the
two norms on its module as a device tensor, and `log` reads them all back with one host sync, outside the
compiled region. A `.item()` in the hook would be a graph break, which fullgraph refuses. The hooks are one
bound method shared by every layer (no per-layer closure), so dynamo compiles one graph for inactive steps
and one for SQNR steps, whatever the number of layers.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from float8.converter import is_float8_linear
from trainer.internals import float8_weight_inner, unwrapped_fqn

logger = logging.getLogger("kiln")


def sqnr_db(noise: float, signal: float) -> float:
    """SQNR in dB from ||ref - out|| and ||ref||."""
    return math.inf if noise == 0 else 20 * math.log10(max(signal, 1e-30) / noise)


def _hp_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The high-precision weight, or None where only float8 or a shard is at hand (float8 all-gather, TP)."""
    inner = float8_weight_inner(weight)  # torchao's float8 all-gather wrapper keeps the hp tensor
    inner = weight if inner is None else inner
    if type(inner) not in (torch.Tensor, nn.Parameter):
        return None
    return inner


# The attribute a hooked Float8Linear holds its last measurement in: (||ref - out||, ||ref||), fp32, on device.
_NORMS = "kiln_sqnr_norms"


class Float8SQNRMonitor:
    """Forward hooks on every Float8Linear; they measure only while `active` is set."""

    def __init__(self, model: nn.Module) -> None:
        self.active = False
        self.modules = {unwrapped_fqn(name): m for name, m in model.named_modules() if is_float8_linear(m)}
        self.skipped: set[str] = set()  # layers of the last logged step without a high-precision weight at hand
        self.handles = [m.register_forward_hook(self._measure) for m in self.modules.values()]

    def _measure(self, module: nn.Linear, inputs: tuple, output: torch.Tensor) -> None:
        if not self.active:
            return
        weight = _hp_weight(module.weight)
        if weight is None or type(inputs[0]) is not torch.Tensor:
            return  # no measurement: reported as skipped by log()
        with torch.no_grad(), torch.autocast(inputs[0].device.type, enabled=False):
            bias = None if module.bias is None else module.bias.float()
            ref = F.linear(inputs[0].float(), weight.float(), bias)
            noise = torch.linalg.vector_norm(ref - output.float())
            setattr(module, _NORMS, torch.stack([noise, torch.linalg.vector_norm(ref)]))

    def _collect(self) -> dict[str, torch.Tensor]:
        """Take (and clear) the measurements the hooks left on the modules."""
        found = {}
        for name, m in self.modules.items():
            norms = m.__dict__.pop(_NORMS, None)
            if norms is not None:
                found[name] = norms
        self.skipped = set(self.modules) - set(found)
        return found

    def clear(self) -> None:
        """Drop this step's measurements without reading them (ranks that do not log)."""
        self._collect()

    def log(self, step: int) -> dict[str, float]:
        """Log the step's SQNR per layer, worst first; return and reset them. One host sync."""
        found = self._collect()
        pairs = torch.stack(list(found.values())).tolist() if found else []
        values = {name: sqnr_db(noise, signal) for name, (noise, signal) in zip(found, pairs)}
        worst = sorted(values.items(), key=lambda kv: kv[1])
        logger.info(f"float8 SQNR step {step} (dB, worst first): " + ", ".join(f"{n} {v:.1f}" for n, v in worst))
        if self.skipped:
            logger.info(f"float8 SQNR: no high-precision weight at hand for {len(self.skipped)} layers (skipped)")
        return values

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self._collect()
