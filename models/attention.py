"""Attention masks and kernels: causal attention, or block-causal document masking of packed sequences.

kiln packs documents back to back and cuts the stream into windows. Under the `causal` mask every token attends to
every earlier token of the window, the previous, unrelated documents included. `block_causal` (Llama 3's
pretraining mask; torchtitan's `*_flex` and `*_varlen` flavors) stops attention at document boundaries: a token
attends to the earlier tokens of its own document only.

Where the boundaries come from is the data's fact, not the model's: a batch carries each token's document id
(`doc_ids`, (bs, seq) int32, the number of documents begun in the row up to and including the token) where the data
records its documents (trainer/data/token_files.py: a Megatron `.idx`'s document index; an EOS token in a flat
numpy file, which has no index). Without them (text, trainer/data/text.py, which encodes each document BOS ... EOS)
a document starts at each BOS token (`document_ids`). Either way the tokens of a row before its first boundary (the
tail of a document begun in an earlier window) form one document.

Positions are not reset at a boundary. RoPE makes a query-key score depend on the two tokens' distance only, so a
document packed after others gets the logits it gets alone (tests/models/test_attention.py).

How a mask reaches attention: `Transformer.forward` builds it once per batch from the document ids (given, or
counted from the token ids' BOS), eagerly, before the blocks, and hands it to every block: `block(x, freqs_cis,
mask)`. Its tensors change value every batch but not shape, so a compiled block takes each new mask without
recompiling (dynamo guards on shapes, not values). A pipeline stage that receives hidden states instead of tokens
must be handed what the mask is built from (the batch's doc_ids, or its token ids); context parallelism must give
each rank the query rows of its sequence shard.

| attn_type | attn_mask_type | kernel |
| --- | --- | --- |
| sdpa | causal | `F.scaled_dot_product_attention(is_causal=True)` |
| flex | block_causal | `flex_attention` with a `BlockMask` (fused by `training.compile`); on a CPU, SDPA (below) |
| varlen | block_causal | `varlen_attn` over the batch's documents (flash attention's varlen kernel; CUDA only) |

On a CPU, torch's flex_attention has no backward (torch 2.13 refuses a CPU input that requires grad, eager and
compiled; inductor's flex backward is Triton only). There the block mask is evaluated densely inside the attention
(`dense_mask`: the mask's own mask_mod at every query-key pair, a (batch, 1, seq, seq) boolean tensor) and SDPA runs
with it: the same mask and the same math, O(seq^2) memory per sequence. The BlockMask itself still travels through
tensor parallelism, FSDP, activation checkpointing and compile exactly as on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.nn.attention.varlen import varlen_attn

from kiln_base.internals import mark_dynamic

# (attn_type, attn_mask_type) pairs a model can have (models/args.py's flavors use each).
SUPPORTED = {("sdpa", "causal"), ("flex", "block_causal"), ("varlen", "block_causal")}


class VarlenMask(NamedTuple):
    """The documents of a batch for `varlen_attn`, which sees the batch as one flat sequence of documents."""

    cu_seqlens: torch.Tensor  # int32 (n_documents + 1,): each document's start in the flattened batch, then the end
    max_len: int  # bound on the longest document: the row length (the exact maximum would cost a host sync)


AttentionMask = BlockMask | VarlenMask | None


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """(bs, seq) token ids -> (bs, seq) int32: the number of BOS tokens up to and including each position, so every
    document of a row has its own number (0 for a row's leading tail of an earlier document)."""
    return torch.cumsum(tokens == bos_id, dim=1, dtype=torch.int32)


def block_causal_mask(docs: torch.Tensor) -> BlockMask:
    """The flex BlockMask of a batch's document ids (bs, seq): query q sees key k iff k <= q and both are in the
    same document."""

    def block_causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    bs, seq = docs.shape
    return create_block_mask(block_causal, bs, None, seq, seq, device=docs.device)


def varlen_mask(docs: torch.Tensor) -> VarlenMask:
    """The documents of a batch (its document ids, (bs, seq)) as `varlen_attn` takes them: each row is cut where
    its id changes (and starts a document), and the pieces of all rows are numbered in order in the flattened
    (bs * seq) batch."""
    bs, seq = docs.shape
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    cu = torch.nonzero(starts.flatten()).flatten().to(torch.int32)  # the number of documents: a host sync
    cu_seqlens = torch.cat([cu, cu.new_full((1,), bs * seq)])
    mark_dynamic(cu_seqlens, 0)  # its length changes every batch: one compiled graph for every length
    return VarlenMask(cu_seqlens, seq)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Attention of q, k, v (bs, heads, seq, head_dim; k and v with as many heads as q) under `mask` (None: causal);
    returns (bs, heads, seq, head_dim)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if isinstance(mask, VarlenMask):
        return _varlen(q, k, v, mask)
    if not flex_trains_on(q.device):  # the same mask, evaluated densely, through SDPA
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(mask, q.shape[0], q.shape[2], q.device))
    return cast(torch.Tensor, flex_attention(q, k, v, block_mask=mask))


def dense_mask(mask: BlockMask, bs: int, seq: int, device: torch.device) -> torch.Tensor:
    """A BlockMask's mask_mod at every query-key pair: (bs, 1, seq, seq) bool. kiln's mask_mod is tensor ops that
    broadcast, so it runs on index grids directly (torch's create_mask vmaps it under a torch-function mode, which
    dynamo cannot trace inside an activation-checkpointed compiled block)."""
    b = torch.arange(bs, device=device).view(bs, 1, 1, 1)
    i = torch.arange(seq, device=device)
    return mask.mask_mod(b, torch.zeros_like(b), i.view(1, 1, seq, 1), i.view(1, 1, 1, seq))


def flex_trains_on(device: torch.device) -> bool:
    """Whether flex_attention has a backward on `device`: not on a CPU (torch 2.13 refuses a CPU input that requires
    grad, eager and compiled; inductor's flex backward is Triton only; 2.11 unchecked)."""
    return device.type != "cpu"


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: VarlenMask) -> torch.Tensor:
    """varlen_attn over the batch flattened to (bs * seq, heads, head_dim), causal within each document."""
    bs, heads, seq, head_dim = q.shape

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(bs * seq, t.shape[1], head_dim)

    cu, n = mask.cu_seqlens, mask.max_len
    # window_size (-1, 0): every earlier key of the document, no later one (causal).
    out = varlen_attn(flat(q), flat(k), flat(v), cu, cu, n, n, window_size=(-1, 0))
    return cast(torch.Tensor, out).view(bs, seq, heads, head_dim).transpose(1, 2)
