"""Model hyper-parameters and the Llama 3 flavors (shapes identical to torchtitan's)."""

from dataclasses import dataclass


@dataclass
class ModelArgs:
    """Shape and initialisation settings of a Llama 3 style decoder."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None means plain multi-head attention (n_kv_heads == n_heads)
    vocab_size: int = -1  # set from the tokenizer at build time
    multiple_of: int = 256  # FFN hidden dim is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: bool = False  # Llama 3.1 long-context frequency scaling
    max_seq_len: int = 131072  # length of the precomputed RoPE table; the trainer sets it to its seq_len
    depth_init: bool = True  # output projections' init std shrinks with layer depth
    tie_word_embeddings: bool = False


def ffn_hidden_dim(args: ModelArgs) -> int:
    """SwiGLU hidden size: 2/3 of 4*dim (keeps params equal to a 4x GELU MLP), scaled, rounded up."""
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, multiple_of=256, rope_theta=500000),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
    ),
}
