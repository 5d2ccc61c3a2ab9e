"""Parameter counts and per-token training FLOPs (torchtitan / PaLM-appendix convention)."""

from torch import nn

from models.args import ModelArgs


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


def flops_per_token(args: ModelArgs, model: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token: ``6 * N + 12 * L * H * Q * T``.

    - ``6 * N``: forward (2 FLOPs per multiply-add) plus backward (twice the forward) for every
      matmul weight; N excludes the token embedding table (a lookup, not a matmul). With tied
      embeddings the table is added back, since it is still the output projection's matmul weight.
    - ``12 * L * H * Q * T``: the two attention matmuls (q @ k^T and scores @ v), each 2*H*Q*T
      FLOPs per token per layer in forward, times 3 for forward + backward. L layers, H query
      heads, Q head dim, T sequence length. The causal mask is NOT halved (torchtitan convention),
      so this overstates the work flash attention does; MFU numbers are comparable with torchtitan's.
    Norms, activations, RoPE and softmax are ignored.
    """
    n = num_params(model, exclude_embedding=True)
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if emb is not None and out is not None and out.weight is emb.weight:
        n += emb.weight.numel()
    head_dim = args.dim // args.n_heads
    return 6 * n + 12 * args.n_layers * args.n_heads * head_dim * seq_len
