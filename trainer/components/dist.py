"""Process-group and device set-up: the same code path for `python train.py` and `torchrun`."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.internals import set_pg_timeout


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
    """Set the world's collective timeout: long while steps may compile, short after (trainer/hooks.py)."""
    if dist.is_initialized():
        set_pg_timeout(seconds)


def set_determinism(seed: int | None, deterministic: bool) -> None:
    """Seed every RNG the same way on every rank; optionally force deterministic kernels."""
    if seed is not None:
        torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
