"""Test helpers: the debug model (tiny seq) with torchao float8 and a per-op SAC policy built from a save list.

The per-op SAC here mirrors torchtitan's policy (save the ops in the list, but only every second mm) so the
memory tests can run before parallelisms/ lands its own; at merge, point them at its SAC_SAVE_LIST.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from models import LLAMA3_FLAVORS, Transformer

aten = torch.ops.aten
VOCAB, SEQ, LAYERS = 2256, 64, 2  # debugmodel widths; 2 blocks are enough to see per-block patterns

# torchtitan's list, plus the CPU flash variant (what SDPA dispatches to here) and aten.amax: torchao's
# rowwise recipe takes its per-row amax with aten.amax, tensorwise with aten.max.
SAVE_LIST: tuple = (
    aten.mm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    aten.max.default,
    aten.amax.default,
)


def sac_context_fn(save_list: tuple) -> Callable:
    """Per-op SAC context factory: MUST_SAVE ops in `save_list`, except every second mm (recomputed)."""

    def context_fn():  # noqa: ANN202
        mm_count = [0]  # per block call: the policy runs in forward only (recompute replays the cache)

        def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001, ANN002, ANN003
            if func == aten.mm.default:
                mm_count[0] += 1
                if mm_count[0] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in save_list else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def debug_model(
    recipe: str | None = None, save_list: tuple | None = SAVE_LIST, device: str | torch.device = "cpu"
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

        config = Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn != "output")
    if save_list is not None:
        for name, block in model.layers.named_children():
            wrapped = checkpoint_wrapper(block, context_fn=sac_context_fn(save_list), preserve_rng_state=False)
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
