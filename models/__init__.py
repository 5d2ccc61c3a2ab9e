"""Llama 3 and Qwen3 (dense and mixture-of-experts) model definitions for kiln: plain nn.Modules, no distributed or
torchao code."""

from models.args import LLAMA3_FLAVORS, QWEN3_FLAVORS, ModelArgs
from models.flops import active_params, flops_per_token, num_params
from models.llama3 import Transformer
from models.moe import MoE, load_balance_loss, moe_layers, update_expert_bias

__all__ = [
    "LLAMA3_FLAVORS",
    "QWEN3_FLAVORS",
    "MoE",
    "ModelArgs",
    "Transformer",
    "active_params",
    "flops_per_token",
    "load_balance_loss",
    "moe_layers",
    "num_params",
    "update_expert_bias",
]
