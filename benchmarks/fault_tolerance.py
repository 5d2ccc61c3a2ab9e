"""What fault tolerance on TorchFT (docs/fault_tolerance.md) costs and how fast it recovers, on this machine's CPU.

    python benchmarks/fault_tolerance.py [--steps 30] [--seq 128] [--kill-at 8]
    python benchmarks/fault_tolerance.py --semi-sync diloco --sync-steps 10 --no-kill   # DiLoCo's cost, no fault

Starts a torchft lighthouse in this process and runs the debug model (2 layers, fp32) through run_train.sh:

1. HSDP 2 x 2 in one job (NGPU=4), then two FT replica groups of FSDP 2 (two run_train.sh jobs, NGPU=2 each) with
   no fault: the mean tps of the step lines after the first 3 (each group's rank 0), and the ratio FT / HSDP; with
   `--semi-sync local_sgd|diloco` the groups train semi-synchronously, meeting every `--sync-steps` (DiLoCo: one
   fragment, the whole model);
2. two groups again; group 1's whole run_train.sh tree SIGKILLed when its step line `--kill-at` appears: the seconds
   from the kill to the survivor's next step line, then group 1 restarted at once: the seconds from its start to its
   first step line (start-up, quorum, healing from the live group and one step; semi-sync: start-up and steps alone
   up to its first sync, where it heals), to its "healed" line, and from that line to the next step line (skipped
   with `--no-kill`).

Times are wall clock as this process reads the lines (one OpenMP thread per rank); the numbers are noisy on a shared
machine: run it on an idle one.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"\[rank0\]:.* step:\s+(\d+)\s+loss:.*tps:\s+([\d,]+)")


class Job:
    """A run_train.sh job in its own session; its merged output lines with the time each was read."""

    def __init__(self, args: list[str], ngpu: int, env: dict[str, str]) -> None:
        environ = {**os.environ, **env, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            ["bash", str(ROOT / "run_train.sh"), *args],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.started = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def first(self, pattern: str, after: float = 0.0, timeout: float = 600) -> float:
        """The time the first line matching `pattern` read after `after` was read."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if t >= after and re.search(pattern, line):
                    return t
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise RuntimeError(f"no {pattern!r}:\n" + "".join(line for _, line in self.lines[-40:]))

    def wait(self) -> int:
        self.proc.wait(timeout=900)
        self.reader.join(timeout=30)
        if self.proc.returncode:
            raise RuntimeError("".join(line for _, line in self.lines[-40:]))
        return self.proc.returncode

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)

    def mean_tps(self, skip: int = 3) -> float:
        tps = [int(m.group(2).replace(",", "")) for _, line in self.lines if (m := STEP.search(line))]
        return statistics.mean(tps[skip:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument(
        "--kill-steps",
        type=int,
        default=150,
        help="steps of the kill run: the survivor must still be training when the restarted group has started",
    )
    parser.add_argument("--semi-sync", choices=("local_sgd", "diloco"), help="fault_tolerance.semi_sync_method")
    parser.add_argument("--sync-steps", type=int, default=5, help="fault_tolerance.sync_steps (with --semi-sync)")
    parser.add_argument("--no-kill", action="store_true", help="measure the cost with no fault only")
    a = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at info
    from torchft._torchft import LighthouseServer

    dump = tempfile.mkdtemp(prefix="kiln_ft_bench_")
    run = [
        "--model.n_layers",
        "2",
        "--training.seq_len",
        str(a.seq),
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(a.steps),
        "--training.mixed_precision_param",
        "float32",
        "--activation_checkpoint.mode",
        "none",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
    ]

    def group(g: int, folder: str, address: str) -> Job:
        ft = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", str(g)]
        if a.semi_sync:
            ft += ["--fault_tolerance.semi_sync_method", a.semi_sync, "--fault_tolerance.sync_steps", str(a.sync_steps)]
        return Job([*run, f"{dump}/{folder}", *ft], 2, {"TORCHFT_LIGHTHOUSE": address})

    hsdp = Job([*run, f"{dump}/hsdp", "--parallelism.data_parallel_replicate_degree", "2"], 4, {})
    hsdp.wait()
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    groups = [group(g, "ft", server.address()) for g in (0, 1)]
    for job in groups:
        job.wait()
    server.shutdown()
    ft_tps = statistics.mean(job.mean_tps() for job in groups)
    mode = f" ({a.semi_sync}, sync_steps {a.sync_steps})" if a.semi_sync else ""
    print(
        f"tps per rank, mean of steps 4..{a.steps}: HSDP 2x2 {hsdp.mean_tps():.0f}, FT 2 groups x FSDP 2{mode} "
        f"{ft_tps:.0f}: FT / HSDP = {ft_tps / hsdp.mean_tps():.3f}"
    )
    if a.no_kill:
        return

    join_ms = 30_000 if a.semi_sync else 1000  # a sync waits for the live groups: the restarted one meets the survivor
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=join_ms, heartbeat_timeout_ms=1000)
    run[run.index("--training.steps") + 1] = str(a.kill_steps)
    g0, g1 = (group(g, "kill", server.address()) for g in (0, 1))
    g1.first(rf"\[rank0\]:.* step:\s+{a.kill_at}\s")
    killed = time.monotonic()
    g1.kill()
    next_step = g0.first(r"\[rank0\]:.* step:", after=killed)
    print(f"death of group 1 -> the survivor's next step line: {next_step - killed:.2f} s")
    restarted = group(1, "kill", server.address())
    first = restarted.first(r"\[rank0\]:.* step:")
    healed = restarted.first(r"healed from a live replica group")
    after = restarted.first(r"\[rank0\]:.* step:", after=healed)  # semi-sync: it trained alone before its first sync
    print(
        f"group 1 restarted -> its first step line: {first - restarted.started:.2f} s, its healed line: "
        f"{healed - restarted.started:.2f} s (healed -> the next step line: {after - healed:.2f} s)"
    )
    restarted.wait()
    g0.wait()
    server.shutdown()
    for name, job in (("survivor", g0), ("restarted", restarted)):  # what each logged of the kill and the heal
        said = [line.rstrip() for _, line in job.lines if "[rank0]" in line and "fault tolerance:" in line]
        print(f"{name}:", *said, sep="\n    ")


if __name__ == "__main__":
    main()
