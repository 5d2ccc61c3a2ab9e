"""checkpoint.create_seed_checkpoint (torchtitan's key): write the initial weights as step-0 and exit; a later run on
the same folder starts from them. Refused without checkpoints, and on a folder that already holds a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln_base.config import parse_args
from kiln_base.errors import CheckpointError, ConfigError
from tests.helpers.common import open_trainer, tiny_run_args


def test_seed_checkpoint_is_step_0_and_the_next_run_starts_from_it(tmp_path: Path) -> None:
    ckpt = ("--job.dump_folder", str(tmp_path), "--checkpoint.enable_checkpoint", "--training.steps", "2")
    with open_trainer(tiny_run_args(*ckpt, "--training.seed", "3", "--checkpoint.create_seed_checkpoint")) as seed:
        initial = {k: v.detach().clone() for k, v in seed.model.state_dict().items()}
        seed.train()
        assert seed.step == 0 and seed.losses == []  # nothing trained
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*")) == ["step-0"]
    # Another seed: the weights still come from the seed checkpoint, which the run resumes.
    with open_trainer(tiny_run_args(*ckpt, "--training.seed", "4")) as run:
        assert run.checkpointer.loaded == str(tmp_path / "checkpoint" / "step-0")
        for k, v in run.model.state_dict().items():
            assert torch.equal(v, initial[k]), k
        run.train()
        assert run.step == 2
    with open_trainer(tiny_run_args(*ckpt, "--checkpoint.create_seed_checkpoint")) as again:
        with pytest.raises(CheckpointError, match="already holds .*step-2; a seed checkpoint starts a run"):
            again.train()
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*")) == ["step-0", "step-2"]


def test_seed_checkpoint_needs_checkpoints_on(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="create_seed_checkpoint writes step-0 .*add --checkpoint.enable_checkpoint"):
        parse_args(tiny_run_args("--job.dump_folder", str(tmp_path), "--checkpoint.create_seed_checkpoint"))


def test_a_run_from_the_seed_checkpoint_trains_as_one_from_scratch(tmp_path: Path) -> None:
    """AdamW's state in step-0 is a fresh optimizer's (step counts 0, not the 1 of torch's zero-step fill), so from
    step 2 on the seeded run's losses are the from-scratch run's, bitwise (the layouts: tests/e2e)."""
    run = ("--checkpoint.enable_checkpoint", "--training.steps", "3", "--training.seed", "7")
    run = (*run, "--training.deterministic")
    with open_trainer(tiny_run_args(*run, "--job.dump_folder", str(tmp_path / "scratch"))) as scratch:
        scratch.train()
    seeded = ("--job.dump_folder", str(tmp_path / "seeded"))
    with open_trainer(tiny_run_args(*run, *seeded, "--checkpoint.create_seed_checkpoint")) as seed:
        seed.train()
        assert {float(s["step"]) for s in seed.optimizer.state.values()} == {0.0}
    with open_trainer(tiny_run_args(*run, *seeded)) as run_from_seed:
        assert {float(s["step"]) for s in run_from_seed.optimizer.state.values()} == {0.0}
        run_from_seed.train()
    assert len(scratch.losses) == 3 and run_from_seed.losses == scratch.losses
