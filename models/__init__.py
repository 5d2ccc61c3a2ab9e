"""Llama 3 model definition for kiln: plain nn.Modules, no distributed or torchao code."""

from models.args import LLAMA3_FLAVORS, ModelArgs
from models.flops import flops_per_token, num_params
from models.llama3 import Transformer

__all__ = ["LLAMA3_FLAVORS", "ModelArgs", "Transformer", "flops_per_token", "num_params"]
