"""What the checkpoint and resume tests share: a small debug model, the deterministic tiny run, and views of a
checkpoint folder. The `small_model` fixture (tests/conftest.py) puts SMALL in place of the debug model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from models import ModelArgs
from tests.helpers.common import run_trainer, tiny_run_args

if TYPE_CHECKING:
    from trainer.trainer import Trainer

# A 2-layer, dim-64 debugmodel: its saves are about 1 MB instead of 76 MB.
SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, rope_theta=500000)
TINY = tiny_run_args("--training.deterministic")


def train_tiny(dump: Path, *args: str) -> Trainer:
    """Build, train and close the deterministic tiny run (TINY) dumping to `dump`, with `args` on top."""
    return run_trainer([*TINY, "--job.dump_folder", str(dump), *args])


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file's size and mtime, except the folder lock (each run takes it and writes its pid@host there)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.name != ".kiln.lock"
    }


def names(folder: Path) -> list[str]:
    """The checkpoint folder's entries, without kiln's hidden lock file."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


class StepCounter:
    """The smallest stateful object a CheckpointManager saves beside a model: a step number."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]
