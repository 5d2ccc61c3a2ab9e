"""What many tests share: the repo root, a tiny exact (fp32) debug-model run, a Trainer that always closes.

Module-level names here serve code that runs at import time (constants, parametrize lists); tests/conftest.py
offers the same as fixtures.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kiln_base.internals import cpu_scaled_mm_supports_rowwise

if TYPE_CHECKING:
    from trainer.hooks import StepHook
    from trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
DEBUG_CONFIG = str(ROOT / "train_configs" / "debug_model.toml")
TOKENIZER_PATH = ROOT / "assets" / "tokenizer" / "tokenizer.model"


def project_files(*suffixes: str) -> list[Path]:
    """The project's own files ending in `suffixes`, as git sees them (tracked, or new and not ignored), sorted;
    never a virtual environment's or a dot-folder's files, wherever they sit in the checkout. Without git (an
    unpacked archive), every file under ROOT outside those folders."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            capture_output=True,
            check=True,
        ).stdout.decode()
        paths = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if p.is_file()]
    venvs: dict[Path, bool] = {}

    def outside(path: Path) -> bool:
        for parent in path.relative_to(ROOT).parents:
            if parent.name.startswith("."):
                return False
            if parent not in venvs:
                venvs[parent] = (ROOT / parent / "pyvenv.cfg").exists()
            if venvs[parent]:
                return False
        return True

    return sorted(p for p in paths if p.name.endswith(suffixes) and p.is_file() and outside(p))


# A guard against hangs, never a verdict: a loaded 2-core machine can take minutes to import torch in a subprocess.
HANG_TIMEOUT_S = 900


def tiny_run_args(*extra: str, ac: str = "none") -> list[str]:
    """train.py arguments for the debug model at seq 32, batch 2, fp32 compute, then `extra` (later wins).

    Steps, lr and warm-up are pinned to the values the tests were written and measured with (the debug config's
    are tuned for the README's first run)."""
    return [
        *("--job.config_file", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2"),
        *("--training.steps", "10", "--optimizer.lr", "8e-4", "--lr_scheduler.warmup_steps", "2"),
        *("--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", ac),
        *extra,
    ]


@contextlib.contextmanager
def open_trainer(argv: list[str]) -> Iterator[Trainer]:
    """A Trainer built from train.py arguments, closed (data thread, checkpoint, process group) however the
    block ends. A Trainer that fails in __init__ leaves its process group to conftest's cleanup fixture."""
    from kiln_base.config import parse_args
    from trainer.trainer import Trainer  # lazy: importing tests.helpers.common stays light

    trainer = Trainer(parse_args(argv))
    try:
        yield trainer
    finally:
        trainer.close()


def run_trainer(argv: list[str], extra_hooks: Sequence[StepHook] = ()) -> Trainer:
    """Build, train to training.steps (with `extra_hooks` after kiln's own) and close a Trainer; return it (losses,
    model, step) for inspection."""
    with open_trainer(argv) as trainer:
        trainer.train(extra_hooks)
    return trainer


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def store_process(port: int) -> Iterator[subprocess.Popen[bytes]]:
    """A TCPStore server on localhost:`port` in a process of its own, listening when this yields: kill the process
    to lose the store as a node's loss would. Killed at the end."""
    keep = "import sys, torch.distributed as d; s = d.TCPStore('localhost', int(sys.argv[1]), is_master=True); "
    server = subprocess.Popen(
        [sys.executable, "-c", keep + "print('ready', flush=True); sys.stdin.read()", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        yield server
    finally:
        server.kill()
        server.wait()


# torch 2.11's CPU float8 matmul takes per-tensor scales only: rowwise recipes train on a CPU from torch 2.13 on
# (on GPUs with either). The oldest-torch leg (scripts/test_oldest_torch.sh) skips them; the main suite runs them.
needs_cpu_rowwise = pytest.mark.skipif(
    not cpu_scaled_mm_supports_rowwise(), reason="this torch's CPU _scaled_mm has no per-row scales (torch 2.11)"
)


class LogLines(logging.Handler):
    """Collects the messages of the loggers it is added to (at `level` and above), for tests to read back."""

    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def kiln_log_lines() -> Iterator[LogLines]:
    """kiln's log records (INFO and up) collected while the block runs, as LogLines."""
    lines, logger = LogLines(), logging.getLogger("kiln")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
