"""Activation checkpointing per transformer block: none | full | selective (every Nth block, or per op).

Per-op selective AC (`selective_ac_option = "op"`) runs each block under `create_selective_checkpoint_contexts`:
outputs of the ops in SAC_SAVE_LIST are kept for backward, everything else is recomputed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainer.config import ActivationCheckpoint

aten = torch.ops.aten

# The one save list for per-op SAC; tests import it. Expensive ops whose outputs are cheap to keep:
SAC_SAVE_LIST: frozenset[Any] = frozenset(
    {
        aten.mm.default,  # every second mm is recomputed (see _mm_policy); a float8 Linear's mm is still aten.mm
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,  # TP rowwise outputs: a collective to redo
        # The amax behind float8 scales: a full read of a big tensor that yields a tiny result, so save it.
        # aten.max is the tensorwise amax (max(abs(x))); aten.amax the rowwise one (amax(abs(x), dim)).
        # Saving amax outputs costs a few KiB per block and skips one read of every cast tensor in recompute
        # (measured in docs/parallelisms.md).
        aten.max.default,
        aten.amax.default,
        # NOT aten.abs: abs is pointwise and its output is as large as its input. Saving it keeps abs(W) of
        # every *unsharded* FSDP weight alive until backward (+23% peak memory on Llama3 8B, seed 001).
    }
)


def _sac_policy() -> Callable[..., CheckpointPolicy]:
    """A policy with its own mm counter: each forward (and its recompute) counts mms from zero."""
    mm_count: defaultdict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func == aten.mm.default:
            mode = "recompute" if ctx.is_recompute else "forward"
            mm_count[mode] += 1
            # Recompute every second mm: halves the mm memory for about a sixth more matmul FLOPs.
            if mm_count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAC_SAVE_LIST else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def sac_context_fn() -> tuple[Any, Any]:
    """context_fn for torch.utils.checkpoint: fresh forward/recompute contexts for one block call."""
    return create_selective_checkpoint_contexts(_sac_policy())


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Wrap transformer blocks in model.layers so their activations are recomputed in backward."""
    if cfg.mode == "none":
        return
    per_op = cfg.mode == "selective" and cfg.selective_ac_option == "op"
    every = 1 if cfg.mode == "full" or per_op else int(cfg.selective_ac_option)
    kwargs = {"context_fn": sac_context_fn} if per_op else {}
    for i, (name, block) in enumerate(model.layers.named_children()):
        if i % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, **kwargs))

