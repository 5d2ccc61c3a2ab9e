"""Profiler traces, memory-snapshot warning, NaN/inf guard, compare_runs.py (float8 numerics: test_numerics.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

import train
from scripts.compare_runs import main as compare_main
from tests.helpers.common import tiny_run_args
from trainer.step.guards import NonFiniteError, last_checkpoint
from trainer.step.step import StepResult, TrainStep


def test_profiler_traces_every_freq_steps_and_cpu_snapshot_warns(
    tmp_path: Path, tiny_args: Callable[..., list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kiln")
    argv = tiny_args("--training.steps", "8", "--profiling.enable_profiling", "--profiling.profile_freq", "4")
    assert train.main([*argv, "--profiling.enable_memory_snapshot"]) == 0
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*_trace.json"))
    assert traces == ["profile_trace/iteration_4/rank0_trace.json", "profile_trace/iteration_8/rank0_trace.json"]
    events = json.loads((tmp_path / traces[0]).read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert "memory snapshots are CUDA-only" in caplog.text
    assert not (tmp_path / "memory_snapshot").exists()


def test_profile_freq_below_warmup_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = tiny_run_args(
        "--job.dump_folder", str(tmp_path / "run"), "--profiling.enable_profiling", "--profiling.profile_freq", "2"
    )
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "kiln: error: profiling.profile_freq must be >= 4 with profiling on (3 warm-up steps + 1 traced), got 2\n"
    )
    assert not (tmp_path / "run").exists()  # refused before anything was built or written


def _argv(dump: Path, *extra: str) -> list[str]:
    """The tiny fp32 debug run (no AC) into `dump`, then `extra`."""
    return tiny_run_args("--job.dump_folder", str(dump), *extra)


def _poison_step(monkeypatch: pytest.MonkeyPatch, bad_step: int) -> None:
    """NaN times the loss of step `bad_step` (the step object's loss function, put back after the step)."""
    call = TrainStep.__call__

    def poisoned(self: TrainStep, step: int) -> StepResult:
        if step != bad_step:
            return call(self, step)
        loss_fn = self.loss_fn
        self.loss_fn = lambda *args: loss_fn(*args) * float("nan")
        try:
            return call(self, step)
        finally:
            self.loss_fn = loss_fn

    monkeypatch.setattr(TrainStep, "__call__", poisoned)


def test_nan_guard_stops_at_next_log_step_naming_step_and_checkpoint(
    tmp_path: Path, tiny_args: Callable[..., list[str]], make_trainer: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"]
    assert train.main(tiny_args("--training.steps", "2", *ckpt)) == 0  # a real, complete step-2
    (tmp_path / "checkpoint" / "step-7.tmp").mkdir()  # an unfinished save never counts as good
    _poison_step(monkeypatch, bad_step=5)
    t = make_trainer(tiny_args("--training.steps", "10", "--metrics.log_freq", "3", *ckpt[:2], "100"))
    with pytest.raises(NonFiniteError, match="non-finite loss or grad norm at step 5") as e:
        t.train()
    assert f"Last good checkpoint: {tmp_path}/checkpoint/step-2" in str(e.value)
    assert t.step == 6  # noticed at the first log step after the bad one (log_freq 3), not later


def test_nan_guard_checks_before_every_save(
    tmp_path: Path, tiny_args: Callable[..., list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _poison_step(monkeypatch, bad_step=2)
    argv = tiny_args("--training.steps", "6", "--metrics.log_freq", "100")
    argv += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"]
    assert train.main(argv) == 1
    folder = tmp_path / "checkpoint"
    assert [p.name for p in folder.iterdir()] == [".kiln.lock"]  # step 2's save never happened (the lock is kiln's)


def test_last_checkpoint_none(tmp_path: Path) -> None:
    assert last_checkpoint(str(tmp_path / "missing")) == "none"


def test_compare_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = "[rank0]:12:00:00 INFO step: {s:2}  loss: {l:7.4f}  memory:  0.10GiB(1.00%)  tps: 1,000  mfu: n/a"
    line += "  grad_norm: {g:7.4f}  lr: 8.0000e-04"
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("\n".join(line.format(s=s, l=8.0 - s * 0.1, g=1.0) for s in range(1, 11)) + "\n")
    b.write_text("\n".join(line.format(s=s, l=(8.0 - s * 0.1) * (1.02 if s == 7 else 1), g=1.0) for s in range(1, 11)))
    assert compare_main([str(a), str(b), "--rtol", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "compared 10 steps (1..10)" in out and "loss       max rel diff 2.0000% (step 7)" in out
    assert compare_main([str(a), str(b), "--rtol", "0.01"]) == 1
    assert compare_main([str(a), str(tmp_path / "missing.log")]) == 2
    # Three runs, each against the first, and the loss picture (matplotlib, the dev extra).
    c = tmp_path / "c.log"
    c.write_text("\n".join(line.format(s=s, l=(8.0 - s * 0.1) * 1.1, g=1.0) for s in range(1, 11)))
    png = tmp_path / "loss.png"
    assert compare_main([str(a), str(b), str(c), "--rtol", "0.05", "--plot", str(png), "--labels", "x,y,z"]) == 1
    out = capsys.readouterr().out
    assert f"{c}: compared 10 steps" in out and "max rel diff 10.0000%" in out and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
