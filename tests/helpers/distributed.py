"""Run a function on N gloo ranks (spawned CPU processes) and collect what each rank returns.

    results = run_distributed(fn, 2, arg)   # fn(arg) runs on ranks 0 and 1 inside an initialised process group

`fn` must be a module-level function (it is pickled into the children). A failure on any rank fails the call
with that rank's traceback. The environment torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) is set too, so code under test that calls `init_process_group("gloo")` itself also works.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.common import free_port, run_trainer

TIMEOUT_S = 600


def _worker(rank: int, world_size: int, port: int, results: Any, fn: Callable[..., Any], args: tuple) -> None:
    # As under torchrun: the job's store at MASTER_ADDR:MASTER_PORT is hosted outside the process group (here by
    # this function on rank 0, there by torchrun's agent) and every group initialised from the environment
    # connects to it as a client (TORCHELASTIC_USE_AGENT_STORE), also one that code under test opens after a
    # Trainer closed this one, and kiln's lost-rank watch. Held until every rank is done: rank 0 ending its group
    # (then its store) while another rank still created a group through the store (DeviceMesh's new_group) reset
    # that rank's connection, once in a full run. The ranks meet at the end through the store only, no
    # collective: a rank whose fn failed, or left the group closed or reopened, still reaches it.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    torch.set_num_threads(1)  # N ranks share the machine's cores; idle OpenMP threads would spin
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        results.put((rank, True, fn(*args)))
    except BaseException:  # report any failure (also assertion errors) to the parent with the traceback
        results.put((rank, False, f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        store.set(f"done/{rank}", "1")
        if rank == 0:  # the host waits for the others before its store (and group) go
            try:
                store.wait([f"done/{r}" for r in range(world_size)], timedelta(seconds=60))
            except Exception:  # a rank that died never signals; the parent reports it
                pass
        if dist.is_initialized():
            dist.destroy_process_group()


# The ranks are forked from a forkserver that has imported torch and the Trainer once: a freshly spawned rank
# spends ~5 s of CPU importing them, which on 2 cores was minutes of the suite. The forkserver is a clean
# single-threaded process (unlike this one, which holds threads), so forking from it is safe.
_PRELOAD = ["torch", "torch.distributed", "trainer.trainer", "tests.helpers.common", "tests.helpers.distributed"]


def check_preload(modules: Sequence[str]) -> None:
    """Fail unless every module exists: the forkserver ignores a preload it cannot import (a renamed module then
    silently costs each rank its imports again)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"forkserver preload: no module named {', '.join(missing)}")


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = TIMEOUT_S) -> list[Any]:
    """Run fn(*args) on `world_size` gloo ranks; return the per-rank results, rank 0 first. `timeout_s` guards
    against a hang, never a verdict: give work that grows (many runs in one call) a budget that grows with it."""
    check_preload(_PRELOAD)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, results, fn, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if ok:
                out[rank] = value
            else:
                errors.append(value)
                break  # the other ranks are likely blocked in a collective
    except queue.Empty:
        errors.append(f"timed out after {timeout_s}s waiting for ranks {sorted(set(range(world_size)) - set(out))}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        raise AssertionError("distributed test failed on " + "\n".join(errors))
    return [out[r] for r in range(world_size)]


def reopen_group(store: str) -> None:
    """On a rank of a run_distributed group: join the group again after a Trainer closed it (Trainer.close ends the
    default group), through a fresh file store `store`; rank and world size as _worker set them."""
    if not dist.is_initialized():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def train_in_group(argv: list[str], store: str, extra_hooks: Sequence[Any] = ()) -> Any:
    """On a rank of a run_distributed group: build, train (with `extra_hooks`, StepHooks) and close a Trainer from
    train.py arguments (the group reopened through `store` if needed; compiled graphs of earlier runs dropped); the
    closed Trainer."""
    reopen_group(store)
    torch._dynamo.reset()  # each run compiles its own blocks, never reuses another run's graphs
    forget_dtensor_plans()
    return run_trainer(argv, extra_hooks)


def forget_dtensor_plans() -> None:
    """Drop DTensor's cached redistribution plans before another Trainer in the same process.

    DTensor caches sharding decisions and redistribution plans by placements and mesh, and meshes compare equal by
    layout and names, not by their process groups: a later Trainer's equal mesh gets the earlier one's, whose
    groups died with the earlier process group. Group names restart with each process group, so an old mesh's
    names usually name the new groups too; a flattened mesh (dp_shard_cp) is created in another order and does
    not ("Could not resolve the process group registered under the name 15"). Only a process that builds
    several Trainers meets this: the tests."""
    from torch.distributed.tensor import _redistribute, debug

    # Looked up, not imported: the names are torch 2.13's (the multi-process tests run on the newest torch only).
    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()  # output specs with their meshes (the Python and the C++ fast-path caches)
    transform_infos = getattr(_redistribute, "_gen_transform_infos", None)
    if transform_infos is not None:
        transform_infos.cache_clear()
    getattr(_redistribute, "_planner_cache", {}).clear()
