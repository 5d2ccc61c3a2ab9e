"""Convert kiln checkpoints to Hugging Face Llama format (model.safetensors + config.json) and back.

    python scripts/convert_hf.py to_hf   CHECKPOINT HF_DIR [--dtype bfloat16] [--flavor debugmodel]
    python scripts/convert_hf.py from_hf HF_DIR CHECKPOINT_FOLDER [--step 0]

CHECKPOINT is a DCP step folder (`outputs/checkpoint/step-100`, full, or an export `export-step-100`) or a
checkpoint folder (its highest complete step is used; an export wins a tie). Checkpoints are read through
kiln's SafeFileSystemReader: a file that needs code to load is refused (exit 2), nothing of it run. The model
shape comes from the step's kiln.json (or --flavor, with the vocabulary read off the embedding). `from_hf`
writes a weights-only DCP checkpoint `CHECKPOINT_FOLDER/step-N` that
kiln loads at start (`--checkpoint.enable_checkpoint --checkpoint.folder CHECKPOINT_FOLDER`) as its initial
weights. Names map as in Hugging Face's convert_llama_weights_to_hf.py, including the q/k row permutation:
kiln (like Meta's Llama) rotates interleaved pairs (x0,x1),(x2,x3)...; HF's Llama rotates the two halves of
each head, so wq and wk rows are reordered per head. Only the model weights are converted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from models.args import LLAMA3_FLAVORS, ModelArgs, ffn_hidden_dim  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.errors import UserError  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")  # torch attribute names
# Llama 3.1 RoPE scaling, as hard-coded in models/llama3.py (_apply_rope_scaling).
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# kiln name (per layer: after "layers.N.") -> HF name (per layer: after "model.layers.N.")
LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_KEYS = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}


def _kv_heads(args: ModelArgs) -> int:
    return args.n_heads if args.n_kv_heads is None else args.n_kv_heads


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rows (pair i, member j) -> (half j, index i): interleaved RoPE pairs -> rotate-half layout."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of permute_to_hf."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def kiln_to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """kiln model state dict -> HF LlamaForCausalLM state dict (new tensors, same dtype)."""
    out: dict[str, torch.Tensor] = {}
    for key, w in sd.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if m and m.group(2) in LAYER_KEYS:
            if m.group(2) == "attention.wq.weight":
                w = permute_to_hf(w, args.n_heads)
            elif m.group(2) == "attention.wk.weight":
                w = permute_to_hf(w, _kv_heads(args))
            out[f"model.layers.{m.group(1)}.{LAYER_KEYS[m.group(2)]}"] = w.contiguous()
        elif key in TOP_KEYS:
            out[TOP_KEYS[key]] = w.contiguous()
        elif key == "output.weight":
            if not args.tie_word_embeddings:  # HF ties by config; safetensors refuses shared storage
                out["lm_head.weight"] = w.contiguous()
        else:
            raise ConfigError(f"no Hugging Face name for kiln weight '{key}'")
    return out


def hf_to_kiln(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM state dict -> kiln model state dict (inverse of kiln_to_hf)."""
    layer_keys = {v: k for k, v in LAYER_KEYS.items()}
    top_keys = {v: k for k, v in TOP_KEYS.items()}
    out: dict[str, torch.Tensor] = {}
    for key, w in sd.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if m and m.group(2) in layer_keys:
            name = layer_keys[m.group(2)]
            if name == "attention.wq.weight":
                w = permute_from_hf(w, args.n_heads)
            elif name == "attention.wk.weight":
                w = permute_from_hf(w, _kv_heads(args))
            out[f"layers.{m.group(1)}.{name}"] = w.contiguous()
        elif key in top_keys:
            out[top_keys[key]] = w.contiguous()
        elif key == "lm_head.weight":
            out["output.weight"] = w.contiguous()
        elif key.endswith("rotary_emb.inv_freq"):  # old HF exports carry this derived buffer
            continue
        else:
            raise ConfigError(f"Hugging Face weight '{key}' has no kiln Llama3 counterpart")
    if args.tie_word_embeddings or "output.weight" not in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(args: ModelArgs, dtype: str) -> dict:
    """config.json for transformers' LlamaForCausalLM."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": ffn_hidden_dim(args),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": _kv_heads(args),
        "head_dim": args.dim // args.n_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": dict(ROPE_SCALING) if args.rope_scaling else None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def args_from_hf_config(cfg: dict, where: str) -> ModelArgs:
    """ModelArgs whose shapes equal the HF config's (the FFN size through multiple_of / ffn_dim_multiplier)."""
    try:
        dim, heads, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
        scaling = cfg.get("rope_scaling")
        if scaling and {k: scaling.get(k) for k in ROPE_SCALING} != ROPE_SCALING:
            raise ConfigError(f"{where}: rope_scaling {scaling} is not Llama 3.1's, the only one kiln implements")
        if cfg.get("head_dim", dim // heads) != dim // heads:
            raise ConfigError(f"{where}: head_dim {cfg['head_dim']} != hidden_size / num_attention_heads")
        base = int(2 * 4 * dim / 3)
        args = ModelArgs(
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads", heads),
            vocab_size=cfg["vocab_size"],
            multiple_of=inter,  # rounds the (scaled) 8/3*dim up to exactly `inter`
            ffn_dim_multiplier=None if base <= inter else inter / base,
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=bool(scaling),
            max_seq_len=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: missing key {e}") from None
    assert ffn_hidden_dim(args) == inter, (ffn_hidden_dim(args), inter)
    return args


# ----------------------------------------------------------------------------- kiln checkpoints on disk


def resolve_step_dir(path: str) -> str:
    """A DCP step folder, or the highest complete `step-N` / `export-step-N` of a checkpoint folder."""
    from trainer.components.checkpoint_folder import scan

    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    done = [e for e in scan(path) if not e.tmp and e.has_metadata]
    if not done:
        raise ConfigError(f"{path}: not a DCP checkpoint (no .metadata) and no complete step-N folder in it")
    return max(done, key=lambda e: (e.step, e.export)).path


def load_kiln_weights(path: str, flavor: str | None = None) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """The model weights of a kiln DCP checkpoint (no process group needed) and the model's ModelArgs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainer.components.checkpoint import MARKER, is_model_key, read_metadata
    from trainer.components.checkpoint_reader import SafeFileSystemReader

    md = read_metadata(path)
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if is_model_key(k) and isinstance(m, TensorStorageMetadata)
    }
    if "tok_embeddings.weight" not in sd:
        raise ConfigError(f"{path}: no tok_embeddings.weight: not a kiln Llama3 checkpoint")
    dcp.load(sd, storage_reader=SafeFileSystemReader(path, md), no_dist=True)
    marker = os.path.join(path, MARKER)
    if flavor is not None:
        args = dataclasses.replace(LLAMA3_FLAVORS[flavor], vocab_size=sd["tok_embeddings.weight"].shape[0])
    elif os.path.isfile(marker):
        with open(marker) as f:
            saved = json.load(f).get("model_args")
        if not saved:
            raise ConfigError(f"{marker} has no model_args; pass --flavor")
        args = ModelArgs(**saved)
    else:
        raise ConfigError(f"{path} has no {MARKER} (not written by kiln?); pass --flavor to give the model shape")
    if sd["tok_embeddings.weight"].shape != (args.vocab_size, args.dim):
        raise ConfigError(
            f"{path}: tok_embeddings.weight {tuple(sd['tok_embeddings.weight'].shape)} does not match the model "
            f"shape (vocab {args.vocab_size}, dim {args.dim})"
        )
    return sd, args


def save_kiln_weights(sd: dict[str, torch.Tensor], args: ModelArgs, folder: str, step: int) -> str:
    """Write a weights-only kiln checkpoint folder/step-N (atomically: .tmp, marker, rename)."""
    import torch.distributed.checkpoint as dcp

    from trainer.components.checkpoint import MARKER, step_dir

    final = step_dir(folder, step)
    if os.path.exists(final):
        raise ConfigError(f"{final} already exists; not overwriting it")
    tmp = final + ".tmp"
    dcp.save(sd, checkpoint_id=tmp, no_dist=True)
    dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    marker = {"step": step, "model_weights_only": True, "dtype": dtype, "model_args": dataclasses.asdict(args)}
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(marker, f, indent=1)
    os.rename(tmp, final)
    return final


def to_hf(checkpoint: str, out_dir: str, dtype: str | None, flavor: str | None) -> None:
    from safetensors.torch import save_file

    path = resolve_step_dir(checkpoint)
    sd, args = load_kiln_weights(path, flavor)
    hf = kiln_to_hf(sd, args)
    if dtype is not None:
        hf = {k: v.to(getattr(torch, dtype)) for k, v in hf.items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(hf, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    saved_dtype = str(next(iter(hf.values())).dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(args, saved_dtype), f, indent=2)
    print(f"{path} -> {out_dir}: {len(hf)} tensors, {saved_dtype}")


def from_hf(hf_dir: str, folder: str, step: int) -> None:
    from safetensors.torch import load_file

    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{config_path}: not found")
    with open(config_path) as f:
        args = args_from_hf_config(json.load(f), config_path)
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"{hf_dir}: no .safetensors files")
    hf: dict[str, torch.Tensor] = {}
    for name in files:  # sharded exports (model-00001-of-00004.safetensors ...) are read whole
        hf.update(load_file(os.path.join(hf_dir, name)))
    final = save_kiln_weights(hf_to_kiln(hf, args), args, folder, step)
    print(f"{hf_dir} -> {final}: weights-only kiln checkpoint")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to_hf", help="kiln DCP checkpoint -> HF model.safetensors + config.json")
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="cast weights (default: as saved)")
    p.add_argument("--flavor", choices=list(LLAMA3_FLAVORS), default=None, help="model shape if no kiln.json")
    p = sub.add_parser("from_hf", help="HF Llama folder -> weights-only kiln checkpoint FOLDER/step-N")
    p.add_argument("hf_dir")
    p.add_argument("folder")
    p.add_argument("--step", type=int, default=0)
    a = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # offline use is the intent
    try:
        if a.command == "to_hf":
            to_hf(a.checkpoint, a.out_dir, a.dtype, a.flavor)
        else:
            from_hf(a.hf_dir, a.folder, a.step)
    except UserError as e:  # config, checkpoint (damaged, refused as unsafe) mistakes
        print(f"convert_hf: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
