"""Whole runs through tests/helpers/loss_driver.py on 1 process or FSDP on 2 ranks (torchrun), each from a copy of
one initial checkpoint, with rank 0's exact losses: what the sample-order and preemption suites compare.

The debug model with 2 layers, fp32, deterministic; 6 steps of 4 sequences of 32 tokens. Every run starts from the
same weights-only checkpoint (step-0): FSDP initialises each shard from its own RNG stream, so a fresh 2-rank
initialisation differs from the 1-rank one; from the same weights the curves must agree. The runs that several
tests compare with (the initial checkpoint, the straight 1- and 2-rank runs) are the fixtures of tests/e2e/conftest.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from models import LLAMA3_FLAVORS, Transformer
from tests.helpers.common import tiny_run_args
from tests.helpers.data import TOKENIZER
from tests.helpers.kiln_process import LOSS_DRIVER, run_kiln

RUN = tiny_run_args("--training.deterministic", "--model.n_layers", "2", "--training.steps", "6",
                    "--checkpoint.enable_checkpoint")  # fmt: skip
ONE_RANK = ("--training.local_batch_size", "4")
TWO_RANKS = ("--training.local_batch_size", "2")
TIMEOUT = 600


def kiln_args(out: Path, dump: Path, args: tuple[str, ...], nproc: int) -> dict[str, Any]:
    """run_kiln / start_kiln arguments: loss_driver.py writing `out`, RUN in the layout of `nproc` ranks (global
    batch 4) dumping to `dump`, then `args`; one OpenMP thread per rank."""
    layout = ONE_RANK if nproc == 1 else TWO_RANKS
    return {
        "args": [out, *RUN, *layout, "--job.dump_folder", dump, *args],
        "launcher": "python" if nproc == 1 else "torchrun",
        "script": LOSS_DRIVER,
        "ngpu": nproc,
        "threads": 1,
        "env": {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(TIMEOUT)},
    }


def drive(dump: Path, *args: str, nproc: int = 1) -> dict[str, Any]:
    """Run to the end; return {'first_step', 'losses'} of rank 0 (exact floats)."""
    out = dump.with_suffix(".json")
    proc = run_kiln(**kiln_args(out, dump, args, nproc), timeout=TIMEOUT, log=dump.parent / f"{dump.name}.log")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def with_init(init: Path, dump: Path, step: Path | None = None) -> Path:
    """dump/checkpoint holding the initial weights (or a copy of checkpoint `step`)."""
    source = step if step is not None else init / "step-0"
    shutil.copytree(source, dump / "checkpoint" / source.name)
    return dump


def save_initial_weights(root: Path) -> None:
    """root/init/step-0: the weights-only checkpoint every run starts from (seed 0)."""
    import torch.distributed.checkpoint as dcp

    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=TOKENIZER.n_words, n_layers=2, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    dcp.save(model.state_dict(), checkpoint_id=str(root / "init" / "step-0"))
