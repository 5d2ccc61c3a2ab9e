"""PeerWatch (trainer/components/dist.py) never names a rank that was alive: one that torchrun ends by SIGTERM
marks itself leaving first, so the survivors' line names only the ranks that died (tests/e2e/test_multinode.py runs
it through run_train.sh after a kill -9)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.helpers.common import ROOT, free_port, store_process
from trainer.components.dist import PeerWatch

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


def test_the_node_that_kept_a_lost_store_is_named_by_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store is kept by rank 0's node: once it is gone, the survivors name that node's ranks and where it ran,
    read from the store while it was up; nodes may run different numbers of ranks (here 2 and 3)."""
    port = free_port()
    for key, value in {"MASTER_ADDR": "localhost", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    watches: list[PeerWatch] = []
    with store_process(port) as server:
        try:
            for rank, node, local_ranks in ((0, "0", "2"), (3, "1", "3")):
                monkeypatch.setenv("KILN_NODE_RANK", node)
                monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
                watches.append(PeerWatch(rank=rank, world_size=5, interval=0.05, grace=0.2))
            watch = watches[1]
            deadline = time.monotonic() + 30
            while watch.store_keepers is None and time.monotonic() < deadline:
                time.sleep(0.05)
            server.kill()
            server.wait(timeout=30)
            assert watch.lost_ranks() is None  # the store is unreachable
            assert watch.describe(None) == (
                f"lost ranks 0, 1 (node 0, host {socket.gethostname()}), which kept the job's store at "
                f"localhost:{port} (unreachable)"
            )
        finally:
            for w in watches:
                w.close()
