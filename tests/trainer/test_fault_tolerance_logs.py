"""What a semi-synchronous replica group says when a sync fails (a peer group died in its all-reduce): kiln's one
warning per failed sync, in place of torchft's traceback per failed all-reduce (its loggers are raised to CRITICAL).
The failure is torchft's own error object as its Manager reports it; the race it needs (a kill inside the all-reduce)
is not reproducible in an e2e run, so the Manager is a stand-in here."""

from __future__ import annotations

import logging

import pytest

from trainer.components.fault_tolerance import ReplicaGroup

manager_module = pytest.importorskip("torchft.manager", reason="fault tolerance needs the torchft extra")


class _Manager:
    def __init__(self) -> None:
        self.error: Exception | None = None

    def errored(self) -> Exception | None:
        return self.error


def test_a_failed_sync_is_one_warning_with_gloos_reason(caplog: pytest.LogCaptureFixture) -> None:
    group = object.__new__(ReplicaGroup)  # the hook's state only: no lighthouse, no process group
    group.manager, group.failed, step = _Manager(), None, [8]
    group.get_step = lambda: step[0]
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:22731. This is typically caused by a remote worker crashing."
    )
    with caplog.at_level(logging.INFO, logger="kiln"):
        group._log_failed_sync()  # no error: nothing
        group.manager.error = manager_module.ExceptionWithTraceback(gloo)
        for step[0] in (8, 9, 10):  # the same error until the next quorum clears it: said once
            group._log_failed_sync()
        group.manager.error = manager_module.ExceptionWithTraceback(gloo)  # the next sync fails too
        step[0] = 12
        group._log_failed_sync()
    assert [r.getMessage() for r in caplog.records] == [
        f"fault tolerance: the sync in step {s} failed (Connection closed by peer [127.0.0.1]:22731); not applied, "
        "the next sync goes on without the lost replica group"
        for s in (8, 12)
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
