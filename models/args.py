"""Model hyper-parameters: the Llama 3 / 3.1 / 3.2 flavors (Meta's published shapes and rope settings) and the
Qwen3 flavors, dense and mixture-of-experts (Qwen's published config.json shapes).

One ModelArgs describes both families: Qwen3 is the Llama 3 block with per-head q/k RMSNorm (`qk_norm`), its own
`head_dim`, an explicit FFN width (`ffn_dim`) and, with `moe_num_experts` > 0, a mixture-of-experts FFN
(models/moe.py). Every new field's default is Llama 3's behaviour, so a Llama 3 ModelArgs builds the same model."""

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kiln_base.config import (
    ATTENTION_VARIANTS,
    BASE_FLAVORS,
    ModelShape,
    attention_flavor,
    check_model_fields,
)
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
    # Qwen3 (QWEN3_FLAVORS). Defaults: Llama 3.
    head_dim: int | None = None  # per-head width; None: dim // n_heads. q/k/v project dim -> heads * head_dim
    qk_norm: bool = False  # RMSNorm over head_dim on each q and k head, before RoPE
    ffn_dim: int | None = None  # the dense SwiGLU hidden size; None: from multiple_of and ffn_dim_multiplier
    # Mixture of experts (models/moe.py): 0 experts is a dense FFN in every block; > 0 an MoE FFN in every block.
    moe_num_experts: int = 0
    moe_top_k: int = 1  # experts per token
    moe_hidden_dim: int = 0  # each routed expert's SwiGLU hidden size (Hugging Face's moe_intermediate_size)
    moe_shared_hidden_dim: int = 0  # the shared experts' SwiGLU hidden size (all shared experts as one); 0: none
    moe_score_func: str = "softmax"  # softmax | sigmoid: the router's scores
    moe_route_norm: bool = False  # renormalise the top-k scores to sum 1 (Hugging Face's norm_topk_prob)
    moe_route_scale: float = 1.0  # the routing weights are multiplied by this
    moe_grouped_mm: bool = True  # torch._grouped_mm where it runs (models/moe.py), else a loop over the experts

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
            experts=self.moe_num_experts,
        )

    def check_fields(self, where: str) -> None:
        """Every field of the right type and in range (kiln_base.config.check_model_fields), ConfigError if not."""
        check_model_fields({f.name: getattr(self, f.name) for f in fields(self)}, where)

    @property
    def moe(self) -> bool:
        return self.moe_num_experts > 0

    def resolved_head_dim(self) -> int:
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim


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
    """The dense SwiGLU hidden size: `ffn_dim` when set (Qwen3), else Llama 3's rule: 2/3 of 4*dim (keeps params
    equal to a 4x GELU MLP), scaled, rounded up."""
    if args.ffn_dim is not None:
        return args.ffn_dim
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


# Fields that change how a model attends, not its weights: the same weights train and run under either mask.
ATTENTION_FIELDS = ("attn_type", "attn_mask_type", "bos_id")


# Fields that choose how the same weights are computed, not what they compute (a kernel).
COMPUTE_FIELDS = ("moe_grouped_mm",)
_MOE_FIELDS = tuple(f.name for f in fields(ModelArgs) if f.name.startswith("moe_") and f.name not in COMPUTE_FIELDS)


def model_signature(args: ModelArgs) -> dict[str, Any]:
    """What makes two ModelArgs the same trained model: every field but the RoPE table length, the init rule,
    the attention (ATTENTION_FIELDS: weights trained with a causal mask load into a document-masked flavor and back)
    and the kernel choices (COMPUTE_FIELDS); the FFN width and head width instead of the numbers that produce them;
    the scaling settings only when scaling is on; the MoE settings only for an MoE (a dense model's are unused)."""
    skip = ("max_seq_len", "depth_init", *ATTENTION_FIELDS, *COMPUTE_FIELDS)
    out = {f.name: getattr(args, f.name) for f in fields(args) if f.name not in skip}
    out["n_kv_heads"] = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
    out["ffn_hidden_dim"] = ffn_hidden_dim(args)
    out["head_dim"] = args.resolved_head_dim()
    for k in ("multiple_of", "ffn_dim_multiplier", "ffn_dim"):
        del out[k]
    if not args.moe:
        for k in _MOE_FIELDS:
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

# Qwen3 (torchtitan's flavor names), the shapes of Qwen's config.json files on the Hugging Face hub (Qwen/Qwen3-*):
# head_dim 128, rope theta 1e6 (no scaling), RMSNorm eps 1e-6, a 151936-token vocabulary, a 40960-token context;
# tied embeddings up to 4B. The MoE flavors: 128 experts, 8 per token, renormalised top-k softmax scores
# (norm_topk_prob), an MoE FFN in every block (decoder_sparse_step 1, no mlp_only_layers), no shared experts.
_QWEN3: dict[str, Any] = {
    "vocab_size": 151936,
    "head_dim": 128,
    "qk_norm": True,
    "norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "context_len": 40960,
    "max_seq_len": 40960,
}
_QWEN3_MOE: dict[str, Any] = {**_QWEN3, "moe_num_experts": 128, "moe_top_k": 8, "moe_route_norm": True}


def _qwen3(dim: int, layers: int, heads: int, kv: int, ffn: int, **kw: Any) -> ModelArgs:
    return ModelArgs(
        **{**_QWEN3, **kw, "dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv}, ffn_dim=ffn
    )


QWEN3_FLAVORS: dict[str, ModelArgs] = {
    # Small enough for a CPU training step in a fraction of a second; the vocabulary comes from the tokenizer.
    "debugmodel": _qwen3(256, 4, 8, 4, 768, head_dim=32, vocab_size=-1, max_seq_len=2048),
    "debugmodel_moe": _qwen3(
        256,
        4,
        8,
        4,
        768,
        head_dim=32,
        vocab_size=-1,
        max_seq_len=2048,
        moe_num_experts=8,
        moe_top_k=2,
        moe_hidden_dim=128,
        moe_route_norm=True,
    ),
    "0.6B": _qwen3(1024, 28, 16, 8, 3072, tie_word_embeddings=True),
    "1.7B": _qwen3(2048, 28, 16, 8, 6144, tie_word_embeddings=True),
    "4B": _qwen3(2560, 36, 32, 8, 9728, tie_word_embeddings=True),
    "8B": _qwen3(4096, 36, 32, 8, 12288),
    "14B": _qwen3(5120, 40, 40, 8, 17408),
    "32B": _qwen3(5120, 64, 64, 8, 25600),
    # intermediate_size (ffn_dim) is unused by an all-MoE model but kept: config.json carries it.
    "30B-A3B": ModelArgs(
        **{**_QWEN3_MOE, "dim": 2048, "n_layers": 48, "n_heads": 32, "n_kv_heads": 4},
        ffn_dim=6144,
        moe_hidden_dim=768,
    ),
    "235B-A22B": ModelArgs(
        **{**_QWEN3_MOE, "dim": 4096, "n_layers": 94, "n_heads": 64, "n_kv_heads": 4},
        ffn_dim=12288,
        moe_hidden_dim=1536,
    ),
}
