"""Model hyper-parameters and the Llama 3 / 3.1 / 3.2 flavors (Meta's published shapes and rope settings)."""

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kiln_base.config import ATTENTION_VARIANTS, BASE_FLAVORS, ModelShape, attention_flavor, check_model_fields
from kiln_base.errors import ConfigError


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
    rope_scaling: bool = False  # Llama 3.1 long-context frequency scaling ("llama3" rope type), settings below
    rope_scaling_factor: float = 8.0  # low frequencies are divided by this (8 in Llama 3.1, 32 in Llama 3.2)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # the context the unscaled frequencies were trained for
    max_seq_len: int = 131072  # length of the precomputed RoPE table; the trainer sets it to its seq_len
    context_len: int = 8192  # the context the model is made for (Hugging Face's max_position_embeddings)
    depth_init: bool = True  # output projections' init std shrinks with layer depth
    tie_word_embeddings: bool = False
    # Attention (models/attention.py): the kernel, and the mask. block_causal: causal within each document of the
    # packed sequence: documents from the batch's doc_ids where its data records them (token files), else a document
    # starting at each bos_id token (kiln's text loader writes BOS ... EOS per document).
    attn_type: str = "sdpa"  # sdpa | flex | varlen
    attn_mask_type: str = "causal"  # causal | block_causal
    bos_id: int | None = None  # set from the tokenizer at build time (like vocab_size); block_causal on text needs it

    def shape(self) -> ModelShape:
        """What the config checks need to know of this shape (kiln_base/config/checks.py)."""
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        return ModelShape(
            self.dim,
            self.n_layers,
            self.n_heads,
            kv,
            ffn_hidden_dim(self),
            self.vocab_size,
            attn_type=self.attn_type,
            tied=self.tie_word_embeddings,
        )

    def check_fields(self, where: str) -> None:
        """Every field of the right type and in range (kiln_base.config.check_model_fields), ConfigError if not."""
        check_model_fields({f.name: getattr(self, f.name) for f in fields(self)}, where)


def stored_model_args(saved: Any, where: str) -> ModelArgs:
    """ModelArgs from a stored mapping (a kiln.json's model_args), each field checked for type and range before
    the model is computed with (`where` names the file in the ConfigError)."""
    if not isinstance(saved, Mapping):
        raise ConfigError(f"{where} stores no model_args (a JSON object of the model's shape)")
    known = {f.name for f in fields(ModelArgs)}
    unknown = sorted(str(k) for k in set(saved) - known)
    if unknown:
        raise ConfigError(f"{where} has model_args.{unknown[0]}, unknown to this kiln")
    check_model_fields(saved, where)
    return ModelArgs(**saved)


def ffn_hidden_dim(args: ModelArgs) -> int:
    """SwiGLU hidden size: 2/3 of 4*dim (keeps params equal to a 4x GELU MLP), scaled, rounded up."""
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


# Fields that change how a model attends, not its weights: the same weights train and run under either mask.
ATTENTION_FIELDS = ("attn_type", "attn_mask_type", "bos_id")


def model_signature(args: ModelArgs) -> dict[str, Any]:
    """What makes two ModelArgs the same trained model: every field but the RoPE table length, the init rule and
    the attention (ATTENTION_FIELDS: weights trained with a causal mask load into a document-masked flavor and back),
    the FFN width instead of the two numbers that produce it, and the scaling settings only when scaling is on."""
    skip = ("max_seq_len", "depth_init", *ATTENTION_FIELDS)
    out = {f.name: getattr(args, f.name) for f in fields(args) if f.name not in skip}
    out["n_kv_heads"] = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
    out["ffn_hidden_dim"] = ffn_hidden_dim(args)
    for k in ("multiple_of", "ffn_dim_multiplier"):
        del out[k]
    if not args.rope_scaling:
        for k in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"):
            del out[k]
    return out


def first_difference(a: ModelArgs, b: ModelArgs) -> tuple[str, Any, Any] | None:
    """The first field (of model_signature) where a and b differ, with a's and b's value; None when equal."""
    sa, sb = model_signature(a), model_signature(b)
    for k in [*sa, *(k for k in sb if k not in sa)]:  # in field order: the message names the first
        if sa.get(k) != sb.get(k):
            return k, sa.get(k), sb.get(k)
    return None


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

# Llama 3.1: the 3.0 shapes (405B is 3.1 only) with llama3 rope scaling (factor 8) and a 131072-token context.
_LLAMA31: dict[str, Any] = {"rope_scaling": True, "rope_scaling_factor": 8.0, "context_len": 131072}
LLAMA3_FLAVORS["3.1-8B"] = replace(LLAMA3_FLAVORS["8B"], **_LLAMA31)
LLAMA3_FLAVORS["3.1-70B"] = replace(LLAMA3_FLAVORS["70B"], **_LLAMA31)
LLAMA3_FLAVORS["3.1-405B"] = replace(LLAMA3_FLAVORS["405B"], **_LLAMA31)
# Llama 3.2 text models: tied embeddings, rope scaling factor 32, 131072-token context (Meta's params.json).
_LLAMA32: dict[str, Any] = {**_LLAMA31, "rope_scaling_factor": 32.0, "tie_word_embeddings": True, "rope_theta": 500000}
LLAMA3_FLAVORS["3.2-1B"] = ModelArgs(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256, **_LLAMA32
)
LLAMA3_FLAVORS["3.2-3B"] = ModelArgs(
    dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256, **_LLAMA32
)
# Document masking (torchtitan's flavors): each flavor with flex or varlen attention and the block-causal mask.
LLAMA3_FLAVORS |= {
    attention_flavor(base, attn): replace(LLAMA3_FLAVORS[base], attn_type=attn, attn_mask_type="block_causal")
    for attn in ATTENTION_VARIANTS
    for base in BASE_FLAVORS
}
