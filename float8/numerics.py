"""The float8 numerics observatory: per float8 Linear and per float8 operand, how well float8 holds the tensor.

For each float8 Linear (Float8Linear, or a Linear with an MXFP8 weight) and each of its three float8 operands
(input, weight, grad_output), on steps that are a multiple of `float8.numerics_log_freq`:

- amax: max |x| of the high-precision tensor;
- scale: the multiplier the recipe's cast uses (x * scale is what becomes float8), recomputed here from the same
  rule as torchao: tensorwise fp8_max / amax; rowwise fp8_max / row amax rounded down to a power of two; MXFP8
  2^-ceil(log2(block amax / fp8_max)) per block of 32 (rceil). For per-row and per-block scales the smallest is
  reported (the one set by the largest row or block);
- underflow: the fraction of nonzero elements that become zero in float8;
- saturation: the fraction of elements with |x * scale| above the float8 maximum (clamped by the cast): zero under
  dynamic scaling unless the scale is stale or rounded the wrong way, so a nonzero value is a bug or an overflow;
- SQNR: 20 log10(||x|| / ||x - dequant(quant(x))||) in dB, the operand's own cast error;
- and, as the SQNR monitor did before, the output SQNR of the Linear against the same matmul in fp32.

Operands are measured in the layout they reach the Linear (TP: this rank's shard), so each rank writes its own
JSONL. The statistics are device tensors stacked and read back with one host sync per logged step. The logged
steps run eagerly (the Trainer's observatory hook sets `force_eager`): the hooks need real tensors and a gradient
hook, and the compiled graphs of the other steps never see them, so the observatory costs nothing on other steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from float8.converter import is_float8_linear
from kiln_base.config import MXFP8_BLOCK, MXFP8_RECIPES
from kiln_base.internals import float8_weight_inner, local_tensor_or_self, mxfp8_weight_data, unwrapped_fqn

OPERANDS = ("input", "weight", "grad_output")
STATS = ("amax", "scale", "underflow", "saturation", "sqnr_db")


@dataclass(frozen=True)
class Cast:
    """How a recipe casts one operand: float8 dtype and scale granularity ('tensor', 'row' or 'block')."""

    dtype: torch.dtype
    granularity: str


def recipe_casts(recipe: str) -> dict[str, Cast]:
    """The cast of each operand under a recipe (torchao 0.18's recipes)."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    if recipe == "tensorwise":  # gradients in e5m2 (range over precision)
        return {"input": Cast(e4m3, "tensor"), "weight": Cast(e4m3, "tensor"), "grad_output": Cast(e5m2, "tensor")}
    granularity = "block" if recipe in MXFP8_RECIPES else "row"
    return {name: Cast(e4m3, granularity) for name in OPERANDS}


def _scales(x: torch.Tensor, cast: Cast, fmax: float) -> torch.Tensor:
    """Per-element-broadcastable scales for x (2-D: rows x K, or rows x blocks x 32 for 'block')."""
    amax = x.abs().amax() if cast.granularity == "tensor" else x.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(amax > 0, amax, fmax)  # an all-zero row or block: scale 1, not 1/0
    if cast.granularity == "tensor":
        return fmax / safe
    if cast.granularity == "row":  # torchao's rowwise recipes round scales down to powers of two
        return torch.exp2(torch.floor(torch.log2(fmax / safe)))
    return torch.exp2(-torch.ceil(torch.log2(safe / fmax)))  # MXFP8 rceil: e8m0 exponent rounded up


def cast_stats(x: torch.Tensor, cast: Cast, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[amax, scale, underflow, saturation, ||x - dq||, ||x||] of casting x to float8, on x's device (no sync).

    `scale` overrides the recipe's (a test, or a stale precomputed scale); otherwise it is computed from x."""
    fmax = torch.finfo(cast.dtype).max
    x = x.detach().float().reshape(-1, x.shape[-1])
    if cast.granularity == "block":
        x = x.reshape(x.shape[0], -1, MXFP8_BLOCK)
    s = _scales(x, cast, fmax) if scale is None else scale.float()
    scaled = x * s
    dq = scaled.clamp(-fmax, fmax).to(cast.dtype).float() / s
    nonzero = x != 0
    underflow = (nonzero & (dq == 0)).sum() / nonzero.sum().clamp(min=1)
    saturation = (scaled.abs() > fmax).float().mean()
    return torch.stack(
        [
            x.abs().amax(),
            s.amin(),
            underflow.float(),
            saturation,
            torch.linalg.vector_norm(x - dq),
            torch.linalg.vector_norm(x),
        ]
    )


def sqnr_db(noise: float, signal: float) -> float:
    """SQNR in dB from ||ref - out|| and ||ref||; inf when exact."""
    return math.inf if noise == 0 else 20 * math.log10(max(signal, 1e-30) / noise)


def to_record(raw: list[float]) -> dict[str, float]:
    """cast_stats' six numbers -> the five reported (the norms become SQNR)."""
    amax, scale, underflow, saturation, noise, signal = raw
    return {
        "amax": amax,
        "scale": scale,
        "underflow": underflow,
        "saturation": saturation,
        "sqnr_db": sqnr_db(noise, signal),
    }


def high_precision_weight(module: nn.Module) -> torch.Tensor:
    """The weight a float8 Linear casts, in high precision (this rank's shard under TP)."""
    w = local_tensor_or_self(module.weight)
    if type(w).__name__ == "MXFP8TrainingWeightWrapperTensor":
        return mxfp8_weight_data(w)
    inner = float8_weight_inner(w)  # torchao's float8 all-gather wrapper keeps the hp tensor
    return w if inner is None else inner


class NumericsObservatory:
    """Hooks on every float8 Linear; they record only while `active` is set, once per step per layer (the first
    micro-batch's forward: activation checkpointing's recompute and later micro-batches are not recorded)."""

    def __init__(self, model: nn.Module, recipe: str) -> None:
        self.active = False
        self.casts = recipe_casts(recipe)
        self.modules = {unwrapped_fqn(n): m for n, m in model.named_modules() if is_float8_linear(m)}
        self.names = {id(m): n for n, m in self.modules.items()}
        self.found: dict[tuple[str, str], torch.Tensor] = {}  # (layer, operand or "output") -> raw stats
        self.handles = []
        for m in self.modules.values():
            self.handles.append(m.register_forward_hook(self._forward))

    def _forward(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if not self.active:
            return
        name = self.names[id(module)]
        if (name, "input") in self.found:
            return
        x = local_tensor_or_self(inputs[0])
        w = high_precision_weight(module)
        self.found[name, "input"] = cast_stats(x, self.casts["input"])
        self.found[name, "weight"] = cast_stats(w, self.casts["weight"])
        if type(x) is torch.Tensor and type(w) in (torch.Tensor, nn.Parameter) and x.shape[-1] == w.shape[-1]:
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                ref = F.linear(x.float(), w.float())
                out = local_tensor_or_self(output).float()
                if out.shape == ref.shape:  # [noise, signal] in the last two of cast_stats' six slots
                    norms = torch.stack([torch.linalg.vector_norm(ref - out), torch.linalg.vector_norm(ref)])
                    self.found[name, "output"] = F.pad(norms, (4, 0))
        if output.requires_grad:
            output.register_hook(lambda g, name=name: self._grad_output(name, g))

    def _grad_output(self, name: str, grad: torch.Tensor) -> None:
        if (name, "grad_output") not in self.found:
            self.found[name, "grad_output"] = cast_stats(local_tensor_or_self(grad), self.casts["grad_output"])

    def collect(self) -> dict[str, dict[str, Any]]:
        """This step's measurements per layer ({operand: {stat: value}}, and 'output_sqnr_db'); one host sync."""
        found, self.found = self.found, {}
        if not found:
            return {}
        keys = list(found)
        values = torch.stack(list(found.values()))
        out: dict[str, dict[str, Any]] = {}
        for (layer, what), raw in zip(keys, values.tolist(), strict=True):
            entry = out.setdefault(layer, {})
            if what == "output":
                entry["output_sqnr_db"] = sqnr_db(raw[-2], raw[-1])
            else:
                entry[what] = to_record(raw)
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.found = {}


def iter_operand_values(step_stats: dict[str, dict[str, Any]], stat: str) -> Iterator[tuple[str, str, float]]:
    """(layer, operand, value) of one statistic over a step's measurements."""
    for layer, entry in step_stats.items():
        for operand in OPERANDS:
            if operand in entry:
                yield layer, operand, entry[operand][stat]
