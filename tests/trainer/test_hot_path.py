"""Hot-path hygiene: a training step that is not a log step never reads a value back from the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln_base.internals import TorchDispatchMode
from tests.helpers.common import DEBUG_CONFIG, open_trainer

# Ops that copy a device value to the host (.item(), bool(tensor), .tolist()): each is a CUDA sync point.
SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("accum", "skip"), [("2", "0"), ("4", "0"), ("2", "3")])
def test_non_log_step_has_no_host_sync(tmp_path: Path, accum: str, skip: str) -> None:
    """Also with training.skip_nonfinite_steps: its decision stays on the device."""
    argv = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), "--training.seq_len", "32"]
    argv += ["--training.local_batch_size", "2", "--training.global_batch_size", accum, "--model.n_layers", "2"]
    argv += ["--training.skip_nonfinite_steps", skip]
    with open_trainer([*argv, "--training.steps", "3"]) as trainer:
        trainer.train_step(1)  # the first step may initialise optimizer state
        counter = SyncCounter()
        with counter:
            trainer.train_step(2)
        assert counter.calls == []
        # and the counter does see a host read when there is one
        with counter:
            trainer.train_step(3).loss.item()
        assert counter.calls == ["aten._local_scalar_dense.default"]
