"""A frozen pipeline stage ends the job within the collective timeout: SIGSTOP of one rank of a PP 2 run through
run_train.sh (comm.train_timeout_seconds 10). gloo's sends and receives wait forever unless given a timeout
(kiln_base/internals.bound_pipeline_waits); before that, such a job ran until killed from outside."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.common import DEBUG_CONFIG
from tests.helpers.kiln_process import children, start_kiln

TIMEOUT_S = 10  # comm.train_timeout_seconds
# From the freeze to the end: the timeout, 5 s telling a gone rank from a busy one, torchrun's 30 s wait for the
# frozen rank to take its SIGTERM before it SIGKILLs it, and room for loaded cores; far below the 200 s it ran.
LIMIT_S = TIMEOUT_S + 5 + 30 + 45
ARGS = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "32"),
    *("--training.steps", "100000", "--training.local_batch_size", "2", "--activation_checkpoint.mode", "none"),
    *("--metrics.log_freq", "1", "--comm.train_timeout_seconds", str(TIMEOUT_S)),
    *("--parallelism.pipeline_parallel_degree", "2"),
)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("frozen", [0, 1], ids=["first stage", "last stage"])
def test_frozen_stage_ends_the_job_within_the_timeout(frozen: int, tmp_path: Path) -> None:
    proc = start_kiln([*ARGS, "--job.dump_folder", tmp_path], ngpu=2, threads=1, log_rank="0,1", merge_stderr=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put(None)], daemon=True).start()
    seen: list[str] = []
    ranks: list[int] = []
    try:
        while not (line := lines.get(timeout=600)) or "step:  5 " not in line:
            assert line is not None, "".join(seen)[-4000:]
            seen.append(line)
        ranks = children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[frozen], signal.SIGSTOP)
        frozen_at = time.monotonic()
        rc = proc.wait(timeout=LIMIT_S)  # a hang fails here (subprocess.TimeoutExpired)
        took = time.monotonic() - frozen_at
    finally:
        for pid in ranks:  # a stopped rank left behind would hold its memory
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.kill()
    while (line := lines.get(timeout=60)) is not None:
        seen.append(line)
    out = "".join(seen)
    errors = [line for line in out.splitlines() if "kiln: error:" in line]
    print(f"stage {frozen} frozen: the job ended {took:.1f} s later, status {rc}", *errors, sep="\n")
    survivor, host = 1 - frozen, socket.gethostname()
    assert rc == 75 and errors, out[-4000:]
    assert re.search(rf"rank {survivor} stopped in step \d+: lost rank {frozen} \(host {host}\); ", errors[0]), out
    assert re.fullmatch(
        rf"kiln: error: the job lost rank {frozen} \(host {host}\) \(rank {survivor} found out in step \d+\); its "
        r"restarts are spent \(MAX_RESTARTS=0\); run it again to resume from the newest complete checkpoint",
        errors[-1],
    ), out[-4000:]
