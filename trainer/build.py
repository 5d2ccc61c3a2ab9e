"""The one model-build path, shared by the Trainer and the dry run so the two cannot drift:

    flavor + overrides -> ModelArgs -> model on the meta device -> float8 conversion -> parallelize

The caller materialises the weights (`to_empty` + `init_weights`) on its device afterwards; the dry run never does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from float8.converter import Float8Converter
from models import LLAMA3_FLAVORS, ModelArgs, Transformer, flops_per_token, num_params
from models.args import first_difference
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_llama
from trainer.config import FROM_CHECKPOINT, JobConfig, Model
from trainer.errors import ConfigError


@dataclass
class BuiltModel:
    model: Transformer  # on the meta device, float8-converted and parallelized
    args: ModelArgs
    n_params: int  # before sharding: the whole model's
    flops_per_token: float  # 6N + 12LHQT at the configured seq_len (MFU's numerator per token)
    linear_fqns: list[str]  # every nn.Linear (Float8Linear included), named before AC/compile wrapping
    tp_plan: dict[str, ParallelStyle]  # module FQN -> TP style applied; empty without TP


def base_args(m: Model, stored: ModelArgs | None) -> ModelArgs:
    """The flavor's ModelArgs, or with model.flavor from_checkpoint the stored ones (checkpoint.initial_load_path)."""
    if m.flavor == FROM_CHECKPOINT:
        assert stored is not None, "config validation requires checkpoint.initial_load_path with from_checkpoint"
        return stored
    return LLAMA3_FLAVORS[m.flavor]


SHAPE_OVERRIDES = ("vocab_size", "n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim_multiplier", "multiple_of")


def model_args(
    m: Model, seq_len: int, tokenizer_words: int, stored: ModelArgs | None = None, source: str = ""
) -> ModelArgs:
    """The flavor's shape with the vocabulary from the tokenizer (or model.vocab_size) and the model.* overrides
    (n_layers, dim, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of).

    `stored`: the shape stored with checkpoint.initial_load_path (`source`). With model.flavor from_checkpoint it
    is the shape (the overrides may only repeat it); with a named flavor, every field that
    changes what the weights compute must equal it, or the first that differs is named."""
    if m.vocab_size is not None and m.vocab_size < tokenizer_words:
        raise ConfigError(f"model.vocab_size ({m.vocab_size}) is smaller than the tokenizer's {tokenizer_words} tokens")
    if m.flavor == FROM_CHECKPOINT:
        assert stored is not None, "config validation requires checkpoint.initial_load_path with from_checkpoint"
        for key in SHAPE_OVERRIDES:
            ours, theirs = getattr(m, key), getattr(stored, key)
            if key == "n_kv_heads" and theirs is None:
                theirs = stored.n_heads
            if ours is not None and ours != theirs:
                raise ConfigError(f"model.{key} {ours} differs from {source}'s {theirs} (model.flavor from_checkpoint)")
        if stored.vocab_size < tokenizer_words:
            raise ConfigError(
                f"{source} has a vocabulary of {stored.vocab_size}, smaller than model.tokenizer_path's "
                f"{tokenizer_words} tokens: another tokenizer's model"
            )
        return dataclasses.replace(stored, max_seq_len=seq_len)
    flavor = LLAMA3_FLAVORS[m.flavor]
    overrides = {key: getattr(m, key) for key in SHAPE_OVERRIDES if getattr(m, key) is not None}
    args = dataclasses.replace(flavor, **{"vocab_size": tokenizer_words, **overrides, "max_seq_len": seq_len})
    check_heads(args, m.flavor)
    if stored is not None:
        diff = first_difference(stored, args)
        if diff is not None:
            field, there, here = diff
            raise ConfigError(
                f"checkpoint.initial_load_path {source} holds another model than model.flavor {m.flavor}: {field} is "
                f"{there!r} there but {here!r} here; set model.flavor from_checkpoint to train the stored shape"
            )
    return args


def check_heads(args: ModelArgs, flavor: str) -> None:
    """model.dim / n_heads / n_kv_heads (the flavor's where not overridden) must split into whole heads of even
    size (RoPE rotates pairs) and whole query groups."""
    kv = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
    shape = f"model.dim {args.dim}, model.n_heads {args.n_heads}, model.n_kv_heads {kv} (flavor {flavor} + overrides)"
    if args.dim % args.n_heads or (args.dim // args.n_heads) % 2:
        raise ConfigError(f"{shape}: n_heads must divide dim into heads of even size (RoPE rotates pairs)")
    if args.n_heads % kv:
        raise ConfigError(f"{shape}: n_kv_heads must divide n_heads (each key/value head serves a whole group)")


def build_model(
    cfg: JobConfig,
    parallel_dims: ParallelDims,
    tokenizer_words: int,
    float8: Float8Converter | None,
    stored: ModelArgs | None = None,
    source: str = "",
) -> BuiltModel:
    """Build the configured model on the meta device, convert to float8 (if a converter is given), parallelize.
    `stored`, `source`: the shape stored with checkpoint.initial_load_path and its path (see model_args)."""
    args = model_args(cfg.model, cfg.training.seq_len, tokenizer_words, stored, source)
    with torch.device("meta"):
        model = Transformer(args)
    if float8 is not None:
        float8.convert(model)
    linear_fqns = [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    n_params, flops = num_params(model), flops_per_token(args, model, cfg.training.seq_len)
    tp_plan = parallelize_llama(
        model, parallel_dims, cfg.training, cfg.parallelism, cfg.activation_checkpoint, cfg.float8
    )
    return BuiltModel(model, args, n_params, flops, linear_fqns, tp_plan)
