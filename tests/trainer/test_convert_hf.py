"""scripts/convert_hf.py: kiln <-> Hugging Face Llama. Logits of the HF-format weights, run through an
independent HF-Llama reference forward (rotate-half RoPE, as transformers' modeling_llama), match kiln's;
kiln -> HF -> kiln is bitwise identical; a trainer checkpoint converts and loads back into the Trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models import LLAMA3_FLAVORS, ModelArgs, Transformer
from models.args import ffn_hidden_dim
from tests.helpers.checkpoints import SMALL
from tests.helpers.common import open_trainer, run_trainer, tiny_run_args
from tests.helpers.scripts import load_script

conv = load_script("convert_hf")


def hf_llama_forward(sd: dict[str, torch.Tensor], cfg: dict, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaForCausalLM forward, written out: HF names, rotate-half RoPE, explicit attention."""
    dim, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = dim // heads, cfg["rms_norm_eps"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if cfg["rope_scaling"]:  # transformers' _compute_llama3_parameters
        rs = cfg["rope_scaling"]
        low_wavelen = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
        high_wavelen = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs["factor"], inv_freq)
        smooth = (rs["original_max_position_embeddings"] / wavelen - rs["low_freq_factor"]) / (
            rs["high_freq_factor"] - rs["low_freq_factor"]
        )
        smoothed = (1 - smooth) * scaled / rs["factor"] + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    bs, seqlen = tokens.shape
    freqs = torch.outer(torch.arange(seqlen).float(), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., hd // 2 :], x[..., : hd // 2]), dim=-1)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    mask = torch.full((seqlen, seqlen), float("-inf")).triu(1)
    h = sd["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(bs, seqlen, heads, hd).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(bs, seqlen, kv, hd).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(bs, seqlen, kv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        h = h + (att @ v).transpose(1, 2).reshape(bs, seqlen, dim) @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        gate, up = x @ sd[p + "mlp.gate_proj.weight"].T, x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    head = sd["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    return rms(h, sd["model.norm.weight"]) @ head.T


def small_kiln_model(rope_scaling: bool) -> tuple[Transformer, ModelArgs]:
    args = ModelArgs(**{**SMALL.__dict__, "vocab_size": 128, "max_seq_len": 16, "rope_scaling": rope_scaling})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():  # sharper attention than at init, so positions (RoPE) move the logits visibly
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(8)
            layer.attention.wk.weight.mul_(8)
    return model, args


@pytest.mark.parametrize("rope_scaling", [False, True])
def test_hf_logits_match_kiln_with_gqa(rope_scaling: bool) -> None:
    model, args = small_kiln_model(rope_scaling)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens)
        sd = model.state_dict()
        cfg = conv.hf_config(args, "float32")
        torch.testing.assert_close(hf_llama_forward(conv.kiln_to_hf(sd, args), cfg, tokens), expected)
        # Without the q/k row permutation HF's rotate-half RoPE computes something else: the test can tell.
        unpermuted = {k: v for k, v in conv.kiln_to_hf(sd, args).items()}
        for i in range(args.n_layers):
            unpermuted[f"model.layers.{i}.self_attn.q_proj.weight"] = sd[f"layers.{i}.attention.wq.weight"]
            unpermuted[f"model.layers.{i}.self_attn.k_proj.weight"] = sd[f"layers.{i}.attention.wk.weight"]
        assert (hf_llama_forward(unpermuted, cfg, tokens) - expected).abs().max() > 1e-2


def test_round_trip_is_identical_and_config_maps_back() -> None:
    model, args = small_kiln_model(rope_scaling=True)
    sd = model.state_dict()
    back = conv.hf_to_kiln(conv.kiln_to_hf(sd, args), args)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    for flavor in ("debugmodel", "8B", "70B", "405B"):
        a = ModelArgs(**{**LLAMA3_FLAVORS[flavor].__dict__, "vocab_size": 128256})
        b = conv.args_from_hf_config(conv.hf_config(a, "bfloat16"), "config.json")
        assert (b.dim, b.n_layers, b.n_heads, b.vocab_size, ffn_hidden_dim(b)) == (
            a.dim,
            a.n_layers,
            a.n_heads,
            a.vocab_size,
            ffn_hidden_dim(a),
        )
        assert (b.n_kv_heads or b.n_heads) == (a.n_kv_heads or a.n_heads) and b.rope_theta == a.rope_theta


def test_cli_trainer_checkpoint_to_hf_and_back(tmp_path: Path, small_model: None, capsys) -> None:
    from safetensors.torch import load_file

    base = tiny_run_args("--checkpoint.enable_checkpoint")
    trainer = run_trainer([*base, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "1"])
    tokens = torch.randint(0, 2256, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = trainer.model(tokens)

    hf_dir = tmp_path / "hf"
    assert conv.main(["to_hf", str(tmp_path / "run" / "checkpoint"), str(hf_dir)]) == 0  # a full checkpoint
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["num_key_value_heads"] == 2 and cfg["vocab_size"] == 2256
    hf = load_file(hf_dir / "model.safetensors")
    assert len(hf) == 2 + 9 * 2 + 1 and hf["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    with torch.no_grad():
        torch.testing.assert_close(hf_llama_forward(hf, cfg, tokens), expected)

    back = tmp_path / "back"
    assert conv.main(["from_hf", str(hf_dir), str(back)]) == 0
    original, _ = conv.load_kiln_weights(str(tmp_path / "run" / "checkpoint" / "step-1"))
    converted, _ = conv.load_kiln_weights(str(back / "step-0"))
    sums = json.loads((back / "step-0" / "kiln.json").read_text())["checksums"]  # verified when a run loads it
    assert set(sums) == {".metadata", "__0_0.distcp"}
    assert converted.keys() == original.keys() and all(torch.equal(converted[k], original[k]) for k in original)
    assert conv.main(["from_hf", str(hf_dir), str(back)]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err

    # The converted weights-only checkpoint is a starting point for a new kiln run.
    argv = [*base, "--job.dump_folder", str(tmp_path / "new"), "--checkpoint.folder", str(back)]
    with open_trainer(argv) as loaded, torch.no_grad():
        assert loaded.step == 0
        assert torch.equal(loaded.model(tokens), expected)

    assert conv.main(["to_hf", str(back), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
