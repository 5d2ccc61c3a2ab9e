"""Tests for the Llama 3 model package: shapes, parameter counts, causality, RoPE, FLOPs, training."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from models import LLAMA3_FLAVORS, ModelArgs, Transformer, flops_per_token, num_params
from models.args import ffn_hidden_dim
from models.llama3 import precompute_freqs_cis

LLAMA3_VOCAB = 128256


def _flavor(name: str, **overrides: object) -> ModelArgs:
    """Copy of a flavor, so tests never mutate the shared LLAMA3_FLAVORS entries."""
    return dataclasses.replace(LLAMA3_FLAVORS[name], **overrides)


def _build_meta(args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def _build_cpu(args: ModelArgs, seed: int = 0) -> Transformer:
    """Meta construction, then allocate on CPU and initialise: the path the trainer uses."""
    model = _build_meta(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


# Published parameter counts: "total_size" / 2 (bf16 bytes) of the model.safetensors.index.json of
# meta-llama/Meta-Llama-3-8B, -70B and Llama-3.1-405B on the Hugging Face hub (untied embeddings).
PUBLISHED = {"8B": 8_030_261_248, "70B": 70_553_706_496, "405B": 405_853_388_800}


@pytest.mark.parametrize(("name", "hidden"), [("8B", 14336), ("70B", 28672), ("405B", 53248)])
def test_param_counts_match_published_llama3(name: str, hidden: int) -> None:
    # 8B's hidden dim by hand: int(8 * 4096 / 3) = 10922; int(1.3 * 10922) = 14198; round up to 1024 -> 14336.
    args = _flavor(name, vocab_size=LLAMA3_VOCAB)
    assert ffn_hidden_dim(args) == hidden
    model = _build_meta(args)  # meta only: never materialised
    assert num_params(model) == PUBLISHED[name]
    assert model.layers["0"].feed_forward.w1.weight.shape == (hidden, args.dim)


def test_debugmodel_ffn_hidden() -> None:
    args = _flavor("debugmodel", vocab_size=300)
    assert ffn_hidden_dim(args) == 768
    assert _build_meta(args).layers["0"].feed_forward.w1.weight.shape == (768, 256)


def test_forward_shape_and_causality() -> None:
    args = _flavor("debugmodel", vocab_size=300, max_seq_len=32)
    model = _build_cpu(args)
    assert model.freqs_cis.device.type == "cpu" and model.freqs_cis.shape == (32, 8)
    torch.manual_seed(1)
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (2, 32, 300)
        assert torch.isfinite(logits).all()
        t = 20
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % 300
        logits2 = model(changed)
    torch.testing.assert_close(logits2[:, :t], logits[:, :t])
    assert not torch.allclose(logits2[:, t:], logits[:, t:])
    # A shorter sequence uses a prefix of the RoPE table and gives the same prefix logits.
    with torch.no_grad():
        torch.testing.assert_close(model(tokens[:, :10]), logits[:, :10], rtol=1e-4, atol=1e-4)


def test_gqa() -> None:
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=32, max_seq_len=8)
    model = _build_cpu(args)
    head_dim = 64 // 4
    assert model.layers["0"].attention.wk.out_features == 2 * head_dim
    assert model.layers["0"].attention.wv.out_features == 2 * head_dim
    with torch.no_grad():
        out = model(torch.randint(0, 50, (3, 8)))
    assert out.shape == (3, 8, 50) and torch.isfinite(out).all()


def test_rope_scaling() -> None:
    head_dim, end = 128, 4
    plain = precompute_freqs_cis(head_dim, end, 500000.0, scaling=None)
    scaled = precompute_freqs_cis(head_dim, end, 500000.0, scaling=LLAMA3_FLAVORS["3.1-8B"])
    assert plain.shape == scaled.shape == (end, head_dim // 2)
    # Angle at position 1 is the frequency itself.
    f_plain, f_scaled = plain[1].angle(), scaled[1].angle()
    # Highest frequencies (wavelength < 8192 / 4) are untouched.
    torch.testing.assert_close(f_scaled[:8], f_plain[:8])
    # Lowest frequencies (wavelength > 8192) are divided by the scale factor 8.
    torch.testing.assert_close(f_scaled[-1], f_plain[-1] / 8)
    assert (f_scaled[-8:] < f_plain[-8:]).all()


def test_flops_per_token() -> None:
    args = _flavor("debugmodel", vocab_size=300)
    model = _build_meta(args)
    dim, layers, heads, seq, vocab, hidden = 256, 6, 16, 2048, 300, 768
    per_layer = 4 * dim * dim + 3 * dim * hidden + 2 * dim  # full MHA (n_kv_heads None) + SwiGLU + norms
    n_no_emb = layers * per_layer + dim + vocab * dim  # + final norm, output
    assert num_params(model, exclude_embedding=True) == n_no_emb
    expected = 6 * n_no_emb + 12 * layers * heads * (dim // heads) * seq
    assert flops_per_token(args, model, seq) == expected


def test_tied_embeddings() -> None:
    args = ModelArgs(
        dim=32, n_layers=1, n_heads=2, vocab_size=40, multiple_of=32, max_seq_len=8, tie_word_embeddings=True
    )
    model = _build_cpu(args)
    assert model.output.weight is model.tok_embeddings.weight  # re-tied after to_empty()
    assert num_params(model) == num_params(model, exclude_embedding=True) + 40 * 32


def test_training_memorises_batch() -> None:
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=64, multiple_of=32, max_seq_len=16)
    model = _build_cpu(args)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (4, 17), generator=gen)
    inputs, labels = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert math.isfinite(losses[-1])
    assert losses[0] - losses[-1] >= 1.5, losses
