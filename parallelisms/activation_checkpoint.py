"""Activation checkpointing per transformer block: none | full | selective (every Nth block)."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from trainer.config import ActivationCheckpoint


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Wrap transformer blocks in model.layers so their activations are recomputed in backward."""
    if cfg.mode == "none":
        return
    if cfg.mode == "selective" and cfg.selective_ac_option == "op":
        raise NotImplementedError("per-op selective activation checkpointing")
    every = 1 if cfg.mode == "full" else int(cfg.selective_ac_option)
    for i, (name, block) in enumerate(model.layers.named_children()):
        if i % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
