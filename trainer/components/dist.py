"""Process-group and device set-up: the same code path for `python train.py` and `torchrun`."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln_base.internals import all_process_groups, set_pg_timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(init_timeout_seconds: int) -> torch.device:
    """Initialise the default process group (nccl on CUDA, gloo on CPU) and return this rank's device.

    A plain `python train.py` becomes a world of one, so the trainer has a single code path.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"  # gloo for CPU-side collectives (checkpoint metadata)
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=init_timeout_seconds)
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timeout
            )
    return device


def set_collective_timeout(seconds: int) -> None:
    """Set every process group's collective timeout: long while steps may compile, short after (trainer/hooks.py).
    Every group, not only the world: FSDP and TP run on the device mesh's subgroups, and a rank whose peer froze
    would otherwise wait in one of those without a deadline."""
    if dist.is_initialized():
        for group in all_process_groups():
            set_pg_timeout(seconds, group)


def set_determinism(seed: int | None, deterministic: bool) -> None:
    """Seed every RNG the same way on every rank; optionally force deterministic kernels."""
    if seed is not None:
        torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False


class PeerWatch:
    """Tells the survivors of a failed collective which ranks are gone, so they can say so in one line.

    Every rank bumps its own counter in the job's store (torchrun's TCPStore at MASTER_ADDR:MASTER_PORT) every
    `interval` seconds from a daemon thread: one small TCP request per rank per second, off the training thread.
    After a collective failed, `lost_ranks` reads every counter, waits `grace` seconds and reads them again: the
    ranks whose counter did not move are gone (killed, or their node is down or cut off). A survivor still
    blocked in a collective keeps beating (its thread is not blocked), so it is never named; nor is a rank ended
    by SIGTERM (torchrun stops the others so once one rank has failed): its handler marks it leaving first.
    """

    def __init__(self, rank: int, world_size: int, interval: float = 1.0, grace: float = 5.0) -> None:
        self.rank, self.world_size, self.interval, self.grace = rank, world_size, interval, grace
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'kiln')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        self._prefix = f"kiln/{attempt}/beat/"  # a restarted job counts afresh
        self.address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        host, _, port = self.address.rpartition(":")
        self._store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        # Where this rank runs, for the survivors' line: the launcher's node rank (NODE_RANK, SLURM_NODEID) and host.
        node = os.environ.get("KILN_NODE_RANK")
        where = (f"node {node}, " if node else "") + f"host {socket.gethostname()}"
        self._store.set(f"{self._prefix}where/{rank}", where)
        # Rank 0's node keeps the store: the survivors can name it once the store is gone only if they read it
        # before. Rank 0 says which ranks (its node's: torchrun numbers a node's ranks in a row from rank 0's) and
        # where; nodes may run different numbers of ranks.
        self.store_keepers: str | None = None  # "ranks 0, 1 (node 0, host gpu7)" once read
        if rank == 0:
            self.store_keepers = _ranks_at(range(self.local_world_size), where)
            self._store.set(f"{self._prefix}keepers", self.store_keepers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="kiln-peer-watch", daemon=True)
        self._thread.start()
        # Outside the training loop (whose StopOnSignal saves and stops instead) a SIGTERM ends the rank at once, as
        # before, but alive: between a failed collective and `leave`, torchrun's SIGTERM once made a survivor look
        # dead to the ranks still looking ("lost ranks 1, 3" after kill -9 of rank 3).
        self._owns_sigterm = threading.current_thread() is threading.main_thread()  # only it may set handlers
        if self._owns_sigterm:
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._leave_on_sigterm)

    @classmethod
    def maybe_start(cls) -> PeerWatch | None:
        """A watch when this process is one of several ranks started by torchrun, else None."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or "MASTER_ADDR" not in os.environ:
            return None
        return cls(dist.get_rank(), dist.get_world_size())

    def _beat(self) -> None:
        key, keepers = f"{self._prefix}{self.rank}", f"{self._prefix}keepers"
        while True:
            try:
                self._store.add(key, 1)
                if self.store_keepers is None and self._store.check([keepers]):
                    self.store_keepers = self._store.get(keepers).decode()
            except (RuntimeError, dist.DistError):  # the store is gone: lost_ranks says so
                return
            if self._stop.wait(self.interval):
                return

    def node_of(self, rank: int) -> int:
        """torchrun's index of the node of `rank` (its ranks are numbered contiguously per node); it need not be the
        launcher's NODE_RANK: torchrun orders the nodes that met at the rendezvous itself."""
        return rank // self.local_world_size

    def lost_ranks(self) -> list[int] | None:
        """The ranks that stopped beating (waits `grace` seconds) without leaving (`leave`): those that died, not
        those that saw a collective fail (alive then) and ended, or were stopped by torchrun after that; None when
        the store itself is unreachable."""
        try:
            before = [self._store.add(f"{self._prefix}{r}", 0) for r in range(self.world_size)]
            time.sleep(self.grace)
            after = [self._store.add(f"{self._prefix}{r}", 0) for r in range(self.world_size)]
            silent = [r for r in range(self.world_size) if after[r] == before[r] and r != self.rank]
            return [r for r in silent if not self._store.check([f"{self._prefix}left/{r}"])]
        except (RuntimeError, dist.DistError):
            return None

    def leave(self) -> None:
        """Say that this rank is alive and ends because a collective failed, so that no `lost_ranks` names it."""
        try:
            self._store.set(f"{self._prefix}left/{self.rank}", "1")
        except (RuntimeError, dist.DistError):  # the store is gone: nobody is left to ask
            pass

    def _leave_on_sigterm(self, signum: int, frame: object) -> None:
        self.leave()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: the status torchrun reads is "killed by SIGTERM"

    def describe(self, lost: list[int] | None) -> str:
        """ "lost ranks 2, 3 (node 1, host gpu7)"; when `lost` is None (the store is unreachable), the ranks of the
        node that kept it."""
        if lost is None:
            keepers = self.store_keepers or "rank 0's node"
            return f"lost {keepers}, which kept the job's store at {self.address} (unreachable)"
        groups: dict[str, list[int]] = {}
        for r in lost:
            try:
                where = self._store.get(f"{self._prefix}where/{r}").decode()
            except (RuntimeError, dist.DistError):
                where = "where unknown"
            groups.setdefault(where, []).append(r)
        return "lost " + "; ".join(_ranks_at(rs, where) for where, rs in groups.items())

    def close(self) -> None:
        if self._owns_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm or signal.SIG_DFL)
        self._stop.set()
        self._thread.join(timeout=self.interval + 1)


def _ranks_at(ranks: Sequence[int], where: str) -> str:
    """ "ranks 2, 3 (node 1, host gpu7)"."""
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} ({where})"
