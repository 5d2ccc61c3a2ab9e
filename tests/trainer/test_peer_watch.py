"""PeerWatch (trainer/components/dist.py) never names a rank that was alive: one that torchrun ends by SIGTERM
marks itself leaving first, so the survivors' line names only the ranks that died (tests/e2e/test_multinode.py runs
it through run_train.sh after a kill -9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

from tests.helpers.common import ROOT, free_port

CHILD = """
import sys, time
from trainer.components.dist import PeerWatch
watch = PeerWatch(rank=1, world_size=2)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_rank_ended_by_sigterm_marks_itself_leaving_and_dies_of_the_signal() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "t"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert not store.check(["kiln/t/0/beat/left/1"])  # alive and training: not leaving
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM  # still the default action's status, for torchrun
        assert store.check(["kiln/t/0/beat/left/1"])
    finally:
        child.kill()
