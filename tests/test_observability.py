"""Profiler traces, memory-snapshot warning, NaN/inf guard, per-layer float8 SQNR, compare_runs.py."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

import train
from scripts.compare_runs import main as compare_main
from tests.sac_helpers import batch, debug_model, loss_fn
from trainer.config import parse_args
from trainer.guards import NonFiniteError, last_checkpoint
from trainer.sqnr import Float8SQNRMonitor
from trainer.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    base = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(tmp_path)]
    base += ["--training.seq_len", "32", "--training.local_batch_size", "2", "--activation_checkpoint.mode", "none"]
    return base + ["--training.mixed_precision_param", "float32", *extra]


def test_profiler_traces_every_freq_steps_and_cpu_snapshot_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kiln")
    argv = _argv(tmp_path, "--training.steps", "8", "--profiling.enable_profiling", "--profiling.profile_freq", "4")
    assert train.main([*argv, "--profiling.enable_memory_snapshot"]) == 0
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*_trace.json"))
    assert traces == ["profile_trace/iteration_4/rank0_trace.json", "profile_trace/iteration_8/rank0_trace.json"]
    events = json.loads((tmp_path / traces[0]).read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert "memory snapshots are CUDA-only" in caplog.text
    assert not (tmp_path / "memory_snapshot").exists()


def test_profile_freq_below_warmup_is_a_config_error(tmp_path: Path) -> None:
    argv = _argv(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq", "2")
    assert train.main(argv) == 2


def test_nan_guard_stops_before_the_update_and_names_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "checkpoint" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoint" / "step-10").mkdir()
    (tmp_path / "checkpoint" / "step-11.tmp").mkdir()  # an unfinished save does not count
    forward_loss, before = Trainer.forward_loss, {}

    def poisoned(self: Trainer, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.step == 2:  # weights as step 1 left them; step 2's loss turns NaN
            before.update({n: p.detach().clone() for n, p in self.model.named_parameters()})
            return forward_loss(self, inputs, labels) * float("nan")
        return forward_loss(self, inputs, labels)

    monkeypatch.setattr(Trainer, "forward_loss", poisoned)
    trainer = Trainer(parse_args(_argv(tmp_path, "--training.steps", "4")))
    try:
        with pytest.raises(NonFiniteError, match="non-finite values at step 2") as e:
            trainer.train()
        assert f"Last good checkpoint: {tmp_path}/checkpoint/step-10" in str(e.value)
        # No optimizer update with NaN gradients: the weights are still step 1's, all finite.
        for n, p in trainer.model.named_parameters():
            assert torch.equal(p.detach(), before[n]), n
        assert trainer.step == 2 and len(trainer.losses) == 1
    finally:
        trainer.close()


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
