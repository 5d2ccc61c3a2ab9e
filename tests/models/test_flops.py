"""FLOPs per token under the two published conventions (models/flops.py): attention counted in full (torchtitan,
PaLM) or causal (Megatron-LM), checked on Llama 3 8B at 8k against the published numbers and against Megatron-LM's
own formula, written from its hidden-size ratios rather than from a parameter count."""

from __future__ import annotations

import dataclasses

import torch

from models import LLAMA3_FLAVORS, ModelArgs, Transformer, flops_per_token, num_params
from models.args import ffn_hidden_dim

SEQ = 8192


def _llama3_8b() -> tuple[ModelArgs, Transformer]:
    args = dataclasses.replace(LLAMA3_FLAVORS["8B"], vocab_size=128256, max_seq_len=SEQ)
    with torch.device("meta"):
        return args, Transformer(args)


def test_llama3_8b_at_8k_reproduces_the_published_counts() -> None:
    """57.9 GFLOP/token with attention in full, 51.5 causal: N is the parameters without the embedding table (a
    lookup) and with the output projection (a matmul), 7,504,924,672; with the table it would be 61.1 and 54.6."""
    args, model = _llama3_8b()
    n = num_params(model, exclude_embedding=True)
    assert n == 7_504_924_672
    full, causal = flops_per_token(args, model, SEQ), flops_per_token(args, model, SEQ, "causal")
    assert full == 6 * n + 12 * 32 * 32 * 128 * SEQ == 57_914_449_920
    assert causal == 6 * n + 6 * 32 * 32 * 128 * SEQ == 51_471_998_976
    assert (round(full / 1e9, 1), round(causal / 1e9, 1)) == (57.9, 51.5)
    assert round(full / causal - 1, 3) == 0.125  # "a 12% difference": full reads 12.5% more FLOPs, so a higher MFU
    assert round(6 * num_params(model) / 1e9 + 12.88, 1) == 61.1  # counting the table too: not the published figure


def _megatron_flops_per_token(args: ModelArgs, seq: int, causal: bool) -> float:
    """Megatron-LM's `num_floating_point_operations` (megatron/training/training.py) per token, for a dense GQA
    SwiGLU model with an untied output layer: 12 L h^2 [(1 + kv/heads + attention) q_ratio + ffn/h * 3/2 +
    V / (2 L h)], where attention is s/h in full, s/(2h) causal (current Megatron halves it). It counts no norm
    weights."""
    h, layers = args.dim, args.n_layers
    kv = args.n_kv_heads or args.n_heads
    attention = seq / h / (2 if causal else 1)
    mlp, logits = ffn_hidden_dim(args) / h * 3 / 2, args.vocab_size / (2 * layers * h)
    bracket = (1 + kv / args.n_heads + attention) + mlp + logits
    return 12 * layers * h * h * bracket


def test_both_conventions_agree_with_megatrons_formula() -> None:
    """kiln's counts equal Megatron-LM's formula up to the norm weights it leaves out (6 x 266,240 FLOPs)."""
    args, model = _llama3_8b()
    for attention, causal in (("full", False), ("causal", True)):
        ours = flops_per_token(args, model, SEQ, attention)
        norms = 6 * (2 * args.n_layers + 1) * args.dim
        assert ours - norms == _megatron_flops_per_token(args, SEQ, causal)
