"""Parameter counts and per-token training FLOPs, under the two conventions published MFUs use."""

from torch import nn

from models.args import ModelArgs
from models.moe import MoE

# How the attention matmuls (q @ k^T and scores @ v) are counted (metrics.attention_flops):
# - full: every query meets every key of the sequence, 12·L·H·Q·T per token: torchtitan's and PaLM's convention;
# - causal: only the keys at or before the query, half of them on average, 6·L·H·Q·T: Megatron-LM's. It is the work
#   a causal kernel (flash attention) does; full counts the masked half too, so it reads higher.
CONVENTIONS = {
    "full": "attention counted in full, as torchtitan and PaLM do",
    "causal": "attention counted causal (half), as Megatron-LM does",
}


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters; tied/shared tensors count once. Works on meta tensors and DTensors
    (``numel`` is the global size).

    With ``exclude_embedding`` the ``tok_embeddings`` table is left out: a lookup costs no FLOPs.
    """
    total = sum(p.numel() for p in model.parameters())
    emb = getattr(model, "tok_embeddings", None)
    if exclude_embedding and emb is not None:
        total -= emb.weight.numel()
    return total


def active_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Parameters one token computes with: num_params less, in each MoE layer, the routed experts it skips (it
    meets top_k of the E experts: (E - k) / E of their weights are idle). The router, the shared experts and the
    dense parts all count. Equal to num_params for a dense model."""
    total = num_params(model, exclude_embedding)
    for m in model.modules():
        if isinstance(m, MoE):
            n = m.experts.num_experts
            total -= sum(p.numel() for p in m.experts.parameters()) // n * (n - m.router.top_k)
    return total


def flops_per_token(args: ModelArgs, model: nn.Module, seq_len: int, attention: str = "full") -> int:
    """Training FLOPs per token: ``6 * N + 12 * L * H * Q * T`` (attention "full") or ``6 * N + 6 * L * H * Q * T``
    ("causal").

    - ``6 * N``: forward (2 FLOPs per multiply-add) plus backward (twice the forward) for every matmul weight a
      token computes with (active_params: of an MoE layer's routed experts, only the top k); N excludes the token
      embedding table (a lookup, not a matmul) and includes the output projection. With tied
      embeddings the table is added back, since it is still the output projection's matmul weight.
    - attention: the two attention matmuls (q @ k^T and scores @ v), each 2*H*Q*T FLOPs per token per layer in
      forward if every query meets all T keys, times 3 for forward + backward: 12 * L * H * Q * T. L layers, H query
      heads, Q head dim, T sequence length. "causal" counts half of it: a causal query meets T/2 keys on average
      ((T+1)/2 with the diagonal; the published formulas use T/2).
    Norms, activations, RoPE and softmax are ignored. Llama 3 8B at T = 8192: N = 7,504,924,672, 6N = 45.03
    GFLOP, attention 12.88 (full) or 6.44 (causal): 57.91 and 51.47 GFLOP per token (docs/metrics.md).
    """
    assert attention in CONVENTIONS, attention
    n = active_params(model, exclude_embedding=True)
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if emb is not None and out is not None and out.weight is emb.weight:
        n += emb.weight.numel()
    head_dim = args.resolved_head_dim()
    full = 12 * args.n_layers * args.n_heads * head_dim * seq_len
    return 6 * n + (full if attention == "full" else full // 2)
