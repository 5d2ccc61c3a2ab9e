"""Preemption: all ranks agree to stop when one got SIGTERM, and the handler is scoped; SIGTERM to a run (1 process,
or torchrun with 2 ranks) saves, says so in one line per rank, exits 143, and the same command resumes with the
losses of the uninterrupted run, exactly; Ctrl-C exits 130 with one line (whole runs through
tests/helpers/loss_runs.py; the straight runs are fixtures of tests/e2e/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
from tests.helpers.kiln_process import KilnRun, start_kiln
from tests.helpers.loss_runs import TIMEOUT, drive, kiln_args, with_init
from trainer.components.preemption import StopOnSignal


def _stop_agreement(signalled_rank: int) -> bool:
    stop = StopOnSignal()
    if dist.get_rank() == signalled_rank:
        stop.received = signal.SIGTERM
    return stop.agreed()


@pytest.mark.distributed
def test_all_ranks_agree_to_stop_when_one_got_sigterm() -> None:
    assert run_distributed(_stop_agreement, 2, 1) == [True, True]
    assert run_distributed(_stop_agreement, 2, -1) == [False, False]


def test_sigterm_handler_is_scoped() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.agreed()
    assert signal.getsignal(signal.SIGTERM) == before


def start_run(dump: Path, *args: str, nproc: int = 1) -> KilnRun:
    """loss_driver.py in the background (tests/helpers/loss_runs.py), writing dump.json."""
    return KilnRun(start_kiln(**kiln_args(dump.with_suffix(".json"), dump, args, nproc)), timeout=TIMEOUT)


def stop_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kiln:")]


@pytest.mark.slow
def test_sigterm_one_rank_saves_exits_143_and_resumes_exactly(runs: Path, straight_one: dict) -> None:
    dump = with_init(runs / "init", runs / "term1")
    with start_run(dump, "--checkpoint.interval", "100") as run:
        run.wait_for("step:  1 ")
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish() == 143
    (line,) = stop_lines("".join(run.stderr))
    stopped = json.loads(dump.with_suffix(".json").read_text())
    k = stopped["first_step"] + len(stopped["losses"]) - 1  # the last step it trained
    assert 1 <= k < 6
    step = dump / "checkpoint" / f"step-{k}"
    assert line == f"kiln: stopped by SIGTERM after step {k} of 6; saved {step}; run the same command again to resume"
    assert "Traceback" not in "".join(run.stderr)
    assert json.loads((step / "kiln.json").read_text())["model_weights_only"] is False
    resumed = drive(dump, "--checkpoint.interval", "100")
    print(f"stopped after step {k}; resumed:", resumed["losses"], "straight:", straight_one["losses"][k:])
    assert resumed["first_step"] == k + 1 and resumed["losses"] == straight_one["losses"][k:]  # exact


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_torchrun_two_ranks_saves_and_resumes_exactly(runs: Path, straight_two: dict) -> None:
    """SIGTERM to torchrun (what Kubernetes sends to the container's process), which forwards it to the ranks."""
    dump = with_init(runs / "init", runs / "term2")
    with start_run(dump, "--checkpoint.interval", "100", nproc=2) as run:
        run.wait_for("step:  1 ")
        run.proc.send_signal(signal.SIGTERM)
        run.finish()  # torchrun's own status after a signal is its business (1, with its SignalException)
    lines = stop_lines("".join(run.stderr))
    stopped = json.loads(dump.with_suffix(".json").read_text())
    k = stopped["first_step"] + len(stopped["losses"]) - 1
    assert 1 <= k < 6
    step = dump / "checkpoint" / f"step-{k}"
    want = f"kiln: stopped by SIGTERM after step {k} of 6; saved {step}; run the same command again to resume"
    assert lines == [want, want]  # both ranks stopped after the same step
    resumed = drive(dump, "--checkpoint.interval", "100", nproc=2)
    print(f"stopped after step {k}; resumed:", resumed["losses"], "straight:", straight_two["losses"][k:])
    assert resumed["first_step"] == k + 1 and resumed["losses"] == straight_two["losses"][k:]  # exact


@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line(tmp_path: Path) -> None:
    # Steps enough that the run cannot end before the signal, however late the test sends it (6 steps could: on
    # loaded cores the run finished between printing step 1 and the signal, status 0); only step 1 ever runs whole.
    with start_run(tmp_path / "int", "--checkpoint.interval", "100", "--training.steps", "100000") as run:
        run.wait_for("step:  1 ")
        run.proc.send_signal(signal.SIGINT)
        assert run.finish() == 130
    stderr = "".join(run.stderr)
    assert "Traceback" not in stderr
    (line,) = stop_lines(stderr)
    assert line.startswith("kiln: interrupted by SIGINT (Ctrl-C) at step ")
    assert line.endswith("; nothing saved since the last checkpoint")
