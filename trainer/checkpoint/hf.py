"""Hugging Face Llama, Qwen3 and Qwen3-MoE <-> kiln, exactly or not at all.

- config.json <-> ModelArgs: transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`) configs,
  rope types `default` and `llama3`, tied embeddings, `head_dim`, `rms_norm_eps`. Anything kiln's Llama cannot
  compute exactly (other rope types, biases, sliding window, another architecture) is a ConfigError naming the
  field: a silently different model is worse than none.
- Weight names as in Hugging Face's convert_llama_weights_to_hf.py, with the q/k row permutation: kiln (like
  Meta's Llama) rotates interleaved pairs (x0,x1),(x2,x3)...; HF's Llama rotates the two halves of each head.
- Weights: safetensors read one tensor at a time (one file, or shards with `model.safetensors.index.json`), and
  written in shards with an index, one shard in memory at a time.
- The tokenizer: tokenizer.json (byte-level BPE, Llama 3's split pattern, the merges recovered from the tiktoken
  ranks) and tokenizer_config.json, so `AutoTokenizer.from_pretrained` encodes as kiln's Tokenizer;
  generation_config.json with kiln's bos/eos ids.

- Qwen3 (model_type qwen3, qwen3_moe): the Llama names plus self_attn.q_norm / k_norm (their weights permuted per
  head like q/k's rows: the norm acts over head_dim before RoPE, in the same layout as the rows), and the MoE FFN:
  mlp.gate (the router) and the routed experts. transformers 5 holds the experts fused per layer,
  mlp.experts.gate_up_proj [E, 2 x hidden, dim] (gate rows, then up rows) and mlp.experts.down_proj [E, dim, hidden]
  (kiln_to_hf / hf_to_kiln give and take that layout); its safetensors files, and the hub's, hold them per expert,
  mlp.experts.N.{gate,up,down}_proj.weight (hf_to_kiln takes those too). Other MoE families (Mixtral, DeepSeek, ...)
  are refused. kiln's expert_bias has no counterpart: zero on import, and a non-zero one refuses the export.

Used by scripts/convert_hf.py and by the Trainer's `checkpoint.initial_load_path`. No transformers import.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kiln_base.config import check_model_fields
from kiln_base.errors import ConfigError, UserError
from kiln_base.files import (
    FileRefused,
    MiB,
    inside,
    loads_json,
    read_bounded,
    refuse_link,
    require_regular,
    write_atomic,
)
from models.args import ModelArgs, ffn_hidden_dim
from trainer.components.tokenizer import PAT_STR, Tokenizer

CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' save_pretrained default is 5 GB shards
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
# Qwen3's additions (kiln name -> HF name, per layer). The fused experts are handled by name in kiln_to_hf.
QWEN3_LAYER_KEYS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.experts.w2": "mlp.experts.down_proj",
}
FUSED_GATE_UP = "mlp.experts.gate_up_proj"  # kiln's moe.experts.w1 (gate) and w3 (up), stacked on dim 1
EXPERT_BIAS = "moe.expert_bias"
# The hub's (and transformers' save_pretrained's) per-expert names -> kiln's 3-D weight each is a slice of.
_PER_EXPERT = {"gate_proj": "moe.experts.w1", "up_proj": "moe.experts.w3", "down_proj": "moe.experts.w2"}
# Mixture-of-experts families whose routers or experts differ from Qwen3-MoE's: refused by name.
OTHER_MOE_TYPES = (
    "mixtral",
    "qwen2_moe",
    "deepseek_v2",
    "deepseek_v3",
    "olmoe",
    "dbrx",
    "jamba",
    "granitemoe",
    "phimoe",
    "gpt_oss",
    "llama4",
    "glm4_moe",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
)
_FROM_HF_LAYER = {v: k for k, v in (LAYER_KEYS | QWEN3_LAYER_KEYS).items()}
_FROM_HF_TOP = {v: k for k, v in TOP_KEYS.items()}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def kv_heads(args: ModelArgs) -> int:
    return args.n_heads if args.n_kv_heads is None else args.n_kv_heads


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rows (pair i, member j) -> (half j, index i): interleaved RoPE pairs -> rotate-half layout."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of permute_to_hf."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# ----------------------------------------------------------------------------- names


def hf_name(key: str, args: ModelArgs) -> str | None:
    """The HF name of kiln weight `key`; None for the output layer of a tied model (HF ties it by config)."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
    if m and m.group(2) in LAYER_KEYS:
        return f"model.layers.{m.group(1)}.{LAYER_KEYS[m.group(2)]}"
    if m and m.group(2) in QWEN3_LAYER_KEYS:
        return f"model.layers.{m.group(1)}.{QWEN3_LAYER_KEYS[m.group(2)]}"
    if key in TOP_KEYS:
        return TOP_KEYS[key]
    if key == "output.weight":
        return None if args.tie_word_embeddings else "lm_head.weight"
    raise ConfigError(f"no Hugging Face name for kiln weight '{key}'")


def to_hf_tensor(key: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """kiln weight `key` in HF's layout (q/k rows permuted per head, q/k norms within their head), contiguous."""
    if key.endswith("attention.wq.weight"):
        w = permute_to_hf(w, args.n_heads)
    elif key.endswith("attention.wk.weight"):
        w = permute_to_hf(w, kv_heads(args))
    elif key.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        w = permute_to_hf(w[:, None], 1)[:, 0]
    return w.contiguous()


def kiln_name(key: str) -> str | None:
    """The kiln name of HF weight `key`; None for derived buffers old exports carry (rotary inv_freq)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
    if m and m.group(2) in _FROM_HF_LAYER:
        return f"layers.{m.group(1)}.{_FROM_HF_LAYER[m.group(2)]}"
    if key in _FROM_HF_TOP:
        return _FROM_HF_TOP[key]
    if key == "lm_head.weight":
        return "output.weight"
    if key.endswith("rotary_emb.inv_freq"):
        return None
    raise ConfigError(f"Hugging Face weight '{key}' has no kiln Llama3 / Qwen3 counterpart")


def from_hf_tensor(name: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """HF weight in kiln's layout (inverse of to_hf_tensor); `name` is the kiln name."""
    if name.endswith("attention.wq.weight"):
        w = permute_from_hf(w, args.n_heads)
    elif name.endswith("attention.wk.weight"):
        w = permute_from_hf(w, kv_heads(args))
    elif name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        w = permute_from_hf(w[:, None], 1)[:, 0]
    return w.contiguous()


def _refuse_expert_bias(key: str, w: torch.Tensor) -> None:
    """A non-zero expert bias changes which experts a token meets; transformers' Qwen3-MoE has none."""
    if bool(w.ne(0).any()):
        raise ConfigError(
            f"kiln weight '{key}' is non-zero (auxiliary-loss-free balancing moved the routing): transformers' "
            "Qwen3-MoE routes without a bias, so the exported model would choose other experts"
        )


def kiln_to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """kiln model state dict -> the state dict of transformers' LlamaForCausalLM, Qwen3ForCausalLM or
    Qwen3MoeForCausalLM (new tensors, same dtype; a Qwen3-MoE's experts fused as transformers 5 holds them)."""
    out = {}
    for key, w in sd.items():
        layer, _, sub = key.removeprefix("layers.").partition(".") if key.startswith("layers.") else ("", "", "")
        if sub == EXPERT_BIAS:
            _refuse_expert_bias(key, w)
        elif sub == "moe.experts.w1":  # gate rows first, then up: transformers' chunk(2) order
            up = sd[f"layers.{layer}.moe.experts.w3"]
            out[f"model.layers.{layer}.{FUSED_GATE_UP}"] = torch.cat([w, up], dim=1)
        elif sub != "moe.experts.w3":  # w3 went out with w1
            name = hf_name(key, args)
            if name is not None:
                out[name] = to_hf_tensor(key, w, args)
    return out


def hf_to_kiln(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A transformers Llama / Qwen3 / Qwen3-MoE state dict -> kiln model state dict (inverse of kiln_to_hf); a
    Qwen3-MoE's experts fused (transformers 5 in memory) or per expert (the safetensors files)."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    for key, w in sd.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        expert = _per_expert(key)
        if m and m.group(2) == FUSED_GATE_UP:
            gate, up = w.chunk(2, dim=1)
            out[f"layers.{m.group(1)}.moe.experts.w1"] = gate.contiguous()
            out[f"layers.{m.group(1)}.moe.experts.w3"] = up.contiguous()
        elif expert is not None:
            per_expert.setdefault(expert[0], {})[expert[1]] = w
        else:
            name = kiln_name(key)
            if name is not None:
                out[name] = from_hf_tensor(name, w, args)
    for name, experts in per_expert.items():
        if sorted(experts) != list(range(args.moe_num_experts)):
            raise ConfigError(f"{name}: the Hugging Face weights hold experts {sorted(experts)[:8]}..., not 0..E-1")
        out[name] = torch.stack([experts[i] for i in range(args.moe_num_experts)])
    for layer in range(args.n_layers if args.moe else 0):
        ref = out.get(f"layers.{layer}.moe.router.gate.weight")
        out[f"layers.{layer}.{EXPERT_BIAS}"] = torch.zeros(
            args.moe_num_experts, device=ref.device if ref is not None else None
        )
    if args.tie_word_embeddings or "output.weight" not in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# ----------------------------------------------------------------------------- config.json


def _refuse(where: str, field: str, value: Any, why: str, family: str = "Llama") -> ConfigError:
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ConfigError(f"{where}: {field} = {shown}: {why}; kiln's {family} cannot compute it exactly")


def _rope(cfg: dict, where: str) -> dict[str, Any]:
    """ModelArgs' rope fields from transformers 5's `rope_parameters` or transformers 4's `rope_theta` +
    `rope_scaling` (whose type key is `rope_type`, or `type` in older files)."""
    if isinstance(cfg.get("rope_parameters"), dict):
        field, rope = "rope_parameters", dict(cfg["rope_parameters"])
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        field = "rope_scaling"
        if not isinstance(cfg.get("rope_scaling") or {}, dict):
            raise _refuse(where, field, cfg[field], "not a JSON object")
        rope = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", 10000.0)
    if any(isinstance(v, dict) for v in rope.values()):
        raise _refuse(where, field, cfg[field], "per-layer-type rope parameters")
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if type(theta) not in (int, float) or theta <= 0:
        raise _refuse(where, "rope_theta", theta, "not a positive number")
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": False}
    if kind == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in rope]
        if missing:
            raise _refuse(where, field, cfg[field], f"rope type llama3 without {missing[0]}")
        for key in LLAMA3_ROPE_KEYS:  # ranges: check_model_fields, on the ModelArgs
            integer = key == "original_max_position_embeddings"
            if not (type(rope[key]) is int if integer else type(rope[key]) in (int, float)):
                raise _refuse(where, f"{field}.{key}", rope[key], f"not {'an integer' if integer else 'a number'}")
        out.update(
            rope_scaling=True,
            rope_scaling_factor=float(rope.pop("factor")),
            rope_low_freq_factor=float(rope.pop("low_freq_factor")),
            rope_high_freq_factor=float(rope.pop("high_freq_factor")),
            rope_original_max_seq_len=rope.pop("original_max_position_embeddings"),
        )
    elif kind != "default":
        raise _refuse(where, f"{field}.rope_type", kind, "kiln implements rope types default and llama3 only")
    if rope.get("attention_factor", 1.0) in (1, 1.0):
        rope.pop("attention_factor", None)
    if rope:
        key = sorted(rope)[0]
        raise _refuse(where, f"{field}.{key}", rope[key], f"not a setting of rope type {kind}")
    return out


def _number(cfg: dict, key: str, where: str, default: Any = None, kind: type = int) -> Any:
    """cfg[key] (or `default` when absent), an int (kind int) or a number (kind float), never a bool or a string:
    ConfigError naming the field otherwise. Ranges are checked with the rest of the shape (check_model_fields)."""
    if key not in cfg:
        if default is None:
            raise ConfigError(f"{where}: missing key '{key}'")
        return default
    value = cfg[key]
    ok = type(value) is int if kind is int else type(value) in (int, float)
    if not ok:
        raise _refuse(where, key, value, f"not {'an integer' if kind is int else 'a number'}")
    return value


# model_type -> (the architecture it converts, what kiln's model of it is called in a refusal)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "Llama"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3-MoE"),
}


def args_from_hf_config(cfg: Any, where: str) -> ModelArgs:
    """ModelArgs computing exactly what transformers' LlamaForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM
    computes with config `cfg`, or a ConfigError naming the field that kiln cannot represent. Missing keys take
    the transformers config's defaults. Every value is type- and range-checked (check_model_fields) before kiln
    divides by a head count."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: not a JSON object (a Hugging Face config.json holds one)")
    kind = cfg.get("model_type")
    if kind in OTHER_MOE_TYPES:
        raise _refuse(
            where,
            "model_type",
            kind,
            "a mixture-of-experts family kiln does not implement (kiln's is qwen3_moe)",
            "Qwen3-MoE",
        )
    if kind not in FAMILIES:
        raise _refuse(where, "model_type", kind, "not a Llama, Qwen3 or Qwen3-MoE model")
    arch, family = FAMILIES[kind]
    if cfg.get("architectures") not in (None, [arch]):
        raise _refuse(where, "architectures", cfg["architectures"], f"kiln converts {arch} only", family)
    llama = kind == "llama"
    checks: tuple[tuple[str, Any], ...] = (
        ("attention_bias", False),
        ("hidden_act", "silu"),
        ("attention_dropout", 0.0),
        ("use_sliding_window", False),
    )
    # Qwen3 ignores sliding_window unless use_sliding_window (its hub configs carry one); Llama has no such switch.
    checks += (("mlp_bias", False), ("sliding_window", None), ("pretraining_tp", 1)) if llama else ()
    for field, ok in checks:
        if cfg.get(field, ok) != ok:
            raise _refuse(where, field, cfg[field], f"kiln's {family} has {field} = {json.dumps(ok)}", family)
    layer_types = cfg.get("layer_types")
    if not llama and layer_types is not None and set(layer_types) != {"full_attention"}:
        raise _refuse(where, "layer_types", layer_types, "kiln's Qwen3 attends in full in every layer", family)
    dim, heads = _number(cfg, "hidden_size", where), _number(cfg, "num_attention_heads", where)
    inter, layers = _number(cfg, "intermediate_size", where), _number(cfg, "num_hidden_layers", where)
    vocab = _number(cfg, "vocab_size", where)
    kv = cfg.get("num_key_value_heads")
    kv = heads if kv is None else _number(cfg, "num_key_value_heads", where)
    context = _number(cfg, "max_position_embeddings", where, 2048 if llama else 32768)
    eps = _number(cfg, "rms_norm_eps", where, 1e-6, float)  # LlamaConfig's and Qwen3Config's default
    tied = cfg.get("tie_word_embeddings", False)
    if type(tied) is not bool:
        raise _refuse(where, "tie_word_embeddings", tied, "not true or false", family)
    fields = {"dim": dim, "n_heads": heads, "n_kv_heads": kv, "n_layers": layers, "vocab_size": vocab}
    fields |= {"multiple_of": inter, "norm_eps": eps, "context_len": context, "max_seq_len": context}
    hf_names = {
        "dim": "hidden_size",
        "n_heads": "num_attention_heads",
        "n_kv_heads": "num_key_value_heads",
        "n_layers": "num_hidden_layers",
        "multiple_of": "intermediate_size",
        "norm_eps": "rms_norm_eps",
        "context_len": "max_position_embeddings",
        "max_seq_len": "max_position_embeddings",
    }
    try:
        check_model_fields(fields, where)
    except ConfigError as e:  # name the config.json key, not kiln's field
        message = str(e)
        for ours, theirs in hf_names.items():
            message = message.replace(f"model {ours} ", f"{theirs} ")
        raise ConfigError(message) from None
    if llama:
        if dim % heads:
            raise _refuse(where, "num_attention_heads", heads, f"does not divide hidden_size {dim}")
        if cfg.get("head_dim") not in (None, dim // heads):
            raise _refuse(
                where, "head_dim", cfg["head_dim"], f"kiln's head_dim is hidden_size / heads = {dim // heads}"
            )
    if heads % kv:
        raise _refuse(where, "num_key_value_heads", kv, f"does not divide num_attention_heads {heads}", family)
    if llama:
        base = int(2 * 4 * dim / 3)
        shape: dict[str, Any] = {
            "multiple_of": inter,  # rounds the (scaled) 8/3*dim up to exactly `inter`
            "ffn_dim_multiplier": None if base <= inter else inter / base,
        }
    else:
        # Qwen3Config defaults head_dim to 128; Qwen3MoeConfig has none (the model uses hidden_size / heads).
        default_head = 128 if kind == "qwen3" else (dim // heads if dim % heads == 0 else None)
        head_dim = _number(cfg, "head_dim", where, default_head)
        shape = {"head_dim": head_dim, "qk_norm": True, "ffn_dim": inter}
        if kind == "qwen3_moe":
            shape |= _qwen3_moe(cfg, where)
    args = ModelArgs(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        vocab_size=vocab,
        norm_eps=float(eps),
        max_seq_len=context,
        context_len=context,
        tie_word_embeddings=tied,
        **shape,
        **_rope(cfg, where),
    )
    args.check_fields(where)  # the rope and Qwen3 values too
    if args.head_dim is not None and args.head_dim % 2:
        raise _refuse(where, "head_dim", args.head_dim, "RoPE rotates pairs: an odd head_dim", family)
    assert ffn_hidden_dim(args) == inter, (ffn_hidden_dim(args), inter)
    return args


def _qwen3_moe(cfg: dict, where: str) -> dict[str, Any]:
    """ModelArgs' MoE fields of a qwen3_moe config: an MoE FFN in every layer, softmax top-k routing."""
    step = _number(cfg, "decoder_sparse_step", where, 1)
    if step != 1:
        raise _refuse(where, "decoder_sparse_step", step, "kiln's Qwen3-MoE has an MoE FFN in every layer", "Qwen3-MoE")
    if cfg.get("mlp_only_layers") not in (None, []):
        raise _refuse(
            where, "mlp_only_layers", cfg["mlp_only_layers"], "kiln's Qwen3-MoE has no dense layers", "Qwen3-MoE"
        )
    # transformers 5 writes num_local_experts (num_experts its alias); the hub and transformers 4 num_experts.
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    experts = _number(cfg, key, where, 128)
    top_k = _number(cfg, "num_experts_per_tok", where, 8)
    hidden = _number(cfg, "moe_intermediate_size", where, 768)
    norm = cfg.get("norm_topk_prob", False)
    if type(norm) is not bool:
        raise _refuse(where, "norm_topk_prob", norm, "not true or false", "Qwen3-MoE")
    if experts < 1:
        raise _refuse(where, key, experts, "an MoE needs at least one expert", "Qwen3-MoE")
    return {"moe_num_experts": experts, "moe_top_k": top_k, "moe_hidden_dim": hidden, "moe_route_norm": norm}


def hf_config(args: ModelArgs, dtype: str, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers' LlamaForCausalLM, read the same by transformers 4 (rope_theta,
    rope_scaling, torch_dtype) and 5 (rope_parameters, dtype); for a Qwen3 (qk_norm) Qwen3ForCausalLM or, with
    experts, Qwen3MoeForCausalLM. A kiln model transformers cannot compute is a ConfigError."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
    if args.rope_scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": float(args.rope_theta),
            "factor": float(args.rope_scaling_factor),
            "low_freq_factor": float(args.rope_low_freq_factor),
            "high_freq_factor": float(args.rope_high_freq_factor),
            "original_max_position_embeddings": int(args.rope_original_max_seq_len),
        }
    legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if args.rope_scaling else None
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": ffn_hidden_dim(args),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": kv_heads(args),
        "head_dim": args.resolved_head_dim(),
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": legacy_scaling,
        "max_position_embeddings": args.context_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    return _qwen3_config(args, out) if args.qk_norm or args.moe else out


def _qwen3_config(args: ModelArgs, llama: dict[str, Any]) -> dict[str, Any]:
    """The Llama config.json turned into Qwen3's (or Qwen3-MoE's): its own head_dim, full attention, q/k norms."""
    if not args.qk_norm:
        raise ConfigError("an MoE without qk_norm has no transformers counterpart (Qwen3-MoE normalises q and k)")
    if args.rope_scaling:
        raise ConfigError("kiln exports Qwen3 with rope type default only")
    drop = ("mlp_bias", "rope_scaling")
    out = {k: v for k, v in llama.items() if k not in drop} | {"head_dim": args.resolved_head_dim()}
    out |= {"use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * args.n_layers}
    if not args.moe:
        return out | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    refused = [
        ("moe_score_func", args.moe_score_func != "softmax"),
        ("moe_route_scale", args.moe_route_scale != 1.0),
        ("moe_shared_hidden_dim", args.moe_shared_hidden_dim != 0),
    ]
    for field, differs in refused:
        if differs:
            raise ConfigError(
                f"model {field} {getattr(args, field)!r}: transformers' Qwen3-MoE routes by softmax, unscaled, "
                "without shared experts; the export would compute another model"
            )
    return out | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": args.moe_num_experts,
        "num_experts_per_tok": args.moe_top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "norm_topk_prob": args.moe_route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG))


MAX_JSON_BYTES = 64 * MiB  # config.json is ~1 KB; the index of a 405B model ~100 KB


def read_json(path: str) -> Any:
    """A JSON file of a model folder (config.json, the safetensors index): a regular file of bounded size and
    nesting, ConfigError naming it otherwise."""
    try:
        return loads_json(read_bounded(path, MAX_JSON_BYTES, "a JSON file of a model folder"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None


def write_json(path: str, obj: Any) -> None:
    """A JSON file of an exported model folder, written whole and never through a link (kiln_base.files)."""
    write_atomic(path, json.dumps(obj, indent=2).encode())


def read_hf_args(folder: str) -> ModelArgs:
    path = os.path.join(folder, CONFIG)
    return args_from_hf_config(read_json(path), path)


# ----------------------------------------------------------------------------- safetensors


def hf_weight_files(folder: str) -> dict[str, str]:
    """HF name -> safetensors file of every weight: from the index when there is one, else from the files."""
    from safetensors import safe_open

    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        loaded = read_json(index)
        weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index}: no weight_map (a JSON object: weight name -> safetensors file)")
        out = {}
        for name, file in weight_map.items():
            try:
                path = inside(folder, file, f"{index}: weight_map['{name}']")
            except FileRefused as e:
                raise ConfigError(str(e)) from None
            if not os.path.isfile(path):
                raise ConfigError(f"{index} names {path}, which is missing (or not a regular file)")
            out[name] = path
        return out
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no .safetensors files (kiln reads safetensors only, never pickled .bin)")
    out = {}
    for name in files:
        try:
            require_regular(os.path.join(folder, name))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{folder}: cannot read {name}: {e}") from None
        with _reading(os.path.join(folder, name)), safe_open(os.path.join(folder, name), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), os.path.join(folder, name)))
    return out


@contextlib.contextmanager
def _reading(path: str) -> Iterator[None]:
    """Around the reads of safetensors file `path`: a damaged file (safetensors' own error, a missing weight, a
    bad header) is a ConfigError naming it."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # SafetensorError is not exported under one stable name across versions
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(f"{path}: cannot read it as safetensors ({type(e).__name__}: {reason})") from None


def kiln_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The shape of every kiln weight of a model with `args` (models/llama3.py's layout), known before a byte of a
    weight file is read. An MoE's expert_bias is a buffer, in no Hugging Face file: not listed."""
    head = args.resolved_head_dim()
    q, kv, ffn = args.n_heads * head, kv_heads(args) * head, ffn_hidden_dim(args)
    layer: dict[str, tuple[int, ...]] = {
        "attention.wq.weight": (q, args.dim),
        "attention.wk.weight": (kv, args.dim),
        "attention.wv.weight": (kv, args.dim),
        "attention.wo.weight": (args.dim, q),
        "attention_norm.weight": (args.dim,),
        "ffn_norm.weight": (args.dim,),
    }
    if args.qk_norm:
        layer |= {"attention.q_norm.weight": (head,), "attention.k_norm.weight": (head,)}
    if args.moe:
        e, h = args.moe_num_experts, args.moe_hidden_dim
        layer |= {
            "moe.router.gate.weight": (e, args.dim),
            "moe.experts.w1": (e, h, args.dim),
            "moe.experts.w3": (e, h, args.dim),
            "moe.experts.w2": (e, args.dim, h),
        }
    else:
        layer |= {
            "feed_forward.w1.weight": (ffn, args.dim),
            "feed_forward.w3.weight": (ffn, args.dim),
            "feed_forward.w2.weight": (args.dim, ffn),
        }
    out = {f"layers.{i}.{k}": v for i in range(args.n_layers) for k, v in layer.items()}
    out |= {"tok_embeddings.weight": (args.vocab_size, args.dim), "norm.weight": (args.dim,)}
    return out | {"output.weight": (args.vocab_size, args.dim)}


def _file_entries(key: str, args: ModelArgs) -> list[str]:
    """The names kiln weight `key` is stored under in a Hugging Face safetensors file: one, or a routed expert
    weight's E per-expert names (the hub's layout, which transformers' save_pretrained writes), or none (a tied
    output; an expert bias, which must be zero: kiln_to_hf)."""
    m = re.fullmatch(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)", key)
    if m:
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[m.group(2)]
        return [f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.weight" for e in range(args.moe_num_experts)]
    if key.endswith(EXPERT_BIAS):
        return []
    name = hf_name(key, args)
    return [] if name is None else [name]


def _per_expert(key: str) -> tuple[str, int] | None:
    """(kiln name, expert) of an HF per-expert weight name, else None."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", key)
    return (f"layers.{m.group(1)}.{_PER_EXPERT[m.group(3)]}", int(m.group(2))) if m else None


HF_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a weight may be stored in


Part = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) of a box of a kiln weight, in kiln's layout


def _permuted_heads(kiln: str, args: ModelArgs) -> int | None:
    """The heads whose rows from_hf_tensor permutes, each within its head, for a 2-D weight; else None."""
    if kiln.endswith("attention.wq.weight"):
        return args.n_heads
    if kiln.endswith("attention.wk.weight"):
        return kv_heads(args)
    return None


def _read_part(f: Any, key: str, kiln: str, args: ModelArgs, part: Part | None) -> torch.Tensor:
    """HF weight `key` (kiln's `kiln`) in kiln's layout: whole, or only box `part` of it, read from the file as a
    slice (safetensors maps the file: what is not sliced is not read). A permuted q/k weight is read by whole heads
    (its rows move only within a head): at most two heads more than the box."""
    if part is None or kiln.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        whole = from_hf_tensor(kiln, f.get_tensor(key), args)
        return whole if part is None else whole[tuple(slice(o, o + n) for o, n in zip(*part))].contiguous()
    offset, shape = part
    heads = _permuted_heads(kiln, args)
    if heads is None:
        return f.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    hd = f.get_slice(key).get_shape()[0] // heads
    h0, h1 = offset[0] // hd, -(-(offset[0] + shape[0]) // hd)
    block = f.get_slice(key)[h0 * hd : h1 * hd, offset[1] : offset[1] + shape[1]]
    block = permute_from_hf(block, h1 - h0) if h1 > h0 else block
    return block[offset[0] - h0 * hd : offset[0] - h0 * hd + shape[0]].contiguous()


def iter_hf_as_kiln(
    folder: str, args: ModelArgs, part: Callable[[str], Part | None] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(kiln name, tensor in kiln's layout) for every weight of an HF folder, one file open at a time. Each
    weight's stored shape is checked against config.json's model before the weight is read (a file's header can
    declare a tensor of any size; a sparse file can back it), ConfigError naming the file and weight.

    `part(kiln name)`: the box of the weight to read (a rank's shard: read once, each rank only what it keeps; an
    empty box reads nothing), or None for the whole weight; the tensor yielded is that box."""
    from safetensors import safe_open

    shapes = kiln_shapes(args)
    by_file: dict[str, list[str]] = {}
    for name, path in hf_weight_files(folder).items():
        by_file.setdefault(path, []).append(name)
    # A routed expert weight arrives as E per-expert tensors, possibly across files: held until those of its box
    # are read (the others are never read); `experts` has every one the files hold, read or not.
    pending: dict[str, dict[int, torch.Tensor]] = {}
    experts: dict[str, set[int]] = {}
    yielded: set[str] = set()
    for path, names in sorted(by_file.items()):
        with _reading(path), safe_open(path, framework="pt") as f:
            for key in names:
                expert = _per_expert(key) if args.moe else None
                try:
                    kiln = expert[0] if expert is not None else kiln_name(key)
                except ConfigError as e:
                    raise ConfigError(f"{path}: {e}") from None
                if kiln is None:
                    continue
                stored = tuple(f.get_slice(key).get_shape())
                if kiln not in shapes or (expert is not None and expert[1] >= args.moe_num_experts):
                    raise ConfigError(
                        f"{path}: weight '{key}' is not part of the model of {CONFIG} ({args.n_layers} layers)"
                    )
                want = shapes[kiln][1:] if expert is not None else shapes[kiln]
                if stored != want:
                    raise ConfigError(
                        f"{path}: weight '{key}' has shape {stored}, but the model of {CONFIG} has {want}"
                    )
                dtype = f.get_slice(key).get_dtype()
                if dtype not in HF_FLOAT_DTYPES:  # copied into float weights, an int64 norm would load silently
                    raise ConfigError(
                        f"{path}: weight '{key}' is stored as {dtype}; a model weight must be a float "
                        f"({', '.join(HF_FLOAT_DTYPES)})"
                    )
                box = part(kiln) if part is not None else None
                if expert is None:
                    yield kiln, _read_part(f, key, kiln, args, box)
                    continue
                experts.setdefault(kiln, set()).add(expert[1])
                lo, n = (box[0][0], box[1][0]) if box is not None else (0, args.moe_num_experts)
                inner = (box[0][1:], box[1][1:]) if box is not None else None
                got = pending.setdefault(kiln, {})
                if lo <= expert[1] < lo + n:
                    got[expert[1]] = _read_part(f, key, "", args, inner)
                if len(got) == n and kiln not in yielded:
                    rest = inner[1] if inner is not None else want
                    yield kiln, torch.stack([got[i] for i in range(lo, lo + n)]) if n else torch.empty((0, *rest))
                    yielded.add(kiln)
                    got.clear()
    for kiln, seen in sorted(experts.items()):
        lacking = sorted(set(range(args.moe_num_experts)) - seen)
        if lacking:
            raise ConfigError(f"{folder}: no weight for expert {lacking[0]} of kiln's '{kiln}'")
    for layer in range(args.n_layers if args.moe else 0):  # kiln's balancing state, which HF has none of
        key = f"layers.{layer}.{EXPERT_BIAS}"
        box = part(key) if part is not None else None
        yield key, torch.zeros(args.moe_num_experts if box is None else box[1][0])


def save_hf_weights(
    keys: dict[str, tuple[tuple[int, ...], torch.dtype]],
    load: Callable[[list[str]], dict[str, torch.Tensor]],
    args: ModelArgs,
    out_dir: str,
    dtype: torch.dtype | None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write kiln weights as HF safetensors: `model.safetensors`, or shards `model-0000i-of-0000n.safetensors`
    plus `model.safetensors.index.json` when they exceed `max_shard_bytes`. `keys`: kiln name -> (shape,
    dtype); `load(names)` returns those kiln tensors. One shard's tensors are in memory at a time."""
    from safetensors.torch import save_file

    plan: list[list[tuple[str, list[str]]]] = [[]]
    size = total = 0
    for key, (shape, saved_dtype) in keys.items():
        if key.endswith(EXPERT_BIAS):
            _refuse_expert_bias(key, load([key])[key])
        stored = _file_entries(key, args)
        if not stored:
            continue
        n = torch.Size(shape).numel() * (dtype or saved_dtype).itemsize
        if plan[-1] and size + n > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((key, stored))
        size, total = size + n, total + n
    n = len(plan)
    names = [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    weight_map = {}
    for file, shard in zip(names, plan):
        tensors = load([k for k, _ in shard])
        out = {}
        for key, stored in shard:
            w = tensors.pop(key)
            parts = [to_hf_tensor(key, w, args)] if len(stored) == 1 and w.dim() < 3 else list(w.unbind(0))
            for name, part in zip(stored, parts, strict=True):
                part = part.contiguous()
                out[name] = part.to(dtype) if dtype is not None else part
                weight_map[name] = file
        refuse_link(os.path.join(out_dir, file))  # safetensors opens by name: no link may redirect it
        save_file(out, os.path.join(out_dir, file), metadata={"format": "pt"})
        os.chmod(os.path.join(out_dir, file), 0o666 & ~_umask())  # safetensors creates its files 0600
        del out, tensors
    if len(plan) > 1:
        write_json(os.path.join(out_dir, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; put it back at once (scripts are single-threaded)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- tokenizer and generation


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_json(tok: Tokenizer) -> dict[str, Any]:
    """tokenizer.json (Hugging Face tokenizers) encoding as `tok` does: the tiktoken ranks as a byte-level BPE
    vocabulary, the merges recovered from them (a token's merges: the splits into two lower-ranked tokens, as
    transformers' TikTokenConverter does), `ignore_merges` (a piece that is a whole token is taken as is, as
    tiktoken does), Llama 3's split pattern, and `<|begin_of_text|>` added in front (as Llama 3's does)."""
    ranks = tok.mergeable_ranks
    table = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(table[x] for x in b)

    merges = []
    for token, rank in ranks.items():
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                local.append((rank, ranks[left], ranks[right], left, right))
        merges.extend(sorted(local))
    merges.sort()
    bos = "<|begin_of_text|>"
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for s, i in tok.special_tokens.items()
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PAT_STR}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id], "tokens": [bos]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text(t): r for t, r in ranks.items()},
            "merges": [[text(a), text(b)] for *_, a, b in merges],
        },
    }


def write_tokenizer(tok: Tokenizer, out_dir: str, context_len: int) -> None:
    """tokenizer.json + tokenizer_config.json. `split_special_tokens`: special-token text inside a string is
    encoded as plain text, as kiln's Tokenizer.encode does (a document cannot smuggle in an end-of-text)."""
    write_atomic(
        os.path.join(out_dir, "tokenizer.json"), json.dumps(tokenizer_json(tok), ensure_ascii=False).encode("utf-8")
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "add_bos_token": True,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_len,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    write_json(os.path.join(out_dir, "tokenizer_config.json"), config)


def generation_config(bos_id: int, eos_id: int) -> dict[str, Any]:
    """generation_config.json: generate() stops at kiln's end-of-text."""
    return {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
