"""Runs kiln in a subprocess, as users start it: every test that starts kiln's processes comes through here.

    result = run_kiln(args, ngpu=2)                                          # ./run_train.sh with NGPU=2, waited for
    result = run_kiln(args, launcher="python")                               # python train.py args
    result = run_kiln([out, *args], launcher="torchrun", ngpu=2, script=LOSS_DRIVER, threads=1)
    proc = start_kiln(args, launcher="python", script=LOSS_DRIVER)           # a Popen, for signals mid-run
    with KilnRun(start_kiln(args, merge_stderr=True, new_session=True)) as run:  # its lines awaited as they come
        run.wait_for("step:  2 ")
        assert run.finish() == 0, run.text
    result = run_python(code, *args)                                         # python -c code (checks of imports)

Launchers:
  "run_train.sh"  `bash run_train.sh args` (or `script`, another shell script such as scripts/slurm_train.sh); `ngpu`,
                  `config_file` and `log_rank` become NGPU, CONFIG_FILE and LOG_RANK
  "torchrun"      `python -m torch.distributed.run --standalone --nproc_per_node=ngpu script args`
  "python"        `python script args` (one process)
`script` defaults to run_train.sh for the first, train.py for the others; a driver (CKPT_DRIVER, LOSS_DRIVER) or a
file from scripts/ goes there too. The environment is this process's, with `env` on top (a None value removes the
variable; inherit_env=False starts from nothing), then OMP_NUM_THREADS=threads and the launcher's variables.
Output is captured as text; `log` also writes stdout + stderr to a file, for reading after a failure.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from tests.helpers.common import HANG_TIMEOUT_S, ROOT

Launcher = Literal["run_train.sh", "torchrun", "python"]

RUN_TRAIN = ROOT / "run_train.sh"
TRAIN_PY = ROOT / "train.py"
CKPT_DRIVER = ROOT / "tests" / "helpers" / "ckpt_driver.py"
LOSS_DRIVER = ROOT / "tests" / "helpers" / "loss_driver.py"
SLURM_TRAIN = ROOT / "scripts" / "slurm_train.sh"
# Resolved once, from this process's PATH: a test may run the launcher with a PATH that holds no bash.
BASH = shutil.which("bash") or "/bin/bash"


@dataclasses.dataclass(frozen=True)
class KilnResult:
    """A finished kiln process: its command line, exit status (negative: killed by that signal) and output."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """stdout, then stderr."""
        return self.stdout + self.stderr

    def error_lines(self) -> list[str]:
        """The lines of stderr that are kiln's one-line errors (`kiln: error: ...`)."""
        return [line for line in self.stderr.splitlines() if line.startswith("kiln: error:")]


def assert_one_line_error(proc: KilnResult | subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 and one line `kiln: error: ...` holding each needle, the last on stderr; no traceback anywhere.

    Before it, stderr may hold only what rank 0 itself printed live before the error ("[rank0]:" lines, e.g.
    torch's DTensor-on-CPU UserWarning once FSDP is built); torchrun's own report of the failure never appears.
    """
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    lines = proc.stderr.splitlines()
    assert lines and lines[-1].startswith("kiln: error: "), out[-3000:]
    assert all(line.startswith("[rank0]:") for line in lines[:-1]), out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


def kiln_argv(
    args: Sequence[str | os.PathLike] = (),
    *,
    launcher: Launcher = "run_train.sh",
    script: str | os.PathLike | None = None,
    ngpu: int | str | None = None,
) -> list[str]:
    """The command line that starts `script args` with `launcher` (module docstring)."""
    args = [str(a) for a in args]
    if launcher == "run_train.sh":
        return [BASH, str(script or RUN_TRAIN), *args]
    script = str(script or TRAIN_PY)
    if launcher == "torchrun":
        if ngpu is None:
            raise ValueError("torchrun needs ngpu (the processes to start)")
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ngpu}"]
        return [*torchrun, script, *args]
    if launcher == "python":
        if ngpu not in (None, 1, "1"):
            raise ValueError(f"launcher 'python' starts one process, not ngpu={ngpu}: use 'torchrun'")
        return [sys.executable, script, *args]
    raise ValueError(f"unknown launcher {launcher!r}")


def kiln_env(
    *,
    launcher: Launcher = "run_train.sh",
    ngpu: int | str | None = None,
    config_file: str | os.PathLike | None = None,
    log_rank: str | None = None,
    threads: int | None = None,
    env: Mapping[str, str | None] | None = None,
    inherit_env: bool = True,
) -> dict[str, str]:
    """The environment of a kiln process (module docstring)."""
    out = dict(os.environ) if inherit_env else {}
    for name, value in (env or {}).items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    if threads is not None:
        out["OMP_NUM_THREADS"] = str(threads)
    launcher_vars = {"NGPU": ngpu, "CONFIG_FILE": config_file, "LOG_RANK": log_rank}
    if launcher != "run_train.sh":
        given = [name for name, value in launcher_vars.items() if value is not None and name != "NGPU"]
        if given:
            raise ValueError(f"only run_train.sh reads {', '.join(given)}, not launcher {launcher!r}")
        return out
    out.update({name: str(value) for name, value in launcher_vars.items() if value is not None})
    return out


def run_kiln(
    args: Sequence[str | os.PathLike] = (),
    *,
    launcher: Launcher = "run_train.sh",
    script: str | os.PathLike | None = None,
    ngpu: int | str | None = None,
    config_file: str | os.PathLike | None = None,
    log_rank: str | None = None,
    threads: int | None = None,
    env: Mapping[str, str | None] | None = None,
    inherit_env: bool = True,
    cwd: str | os.PathLike = ROOT,
    timeout: float = HANG_TIMEOUT_S,
    check: bool = False,
    log: str | os.PathLike | None = None,
) -> KilnResult:
    """Run kiln to its end (module docstring); check=True fails the test, with the output, unless it exits 0."""
    argv = kiln_argv(args, launcher=launcher, script=script, ngpu=ngpu)
    environ = kiln_env(
        launcher=launcher,
        ngpu=ngpu,
        config_file=config_file,
        log_rank=log_rank,
        threads=threads,
        env=env,
        inherit_env=inherit_env,
    )
    return _run(argv, environ, cwd, timeout, check, log)


def start_kiln(
    args: Sequence[str | os.PathLike] = (),
    *,
    launcher: Launcher = "run_train.sh",
    script: str | os.PathLike | None = None,
    ngpu: int | str | None = None,
    config_file: str | os.PathLike | None = None,
    log_rank: str | None = None,
    threads: int | None = None,
    env: Mapping[str, str | None] | None = None,
    inherit_env: bool = True,
    cwd: str | os.PathLike = ROOT,
    merge_stderr: bool = False,
    new_session: bool = False,
) -> subprocess.Popen[str]:
    """Start kiln as run_kiln would and return at once: a Popen with text pipes for stdout and stderr (stderr into
    stdout with merge_stderr), in its own session with new_session (so the test can kill its whole tree)."""
    argv = kiln_argv(args, launcher=launcher, script=script, ngpu=ngpu)
    environ = kiln_env(
        launcher=launcher,
        ngpu=ngpu,
        config_file=config_file,
        log_rank=log_rank,
        threads=threads,
        env=env,
        inherit_env=inherit_env,
    )
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


class KilnRun:
    """A kiln process started by start_kiln, its stdout read line by line as it comes (stderr too, when not merged).

    wait_for blocks until a line matches, with no sleeps, so a verdict never depends on timing. A run that outlives
    its timeout, or is still running when its `with` block ends, is killed with every process under it before the
    test goes on: a run left training would load the cores under every test after it.
    """

    def __init__(self, proc: subprocess.Popen[str], timeout: float = HANG_TIMEOUT_S) -> None:
        self.proc, self.timeout = proc, timeout
        self._own_group = os.getpgid(proc.pid) == proc.pid  # start_kiln(new_session=True): killpg reaches all of it
        self.lines: list[tuple[float, str]] = []  # stdout's lines, each with the time it arrived (time.monotonic)
        self.stderr: list[str] = []
        self._searched = 0  # wait_for looks only at lines after the one it last returned
        self._arrived = threading.Condition()
        self._ended = False
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True)]
        if proc.stderr is not None:
            self._readers.append(threading.Thread(target=lambda: self.stderr.extend(proc.stderr), daemon=True))
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._arrived:
                self.lines.append((time.monotonic(), line))
                self._arrived.notify_all()
        with self._arrived:
            self._ended = True
            self._arrived.notify_all()

    @property
    def text(self) -> str:
        """stdout so far."""
        return "".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float | None = None) -> tuple[float, str]:
        """The next line that matches regex `pattern` (re.search), and the time it arrived."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                for at, line in self.lines[self._searched :]:
                    self._searched += 1
                    if re.search(pattern, line):
                        return at, line
                if self._ended or time.monotonic() >= deadline:
                    break
                self._arrived.wait(deadline - time.monotonic())
        raise self._give_up(f"exited before printing {pattern!r}" if self._ended else f"no {pattern!r} in {timeout} s")

    def finish(self, timeout: float | None = None) -> int:
        """Wait for the run to end and its output to be read; its exit status."""
        timeout = self.timeout if timeout is None else timeout
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise self._give_up(f"still running after {timeout} s") from None
        deadline = time.monotonic() + 10  # what is left in the pipes is read at once, unless a process the run
        for reader in self._readers:  # left behind holds them open: its output is not waited for
            reader.join(timeout=max(0, deadline - time.monotonic()))
        return rc

    def kill(self) -> None:
        """SIGKILL the run and every process under it (a node gone: the launcher, torchrun's agent, the ranks)."""
        tree = [self.proc.pid]
        for pid in tree:
            tree.extend(children(pid))
        kills = [(os.killpg, self.proc.pid)] if self._own_group else []  # also what the launcher's end orphaned
        for kill, pid in [*kills, *((os.kill, pid) for pid in tree)]:
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=60)
        below = set(tree[1:])  # the launcher itself was reaped by wait()
        deadline = time.monotonic() + 60  # a signal is delivered when its process next runs: wait till it has
        while time.monotonic() < deadline:
            if not any(
                stat[0] != "Z" and (pid in below or (self._own_group and int(stat[2]) == self.proc.pid))
                for pid, stat in _stats()
            ):
                break
            time.sleep(0.01)

    def _give_up(self, what: str) -> AssertionError:
        self.kill()
        return AssertionError(f"{what}:\n{self.text[-4000:]}{''.join(self.stderr)[-3000:]}")

    def __enter__(self) -> KilnRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def run_python(
    code: str,
    *args: str,
    env: Mapping[str, str | None] | None = None,
    inherit_env: bool = True,
    cwd: str | os.PathLike = ROOT,
    timeout: float = HANG_TIMEOUT_S,
    check: bool = False,
) -> KilnResult:
    """`python -c code args` in a fresh interpreter (what a module imports, a patched entry point, a process that
    dies holding a lock), with run_kiln's environment and output handling."""
    environ = kiln_env(launcher="python", env=env, inherit_env=inherit_env)
    return _run([sys.executable, "-c", code, *args], environ, cwd, timeout, check, None)


def _run(
    argv: list[str],
    env: dict[str, str],
    cwd: str | os.PathLike,
    timeout: float,
    check: bool,
    log: str | os.PathLike | None,
) -> KilnResult:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    result = KilnResult(argv, proc.returncode, proc.stdout, proc.stderr)
    if log is not None:
        Path(log).write_text(result.output)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)[:500]}\nexited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie, waiting to be reaped, has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stats() -> list[tuple[int, list[str]]]:
    """Every process's /proc/<pid>/stat fields after its name: state, parent pid, process group, ..."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                out.append((int(entry), f.read().rsplit(")", 1)[1].split()))
        except (OSError, ValueError, IndexError):
            continue
    return out


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, oldest first: under run_train.sh on a CPU node, the launcher's ranks in
    local-rank order (torchrun forks them one after another)."""
    return sorted(child for child, stat in _stats() if int(stat[1]) == pid)
