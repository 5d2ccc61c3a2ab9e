"""A frozen rank ends the job within the collective timeout: SIGSTOP of one rank of a PP 2 run (either stage) or of
an FSDP 2 run through run_train.sh (comm.train_timeout_seconds 10). gloo's pipeline sends and receives wait forever
unless given a timeout (kiln_base/internals.bound_pipeline_waits); before that, such a job ran until killed from
outside."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.common import DEBUG_CONFIG
from tests.helpers.kiln_process import KilnRun, children, start_kiln

TIMEOUT_S = 10  # comm.train_timeout_seconds
# From the freeze to the end: the timeout, 5 s telling a gone rank from a busy one, torchrun's 30 s wait for the
# frozen rank to take its SIGTERM before it SIGKILLs it, and room for loaded cores; far below the 200 s it ran.
LIMIT_S = TIMEOUT_S + 5 + 30 + 45
ARGS = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "32"),
    *("--training.steps", "100000", "--training.local_batch_size", "2", "--activation_checkpoint.mode", "none"),
    *("--metrics.log_freq", "1", "--comm.train_timeout_seconds", str(TIMEOUT_S)),
)
PP2 = ("--parallelism.pipeline_parallel_degree", "2")
FSDP2 = ("--parallelism.data_parallel_shard_degree", "2")
CASES = {"first stage": (PP2, 0), "last stage": (PP2, 1), "fsdp rank 1": (FSDP2, 1)}  # id -> (layout, frozen rank)


def _freeze(layout: tuple[str, ...], frozen: int, dump: Path) -> tuple[int, str, float]:
    """A 2-rank job whose rank `frozen` is stopped after step 5: its status, its output, the seconds it took to end."""
    proc = start_kiln([*ARGS, *layout, "--job.dump_folder", dump], ngpu=2, threads=1, log_rank="0,1", merge_stderr=True)
    ranks: list[int] = []
    with KilnRun(proc, timeout=600) as run:
        try:
            run.wait_for("step:  5 ")
            ranks = children(proc.pid)
            assert len(ranks) == 2, ranks
            os.kill(ranks[frozen], signal.SIGSTOP)
            frozen_at = time.monotonic()
            rc = run.finish(timeout=LIMIT_S)  # a hang fails here
            took = time.monotonic() - frozen_at
        finally:
            for pid in ranks:  # a stopped rank left behind would hold its memory
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
    return rc, run.text, took


@pytest.fixture(scope="module")
def frozen_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[tuple[int, str, float]]]:
    """Every case at once: most of each job's time is waiting (the timeout, torchrun's 30 s), not computing."""
    pool = ThreadPoolExecutor(len(CASES))
    jobs = {name: pool.submit(_freeze, *case, tmp_path_factory.mktemp("frozen")) for name, case in CASES.items()}
    pool.shutdown(wait=False)
    return jobs


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_frozen_rank_ends_the_job_within_the_timeout(
    case: str, frozen_jobs: dict[str, Future[tuple[int, str, float]]]
) -> None:
    rc, out, took = frozen_jobs[case].result()
    frozen = CASES[case][1]
    errors = [line for line in out.splitlines() if "kiln: error:" in line]
    print(f"{case} frozen: the job ended {took:.1f} s later, status {rc}", *errors, sep="\n")
    survivor, host = 1 - frozen, socket.gethostname()
    assert rc == 75 and errors, out[-4000:]
    assert re.search(rf"rank {survivor} stopped in step \d+: lost rank {frozen} \(host {host}\); ", errors[0]), out
    assert errors[0].endswith("; no restarts left (MAX_RESTARTS); run it again to resume from the newest complete "
                              "checkpoint"), errors[0]  # fmt: skip
    assert re.fullmatch(
        rf"kiln: error: the job lost rank {frozen} \(host {host}\) \(rank {survivor} found out in step \d+\); its "
        r"restarts are spent \(MAX_RESTARTS=0\); run it again to resume from the newest complete checkpoint",
        errors[-1],
    ), out[-4000:]
