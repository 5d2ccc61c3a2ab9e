"""The float8 model converter (seam for the float8 issue): config -> torchao conversion + post-optimizer hook."""

from __future__ import annotations

import torch.nn as nn

from trainer.config import ConfigError, Float8


class Float8Converter:
    def __init__(self, cfg: Float8) -> None:
        self.cfg = cfg

    def convert(self, model: nn.Module) -> None:
        raise ConfigError("float8.enable_float8_linear: float8 training is not implemented yet")

    def post_optimizer_hook(self, model: nn.Module) -> None:
        pass


def build_float8_converter(cfg: Float8) -> Float8Converter | None:
    return Float8Converter(cfg) if cfg.enable_float8_linear else None
