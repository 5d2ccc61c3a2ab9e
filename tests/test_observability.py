"""Profiler traces, memory-snapshot warning, NaN/inf guard, per-layer float8 SQNR, compare_runs.py."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import train
from float8.sqnr import Float8SQNRMonitor
from scripts.compare_runs import main as compare_main
from tests.common import tiny_run_args
from tests.sac_helpers import batch, debug_model, loss_fn
from trainer.config import parse_args
from trainer.tools.guards import NonFiniteError, last_checkpoint
from trainer.train import Trainer


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
    forward_loss = Trainer.forward_loss

    def poisoned(self: Trainer, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = forward_loss(self, inputs, labels)
        return loss * float("nan") if self.step == bad_step else loss

    monkeypatch.setattr(Trainer, "forward_loss", poisoned)


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


def test_sqnr_points_at_the_layer_that_hurts() -> None:
    model = debug_model("tensorwise", save_list=None)
    # A layer whose float8 output is off by ~30% noise (as a badly scaled layer would be): registered
    # before the monitor, so the monitor sees the damaged output.
    bad = model.layers["1"].feed_forward.w2
    bad.register_forward_hook(lambda m, i, out: out + 0.3 * out.std() * torch.randn_like(out))
    monitor = Float8SQNRMonitor(model)
    monitor.active = True
    with torch.no_grad():
        loss_fn(model, batch())()
    values = monitor.log(step=1)
    assert len(values) == 14 and all(math.isfinite(v) for v in values.values())
    worst = min(values, key=values.get)
    assert worst == "layers.1.feed_forward.w2", values
    others = [v for n, v in values.items() if n != worst]
    assert min(others) > 20 and values[worst] < 15  # e4m3 tensorwise: ~28 dB on these layers


def _sqnr_lines(caplog: pytest.LogCaptureFixture) -> dict[int, dict[str, float]]:
    """Per-layer SQNR (dB) from the 'float8 SQNR step N' log lines, by step."""
    found = {}
    for r in caplog.records:
        m = re.match(r"float8 SQNR step (\d+) \(dB, worst first\): (.*)", r.getMessage())
        if m:
            found[int(m.group(1))] = {n: float(v) for n, v in (kv.rsplit(" ", 1) for kv in m.group(2).split(", "))}
    return found


@pytest.mark.slow
def test_sqnr_under_compile_trains_and_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--float8.sqnr_log_freq with --training.compile: the hooks run inside the fullgraph-compiled blocks (step 1
    is eager for the float8 check; steps 2-4 compiled). A `.item()` in the hook used to crash step 2. Losses equal
    an eager run without SQNR (the measurement must not change the step); values are the eager ones' magnitude."""
    caplog.set_level(logging.INFO, logger="kiln")
    extra = ["--training.steps", "4", "--model.n_layers", "1", "--float8.enable_float8_linear", "--training.seed", "0"]
    compiled = Trainer(parse_args(_argv(tmp_path / "c", *extra, "--float8.sqnr_log_freq", "2", "--training.compile")))
    try:
        compiled.train()
    finally:
        compiled.close()
    sqnr = _sqnr_lines(caplog)
    assert sorted(sqnr) == [2, 4], sqnr  # every second step, the compiled ones included
    for values in sqnr.values():
        assert sorted(values) == sorted(
            f"layers.0.{n}"
            for n in (
                "attention.wq",
                "attention.wk",
                "attention.wv",
                "attention.wo",
                "feed_forward.w1",
                "feed_forward.w2",
                "feed_forward.w3",
            )
        )
        assert all(20 < v < 40 for v in values.values()), values  # e4m3 tensorwise: ~28 dB here
    eager = Trainer(parse_args(_argv(tmp_path / "e", *extra)))
    try:
        eager.train()
    finally:
        eager.close()
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-4, atol=1e-4)


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
