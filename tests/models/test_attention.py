"""Document masking (models/attention.py): the defining properties of block-causal attention on the debug model.

- a document packed after others gets the logits it gets alone (RoPE scores depend on distances only);
- with no document boundary inside a sequence, block-causal attention is causal attention;
- a boundary inside a sequence changes the logits after it, and only those;
- on a CPU the mask runs through SDPA (no flex backward there): it computes what flex_attention computes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from kiln_base.config import BASE_FLAVORS, FLAVORS
from kiln_base.internals import dynamo_graphs_compiled
from models import LLAMA3_FLAVORS, ModelArgs, Transformer
from models.args import ATTENTION_FIELDS, model_signature
from models.attention import VarlenMask, attend, block_causal_mask, document_ids, varlen_mask

VOCAB, BOS, EOS = 2256, 2000, 2001  # the bundled tokenizer's size and special ids


def _model(flavor: str, seed: int = 0, **overrides: object) -> Transformer:
    args = dataclasses.replace(
        LLAMA3_FLAVORS[flavor], vocab_size=VOCAB, n_layers=2, max_seq_len=128, bos_id=BOS, **overrides
    )
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def _doc(n: int, seed: int) -> torch.Tensor:
    """One document as the loader encodes it: BOS, n - 2 text tokens, EOS."""
    body = torch.randint(0, 1900, (n - 2,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.tensor([BOS]), body, torch.tensor([EOS])])


@pytest.fixture(scope="module")
def models() -> tuple[Transformer, Transformer]:
    """The same weights, causal and block-causal (the flavors differ only in attention)."""
    causal, block = _model("debugmodel"), _model("debugmodel_flex_attn")
    block.load_state_dict(causal.state_dict())
    return causal, block


def test_model_flavors_are_the_config_choices() -> None:
    assert set(LLAMA3_FLAVORS) == set(FLAVORS) and len(FLAVORS) == 3 * len(BASE_FLAVORS)


@pytest.mark.parametrize("flavor", [f for f in FLAVORS if f not in BASE_FLAVORS])
def test_each_masked_flavor_is_its_base_with_only_the_attention_changed(flavor: str) -> None:
    attn = "flex" if "_flex" in flavor else "varlen"
    base = flavor.removesuffix("_attn").removesuffix(f"_{attn}")
    masked, plain = LLAMA3_FLAVORS[flavor], LLAMA3_FLAVORS[base]
    assert (masked.attn_type, masked.attn_mask_type) == (attn, "block_causal")
    assert (plain.attn_type, plain.attn_mask_type) == ("sdpa", "causal")
    assert dataclasses.replace(masked, attn_type="sdpa", attn_mask_type="causal") == plain
    assert model_signature(masked) == model_signature(plain)  # the same trained model: weights load either way
    assert set(ATTENTION_FIELDS) == {"attn_type", "attn_mask_type", "bos_id"}


def test_document_ids_count_bos_tokens() -> None:
    tokens = torch.tensor([[7, 8, BOS, 9, EOS, BOS, 5], [BOS, 1, 2, 3, 4, 5, 6]])
    assert document_ids(tokens, BOS).tolist() == [[0, 0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1]]


def test_packed_document_gets_its_logits_alone(models: tuple[Transformer, Transformer]) -> None:
    """Document A after two others (37 tokens) gets, in fp32, the logits it gets alone, within 1e-5; causal attention
    (attending to the documents before) changes them by far more."""
    causal, block = models
    a = _doc(20, seed=1)
    packed = torch.cat([_doc(15, seed=2), _doc(22, seed=3), a])[None]
    with torch.no_grad():
        alone, in_pack = block(a[None])[0], block(packed)[0, 37:]
        causal_diff = (causal(a[None])[0] - causal(packed)[0, 37:]).abs().max().item()
    diff = (alone - in_pack).abs().max().item()
    assert diff < 1e-5, diff
    assert causal_diff > 1e-2, causal_diff  # the property is the mask's, not the model's


def test_no_boundary_in_the_sequence_gives_causal_losses(models: tuple[Transformer, Transformer]) -> None:
    """Windows without a BOS after their first token: one document each, so the block-causal loss is the causal one
    (within fp32 rounding: the two kernels sum in different orders), gradients too."""
    causal, block = models
    tokens = torch.randint(0, 1900, (2, 65), generator=torch.Generator().manual_seed(4))
    tokens[0, 0] = BOS  # a document starting at the window's start; row 1 is the tail of an earlier one
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses, grads = [], []
    for model in (causal, block):
        model.zero_grad()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append(model.layers["0"].attention.wq.weight.grad.clone())
    assert abs(losses[0] - losses[1]) < 1e-6, losses
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_a_boundary_changes_the_logits_after_it_only(models: tuple[Transformer, Transformer]) -> None:
    causal, block = models
    tokens = torch.randint(0, 1900, (1, 64), generator=torch.Generator().manual_seed(5))
    tokens[0, 0], tokens[0, 29], tokens[0, 30] = BOS, EOS, BOS  # documents [0, 30) and [30, 64)
    labels = torch.roll(tokens, -1, 1)
    with torch.no_grad():
        a, b = causal(tokens), block(tokens)
        loss_a, loss_b = (F.cross_entropy(x[0, :-1], labels[0, :-1]).item() for x in (a, b))
    assert (a[0, :30] - b[0, :30]).abs().max().item() < 1e-5  # before the boundary: one document either way
    assert (a[0, 30:] - b[0, 30:]).abs().amax(-1).min().item() > 1e-3  # every position after it changes
    # Random init: near-uniform logits, so the loss moves little (5e-4 here), yet 500x the no-boundary gap (1e-6).
    assert abs(loss_a - loss_b) > 1e-4, (loss_a, loss_b)


def _qkv_and_tokens(seed: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 80, 16, generator=g) for _ in range(3))
    tokens = torch.randint(0, 1900, (2, 80), generator=g)
    tokens[0, [0, 17, 50]] = BOS
    tokens[1, [33, 34]] = BOS  # a one-token document, and a leading tail
    return q, k, v, tokens


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Block-causal attention written out: an explicit (seq x seq) boolean mask."""
    docs = document_ids(tokens, BOS)
    pos = torch.arange(tokens.shape[1])
    allowed = (pos[:, None] >= pos[None, :]) & (docs[:, :, None] == docs[:, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])


def test_cpu_block_mask_path_computes_what_flex_attention_computes() -> None:
    """On a CPU, attend() evaluates the BlockMask densely for SDPA; flex_attention itself (forward only on a CPU,
    the kernel a GPU runs) gives the same output, and both equal the mask written out by hand."""
    q, k, v, tokens = _qkv_and_tokens()
    mask = block_causal_mask(document_ids(tokens, BOS))
    with torch.no_grad():
        ours, flex = attend(q, k, v, mask), flex_attention(q, k, v, block_mask=mask)
    torch.testing.assert_close(ours, flex, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, _dense_reference(q, k, v, tokens), rtol=0, atol=1e-6)


def test_varlen_mask_cuts_rows_at_bos_and_packs_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    """varlen_attn (CUDA only) sees the batch as a flat list of documents: the offsets are each row's pieces, and
    kiln's packing and unpacking around it give the block-causal output (checked with a per-document stand-in for
    the kernel: causal SDPA over each [start, end) of the flattened batch)."""
    q, k, v, tokens = _qkv_and_tokens()
    mask = varlen_mask(document_ids(tokens, BOS))
    assert mask.cu_seqlens.tolist() == [0, 17, 50, 80, 80 + 33, 80 + 34, 160] and mask.max_len == 80

    def per_document(q, k, v, cu_q, cu_k, max_q, max_k, window_size):  # noqa: ANN001, ANN202
        assert window_size == (-1, 0) and cu_q is cu_k and max_q == max_k == 80
        out = torch.empty_like(q)
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            piece = [t[s:e].transpose(0, 1) for t in (q, k, v)]  # (heads, len, head_dim)
            out[s:e] = F.scaled_dot_product_attention(*piece, is_causal=True).transpose(0, 1)
        return out

    monkeypatch.setattr("models.attention.varlen_attn", per_document)
    out = attend(q, k, v, VarlenMask(mask.cu_seqlens, mask.max_len))
    torch.testing.assert_close(out, _dense_reference(q, k, v, tokens), rtol=0, atol=1e-6)


def test_unsupported_attention_is_refused() -> None:
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32, attn_type="sdpa", attn_mask_type="block_causal")
    with pytest.raises(ValueError, match="attention sdpa with mask block_causal"):
        Transformer(args)
    model = Transformer(dataclasses.replace(args, attn_type="flex"))  # no bos_id: no document boundaries known
    with pytest.raises(ValueError, match="needs ModelArgs.bos_id"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_compiled_flex_attention_takes_a_new_block_mask_every_batch_without_recompiling() -> None:
    """The guard behaviour a GPU run relies on, on the flex kernel itself (inductor's CPU flex template, forward only
    on a CPU): a compiled function fed a new BlockMask per batch, documents in new places each time, compiles once.
    On a GPU a recompile per batch would cost more than the mask saves."""
    q, k, v, _ = _qkv_and_tokens()
    fn = torch.compile(lambda q, k, v, m: flex_attention(q, k, v, block_mask=m), fullgraph=True)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for i in range(4):
            tokens = torch.randint(0, 1900, (2, 80), generator=g)
            tokens[:, torch.randint(0, 80, (i + 1,), generator=g)] = BOS
            out = fn(q, k, v, block_causal_mask(document_ids(tokens, BOS)))
            torch.testing.assert_close(out, _dense_reference(q, k, v, tokens), rtol=0, atol=1e-5)
            if i == 0:
                first = dynamo_graphs_compiled()
    assert dynamo_graphs_compiled() == first
