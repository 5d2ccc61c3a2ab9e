"""Profiler traces and CUDA memory snapshots for the train loop (torchtitan's maybe_enable_* shape).

Both are context managers yielding an object (or None when off) whose `step()` the loop calls once per
training step:

    with maybe_enable_profiling(cfg.profiling, dump_folder, rank) as prof, \
         maybe_enable_memory_snapshot(cfg.profiling, dump_folder, rank, device) as snap:
        for step ...:
            train_step()
            if prof: prof.step()
            if snap: snap.step()
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import time
from collections.abc import Iterator

import torch

from kiln_base.config import Profiling
from kiln_base.internals import cuda_memory_snapshot, start_cuda_memory_history, stop_cuda_memory_history

logger = logging.getLogger("kiln")

WARMUP, ACTIVE = 3, 1  # profiled steps per cycle: 3 warm-up (not recorded) + 1 recorded, at steps N*freq
MAX_SNAPSHOT_ENTRIES = 100_000  # allocation events kept by the CUDA caching allocator's history


@contextlib.contextmanager
def maybe_enable_profiling(cfg: Profiling, dump_folder: str, rank: int, start_step: int = 0) -> Iterator:
    """torch.profiler recording every `profile_freq` steps into
    `<dump_folder>/<save_traces_folder>/iteration_<step>/rank<rank>_trace.json` (open in Perfetto or
    chrome://tracing). Recording costs time: only the `ACTIVE` step of each cycle is traced."""
    if not cfg.enable_profiling:
        yield None
        return
    trace_dir = os.path.join(dump_folder, cfg.save_traces_folder)
    freq = cfg.profile_freq
    assert freq >= WARMUP + ACTIVE, "config validation checks profiling.profile_freq"

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        folder = os.path.join(trace_dir, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        t0 = time.perf_counter()
        prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_trace.json"))
        logger.info(f"Profiler trace of step {prof.step_num} saved to {folder} in {time.perf_counter() - t0:.1f}s")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    logger.info(f"Profiling: a trace every {freq} steps into {trace_dir}")
    with torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=freq - WARMUP - ACTIVE, warmup=WARMUP, active=ACTIVE),
        on_trace_ready=on_trace_ready,
        record_shapes=True,
    ) as prof:
        prof.step_num = start_step  # resumed runs keep their step numbers in folder names
        yield prof


class MemorySnapshot:
    """Records the CUDA allocator's history; dumps a snapshot every `profile_freq` steps and on OOM."""

    def __init__(self, folder: str, rank: int, freq: int, step: int) -> None:
        self.folder, self.rank, self.freq, self.step_num = folder, rank, freq, step
        start_cuda_memory_history(MAX_SNAPSHOT_ENTRIES)

    def dump(self, tag: str) -> str:
        folder = os.path.join(self.folder, tag)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        with open(path, "wb") as f:
            pickle.dump(cuda_memory_snapshot(), f)
        logger.info(f"CUDA memory snapshot saved to {path} (view at https://pytorch.org/memory_viz)")
        return path

    def step(self) -> None:
        self.step_num += 1
        if self.step_num % self.freq == 0:
            self.dump(f"iteration_{self.step_num}")


@contextlib.contextmanager
def maybe_enable_memory_snapshot(
    cfg: Profiling, dump_folder: str, rank: int, device: torch.device, start_step: int = 0
) -> Iterator[MemorySnapshot | None]:
    """CUDA memory snapshots into `<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/`, and
    `<...>/<step>_exit_oom/` when a step raises torch.OutOfMemoryError. CUDA only: on CPU, warn and go on."""
    if not cfg.enable_memory_snapshot:
        yield None
        return
    if device.type != "cuda":
        logger.warning(
            "profiling.enable_memory_snapshot: memory snapshots are CUDA-only (the CUDA caching allocator "
            f"records them); this run is on {device.type}, so no snapshot will be written"
        )
        yield None
        return
    snapshot = MemorySnapshot(
        os.path.join(dump_folder, cfg.save_memory_snapshot_folder), rank, cfg.profile_freq, start_step
    )
    try:
        yield snapshot
    except torch.OutOfMemoryError:
        snapshot.dump(f"iteration_{snapshot.step_num + 1}_exit_oom")
        raise
    finally:
        stop_cuda_memory_history()
