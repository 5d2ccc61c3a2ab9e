"""tests/helpers/kiln_process.KilnRun, the background run every signal and kill test waits on: lines awaited in
order, and a run that times out or outlives its `with` block leaves no process behind (a run left training once
loaded the cores under every later test)."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.helpers.kiln_process import KilnRun, children, running

# A launcher that starts a worker (as run_train.sh starts torchrun, torchrun the ranks), prints, then waits on it.
TREE = "sleep 300 & echo 'step:  1 loss: 9'; echo 'step:  2 loss: 8'; wait"


def start(script: str, new_session: bool = False) -> KilnRun:
    proc = subprocess.Popen(
        ["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=new_session
    )
    return KilnRun(proc, timeout=1)


def worker_of(run: KilnRun) -> int:
    deadline = time.monotonic() + 10
    while not (kids := children(run.proc.pid)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return kids[0]


def test_lines_are_awaited_in_order_with_their_arrival_time() -> None:
    with start("echo 'step:  1 loss: 9'; echo 'step:  2 loss: 8'; echo done >&2") as run:
        at, line = run.wait_for(r"step:\s+\d ")
        assert line == "step:  1 loss: 9\n" and at <= time.monotonic()
        assert run.wait_for(r"step:\s+\d ")[1] == "step:  2 loss: 8\n"  # after the line returned last
        assert run.finish() == 0
    assert run.text == "step:  1 loss: 9\nstep:  2 loss: 8\n" and run.stderr == ["done\n"]


@pytest.mark.parametrize("new_session", [False, True])
def test_a_run_that_times_out_is_killed_with_its_whole_tree(new_session: bool) -> None:
    run = start(TREE, new_session)
    worker = worker_of(run)
    with pytest.raises(AssertionError, match="no 'never printed' in 1 s:\nstep:  1 loss: 9\nstep:  2 loss: 8"):
        run.wait_for("never printed")
    assert run.proc.returncode == -9 and not running(worker)

    run = start(TREE, new_session)
    worker = worker_of(run)
    with pytest.raises(AssertionError, match="still running after 1 s"):
        run.finish()
    assert run.proc.returncode == -9 and not running(worker)


def test_a_run_that_ends_before_the_line_fails_at_once() -> None:
    run = start("echo 'step:  1 loss: 9'; exit 3")
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="exited before printing 'step:  2 '"):
        run.wait_for("step:  2 ")
    assert time.monotonic() - t0 < 1 and run.finish() == 3


def test_a_run_left_running_by_a_failed_test_is_killed_when_its_block_ends() -> None:
    with pytest.raises(ZeroDivisionError), start(TREE) as run:
        worker = worker_of(run)
        run.wait_for("step:  1 ")
        1 / 0  # noqa: B018 (a check that fails mid-run)
    assert run.proc.returncode == -9 and not running(worker)


def test_what_a_finished_launcher_left_in_its_session_is_killed_when_its_block_ends() -> None:
    with start("sleep 300 >/dev/null 2>&1 & echo $!", new_session=True) as run:  # the launcher exits, its worker not
        worker = int(run.wait_for(r"^\d+$")[1])
        assert run.finish() == 0 and running(worker)
    assert not running(worker)
