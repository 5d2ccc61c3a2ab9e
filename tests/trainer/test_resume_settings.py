"""Resume compatibility of changed settings (in-process, the small debug model): the data position and the run's
settings load with weights_only; changed steps rebuild the lr schedule at the resumed step; changed optimizer
settings apply; other data or another seq_len is refused with one line, touching nothing; moved data resumes;
a changed global batch goes on at the saved sequence; check_resume follows docs/checkpoint.md's table."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

import train as train_entry
from kiln_base.config import parse_args
from kiln_base.errors import CheckpointError
from models import ModelArgs
from tests.helpers.checkpoints import TINY, train_tiny
from tests.helpers.common import ROOT
from tests.helpers.data import GOOD
from trainer.checkpoint.manager import read_metadata
from trainer.checkpoint.resume import check_resume
from trainer.components.optim import lr_factor
from trainer.hooks import StepHook, StepOutput
from trainer.trainer import Trainer


class RecordLr(StepHook):
    def __init__(self, applied: list[float]) -> None:
        self.applied = applied

    def post_step(self, out: StepOutput) -> None:
        self.applied.append(float(out.lr))


CKPT = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "3", "--training.steps", "4")


def run_to_step_3(tmp_path: Path) -> None:
    """Train 4 steps (saves step-3 and step-4), then move step-4 out: kiln refuses a rollback in place, so a
    user resuming from step-3 with other settings first moves the later checkpoint aside."""
    train_tiny(tmp_path, *CKPT)
    (tmp_path / "checkpoint" / "step-4").rename(tmp_path / "step-4.moved")


def test_checkpoint_loader_and_settings_load_with_weights_only(tmp_path: Path, small_model: None) -> None:
    train_tiny(tmp_path, *CKPT)
    step = tmp_path / "checkpoint" / "step-3"
    md = read_metadata(str(step))
    items = {}
    for index, info in md.storage_data.items():
        if index.fqn.startswith(("dataloader.", "train_state.")):
            with open(step / info.relative_path, "rb") as f:
                f.seek(info.offset)
                items[index.fqn] = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    assert set(items) == {
        *("dataloader.sequences", "dataloader.epoch", "dataloader.shard", "dataloader.record", "dataloader.buffer"),
        *("train_state.step", "train_state.settings"),
    }
    assert items["dataloader.sequences"] == 6 and items["train_state.step"] == 3  # 3 steps x 2 sequences
    settings = json.loads(items["train_state.settings"])
    assert settings["training.steps"] == 4 and settings["training.seq_len"] == 32
    assert settings["data"]["files"] == [
        ["kiln_corpus.jsonl", os.path.getsize(ROOT / "assets/corpus/kiln_corpus.jsonl")]
    ]


def test_changed_steps_rebuild_the_lr_schedule_at_the_resumed_step(
    tmp_path: Path, small_model: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Saved at step 3 of 4 (the old schedule decays: lr factor 0.5 for step 4); resumed with 20 steps, step 4
    uses the 20-step schedule's lr (factor 1.0), and every later lr is that schedule's."""
    run_to_step_3(tmp_path)
    caplog.set_level(logging.WARNING, logger="kiln")
    resumed = Trainer(parse_args([*TINY, "--job.dump_folder", str(tmp_path), *CKPT[:3], "--training.steps", "20",
                                  "--checkpoint.load_step", "3"]))  # fmt: skip
    try:
        cfg = resumed.cfg
        sched = cfg.lr_scheduler

        def lr(step: int, total: int) -> float:
            decay = round((total - sched.warmup_steps) * sched.decay_ratio)
            return cfg.optimizer.lr * lr_factor(step, sched.warmup_steps, decay, total, "linear", 0.0)

        assert lr(3, 4) != lr(3, 20)
        assert resumed.step == 3 and resumed.optimizer.param_groups[0]["lr"] == lr(3, 20)
        assert "changed training.steps (4 there, 20 in this run)" in caplog.text
        applied: list[float] = []
        resumed.train([RecordLr(applied)])  # 17 more steps: each logged lr is the 20-step schedule's
    finally:
        resumed.close()
    assert resumed.lr_scheduler.last_epoch == 20 and applied[-1] == lr(19, 20)


def test_changed_optimizer_settings_apply(tmp_path: Path, small_model: None, caplog: pytest.LogCaptureFixture) -> None:
    run_to_step_3(tmp_path)
    caplog.set_level(logging.WARNING, logger="kiln")
    args = [*TINY, "--job.dump_folder", str(tmp_path), *CKPT, "--checkpoint.load_step", "3"]
    resumed = Trainer(parse_args([*args, "--optimizer.weight_decay", "0.3", "--optimizer.beta2", "0.99"]))
    group = resumed.optimizer.param_groups[0]
    resumed.close()
    assert group["weight_decay"] == 0.3 and group["betas"] == (0.9, 0.99)  # the checkpoint held 0.1 and 0.95
    assert "changed optimizer.weight_decay (0.1 there, 0.3 in this run)" in caplog.text


@pytest.mark.parametrize("change", ["dataset_path", "seq_len"])
def test_refused_changes_exit_2_and_touch_nothing(
    tmp_path: Path, small_model: None, capsys: pytest.CaptureFixture, change: str
) -> None:
    train_tiny(tmp_path, *CKPT)
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(GOOD) + "\n")
    extra = ["--training.dataset_path", str(other)] if change == "dataset_path" else ["--training.seq_len", "64"]
    (tmp_path / "checkpoint" / "step-9.tmp").mkdir()  # a stale temp folder: a refused run deletes nothing
    before = sorted(str(p) for p in (tmp_path / "checkpoint").rglob("*"))
    assert train_entry.main([*TINY, "--job.dump_folder", str(tmp_path), *CKPT, *extra]) == 2
    err = capsys.readouterr().err
    step = tmp_path / "checkpoint" / "step-4"
    want = {
        "dataset_path": f"kiln: error: checkpoint {step} was saved with other data (files: ",
        "seq_len": f"kiln: error: checkpoint {step} was saved with other training.seq_len (32 there, 64 in this run): "
        "its data position counts sequences of the saved length",
    }[change]
    assert err.count("\n") == 1 and err.startswith(want), err
    assert sorted(str(p) for p in (tmp_path / "checkpoint").rglob("*")) == before


def test_moved_data_resumes(tmp_path: Path, small_model: None) -> None:
    """The data's identity is its files' names and sizes, not its folder: a moved copy resumes."""
    run_to_step_3(tmp_path)
    moved = tmp_path / "moved" / "kiln_corpus.jsonl"
    moved.parent.mkdir()
    shutil.copy(ROOT / "assets" / "corpus" / "kiln_corpus.jsonl", moved)
    args = [*TINY, "--job.dump_folder", str(tmp_path), *CKPT, "--checkpoint.load_step", "3"]
    resumed = Trainer(parse_args([*args, "--training.dataset_path", str(moved)]))
    resumed.close()
    assert resumed.step == 3 and resumed.dataloader.state_dict()["sequences"] == 6


def test_check_resume_table() -> None:
    """Each row of docs/checkpoint.md's table: refused keys raise, handled and warned keys warn."""
    model = {**{f.name: f.default for f in dataclasses.fields(ModelArgs)}, "dim": 64}  # as a run records it
    base = {
        "data": {"files": [["a.jsonl", 10]]},
        "model.tokenizer": "abc",
        "training.seq_len": 32,
        "model": model,
        "training.steps": 10,
        "lr_scheduler": {"warmup_steps": 2},
        "optimizer.name": "AdamW",
        **{f"optimizer.{k}": 0.1 for k in ("lr", "beta1", "beta2", "eps", "weight_decay")},
        "training.global_batch_size": 8,
        "float8": {"enable_float8_linear": False},
        "training.mixed_precision_param": "float32",
    }
    assert check_resume(base, dict(base), "ckpt") == []
    for key, new in [("data", {"hub": "allenai/c4/en"}), ("model.tokenizer", "abd"), ("training.seq_len", 64),
                     ("model", {**model, "rope_theta": 1.0})]:  # fmt: skip
        with pytest.raises(CheckpointError, match=f"ckpt was saved with other {key} "):
            check_resume(base, {**base, key: new}, "ckpt")
    for key, new in [("training.steps", 20), ("lr_scheduler", {"warmup_steps": 5}), ("optimizer.eps", 0.2),
                     ("training.global_batch_size", 16), ("float8", {"enable_float8_linear": True}),
                     ("training.mixed_precision_param", "bfloat16")]:  # fmt: skip
        warnings = check_resume(base, {**base, key: new}, "ckpt")
        assert len(warnings) == 1 and f"changed {key} " in warnings[0], key


def test_changed_global_batch_continues_at_the_saved_sequence(tmp_path: Path, small_model: None) -> None:
    run_to_step_3(tmp_path)
    args = [*TINY, "--job.dump_folder", str(tmp_path), *CKPT, "--checkpoint.load_step", "3"]
    resumed = Trainer(parse_args([*args, "--training.local_batch_size", "4"]))
    resumed.close()
    assert resumed.dataloader.state_dict()["sequences"] == 6  # 3 steps x 2: the data goes on from there
