"""Llama 3 and Qwen3 decoders as plain nn.Modules (Qwen3: per-head q/k norms, its own head_dim, MoE FFNs).

Module and attribute names match torchtitan exactly so that tensor-parallel plans, FQN filters
and checkpoints written for torchtitan apply unchanged. No distributed code lives here.

Blocks take (x, freqs_cis, attention_mask): the mask is None for causal attention, or the batch's document mask
(models/attention.py), built once per forward from the batch's document ids (or its token ids' BOS).
"""

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln_base.internals import unwrapped_fqn
from models.args import ModelArgs, ffn_hidden_dim
from models.attention import SUPPORTED, AttentionMask, attend, block_causal_mask, document_ids, varlen_mask
from models.init import ParamInit, trunc
from models.moe import MoE


def _apply_rope_scaling(freqs: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Llama 3.1 scaling: keep high frequencies, divide low ones by the factor, interpolate in between."""
    scale_factor, low_freq_factor = args.rope_scaling_factor, args.rope_low_freq_factor
    high_freq_factor, old_context_len = args.rope_high_freq_factor, args.rope_original_max_seq_len
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1 - smooth) * freqs / scale_factor + smooth * freqs
    out = torch.where(wavelen > low_freq_wavelen, freqs / scale_factor, mid)
    return torch.where(wavelen < high_freq_wavelen, freqs, out)


def precompute_freqs_cis(
    dim: int, end: int, theta: float = 10000.0, scaling: ModelArgs | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Complex RoPE table of shape (end, dim // 2): entry [t, i] = exp(1j * t * theta**(-2i/dim)).

    `scaling`: the ModelArgs whose llama3 rope-scaling settings to apply; None for none."""
    # float32 explicitly: a bf16 default dtype would wreck the angles at large positions.
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
    if scaling is not None:
        freqs = _apply_rope_scaling(freqs, scaling)
    t = torch.arange(end, device=device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k, each (bs, seqlen, heads, head_dim), by the first seqlen rows of freqs_cis (the rows of the
    tokens' positions: Transformer.forward selects them when the tokens are not positions 0..seqlen-1)."""
    seqlen = xq.shape[1]
    freqs_cis = freqs_cis[:seqlen].view(1, seqlen, 1, -1)
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(bs, seqlen, n_kv_heads, head_dim) -> (bs, seqlen, n_kv_heads * n_rep, head_dim)."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    # expand is a view; reshape copies once. Each kv head serves n_rep consecutive query heads.
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv_heads * n_rep, head_dim)
    )


# The attention proper, after the projections and RoPE: (q (bs, seqlen, n_heads, head_dim), k and v (bs, seqlen,
# n_kv_heads, head_dim), the batch's mask (None: causal)) -> (bs, seqlen, n_heads, head_dim).
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], torch.Tensor]


def attention_core(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Attention over a whole sequence held here (an AttentionCore): each kv head serves n_rep query heads."""
    n_rep = xq.shape[2] // xk.shape[2]
    keys, values = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
    # The kernels want (bs, heads, seqlen, head_dim).
    out = attend(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE: causal, or causal within each document (models/attention.py).

    `core` computes the attention itself (an AttentionCore): `attention_core` unless parallelisms/ replaces it,
    e.g. with context parallelism's, which sees only this rank's part of each sequence and exchanges keys and
    values with the other ranks.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.resolved_head_dim()
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        # Qwen3: each q and k head RMS-normalised over head_dim before RoPE (None: Llama 3, no norm).
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.core: AttentionCore = attention_core

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """Input projections std 0.02; the residual-facing wo uses the depth-scaled init_std; q/k norms ones."""
        out = {
            "wq.weight": trunc(0.02),
            "wk.weight": trunc(0.02),
            "wv.weight": trunc(0.02),
            "wo.weight": trunc(init_std),
        }
        if self.q_norm is not None:
            out |= {"q_norm.weight": ParamInit("ones"), "k_norm.weight": ParamInit("ones")}
        return out

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
        """x: (bs, seqlen, dim) -> (bs, seqlen, dim); `mask` None is causal attention."""
        bs, seqlen, _ = x.shape
        # -1 for the head count: under tensor parallelism each rank holds only its local heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        out = self.core(xq, xk, xv, mask)
        return self.wo(out.contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    @staticmethod
    def param_inits(init_std: float) -> dict[str, ParamInit]:
        """w1 std 0.02; w2 and w3 use init_std (torchtitan's choice, w3 included)."""
        return {"w1.weight": trunc(0.02), "w2.weight": trunc(init_std), "w3.weight": trunc(init_std)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) -> (..., dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + ffn(norm(h)). The FFN is `feed_forward` (a SwiGLU) or,
    with args.moe_num_experts > 0, `moe` (models/moe.py); the other is None."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward: FeedForward | None = None
        self.moe: MoE | None = None
        if args.moe:
            shared = args.moe_shared_hidden_dim
            self.moe = MoE(args, FeedForward(args.dim, shared) if shared else None)
        else:
            self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args))
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Deeper layers' residual outputs start smaller so the residual stream variance stays bounded.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def param_inits(self) -> dict[str, ParamInit]:
        """Each parameter's init, by its name in the block."""
        std = self.weight_init_std
        out = {f"attention.{k}": v for k, v in self.attention.param_inits(std).items()}
        if self.moe is not None:
            out |= {f"moe.{k}": v for k, v in MoE.param_inits(std).items()}
            if self.moe.shared_experts is not None:
                out |= {f"moe.shared_experts.{k}": v for k, v in FeedForward.param_inits(std).items()}
        else:
            out |= {f"feed_forward.{k}": v for k, v in FeedForward.param_inits(std).items()}
        return out | {"attention_norm.weight": ParamInit("ones"), "ffn_norm.weight": ParamInit("ones")}

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (bs, seqlen, dim) -> (bs, seqlen, dim); an MoE block also returns its routing statistics
        (models/moe.py ROUTER_STATS), as an output so that compile and activation checkpointing capture them."""
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        if self.moe is not None:
            out, stats = self.moe(self.ffn_norm(h))
            return h + out, stats
        assert self.feed_forward is not None
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3 or Qwen3 decoder (by its ModelArgs). tok_embeddings, norm and output may be set to None by pipeline
    splitting."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("ModelArgs.vocab_size must be set (from the tokenizer) before building")
        if args.head_dim is None and args.dim % args.n_heads != 0:
            raise ValueError(f"dim {args.dim} is not divisible by n_heads {args.n_heads}")
        if args.head_dim is not None and args.head_dim % 2:
            raise ValueError(f"head_dim {args.head_dim} is odd: RoPE rotates pairs")
        if args.n_kv_heads is not None and args.n_heads % args.n_kv_heads != 0:
            raise ValueError(f"n_heads {args.n_heads} is not divisible by n_kv_heads {args.n_kv_heads}")
        if (args.attn_type, args.attn_mask_type) not in SUPPORTED:
            raise ValueError(f"attention {args.attn_type} with mask {args.attn_mask_type}: not one of {SUPPORTED}")
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict keyed by layer id (not ModuleList) so FQNs survive pipeline stages dropping layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from args, so it is neither checkpointed nor sharded.
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        # The last forward's routing statistics, one [2, E] tensor per MoE block held here, in layer order
        # (models/moe.py load_balance_loss); empty for a dense model.
        self.router_stats: list[torch.Tensor] = []

    def _precompute_freqs_cis(self, device: torch.device | None = None) -> torch.Tensor:
        args = self.model_args
        return precompute_freqs_cis(
            args.resolved_head_dim(), args.max_seq_len, args.rope_theta, args if args.rope_scaling else None, device
        )

    def param_inits(self) -> dict[str, ParamInit]:
        """Each parameter's init, by FQN (as named_parameters names it without AC/compile wrappers; a tied output
        shares the embedding's entry). A pipeline stage's model lists only what it holds."""
        std = self.model_args.dim**-0.5
        out: dict[str, ParamInit] = {}
        if self.tok_embeddings is not None:
            # A tied table gets the output init: std 1.0 would make the initial logits huge.
            tied = self.model_args.tie_word_embeddings
            out["tok_embeddings.weight"] = ParamInit("trunc_normal", std, 3.0) if tied else ParamInit("normal")
        for name, layer in self.layers.items():
            if layer is not None:  # a block, or its AC/compile wrapper (which forwards attributes)
                block = cast(TransformerBlock, layer)
                out |= {f"layers.{name}.{k}": v for k, v in block.param_inits().items()}
        if self.norm is not None:
            out["norm.weight"] = ParamInit("ones")
        if self.output is not None:
            out["output.weight"] = ParamInit("trunc_normal", std, 3.0)
        return out

    def init_buffers(self, device: torch.device) -> None:
        """Recompute freqs_cis on `device` (a meta-built model holds no values) and re-tie a tied output, which
        to_empty() unties by allocating each module's parameters separately; zero the MoE buffers."""
        self.freqs_cis = self._precompute_freqs_cis(torch.device(device))
        for m in self.modules():
            if isinstance(m, MoE):
                m.init_buffers()
        emb, out = self.tok_embeddings, self.output
        if self.model_args.tie_word_embeddings and emb is not None and out is not None:
            out.weight = emb.weight

    def init_weights(self, buffer_device: torch.device | None = None, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter in place from one random stream (`generator`, else torch's default), in
        parameter order, and the buffers. Call after ``to_empty``. A parallelized model is initialised by
        parallelisms/seeded_init.py instead, so that its values do not depend on the layout."""
        if buffer_device is None:
            ref = self.tok_embeddings.weight if self.tok_embeddings is not None else self.freqs_cis
            buffer_device = ref.device
        self.init_buffers(torch.device(buffer_device))
        inits = self.param_inits()
        for name, param in self.named_parameters():
            inits[unwrapped_fqn(name)].fill_(param, generator)

    def attention_mask(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> AttentionMask:
        """The attention mask of a batch of token ids (bs, seqlen): None for causal attention, else the documents'
        mask: of `doc_ids` (bs, seqlen), each token's document, where the data records its documents
        (trainer/data/token_files.py), else a document starting at each bos_id. Transformer.forward calls it."""
        args = self.model_args
        if args.attn_mask_type == "causal":
            return None
        if doc_ids is None:
            if args.bos_id is None:
                raise ValueError("attn_mask_type block_causal needs ModelArgs.bos_id (the tokenizer's BOS id)")
            doc_ids = document_ids(tokens, args.bos_id)
        if args.attn_type == "varlen":
            return varlen_mask(doc_ids)
        return block_causal_mask(doc_ids)

    def forward(
        self,
        tokens: torch.Tensor,
        attention_mask: AttentionMask = None,
        token_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (bs, seqlen) int64 -> logits (bs, seqlen, vocab); passes hidden states through
        whichever of tok_embeddings / norm / output a pipeline stage has removed.

        `attention_mask`: the batch's mask (`attention_mask(tokens, doc_ids)`), built here when not given.
        `doc_ids` (bs, seqlen) int32: each token's document, where the batch's data records its documents (a
        Megatron .idx, EOS in a numpy token file); without them a document starts at each BOS token id. A pipeline
        stage without tok_embeddings receives hidden states in `tokens`: under a document mask it is given the
        batch's doc_ids, or its token ids in `token_ids` (every stage of a pipeline sees the batch;
        parallelisms/pipeline.py), and builds the same mask from them.
        `positions` (seqlen,) int64: where in the sequence each token sits, when the tokens are not positions
        0..seqlen-1 (a context-parallel rank holds chunks from across the sequence); RoPE rotates by them. A
        pipeline hands them as (bs, seqlen) with equal rows (its schedule splits keyword inputs by rows)."""
        if attention_mask is None and self.model_args.attn_mask_type != "causal":
            if doc_ids is None and token_ids is None and self.tok_embeddings is None:
                raise ValueError("a stage fed hidden states needs the batch's doc_ids or token_ids (document masking)")
            # Eager, once per forward, outside the (compiled) blocks: every block reuses it.
            attention_mask = self.attention_mask(token_ids if token_ids is not None else tokens, doc_ids)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is not None and positions.dim() == 2:
            positions = positions[0]
        freqs_cis = self.freqs_cis if positions is None else self.freqs_cis[positions]
        stats = []
        for layer in self.layers.values():
            out = layer(h, freqs_cis, attention_mask)
            if isinstance(out, tuple):  # an MoE block
                h, routed = out
                stats.append(routed)
            else:
                h = out
        self.router_stats = stats  # eager, outside the compiled and checkpointed blocks
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
