"""Test helpers: the debug model (tiny seq) with torchao float8 under kiln's per-op SAC policy.

The policy and SAC_SAVE_LIST are parallelisms/activation_checkpoint.py's own; tests only pass a different
list to prove that a wrong one (with abs) is caught.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln_base.internals import checkpoint_wrapper
from models import LLAMA3_FLAVORS, Transformer
from parallelisms.activation_checkpoint import SAC_SAVE_LIST, sac_context_fn

aten = torch.ops.aten
VOCAB, SEQ, LAYERS = 2256, 64, 2  # debugmodel widths; 2 blocks are enough to see per-block patterns

SAVE_LIST: frozenset = SAC_SAVE_LIST


def debug_model(
    recipe: str | None = None, save_list: frozenset | None = SAVE_LIST, device: str | torch.device = "cpu"
) -> Transformer:
    """Debug-shaped Llama3 (seq 64, 2 blocks), float8-converted with `recipe` (output layer kept high precision),
    every block under per-op SAC with `save_list` (None = no AC)."""
    torch.manual_seed(0)
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=VOCAB, max_seq_len=SEQ, n_layers=LAYERS)
    with torch.device(device):
        model = Transformer(args)
        model.init_weights()
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from float8.converter import prepare_cpu_float8

        prepare_cpu_float8()  # torch's CPU float8 matmul, as kiln's build uses

        config = Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn != "output")
    if save_list is not None:
        for name, block in model.layers.named_children():
            context_fn = partial(sac_context_fn, None, save_list)
            wrapped = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
            model.layers.register_module(name, wrapped)
    return model


def batch(n: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def loss_fn(model: nn.Module, tokens: torch.Tensor, autocast: bool = True) -> Callable[[], torch.Tensor]:
    """Forward closure like the trainer's: bf16 autocast over fp32 weights (single device), fp32 loss."""

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())

    return forward
