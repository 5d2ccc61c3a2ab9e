"""Activation checkpointing per transformer block: none | full | selective (every Nth block, or per op).

Per-op selective AC (`selective_ac_option = "op"`) runs each block under `create_selective_checkpoint_contexts`:
outputs of the ops in SAC_SAVE_LIST are kept for backward, everything else is recomputed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.attention.varlen  # noqa: F401  registers torch.ops.torch_attn._varlen_attn, saved below
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from kiln_base.config import ActivationCheckpoint
from kiln_base.internals import checkpoint_wrapper, sac_op_output, tree_leaves

if TYPE_CHECKING:
    from models import Transformer

aten = torch.ops.aten

# The one save list for per-op SAC; tests import it. Expensive ops whose outputs are cheap to keep:
SAC_SAVE_LIST: frozenset[Any] = frozenset(
    {
        aten.mm.default,  # every second mm is recomputed (see _mm_policy); a float8 Linear's mm is still aten.mm
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        # Document masking (models/attention.py): flex attention's output and log-sum-exp (what its backward reads
        # besides q, k, v), and varlen attention's. Recomputing them would redo the whole attention forward in
        # backward, the most expensive op of a long sequence. SAC sees flex as its higher-order op.
        torch.ops.higher_order.flex_attention,
        torch.ops.torch_attn._varlen_attn.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,  # TP rowwise outputs: a collective to redo
        # Expert parallelism's dispatch and combine (the counts' and the rows' all-to-alls): recomputing them would
        # redo the exchange in backward, on every EP rank (torchtitan saves them too).
        torch.ops._c10d_functional.all_to_all_single.default,
        # The amax behind float8 scales: a full read of a big tensor that yields a tiny result, so save it.
        # aten.max is the tensorwise amax (max(abs(x))); aten.amax the rowwise one (amax(abs(x), dim)).
        # Saving amax outputs costs a few KiB per block and skips one read of every cast tensor in recompute
        # (measured in docs/parallelisms.md).
        aten.max.default,
        aten.amax.default,
        # NOT aten.abs: abs is pointwise and its output is as large as its input. Saving it keeps abs(W) of
        # every *unsharded* FSDP weight alive until backward (+23% peak memory on Llama3 8B, torchtitan PR #808).
    }
)


@dataclass
class SACStats:
    """What the per-op policy decided during forward: bytes kept per op, and ops left for the recompute."""

    kept_bytes: defaultdict[Any, int] = field(default_factory=lambda: defaultdict(int))
    recomputed: defaultdict[Any, int] = field(default_factory=lambda: defaultdict(int))
    recomputed_numel: defaultdict[Any, int] = field(default_factory=lambda: defaultdict(int))  # of first input

    def record(self, func: Any, policy: CheckpointPolicy, output: Any, args: tuple) -> None:
        if policy == CheckpointPolicy.MUST_SAVE:
            leaves = tree_leaves(output)
            self.kept_bytes[func] += sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor))
        else:
            self.recomputed[func] += 1
            if args and isinstance(args[0], torch.Tensor):
                self.recomputed_numel[func] += args[0].numel()


def _sac_policy(stats: SACStats | None, save_list: frozenset[Any]) -> Callable[..., CheckpointPolicy]:
    """A policy with its own mm counter: each forward (and its recompute) counts mms from zero.

    `save_list` is SAC_SAVE_LIST except in tests that prove a wrong list (with abs) is caught.
    """
    mm_count: defaultdict[str, int] = defaultdict(int)

    def decide(ctx: Any, func: Any) -> CheckpointPolicy:
        if func == aten.mm.default:
            mode = "recompute" if ctx.is_recompute else "forward"
            mm_count[mode] += 1
            # Recompute every second mm: halves the mm memory for about a sixth more matmul FLOPs.
            if mm_count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save_list else CheckpointPolicy.PREFER_RECOMPUTE

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision = decide(ctx, func)
        if stats is not None and not ctx.is_recompute:
            output = sac_op_output(ctx, func, args, kwargs) if decision == CheckpointPolicy.MUST_SAVE else None
            stats.record(func, decision, output, args)
        return decision

    return policy


def sac_context_fn(stats: SACStats | None = None, save_list: frozenset[Any] | None = None) -> tuple[Any, Any]:
    """context_fn for torch.utils.checkpoint: fresh forward/recompute contexts for one block call.

    `save_list` None means SAC_SAVE_LIST, looked up at call time (a default argument would bind it once).
    """
    return create_selective_checkpoint_contexts(_sac_policy(stats, SAC_SAVE_LIST if save_list is None else save_list))


def apply_ac(
    model: Transformer,
    cfg: ActivationCheckpoint,
    stats: SACStats | None = None,
    save_list: frozenset[Any] | None = None,
) -> None:
    """Wrap transformer blocks in model.layers so their activations are recomputed in backward.

    With per-op SAC, `stats` (if given) collects what the policy kept and left to recompute (tests, reports);
    `save_list` replaces SAC_SAVE_LIST (scripts/measure_sac.py's what-if flags, tests of a wrong list).
    """
    if cfg.mode == "none":
        return
    per_op = cfg.mode == "selective" and cfg.selective_ac_option == "op"
    every = 1 if cfg.mode == "full" or per_op else int(cfg.selective_ac_option)
    kwargs = {"context_fn": partial(sac_context_fn, stats, save_list)} if per_op else {}
    for i, (name, block) in enumerate(model.layers.named_children()):
        if i % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, **kwargs))
