"""Preemption: SIGTERM (what SLURM and Kubernetes send before they kill a job) stops training cleanly.

The handler only records the signal; the step in flight finishes. After every step all ranks agree whether
any of them got it (one all-reduce of a CPU int, on gloo: no device sync, no GPU stream wait), so they stop at
the same step, save a full checkpoint of it and end with TrainingStopped (kiln_base/errors.py): exit status 143
(128 + SIGTERM, the status of a process killed by SIGTERM), so a scheduler that restarts failed jobs restarts
this one, and the restart resumes at the next step. Ctrl-C (SIGINT) keeps Python's KeyboardInterrupt: the entry
point stops at once, without saving, with one line and status 130.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist


class StopOnSignal:
    """Context manager: while active, SIGTERM sets a flag instead of killing the process; `agreed()` says
    whether any rank has seen it, the same answer on every rank."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}  # what signal.signal returned

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)  # nothing else here: the step in flight must finish undisturbed

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self) -> bool:
        """Whether any rank received a stop signal. Collective: every rank calls it after every step.

        Cost: one all-reduce of one int32 on the CPU (gloo, also under "cuda:nccl,cpu:gloo"), a host-side
        barrier of the ranks each step (docs/checkpoint.md has the measured time); with one process, nothing.
        """
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
