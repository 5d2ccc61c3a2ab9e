"""Checkpoint save and load against the disk's own rates, measured in the same run: the full training state (model,
AdamW moments, data and RNG state) of a ~0.6B-parameter model through run_train.sh, beside a plain sequential
write (fsync'd) and read of a file of the same size on the same file system.

    python benchmarks/checkpoint_speed.py [--folder DIR] [--flavor 0.6B] [--s3]

1. The disk: write the checkpoint's size in 64 MiB blocks and fsync, then read it back with the page cache
   dropped for that file (posix_fadvise DONTNEED: no root needed). Measured twice, between kiln's save and load and
   after the load; the table gives both (the ratios use their mean).
2. kiln: train 1 step with a checkpoint at step 1 (its "Saved checkpoint ... in X s" line: DCP's files written and
   fsync'd, the checksums, the marker), then drop the checkpoint's files from the page cache and resume it (its
   "Loaded checkpoint ... in X s": reading, checksums, the checks of every loaded value).
3. --s3: the same save and resume against moto's S3 server on localhost (tests/helpers/s3_server.py), and the
   server's own ceiling measured the same way (the checkpoint's size put and got as 64 MiB objects through s3fs).
   moto keeps objects in this machine's memory: it needs the checkpoint's size in free RAM on top of the run's.

Rates are GB/s of wall time (1 GB = 1e9 bytes); on shared cores and a shared disk, both sides move with the load,
which is why they are measured in one run.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK = 64 << 20
SAVED = re.compile(r"Saved checkpoint (\S+) in ([\d.]+) s")
LOADED = re.compile(r"Loaded checkpoint (\S+) \(.*?\) in ([\d.]+) s")


def drop_cached(path: Path) -> None:
    """Drop a file's (or a folder's files') pages from the page cache, so the next read comes from the disk."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_rates(folder: Path, n_bytes: int) -> tuple[float, float]:
    """Sequential write (with fsync) and cold read of n_bytes in `folder`: GB/s each."""
    block = os.urandom(BLOCK)  # incompressible, in case the device compresses
    path = folder / "disk_rate.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, n_bytes // BLOCK)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    size = path.stat().st_size
    drop_cached(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(BLOCK):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return size / write_s / 1e9, size / read_s / 1e9


def run_train(args: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        ["bash", str(ROOT / "run_train.sh"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"run_train.sh failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def kiln_save(train_args: list[str], ckpt: str, dump: Path, env: dict[str, str] | None = None) -> float:
    """Seconds of kiln's save at step 1, from its log line."""
    args = [*train_args, "--checkpoint.enable_checkpoint", "--checkpoint.folder", ckpt, "--checkpoint.interval", "1"]
    out = run_train([*args, "--job.dump_folder", str(dump)], env)
    if not (saved := SAVED.search(out)):
        raise SystemExit(f"no save line in the run's output:\n{out[-3000:]}")
    return float(saved.group(2))


def kiln_load(train_args: list[str], ckpt: str, dump: Path, env: dict[str, str] | None = None) -> float:
    """Seconds of kiln's load of that checkpoint (resumed at the last step: it loads and trains nothing more)."""
    args = [*train_args, "--checkpoint.enable_checkpoint", "--checkpoint.folder", ckpt]
    out = run_train([*args, "--job.dump_folder", str(dump)], env)
    if not (loaded := LOADED.search(out)):
        raise SystemExit(f"no load line in the run's output:\n{out[-3000:]}")
    return float(loaded.group(2))


def s3_ceiling(server: Any, n_bytes: int) -> tuple[float, float]:
    """Upload and download n_bytes through s3fs (kiln's own client) as 64 MiB objects, one request each: GB/s
    each. (One object of the checkpoint's size goes by multipart upload, which moto's in-process server fails on
    above a GB: "seek of closed file".)"""
    block, keys = os.urandom(BLOCK), [f"kiln-test/ceiling/{i}" for i in range(max(1, n_bytes // BLOCK))]
    t0 = time.perf_counter()
    for key in keys:
        server.fs.pipe_file(key, block)
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = sum(len(server.fs.cat_file(key)) for key in keys)
    get_s = time.perf_counter() - t0
    server.fs.rm("kiln-test/ceiling", recursive=True)
    return got / put_s / 1e9, got / get_s / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=ROOT / "benchmarks" / "results" / "checkpoint_speed")
    parser.add_argument("--model", default="qwen3")
    parser.add_argument("--flavor", default="0.6B")
    parser.add_argument("--s3", action="store_true", help="also against moto's S3 server on localhost")
    parser.add_argument("--s3-layers", type=int, help="model.n_layers for the S3 leg (moto holds it all in RAM)")
    opts = parser.parse_args()
    folder: Path = opts.folder.resolve()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    train_args = [
        *("--model.name", opts.model, "--model.flavor", opts.flavor, "--training.steps", "1"),
        *("--training.seq_len", "64", "--training.local_batch_size", "1", "--activation_checkpoint.mode", "none"),
    ]
    local = folder / "checkpoint"
    save_s = kiln_save(train_args, str(local), folder / "dump")
    n_bytes = sum(p.stat().st_size for p in (local / "step-1").rglob("*") if p.is_file())
    before = disk_rates(folder, n_bytes)  # between the save and the load, then after the load
    drop_cached(local)
    load_s = kiln_load(train_args, str(local), folder / "dump")
    after = disk_rates(folder, n_bytes)
    gb = n_bytes / 1e9
    rows = [
        "| where | size | kiln save | kiln load | ceiling write | ceiling read | save / write | load / read |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    write, read = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    rows.append(
        f"| local disk ({folder}) | {gb:.2f} GB | {save_s:.1f} s, {gb / save_s:.3f} GB/s | "
        f"{load_s:.1f} s, {gb / load_s:.3f} GB/s | {before[0]:.3f}, {after[0]:.3f} GB/s | "
        f"{before[1]:.3f}, {after[1]:.3f} GB/s | {gb / save_s / write:.0%} | {gb / load_s / read:.0%} |"
    )
    print("\n".join(rows), flush=True)
    shutil.rmtree(local)
    if opts.s3:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
        if opts.s3_layers:
            train_args += ["--model.n_layers", str(opts.s3_layers)]
        from tests.helpers.s3_server import S3Server

        with S3Server() as server:
            url = server.url("bench/checkpoint")
            s3_save = kiln_save(train_args, url, folder / "dump_s3", server.env)
            s3_load = kiln_load(train_args, url, folder / "dump_s3", server.env)
            n_bytes = sum(server.fs.du(f"{url[len('s3://') :]}/step-1", total=False).values())
            gb = n_bytes / 1e9
            put, get = s3_ceiling(server, n_bytes)
            rows.append(
                f"| moto S3 on localhost | {gb:.2f} GB | {s3_save:.1f} s, {gb / s3_save:.3f} GB/s | "
                f"{s3_load:.1f} s, {gb / s3_load:.3f} GB/s | {put:.3f} GB/s (put) | {get:.3f} GB/s (get) | "
                f"{gb / s3_save / put:.0%} | {gb / s3_load / get:.0%} |"
            )
            print(rows[-1])
    shutil.rmtree(folder / "dump", ignore_errors=True)
    shutil.rmtree(folder / "dump_s3", ignore_errors=True)


if __name__ == "__main__":
    main()
