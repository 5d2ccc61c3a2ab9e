"""Qwen3, dense and mixture-of-experts, against transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM.

Random-init transformers models at tiny shapes (head_dim != dim / heads, GQA, random q/k norms and a sharpened
router, so that a wrong permutation, norm or routing shows in the logits) move to kiln through
trainer/checkpoint/hf.py (config.json and weights) and back; logits, the auxiliary balance loss and gradients are
compared in float32 on CPU. Then the MoE layer's own rules: the grouped_mm path against the loop, dropless
routing, the expert bias, the bias update, and active parameters / FLOPs against a hand count.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from kiln_base.errors import ConfigError
from models import QWEN3_FLAVORS, ModelArgs, Transformer, active_params, flops_per_token, num_params
from models.args import first_difference, model_signature, stored_model_args
from models.moe import MoE, expert_bias_step, grouped_mm_runs, load_balance_loss, update_expert_bias
from trainer.checkpoint.hf import (
    args_from_hf_config,
    hf_config,
    hf_to_kiln,
    iter_hf_as_kiln,
    kiln_to_hf,
    read_hf_args,
    save_hf_weights,
    write_json,
)

VOCAB = 128
BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # not hidden_size / heads (8): the independent head_dim bites
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
TOL = {"rtol": 1e-5, "atol": 1e-5}


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """Random norms (the q/k norms' per-head permutation must show), sharper attention, a decisive router."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(4)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif "embed_tokens" in name or "lm_head" in name:
                p.mul_(5)
    return model.eval()


def hf_model(moe: bool, **extra: object) -> torch.nn.Module:
    torch.manual_seed(0)
    if moe:
        return sharpen(Qwen3MoeForCausalLM(Qwen3MoeConfig(**BASE, **MOE, **extra)))
    return sharpen(Qwen3ForCausalLM(Qwen3Config(**BASE, **extra)))


def kiln_from(hf: torch.nn.Module, **overrides: object) -> Transformer:
    """The kiln model of `hf`: its config.json through args_from_hf_config, its weights through hf_to_kiln."""
    args = dataclasses.replace(args_from_hf_config(hf.config.to_dict(), "config.json"), **overrides)
    model = Transformer(args)
    model.load_state_dict(hf_to_kiln(hf.state_dict(), args), strict=True)
    return model.eval()


CASES = {"dense": (False, {}), "dense_tied": (False, {"tie_word_embeddings": True}), "moe": (True, {})}


@pytest.mark.parametrize("case", CASES)
def test_hf_to_kiln_logits_equal(case: str) -> None:
    moe, extra = CASES[case]
    hf = hf_model(moe, **extra)
    kiln = kiln_from(hf)
    assert kiln.model_args.head_dim == 16 and kiln.model_args.qk_norm and kiln.model_args.moe == moe
    with torch.no_grad():
        theirs = hf(TOKENS).logits
        ours = kiln(TOKENS)
    assert theirs.abs().max() > 1  # logits large enough that a wrong weight cannot hide
    torch.testing.assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("case", CASES)
def test_kiln_to_hf_logits_equal(case: str) -> None:
    """kiln weights (kiln's own init, then perturbed norms) -> transformers through kiln_to_hf and hf_config."""
    moe, extra = CASES[case]
    args = args_from_hf_config(hf_model(moe, **extra).config.to_dict(), "config.json")
    torch.manual_seed(1)
    kiln = Transformer(args)
    kiln.init_weights()
    with torch.no_grad():
        for name, p in kiln.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "router" in name:
                p.normal_(0, 0.5)
    cfg = hf_config(args, "float32")
    hf_cls, cfg_cls = (Qwen3MoeForCausalLM, Qwen3MoeConfig) if moe else (Qwen3ForCausalLM, Qwen3Config)
    assert cfg["architectures"] == [hf_cls.__name__]
    hf = hf_cls(cfg_cls(**cfg)).eval()
    missing, unexpected = hf.load_state_dict(kiln_to_hf(kiln.state_dict(), args), strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if args.tie_word_embeddings else [])
    with torch.no_grad():
        torch.testing.assert_close(kiln(TOKENS), hf(TOKENS).logits, **TOL)
    # And the config goes back to the same model.
    assert model_signature(args_from_hf_config(cfg, "exported config.json")) == model_signature(args)


def test_hf_folders_both_ways() -> None:
    """Folders: transformers' save_pretrained (per-expert safetensors, as on the hub) -> iter_hf_as_kiln; kiln ->
    save_hf_weights + hf_config -> transformers' from_pretrained. Both compute transformers' logits. 12 experts:
    their names sort as text (10 before 2), so only stacking by expert number gives the right order."""
    torch.manual_seed(0)
    hf = sharpen(Qwen3MoeForCausalLM(Qwen3MoeConfig(**BASE, **{**MOE, "num_experts": 12})))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        stored = load_file(os.path.join(d, "model.safetensors"))
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in stored
        args = read_hf_args(d)
        kiln = Transformer(args)
        kiln.load_state_dict(dict(iter_hf_as_kiln(d, args)), strict=True)
        assert hf_to_kiln(stored, args).keys() == kiln.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(kiln.eval()(TOKENS), hf(TOKENS).logits, **TOL)
    with torch.no_grad():
        kiln.layers["1"].moe.experts.w3.mul_(2)  # a kiln model of its own, to export  # type: ignore[union-attr]
    with tempfile.TemporaryDirectory() as d:
        sd = kiln.state_dict()
        files = save_hf_weights(
            {k: (tuple(v.shape), v.dtype) for k, v in sd.items()},
            lambda ks: {k: sd[k] for k in ks},
            args,
            d,
            None,
            max_shard_bytes=20_000,
        )
        assert len(files) > 1  # sharded: the per-expert tensors of one kiln weight may land in several files
        write_json(os.path.join(d, "config.json"), hf_config(args, "float32"))
        exported = Qwen3MoeForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        torch.testing.assert_close(kiln.eval()(TOKENS), exported(TOKENS).logits, **TOL)


def test_a_moved_expert_bias_refuses_the_export() -> None:
    args = args_from_hf_config(hf_model(True).config.to_dict(), "config.json")
    kiln = Transformer(args)
    kiln.init_weights()
    kiln.layers["0"].moe.expert_bias[1] = 1e-3  # type: ignore[union-attr,index]
    with pytest.raises(ConfigError, match=r"'layers.0.moe.expert_bias' is non-zero"):
        kiln_to_hf(kiln.state_dict(), args)


def test_aux_loss_and_gradients_equal_transformers() -> None:
    """The auxiliary balance loss (all layers pooled, as load_balancing_loss_func does) equals transformers';
    gradients of cross-entropy + 0.1 x aux equal transformers' for the permuted, fused and routing weights."""
    hf = hf_model(True).train()
    kiln = kiln_from(hf).train()
    out = hf(TOKENS, output_router_logits=True)
    logits = kiln(TOKENS)
    aux = load_balance_loss(kiln.router_stats)
    assert aux is not None
    torch.testing.assert_close(aux, out.aux_loss, **TOL)
    targets = torch.roll(TOKENS, -1, 1)

    def loss(lg: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(lg.flatten(0, 1), targets.flatten()) + 0.1 * a

    loss(out.logits, out.aux_loss).backward()
    loss(logits, aux).backward()
    ours = kiln_to_hf({k: p.grad for k, p in kiln.named_parameters()}, kiln.model_args)
    theirs = dict((k, p.grad) for k, p in hf.named_parameters())
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
        "model.embed_tokens.weight",
    ):
        assert theirs[name] is not None and theirs[name].abs().max() > 0, name
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


def test_other_moe_families_are_refused() -> None:
    for kind in ("mixtral", "deepseek_v3"):
        with pytest.raises(ConfigError, match=f'/x/config.json: model_type = "{kind}": a mixture-of-experts'):
            args_from_hf_config({**BASE, "model_type": kind}, "/x/config.json")
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        args_from_hf_config({**hf_model(True).config.to_dict(), "decoder_sparse_step": 2}, "config.json")


# ----------------------------------------------------------------------------- the MoE layer

MOE_ARGS = ModelArgs(
    dim=32,
    n_layers=1,
    n_heads=4,
    vocab_size=VOCAB,
    moe_num_experts=4,
    moe_top_k=2,
    moe_hidden_dim=16,
    moe_route_norm=True,
    moe_shared_hidden_dim=8,
)


def moe_layer(args: ModelArgs = MOE_ARGS, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    layer = model.layers["0"].moe
    assert isinstance(layer, MoE)
    with torch.no_grad():
        layer.router.gate.weight.normal_(0, 0.5)
    return layer


def test_grouped_mm_equals_loop_values_and_grads() -> None:
    grouped = moe_layer()
    loop = moe_layer(dataclasses.replace(MOE_ARGS, moe_grouped_mm=False))
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(2, 16, 32)
    assert grouped_mm_runs(x, grouped.experts.w1, grouped.experts.w2)  # the grouped path really runs here
    calls = []
    real = torch._grouped_mm
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
        y1, s1 = grouped(x.clone().requires_grad_())
    assert len(calls) == 3
    y2, s2 = loop(x.clone().requires_grad_())
    torch.testing.assert_close(s1, s2)
    torch.testing.assert_close(y1, y2, **TOL)
    g = torch.randn_like(y1)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    for (name, a), b in zip(grouped.named_parameters(), loop.parameters()):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)


def test_dropless_every_token_reaches_its_k_experts() -> None:
    """All (token, expert) pairs are counted and computed, even when every token picks the same experts."""
    layer = moe_layer()
    x = torch.randn(3, 10, 32)
    layer.expert_bias.copy_(torch.tensor([0.0, 100.0, 100.0, 0.0]))  # every token chooses experts 1 and 2
    y, _ = layer(x)
    assert layer.tokens_per_expert.tolist() == [0.0, 30.0, 30.0, 0.0]
    layer(x[:, :4])
    assert layer.tokens_per_expert.sum().item() == (30 + 12) * 2  # counts accumulate: tokens x k
    # Each token's output: its two experts weighted by the renormalised (unbiased) scores, plus the shared expert.
    flat = x.reshape(-1, 32)
    scores = torch.softmax(layer.router.gate(flat), -1)[:, [1, 2]]
    w = scores / scores.sum(-1, keepdim=True)
    e = layer.experts

    def expert(i: int) -> torch.Tensor:
        return F.linear(F.silu(F.linear(flat, e.w1[i])) * F.linear(flat, e.w3[i]), e.w2[i])

    assert layer.shared_experts is not None
    want = w[:, :1] * expert(1) + w[:, 1:] * expert(2) + layer.shared_experts(flat)
    torch.testing.assert_close(y.reshape(-1, 32), want, **TOL)


def test_expert_bias_moves_the_choice_not_the_weights() -> None:
    layer = moe_layer(dataclasses.replace(MOE_ARGS, moe_route_norm=False))
    x = torch.randn(40, 32)
    w0, e0, p0 = layer.router(x, layer.expert_bias)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 is everyone's choice
    w1, e1, p1 = layer.router(x, bias)
    assert (e1 == 3).any(-1).all() and not (e0 == 3).any(-1).all()
    # The weights are the unbiased scores of the chosen experts, whatever the bias.
    torch.testing.assert_close(w1, p0.gather(-1, e1))
    torch.testing.assert_close(p1, p0)
    same = (torch.sort(e0, -1).values == torch.sort(e1, -1).values).all(-1)
    torch.testing.assert_close(w1[same].sum(-1), w0[same].sum(-1))


def test_bias_update_rule_on_hand_made_counts() -> None:
    # mean 4: experts 0-2 under it (+coeff), expert 3 over (-coeff); centred: minus the mean step 0.5 x coeff.
    step = expert_bias_step(torch.tensor([1.0, 2.0, 3.0, 10.0]), coeff=1e-3)
    torch.testing.assert_close(step, torch.tensor([0.5e-3, 0.5e-3, 0.5e-3, -1.5e-3]))
    layer = moe_layer()
    layer(torch.randn(1, 8, 32))
    counts = layer.tokens_per_expert.clone()
    update_expert_bias(layer, 1e-3)
    torch.testing.assert_close(layer.expert_bias, expert_bias_step(counts, 1e-3))
    assert layer.tokens_per_expert.sum() == 0  # reset for the next step


def test_active_params_and_flops_hand_count() -> None:
    args = ModelArgs(
        dim=8,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=4,
        qk_norm=True,
        vocab_size=16,
        moe_num_experts=4,
        moe_top_k=2,
        moe_hidden_dim=4,
        moe_shared_hidden_dim=4,
    )
    with torch.device("meta"):
        model = Transformer(args)
    attn = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 4 + 4  # wq (2 heads x 4), wk, wv (1 x 4), wo; q/k norms
    router, expert, shared, norms = 8 * 4, 3 * 4 * 8, 3 * 4 * 8, 8 + 8
    total = attn + router + 4 * expert + shared + norms + 16 * 8 + 8 + 16 * 8  # + embedding, final norm, output
    assert num_params(model) == total
    active = total - 16 * 8 - (4 - 2) * expert  # no embedding; 2 of the 4 routed experts idle per token
    assert active_params(model, exclude_embedding=True) == active
    assert flops_per_token(args, model, seq_len=16) == 6 * active + 12 * 1 * 2 * 4 * 16


# The Qwen3 model cards' counts (Qwen/Qwen3-* on the Hugging Face hub), in billions: total, and without the
# embedding and output tables ("Non-Embedding"); the MoE cards give activated parameters instead of the latter.
CARDS = {
    "0.6B": (0.6, 0.44),
    "1.7B": (1.7, 1.4),
    "4B": (4.0, 3.6),
    "8B": (8.2, 6.95),
    "14B": (14.8, 13.2),
    "32B": (32.8, 31.2),
    "30B-A3B": (30.5, 3.3),
    "235B-A22B": (235, 22),
}


def test_flavors_build_and_match_transformers_and_the_model_cards() -> None:
    """Every flavor checks and builds (meta); the published ones count as transformers' model of their config
    does, and as their model cards say (to the 2% the cards' rounding allows)."""
    for name, args in QWEN3_FLAVORS.items():
        args = dataclasses.replace(args, vocab_size=151936)
        args.check_fields(f"flavor {name}")
        assert stored_model_args(dataclasses.asdict(args), "kiln.json") == args
        with torch.device("meta"):
            model = Transformer(args)
        if name.startswith("debug"):
            continue
        cfg = hf_config(args, "bfloat16")
        cls, cfg_cls = (Qwen3MoeForCausalLM, Qwen3MoeConfig) if args.moe else (Qwen3ForCausalLM, Qwen3Config)
        with torch.device("meta"):
            hf = cls(cfg_cls(**cfg))
        total = num_params(model)
        assert total == sum(p.numel() for p in hf.parameters()), name
        tables = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
        second = active_params(model) if args.moe else total - tables
        for ours, card in zip((total, second), CARDS[name]):
            assert abs(ours / 1e9 - card) / card < 0.02, (name, ours, card)


def test_routing_statistics_survive_compile_of_checkpointed_blocks() -> None:
    """Blocks compiled with fullgraph=True over activation checkpointing (parallelisms/' order) give the eager
    aux loss, gradients and counts: the statistics are block outputs and the counts a buffer update, no Python
    side effect (an attribute set in the layer is refused there). bf16: torch._grouped_mm's meta kernel, which
    compile traces, takes bf16 only."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    args = dataclasses.replace(MOE_ARGS, moe_shared_hidden_dim=0, max_seq_len=16)
    tokens = TOKENS[:, :16]

    def run(compiled: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[float]]:
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights()
        model.to(torch.bfloat16)
        for name, block in list(model.layers.items()):
            if compiled:
                block = torch.compile(checkpoint_wrapper(block), backend="aot_eager", fullgraph=True)
            model.layers[name] = block
        logits = model(tokens)
        aux = load_balance_loss(model.router_stats)
        assert aux is not None
        (logits.float().logsumexp(-1).mean() + 0.1 * aux).backward()
        counts = [m.tokens_per_expert.sum().item() for m in model.modules() if isinstance(m, MoE)]
        return aux.detach(), [p.grad for p in model.parameters() if p.grad is not None], counts

    torch._dynamo.reset()
    aux, grads, counts = run(False)
    aux_c, grads_c, counts_c = run(True)
    torch.testing.assert_close(aux_c, aux)
    assert len(grads_c) == len(grads) == len(list(Transformer(args).parameters()))
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b)
    assert counts_c == counts == [tokens.numel() * 2.0]


def test_model_signature_tells_the_new_fields_apart() -> None:
    moe = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], vocab_size=VOCAB)
    assert first_difference(moe, dataclasses.replace(moe, moe_top_k=3)) == ("moe_top_k", 2, 3)
    assert first_difference(moe, dataclasses.replace(moe, moe_route_norm=False)) == ("moe_route_norm", True, False)
    assert first_difference(moe, dataclasses.replace(moe, moe_grouped_mm=False)) is None  # a kernel, same model
    dense = dataclasses.replace(QWEN3_FLAVORS["debugmodel"], vocab_size=VOCAB)
    assert first_difference(dense, dataclasses.replace(dense, qk_norm=False)) == ("qk_norm", True, False)
    assert first_difference(dense, dataclasses.replace(dense, head_dim=64)) == ("head_dim", 32, 64)
    assert first_difference(dense, dataclasses.replace(dense, moe_top_k=4)) is None  # unused by a dense model
    # head_dim None is dim // n_heads: the same model as saying so.
    llama = ModelArgs(dim=64, n_heads=4, vocab_size=VOCAB)
    assert first_difference(llama, dataclasses.replace(llama, head_dim=16)) is None
    with pytest.raises(ConfigError, match="kiln.json: model moe_top_k must be"):
        stored_model_args({**dataclasses.asdict(moe), "moe_top_k": 0}, "kiln.json")
