"""Checkpoint seam: the Trainer calls load() once before training and maybe_save() after each step."""

from __future__ import annotations

from typing import Any

from trainer.config import Checkpoint, ConfigError


class CheckpointManager:
    def __init__(self, cfg: Checkpoint, folder: str, states: dict[str, Any]) -> None:
        if cfg.enable_checkpoint:
            raise ConfigError("checkpoint.enable_checkpoint: checkpointing is not implemented yet")
        self.cfg = cfg

    def load(self) -> int:
        """Load the latest (or checkpoint.load_step) checkpoint into `states`; return its step (0 if none)."""
        return 0

    def maybe_save(self, step: int, last: bool = False) -> None:
        pass

    def close(self) -> None:
        pass
