"""The launcher behind run_train.sh: check the config for the whole world, then torchrun train.py on this node.

    CONFIG_FILE  TOML config (default: kiln's train_configs/debug_model.toml); --job.config_file in the arguments wins
    NGPU         processes on this node (default: the visible GPUs, else one CPU rank; at most one per GPU, or 4 per
                 CPU core on a node without GPUs)
    LOG_RANK     local ranks whose output each node shows; the same numbers as global ranks log metrics (default: 0)
    MAX_RESTARTS torchrun's --max-restarts: how often a failed job (a lost node) restarts all ranks (default: 0)

Several nodes: the same command on every node; the nodes meet at a c10d rendezvous. Under SLURM (SLURM_JOB_ID set,
one task per node, e.g. scripts/slurm_train.sh) everything comes from SLURM: node count SLURM_NNODES, node rank
SLURM_NODEID, job id SLURM_JOB_ID, endpoint the first host of SLURM_JOB_NODELIST on port RDZV_PORT (29500).
Elsewhere, or to override SLURM's:

    NNODES        number of nodes (default: 1, a local rendezvous)
    NODE_RANK     this node's index; node 0 hosts the rendezvous store (default: whichever matches the endpoint)
    RDZV_ENDPOINT host:port every node can reach, on node 0 (required with NNODES > 1 outside SLURM)
    RDZV_ID       the job's id, the same on every node (default: SLURM_JOB_ID, else "kiln")

The config is checked for NNODES x NGPU ranks on every node before torchrun starts.

Every user mistake ends with exit status 2 and one line `kiln: error: ...` on stderr:

- what the config and NGPU decide, the files read first (tokenizer, dataset name, a local dataset's first
  record) and the model the ranks would build (its shape from every source, the TP plan, on a CPU node the memory)
  are checked here before any rank starts (train.check_config);
- what only a rank can find (a checkpoint of another model, a dataset too small for one sequence) the rank
  appends as one line to KILN_ERROR_FILE before it exits 2 (kiln_base.errors.report); torchrun then fails, and
  this launcher prints that line in place of torchrun's report (a log line per failed rank and a ChildFailedError
  traceback). A non-finite loss or grad norm (exit 1, NonFiniteError) ends the same way, with its status.

Lost ranks end in the launcher's own line, exit 75. Any other failure (a crash) keeps torchrun's output and exit
status.

A SIGTERM or Ctrl-C ends with each rank's one line (what it saved) and the shell's status for the signal (143,
130), without torchrun's traceback of its own signal.

torchrun runs in this process (torch.distributed.run is the code behind the `torchrun` command) and run_train.sh
execs this script, so signals (SIGTERM on preemption, Ctrl-C) reach torchrun as they did with `exec torchrun`,
and the ranks' output streams live as before. With GPUs the ranks are fresh interpreters running train.py, as
`torchrun train.py` starts them. Without, torchrun forks them from this process once it has imported the Trainer
(its function-entry-point mode, `forked_rank`): each fresh interpreter would spend ~5 s of CPU importing torch,
torchao and the Trainer again, and the ranks of a CPU run share a few cores.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from kiln_base.errors import DONE, ERROR_FILE_ENV, LOST_FILE_ENV, PEER_LOST, USER_ERROR, ConfigError, say

KILN_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(KILN_DIR, "train_configs", "debug_model.toml")


class QuietAfterRankLine:
    """Wraps sys.stderr: passes everything through until a rank has written its line (a user error, a non-finite
    stop) to `error_file`, then drops what follows (torchrun's report of the failure would bury the one line that
    matters).

    A rank writes the file before it exits, and torchrun reports only after a rank has exited, so the report
    always comes after the file is non-empty; output written before the error passes live.
    """

    def __init__(self, stream: TextIO, error_file: str) -> None:
        self._stream, self._error_file = stream, error_file

    def _quiet(self) -> bool:
        try:
            return os.path.getsize(self._error_file) > 0
        except OSError:
            return False

    def write(self, text: str) -> int:
        return len(text) if self._quiet() else self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


CPU_RANKS_PER_CORE = 4  # oversubscribed CPU ranks still make progress (the 2-core CI runs 4); more only thrash


def _nproc(value: str | None, gpus: int) -> int:
    """NGPU: ranks on this node, at most one per GPU (of `gpus`), or on a node without GPUs CPU_RANKS_PER_CORE per
    core (every rank is a process with its pipes and threads: NGPU=100000 once forked until the node ran out of
    files)."""
    if value is None or value == "":
        return gpus or 1
    digits, shown = value.lstrip("0"), value if len(value) <= 20 else value[:17] + "..."
    if not value.isdigit() or not digits:
        raise ValueError(f"NGPU must be a positive integer (processes on this node), got '{shown}'")
    n, cores = int(digits) if len(digits) <= 18 else 10**18, os.cpu_count() or 1  # int() refuses 4300+ digits
    if gpus and n > gpus:
        raise ValueError(f"NGPU={shown}: this node has {gpus} GPU(s); run at most one rank per GPU")
    if not gpus and n > CPU_RANKS_PER_CORE * cores:
        raise ValueError(
            f"NGPU={shown}: this node has no GPU and {cores} CPU core(s); kiln starts at most "
            f"{CPU_RANKS_PER_CORE * cores} CPU ranks ({CPU_RANKS_PER_CORE} a core)"
        )
    return n


# A node with GPUs has one of these device files (NVIDIA's driver, AMD's ROCm, WSL's GPU bridge). Without any, the
# node has none and a launch that stops at a config mistake never imports torch (~1 s of its ~1.3 s, a refusal).
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def _gpu_count() -> int:
    """The GPUs torch sees; 0 without importing torch on a node that has no GPU device file."""
    if not any(os.path.exists(path) for path in GPU_DEVICE_FILES):
        return 0
    import torch  # torchrun imports it anyway

    return torch.cuda.device_count()


def _count(env: Mapping[str, str], name: str, default: int, minimum: int, what: str) -> int:
    value = env.get(name, "")
    if value == "":
        return default
    if not value.isdigit() or int(value) < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"{name} must be {kind} integer ({what}), got '{value}'")
    return int(value)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[003-004,9],cpu1" -> "gpu003" (`scontrol show hostnames` order)."""
    depth, end = 0, len(nodelist)
    for i, c in enumerate(nodelist):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            end = i
            break
    host = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], nodelist[:end].strip())
    if not host or any(c in host for c in "[],"):
        raise ValueError(f"SLURM_JOB_NODELIST '{nodelist}' is not a SLURM node list")
    return host


def _slurm_head_node(nodelist: str) -> str:
    """`scontrol show hostnames` where SLURM's tools are installed (the authority), else `first_host`."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    return first_host(nodelist)


@dataclass(frozen=True)
class Nodes:
    """Where this node's torchrun meets the others."""

    nnodes: int
    node_rank: int | None  # None: torchrun decides which node hosts the rendezvous store (by host name)
    endpoint: str  # host:port of the c10d rendezvous; "localhost:0" on one node (a free port)
    rdzv_id: str
    source: str  # where the layout came from, for the start-up line

    def torchrun_args(self) -> list[str]:
        args = ["--nnodes", str(self.nnodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", self.endpoint]
        args += ["--rdzv_id", self.rdzv_id]
        if self.node_rank is not None and self.nnodes > 1:
            # Node 0 hosts the rendezvous store. torchrun would guess by matching the endpoint's host name, which
            # cannot tell nodes apart when they share a host name (a test on one machine, containers).
            args += ["--rdzv_conf", f"is_host={int(self.node_rank == 0)}"]
        return args


def node_layout(env: Mapping[str, str]) -> Nodes:
    """NNODES / NODE_RANK / RDZV_ENDPOINT / RDZV_ID when set, else SLURM's, else one node (see the docstring)."""
    slurm = env.get("SLURM_JOB_ID", "") != "" and env.get("SLURM_NNODES", "") != ""
    if slurm and env.get("NNODES", "") == "":
        tasks = env.get("SLURM_STEP_NUM_TASKS", "")
        if tasks and tasks != env["SLURM_STEP_NUM_NODES"]:
            raise ValueError(
                f"SLURM step has {tasks} tasks on {env['SLURM_STEP_NUM_NODES']} nodes: run one task per node "
                "(srun --ntasks-per-node=1); torchrun starts the NGPU ranks of each node"
            )
        nnodes = _count(env, "SLURM_NNODES", 1, 1, "nodes")
        node_rank: int | None = _count(env, "SLURM_NODEID", 0, 0, "this node's index")
        port = _count(env, "RDZV_PORT", 29500, 1, "the rendezvous port")
        endpoint = env.get("RDZV_ENDPOINT", "")
        if not endpoint:  # one node: a free local port, so that jobs sharing a node never meet
            head = _slurm_head_node(env.get("SLURM_JOB_NODELIST", "")) if nnodes > 1 else "localhost"
            endpoint = f"{head}:{port if nnodes > 1 else 0}"
        rdzv_id, source = env.get("RDZV_ID") or env["SLURM_JOB_ID"], "SLURM"
    else:
        nnodes = _count(env, "NNODES", 1, 1, "nodes")
        given_rank = _count(env, "NODE_RANK", -1, 0, "this node's index")
        node_rank = None if given_rank < 0 else given_rank
        endpoint = env.get("RDZV_ENDPOINT", "")
        if nnodes > 1 and not endpoint:
            raise ValueError(f"NNODES={nnodes} needs RDZV_ENDPOINT=host:port (a port on node 0 every node reaches)")
        endpoint = endpoint or "localhost:0"
        rdzv_id, source = env.get("RDZV_ID") or env.get("SLURM_JOB_ID") or "kiln", "environment"
    if node_rank is not None and node_rank >= nnodes:
        raise ValueError(f"node rank {node_rank} must be in 0..{nnodes - 1} ({nnodes} nodes)")
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isdigit():
        raise ValueError(f"RDZV_ENDPOINT must be host:port, got '{endpoint}'")
    return Nodes(nnodes, node_rank, endpoint, rdzv_id, source)


def _log_ranks(value: str, nproc: int) -> str:
    ranks = value.split(",")
    if not all(r.isdigit() and int(r) < nproc for r in ranks):
        raise ValueError(f"LOG_RANK must be a comma-separated list of ranks in 0..{nproc - 1}, got '{value}'")
    return value


def main(argv: list[str]) -> int:
    fd, error_file = tempfile.mkstemp(prefix="kiln_error_", suffix=".txt")
    os.close(fd)
    fd, lost_file = tempfile.mkstemp(prefix="kiln_lost_", suffix=".txt")
    os.close(fd)
    os.environ[LOST_FILE_ENV] = lost_file  # what the ranks that found others gone lost (kiln_base/errors.py)
    real_stderr = sys.stderr
    # Before torch is imported: its log handler and torchrun's rank-output tee capture sys.stderr as it is then.
    sys.stderr = QuietAfterRankLine(real_stderr, error_file)
    try:
        return _launch(argv, error_file, real_stderr)
    finally:
        sys.stderr = real_stderr
        os.unlink(error_file)
        os.unlink(lost_file)


def _launch(argv: list[str], error_file: str, real_stderr: TextIO) -> int:
    import train

    # OpenMP threads that spin while they wait for each other are ruinous on shared cores: a thread spins while the
    # one it waits for is descheduled. The debug run on a 2-core machine shared with other jobs took 4.5-7.7 min
    # with libgomp's default and 1.2-1.5 min with passive waiting (docs/performance.md). Yours to override. Set
    # before this process imports torch (for torchrun): OpenMP reads it once, and forked ranks inherit its state.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    gpus = _gpu_count()
    try:
        nproc = _nproc(os.environ.get("NGPU"), gpus)
        log_rank = _log_ranks(os.environ.get("LOG_RANK") or "0", nproc)
        nodes = node_layout(os.environ)
        max_restarts = _count(os.environ, "MAX_RESTARTS", 0, 0, "torchrun's restarts of a failed job")
    except ValueError as e:
        say(ConfigError(str(e)).line())
        return USER_ERROR
    # CONFIG_FILE first: parse_args takes the last --job.config_file, so one in argv wins.
    args = ["--job.config_file", os.environ.get("CONFIG_FILE") or DEFAULT_CONFIG, *argv]
    cfg = train.check_config(args, world_size=nodes.nnodes * nproc, local_ranks=nproc)  # every node: the whole world
    if cfg is None:
        return USER_ERROR
    if cfg.job.dry_run:  # planned here, once: the ranks would each plan the same; NGPU or NNODES set: that world
        named = bool(os.environ.get("NGPU")) or nodes.nnodes > 1
        return train.print_dry_run(cfg, nodes.nnodes * nproc if named else None)
    if nodes.nnodes > 1:
        where = "" if nodes.node_rank is None else f"node {nodes.node_rank} of "
        print(
            f"kiln: {where}{nodes.nnodes} nodes x {nproc} ranks ({nodes.source}), rendezvous {nodes.endpoint} "
            f"id {nodes.rdzv_id}, max restarts {max_restarts}",
            flush=True,
        )

    os.environ["LOG_RANK"] = log_rank  # the Trainer logs metrics on these ranks
    os.environ[ERROR_FILE_ENV] = error_file
    if nproc > 1:
        # torchrun's own default with several ranks per node, set here to spare its 4-line banner on every launch.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if nodes.node_rank is not None:
        os.environ["KILN_NODE_RANK"] = str(nodes.node_rank)  # the survivors of a lost node name it by this
    if nodes.nnodes > 1:
        # Each rendezvous round gets a fresh store for the ranks, kept by the new rank 0. By default torchrun keeps
        # the first round's in the agent that was node 0 then: a restart after that node died waits for a store
        # that is gone, and a replacement node never joins (seen in tests/e2e/test_multinode.py's kill test).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args, run

    torchrun_args = [
        *("--nproc_per_node", str(nproc), *nodes.torchrun_args(), "--max_restarts", str(max_restarts)),
        *("--local-ranks-filter", log_rank, "--role", "rank", "--tee", "3"),
        os.path.join(KILN_DIR, "train.py"),
        *args,
    ]
    torchrun = parse_args(torchrun_args)
    launch = functools.partial(run, torchrun)
    if gpus == 0:
        # No GPU: torchrun forks the ranks from this process once it has imported the Trainer (and torchao for a
        # float8 run) instead of starting interpreters that each import them again (docs/performance.md). With
        # GPUs the ranks stay fresh interpreters, as `torchrun train.py` starts them: CUDA does not survive a fork
        # of a process that initialised it, and counting the GPUs here may have.
        import trainer.trainer  # noqa: F401

        if cfg.float8.enable_float8_linear:
            # Its import logs warnings (CUDA extensions a CPU cannot load, a deprecated pytree registration of its
            # KernelPreference Enum): kept off stderr, where a refusal by the ranks must be the only line.
            with contextlib.suppress(ImportError), _logging_off_below(logging.ERROR):
                import torchao.float8  # noqa: F401

        config, _, _ = config_from_args(torchrun)  # what `run` does, with train.py's main as a function
        config.start_method = "fork"
        launch = functools.partial(elastic_launch(config, forked_rank), args)
        # torchrun logs a failed forked rank with the traceback of its own ProcessExitedException (a failed rank
        # started as a program gets that line alone); the rank has said what went wrong.
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_exit_traceback)

    try:
        record(launch)()  # record: torchrun's own failure summary, as `torchrun` has it
    except ChildFailedError as e:
        reported = failure_report(e, error_file, os.environ[LOST_FILE_ENV], max_restarts, real_stderr)
        if reported is None:
            raise  # no kiln line, no lost rank (a crash): torchrun's report and exit status, unchanged
        return reported
    except RendezvousConnectionError:
        if nodes.node_rank == 0:  # node 0 keeps the rendezvous (Nodes.torchrun_args): it could not listen there
            say(
                ConfigError(
                    f"RDZV_ENDPOINT={nodes.endpoint}: node 0 keeps the rendezvous there and cannot listen on it: the "
                    "port is in use (another job's rendezvous?) or the host is not this machine; choose a free port "
                    "on node 0's host"
                ).line()
            )
            return USER_ERROR
        # torchrun's agent asks the rendezvous for new nodes while the ranks train: with node 0 gone, the job can
        # neither go on nor restart.
        print(
            f"kiln: error: the rendezvous at {nodes.endpoint}, kept by node 0, is unreachable: node 0 is down or cut "
            "off, and torchrun cannot go on or restart the job without it; run it again to resume from the newest "
            "complete checkpoint",
            file=real_stderr,
        )
        return PEER_LOST
    except SignalException as e:
        # SIGTERM or Ctrl-C: torchrun has passed it on to the ranks and waited for them, and each rank said what it
        # saved; torchrun's traceback of its own signal would add nothing. The shell's status for that signal.
        return 128 + int(e.sigval)
    return DONE


@contextlib.contextmanager
def _logging_off_below(level: int) -> Iterator[None]:
    """Every logger's records below `level` dropped inside the block (logging.disable), the old setting after."""
    before = logging.root.manager.disable
    logging.disable(level - 1)
    try:
        yield
    finally:
        logging.disable(before)


def _without_exit_traceback(record: logging.LogRecord) -> bool:
    from torch.multiprocessing import ProcessExitedException

    if record.exc_info and isinstance(record.exc_info[1], ProcessExitedException):
        record.exc_info, record.exc_text = None, None
    return True


def forked_rank(argv: list[str]) -> int:
    """A rank forked from the launcher: train.py's main as a fresh interpreter would run it, its exit status the
    rank's (torchrun counts a return as success, a SystemExit's code as the failure's)."""
    import train

    sys.stderr = sys.__stderr__  # not the launcher's QuietAfterRankLine
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # live lines, as `python -u` gives
    # torchrun had installed its handlers in this process before forking; a fresh interpreter has these.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = train.main(argv)
    if status:
        sys.exit(status)
    return DONE


def failure_report(e: Any, error_file: str, lost_file: str, max_restarts: int, stream: TextIO) -> int | None:
    """For torchrun's ChildFailedError `e`: print one line and return the exit status, or None to keep torchrun's
    report. A user mistake or a non-finite stop (a rank wrote "<status> <line>" to `error_file`): that line, that
    status (2, 1). Ranks lost, after the restarts
    are spent: one line naming them, 75. torchrun's first failure in time tells which: a rank of this node killed
    by a signal is the rank that died (torchrun stopped the others after it); a rank that found others gone (exit
    PEER_LOST) lost ranks elsewhere, which the first such rank wrote to `lost_file`."""
    with open(error_file) as f:
        status, _, first = f.readline().strip().partition(" ")
    if first:
        print(first, file=stream)
        return int(status)
    rank, root = e.get_first_failure()  # the first failure in time: the rank that died or saw the loss
    if root.exitcode < 0:
        node = os.environ.get("KILN_NODE_RANK")
        where = (f"node {node}, " if node else "") + f"host {socket.gethostname()}"
        lost = f"rank {rank} ({where}), killed by {root.signal_name()}; torchrun stopped the other ranks"
    elif root.exitcode == PEER_LOST:
        with open(lost_file) as f:
            lost = f.readline().strip().removeprefix("lost ")
        lost = lost or f"ranks that no rank could name (rank {rank} found a collective failed)"
    else:
        return None
    print(
        f"kiln: error: the job lost {lost}; its restarts are spent (MAX_RESTARTS={max_restarts}); run it again to "
        "resume from the newest complete checkpoint",
        file=stream,
    )
    return PEER_LOST


if __name__ == "__main__":
    from train import exit_now

    exit_now(main(sys.argv[1:]))
