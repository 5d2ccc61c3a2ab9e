"""AdamW and the warmup-stable-decay learning-rate schedule."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from kiln_base.config import LRScheduler, Optimizer


def build_optimizer(params: list[torch.nn.Parameter], cfg: Optimizer) -> torch.optim.Optimizer:
    """Adam(W) with the configured kernel: fused (one kernel for all params) or foreach (batched)."""
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    return cls(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **kernel[cfg.implementation],
    )


def lr_factor(
    step: int, warmup_steps: int, decay_steps: int, total_steps: int, decay_type: str, min_lr_factor: float
) -> float:
    """Multiplier of the peak lr after `step` optimizer steps: linear warmup, flat, then decay.

    Warmup starts at 1/(warmup+1) rather than 0 so that the first step trains (as torchtitan does).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / max(decay_steps, 1), 1.0)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:  # cosine
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int) -> LambdaLR:
    warmup = min(cfg.warmup_steps, total_steps)
    post_warmup = total_steps - warmup
    decay_steps = post_warmup if cfg.decay_ratio is None else round(post_warmup * cfg.decay_ratio)
    fn = partial(
        lr_factor,
        warmup_steps=warmup,
        decay_steps=decay_steps,
        total_steps=total_steps,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    return LambdaLR(optimizer, fn)
