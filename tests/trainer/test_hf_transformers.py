"""kiln <-> Hugging Face checked against the real transformers (5.x) LlamaForCausalLM and AutoTokenizer.

Models are saved by transformers itself (`save_pretrained`: transformers 5's `rope_parameters` config), for MHA,
GQA, llama3-scaled rope and tied embeddings; each goes HF -> kiln (scripts/convert_hf.py from_hf, and the
Trainer's checkpoint.initial_load_path) and kiln -> HF (to_hf, then `from_pretrained`), logits compared. The
exported tokenizer encodes the bundled corpus exactly as kiln's; generate() stops at kiln's end-of-text.
tests/trainer/test_convert_hf.py keeps the hand-written reference forward as a second opinion.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from models import LLAMA3_FLAVORS, ModelArgs, Transformer
from models.args import first_difference
from tests.helpers.common import ROOT, TOKENIZER_PATH, open_trainer, tiny_run_args
from tests.helpers.kiln_process import run_kiln
from tests.helpers.scripts import load_script
from trainer.components.tokenizer import Tokenizer

conv = load_script("convert_hf")

assert int(transformers.__version__.split(".")[0]) >= 5, transformers.__version__
VOCAB = 2256  # the bundled tokenizer's size, so exports carry it
RTOL = 1e-5  # of the largest |logit|: float32 on CPU, the two round differently (complex vs rotate-half RoPE)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# name -> LlamaConfig settings on top of BASE. llama3: original context 16 < seq 32, so the scaling bites.
CASES = {
    "mha": {"num_key_value_heads": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "gqa": {"num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "llama3_rope": {
        "num_key_value_heads": 2,
        "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0, "original_max_position_embeddings": 16},
    },
    "tied": {
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    },
}
BASE = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}
TOKENS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))


def sharpen(model: LlamaForCausalLM, qk: float = 20.0) -> LlamaForCausalLM:
    """Random norms, sharper attention and larger logits than HF's init, so that RoPE, the norms and every
    weight move the logits visibly (a wrong permutation or rope setting cannot hide under a small scale). Deep
    models get a smaller `qk`: very sharp attention amplifies float32 rounding layer by layer."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(qk)
            elif "embed_tokens" in name or "lm_head" in name:
                p.mul_(5)  # logits of std ~1 rather than ~0.2
    return model.eval()


def hf_model(case: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return sharpen(LlamaForCausalLM(LlamaConfig(**BASE, **CASES[case])))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case's model as transformers 5 saves it."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for case in CASES:
        hf_model(case).save_pretrained(root / case)
        out[case] = root / case
    return out


def check_logits(got: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    diff, scale = (got - expected).abs().max().item(), expected.abs().max().item()
    print(f"{label}: logits max abs diff {diff:.3g} (max |logit| {scale:.3g}, std {expected.std():.3g})")
    assert diff <= RTOL * scale, (label, diff, scale)


def hf_logits(folder: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def kiln_model(sd: dict[str, torch.Tensor], args: ModelArgs) -> Transformer:
    model = Transformer(args)
    model.load_state_dict(sd)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_kiln_logits(case: str, saved: dict[str, Path], tmp_path: Path) -> None:
    cfg = json.loads((saved[case] / "config.json").read_text())
    assert "rope_parameters" in cfg and "rope_theta" not in cfg  # a transformers 5 folder
    assert conv.main(["from_hf", str(saved[case]), str(tmp_path / "kiln")]) == 0
    sd, args = conv.load_kiln_weights(str(tmp_path / "kiln" / "step-0"))
    with torch.no_grad():
        got = kiln_model(sd, args)(TOKENS)
    expected = hf_logits(saved[case])
    check_logits(got, expected, f"HF -> kiln {case}")
    if case == "llama3_rope":  # the scaling is read and it matters: without it the logits are far off
        with torch.no_grad():
            plain = kiln_model(sd, ModelArgs(**{**args.__dict__, "rope_scaling": False}))(TOKENS)
        assert (plain - expected).abs().max() > 0.1
    if case == "tied":
        assert args.tie_word_embeddings


@pytest.mark.parametrize("case", list(CASES))
def test_kiln_to_hf_logits(case: str, saved: dict[str, Path], tmp_path: Path) -> None:
    """A kiln model of the case's shape with its own random weights -> to_hf -> transformers."""
    args = conv.hf.read_hf_args(str(saved[case]))
    torch.manual_seed(1)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(20)
            layer.attention.wk.weight.mul_(20)
            layer.attention_norm.weight.uniform_(0.5, 1.5)
        expected = model.eval()(TOKENS)
    conv.save_kiln_weights(model.state_dict(), args, str(tmp_path / "kiln"), 0)
    assert conv.main(["to_hf", str(tmp_path / "kiln"), str(tmp_path / "out")]) == 0
    got = hf_logits(tmp_path / "out")
    check_logits(got, expected, f"kiln -> HF {case}")
    exported = LlamaConfig.from_pretrained(tmp_path / "out")
    assert exported.max_position_embeddings == 256 and exported.tie_word_embeddings == args.tie_word_embeddings
    assert exported.rope_parameters == json.loads((saved[case] / "config.json").read_text())["rope_parameters"]


def test_config_versions_and_flavors_read_exactly() -> None:
    """transformers 4 (rope_theta + rope_scaling, `type` or `rope_type`) and 5 configs give the same ModelArgs;
    the published Llama 3.x configs give kiln's flavors."""
    v5 = {
        **BASE,
        "model_type": "llama",
        "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 5e5, "original_max_position_embeddings": 16},
    }
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = 5e5
    v4["rope_scaling"] = {
        "type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    a5, a4 = conv.args_from_hf_config(v5, "v5"), conv.args_from_hf_config(v4, "v4")
    assert first_difference(a5, a4) is None and a5.rope_scaling and a5.rope_scaling_factor == 4.0
    # Meta's config.json values (huggingface.co/meta-llama/*/config.json), the keys that matter.
    published = {
        "8B": (4096, 14336, 32, 32, 8, 8192, None, False),
        "3.1-8B": (4096, 14336, 32, 32, 8, 131072, 8.0, False),
        "3.1-70B": (8192, 28672, 80, 64, 8, 131072, 8.0, False),
        "3.1-405B": (16384, 53248, 126, 128, 8, 131072, 8.0, False),
        "3.2-1B": (2048, 8192, 16, 32, 8, 131072, 32.0, True),
        "3.2-3B": (3072, 8192, 28, 24, 8, 131072, 32.0, True),
    }
    for flavor, (dim, inter, layers, heads, kv, ctx, factor, tied) in published.items():
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": dim,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "max_position_embeddings": ctx,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": None
            if factor is None
            else {**LLAMA3_SCALING, "factor": factor, "original_max_position_embeddings": 8192},
            "tie_word_embeddings": tied,
            "vocab_size": 128256,
            "head_dim": dim // heads,
        }
        ours = ModelArgs(**{**LLAMA3_FLAVORS[flavor].__dict__, "vocab_size": 128256})
        assert first_difference(conv.args_from_hf_config(cfg, flavor), ours) is None, flavor
        written = conv.hf_config(ours, "bfloat16")
        assert {k: written[k] for k in cfg if k != "architectures"} == {
            k: v for k, v in cfg.items() if k != "architectures"
        }
        assert LlamaConfig(**written).rope_parameters["rope_theta"] == 500000.0


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"architectures": ["MistralForCausalLM"]}, "architectures"),
        ({"model_type": "mistral"}, "model_type"),
        ({"head_dim": 32}, "head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unrepresentable_configs_refused(
    change: dict, field: str, saved: dict[str, Path], tmp_path: Path, capsys
) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    cfg = json.loads((saved["gqa"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    (folder / "model.safetensors").symlink_to(saved["gqa"] / "model.safetensors")
    assert conv.main(["from_hf", str(folder), str(tmp_path / "kiln")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_hf: error: ") and f"{field} = " in err and err.count("\n") == 1, err
    assert not (tmp_path / "kiln").exists()


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small kiln model with the bundled tokenizer, exported."""
    root = tmp_path_factory.mktemp("export")
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, vocab_size=VOCAB, rope_theta=5e5)
    torch.manual_seed(2)
    model = Transformer(args)
    model.init_weights()
    conv.save_kiln_weights(model.state_dict(), args, str(root / "kiln"), 0)
    assert conv.main(["to_hf", str(root / "kiln"), str(root / "hf")]) == 0
    return root


def test_export_tokenizer_encodes_as_kiln(export: Path) -> None:
    kiln = Tokenizer(str(TOKENIZER_PATH))
    hf = AutoTokenizer.from_pretrained(export / "hf")
    texts = [json.loads(line)["text"] for line in (ROOT / "assets" / "corpus" / "kiln_corpus.jsonl").open()]
    texts += ["Hello  world!\n\n\tx = 12345;  <|end_of_text|> ünïcödé 日本語 🙂", " leading space", ""]
    for text in texts:
        assert hf(text, add_special_tokens=False).input_ids == kiln.encode(text, bos=False, eos=False)
        assert hf(text).input_ids == kiln.encode(text, bos=True, eos=False)  # Llama 3's: bos added, no eos
    assert hf.decode(kiln.encode(texts[0], bos=False, eos=False)) == texts[0]
    assert (hf.bos_token_id, hf.eos_token_id) == (kiln.bos_id, kiln.eos_id) == (2000, 2001)
    print(f"tokenizer: {len(texts)} texts ({sum(map(len, texts))} chars) encode to identical ids")


def test_export_config_bos_eos_and_generation_stops_at_eos(export: Path, tmp_path: Path) -> None:
    cfg = json.loads((export / "hf" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["dtype"], cfg["max_position_embeddings"]) == (
        2000,
        2001,
        "float32",
        8192,
    )
    gen = json.loads((export / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2001
    # Relabel one token as end-of-text (swap its embedding and output rows with eos's): greedy decoding then emits
    # eos where the original model emitted that token, and generate() must stop right after it.
    sd, args = conv.load_kiln_weights(str(export / "kiln" / "step-0"))
    prompt = torch.tensor([[2000, 5, 17, 300]])
    greedy = _kiln_greedy(kiln_model(sd, args), prompt, 6)
    target = greedy[3]
    assert target not in greedy[:3] and 2001 not in greedy
    for key in ("tok_embeddings.weight", "output.weight"):
        w = sd[key].clone()
        w[[target, 2001]] = w[[2001, target]]
        sd[key] = w
    conv.save_kiln_weights(sd, args, str(tmp_path / "kiln"), 0)
    assert conv.main(["to_hf", str(tmp_path / "kiln"), str(tmp_path / "hf")]) == 0
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    out = model.generate(prompt, max_new_tokens=10, do_sample=False)
    assert out[0, 4:].tolist() == [*greedy[:3], 2001]  # token-for-token kiln's, stopped at eos


def _kiln_greedy(model: Transformer, prompt: torch.Tensor, n: int) -> list[int]:
    tokens = prompt
    with torch.no_grad():
        for _ in range(n):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, prompt.shape[1] :].tolist()


def test_sharded_export_one_shard_in_memory(export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    read = conv._read
    monkeypatch.setattr(conv, "_read", lambda path, keys: reads.append(set(keys)) or read(path, keys))
    assert conv.main(["to_hf", str(export / "kiln"), str(tmp_path / "hf"), "--max_shard_size", "100KB"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(reads) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert sum(map(len, reads)) == len(set().union(*reads))  # each weight read once, a shard's worth at a time
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), hf_logits(export / "hf"), rtol=0, atol=0)
    # ... and read back, sharded, by from_hf: bitwise the original.
    assert conv.main(["from_hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back, _ = conv.load_kiln_weights(str(tmp_path / "back" / "step-0"))
    original, _ = conv.load_kiln_weights(str(export / "kiln" / "step-0"))
    assert all(torch.equal(back[k], original[k]) for k in original)


# ----------------------------------------------------------------------------- the Trainer


def _hf_debug_shape(folder: Path, **overrides) -> LlamaForCausalLM:
    """An HF model with the debug flavor's shape (2 layers unless overridden; the bundled tokenizer's
    vocabulary), saved to `folder` by transformers."""
    torch.manual_seed(4)
    settings = {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "vocab_size": VOCAB,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    }
    model = sharpen(LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})), qk=4.0)
    model.save_pretrained(folder)
    return model


def test_trainer_starts_from_hf_folder(tmp_path: Path) -> None:
    """checkpoint.initial_load_path at an HF folder: the model is the HF model (logits), the run's checkpoints go
    to its own folder, the source is untouched, and the same command resumes from the run's checkpoint."""
    src = tmp_path / "downloaded"
    expected = hf_logits_of(_hf_debug_shape(src))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in src.iterdir())
    argv = tiny_run_args(
        *("--checkpoint.enable_checkpoint", "--checkpoint.initial_load_path", str(src)),
        *("--model.flavor", "from_checkpoint", "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "2"),
    )
    with open_trainer(argv) as trainer:
        assert trainer.model.model_args.n_layers == 2 and trainer.step == 0
        with torch.no_grad():
            check_logits(trainer.model(TOKENS), expected, "HF -> kiln through checkpoint.initial_load_path")
        trainer.train()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in src.iterdir()) == before
    assert (tmp_path / "run" / "checkpoint" / "step-2" / ".metadata").is_file()
    with open_trainer([*argv[:-2], "--training.steps", "3"]) as resumed:
        assert resumed.step == 2  # the run's own checkpoint wins over the initial weights
    # The same weights, named flavor: debugmodel has 6 layers; with 2 the next difference is rope_theta.
    diff_theta = tmp_path / "theta"
    _hf_debug_shape(diff_theta, **{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    from kiln_base.errors import ConfigError

    bad = [
        *argv,
        "--model.flavor",
        "debugmodel",
        "--model.n_layers",
        "2",
        "--checkpoint.initial_load_path",
        str(diff_theta),
    ]
    with pytest.raises(ConfigError, match="rope_theta is 10000.0 there but 500000"):
        with open_trainer([*bad, "--job.dump_folder", str(tmp_path / "run2")]):
            pass
    with pytest.raises(ConfigError, match="overlap"):
        with open_trainer([*argv, "--job.dump_folder", str(src)]):
            pass


def hf_logits_of(model: LlamaForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.slow
def test_trainer_starts_from_converted_checkpoint_and_refuses_other_rope(tmp_path: Path) -> None:
    """initial_load_path at a from_hf conversion works the same; a converted step-0 put in the run's own folder
    is refused when its stored rope_theta is not the flavor's (it used to train at the flavor's silently);
    a mismatch through train.py exits 2 with one line naming the field."""
    src = tmp_path / "downloaded"
    expected = hf_logits_of(_hf_debug_shape(src, num_hidden_layers=6))
    assert conv.main(["from_hf", str(src), str(tmp_path / "converted")]) == 0
    argv = tiny_run_args("--checkpoint.initial_load_path", str(tmp_path / "converted"), "--training.steps", "1")
    with open_trainer([*argv, "--job.dump_folder", str(tmp_path / "a")]) as trainer, torch.no_grad():
        check_logits(trainer.model(TOKENS), expected, "converted kiln checkpoint through initial_load_path")
    other = tmp_path / "other"
    _hf_debug_shape(other, num_hidden_layers=6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert conv.main(["from_hf", str(other), str(tmp_path / "b" / "checkpoint")]) == 0
    from kiln_base.errors import CheckpointError

    with pytest.raises(CheckpointError, match="rope_theta is 10000.0 there but 500000"):
        with open_trainer(tiny_run_args("--checkpoint.enable_checkpoint", "--job.dump_folder", str(tmp_path / "b"))):
            pass
    proc = run_kiln([*argv, "--checkpoint.initial_load_path", other], launcher="python", cwd=tmp_path)
    assert proc.returncode == 2 and "rope_theta is 10000.0 there" in proc.stderr, proc.stderr[-2000:]
    assert proc.error_lines() != []


def test_checkpoints_saved_before_the_rope_fields_still_resume() -> None:
    """A full checkpoint's stored model settings predate rope_scaling_factor, context_len...: missing fields take
    their defaults (what the model computed then), so it resumes; a real change is still refused."""
    from kiln_base.errors import CheckpointError
    from trainer.checkpoint.resume import check_resume

    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=VOCAB)
    current = {"model": {k: v for k, v in dataclasses.asdict(args).items() if k not in ("max_seq_len", "depth_init")}}
    current |= {k: None for k in ("data", "model.tokenizer", "training.seq_len", "training.steps", "optimizer.lr")}
    current |= {k: None for k in ("lr_scheduler", "optimizer.name", "optimizer.beta1", "optimizer.beta2")}
    current |= {k: None for k in ("optimizer.eps", "optimizer.weight_decay", "training.global_batch_size")}
    current |= {"float8": None, "training.mixed_precision_param": None}
    new_fields = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor")
    old = {**current, "model": {k: v for k, v in current["model"].items() if k not in (*new_fields, "context_len")}}
    assert check_resume(old, current, "ckpt") == []
    changed = {**current, "model": {**current["model"], "context_len": 131072}}
    with pytest.raises(CheckpointError, match="context_len"):
        check_resume(changed, current, "ckpt")


def _sharded_logits(src: str, dump: str, layout: list[str]) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    argv = tiny_run_args("--checkpoint.initial_load_path", src, "--model.flavor", "from_checkpoint", *layout)
    with open_trainer([*argv, "--job.dump_folder", dump]) as trainer, torch.no_grad():
        out = trainer.model(TOKENS)
        out = out.full_tensor() if isinstance(out, DTensor) else out  # TP: vocab-sharded logits (loss parallel)
    return out.tolist()  # plain data through the result queue (a tensor would travel as a shared-memory handle)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.data_parallel_shard_degree", "2"],
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    ],
    ids=["fsdp2", "tp2"],
)
def test_initial_load_from_hf_into_sharded_model(layout: list[str], tmp_path: Path) -> None:
    """Each rank keeps its shard of every HF tensor (FSDP rows, TP rows/columns of permuted q/k): the sharded
    model computes the HF model's logits (GQA, tied embeddings)."""
    from tests.helpers.distributed import run_distributed

    src = tmp_path / "downloaded"
    expected = hf_logits_of(_hf_debug_shape(src, num_key_value_heads=4, tie_word_embeddings=True))
    for rank, got in enumerate(run_distributed(_sharded_logits, 2, str(src), str(tmp_path / "run"), layout)):
        check_logits(torch.tensor(got), expected, f"HF -> kiln, 2 ranks {' '.join(layout)}, rank {rank}")
