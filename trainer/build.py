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
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_llama
from trainer.config import JobConfig, Model
from trainer.errors import ConfigError


@dataclass
class BuiltModel:
    model: Transformer  # on the meta device, float8-converted and parallelized
    args: ModelArgs
    n_params: int  # before sharding: the whole model's
    flops_per_token: float  # 6N + 12LHQT at the configured seq_len (MFU's numerator per token)
    linear_fqns: list[str]  # every nn.Linear (Float8Linear included), named before AC/compile wrapping
    tp_plan: dict[str, ParallelStyle]  # module FQN -> TP style applied; empty without TP


def model_args(m: Model, seq_len: int, tokenizer_words: int) -> ModelArgs:
    """The flavor's shape with the vocabulary from the tokenizer (or model.vocab_size) and model.n_layers."""
    if m.vocab_size is not None and m.vocab_size < tokenizer_words:
        raise ConfigError(f"model.vocab_size ({m.vocab_size}) is smaller than the tokenizer's {tokenizer_words} tokens")
    flavor = LLAMA3_FLAVORS[m.flavor]
    return dataclasses.replace(
        flavor,
        vocab_size=m.vocab_size or tokenizer_words,
        n_layers=m.n_layers or flavor.n_layers,
        max_seq_len=seq_len,
    )


def build_model(
    cfg: JobConfig, parallel_dims: ParallelDims, tokenizer_words: int, float8: Float8Converter | None
) -> BuiltModel:
    """Build the configured model on the meta device, convert to float8 (if a converter is given), parallelize."""
    args = model_args(cfg.model, cfg.training.seq_len, tokenizer_words)
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
