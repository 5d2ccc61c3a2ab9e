"""The training loss: token-level cross-entropy in fp32 over the whole vocabulary.

Eager, `F.cross_entropy(logits.float(), labels)` materialises (tokens x vocab) fp32 tensors: the upcast copy of
bf16 logits, the log-softmax output (kept for backward), and in backward its gradient and the logits' gradient.
With Llama3's 128,256-token vocabulary at seq 8192 each one is 4.2 GB. Compiled (as torchtitan does with
`compile.components = ["model", "loss"]`), inductor fuses upcast, log-softmax and NLL into one pass over the
logits and keeps only the logits and a per-token log-sum-exp for backward. Measured in docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, normalizer: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of (batch, seq, vocab) logits against (batch, seq) labels, computed in fp32: the mean over the
    tokens, or their sum divided by `normalizer` (context parallelism: the whole sequences' token count over the
    context-parallel degree, so the ranks' mean is the mean over the whole sequences)."""
    if normalizer is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / normalizer


def build_loss_fn(compile: bool) -> LossFn:
    """The loss, compiled when the model is (training.compile). Vocab-sharded DTensor logits (TP loss parallel)
    stay eager: the caller passes compile=False for them."""
    return torch.compile(cross_entropy_loss) if compile else cross_entropy_loss


def row_log_likelihood(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Downstream evaluation: per row, the summed log-probability (fp32) of the labels that are not -100 (the
    positions that predict a scored continuation), (batch,). Vocab-sharded DTensor logits (TP loss parallel, inside
    `loss_parallel()`) give a DTensor per token, made whole here."""
    nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")  # 0 where ignored
    if hasattr(nll, "full_tensor"):
        nll = nll.full_tensor()
    return -nll.view(labels.shape).sum(-1)
