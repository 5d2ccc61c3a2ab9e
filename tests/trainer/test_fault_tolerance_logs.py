"""What a semi-synchronous replica group says when a sync fails (a peer group died in its all-reduce): kiln's one
warning per failed sync, in place of torchft's traceback per failed all-reduce (its loggers are raised to CRITICAL).
The failure is torchft's own error object as its Manager reports it; the race it needs (a kill inside the all-reduce)
is not reproducible in an e2e run, so the Manager is a stand-in here. And what every rank of a group says when no
lighthouse answers (tests/e2e/test_fault_tolerance.py runs it through run_train.sh)."""

from __future__ import annotations

import logging

import pytest

from trainer.checkpoint.resume import TrainState
from trainer.step.fault_tolerance import ReplicaGroup

manager_module = pytest.importorskip("torchft.manager", reason="fault tolerance needs the torchft extra")


class _Manager:
    def __init__(self) -> None:
        self.error: Exception | None = None

    def errored(self) -> Exception | None:
        return self.error


def test_a_failed_sync_is_one_warning_with_gloos_reason(caplog: pytest.LogCaptureFixture) -> None:
    group = object.__new__(ReplicaGroup)  # the hook's state only: no lighthouse, no process group
    group.manager, group.failed, group.progress = _Manager(), None, TrainState(step=8)
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:22731. This is typically caused by a remote worker crashing."
    )
    with caplog.at_level(logging.INFO, logger="kiln"):
        group._log_failed_sync()  # no error: nothing
        group.manager.error = manager_module.ExceptionWithTraceback(gloo)
        for group.progress.step in (8, 9, 10):  # the same error until the next quorum clears it: said once
            group._log_failed_sync()
        group.manager.error = manager_module.ExceptionWithTraceback(gloo)  # the next sync fails too
        group.progress.step = 12
        group._log_failed_sync()
    assert [r.getMessage() for r in caplog.records] == [
        f"fault tolerance: the sync in step {s} failed (Connection closed by peer [127.0.0.1]:22731); not applied, "
        "the next sync goes on without the lost replica group"
        for s in (8, 12)
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_every_rank_of_a_group_finds_an_unreachable_lighthouse_itself(
    rank: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only the group's rank 0 (whose manager talks to the lighthouse): a rank 1 that went on would wait in the
    store for rank 0's manager, take no SIGTERM, and hold the job until torchrun killed it 30 s later."""
    import socket

    import torch

    from kiln_base.config.schema import FaultTolerance
    from kiln_base.errors import ConfigError

    with socket.socket() as closed:  # bound, never listened on: connections are refused
        closed.bind(("127.0.0.1", 0))
        lighthouse = f"http://localhost:{closed.getsockname()[1]}"
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
        monkeypatch.setenv("RANK", rank)
        for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):  # no job store to wait in: a rank that skipped
            monkeypatch.delenv(name, raising=False)  # the check fails at once on another error
        model = torch.nn.Linear(2, 2)
        ft = FaultTolerance(enable=True, group_size=2, process_group_timeout_ms=1000)
        with pytest.raises(ConfigError, match=f"no torchft lighthouse answers at TORCHFT_LIGHTHOUSE={lighthouse}"):
            ReplicaGroup(ft, model, torch.optim.SGD(model.parameters()), None, TrainState(), 4, 60, False)
