"""Several nodes, simulated on one machine: two torchrun agents (run_train.sh each, 2 gloo ranks per "node") meet
at a c10d rendezvous on localhost, as nodes of a cluster do at the first node's address.

- the launcher's node layout from SLURM's variables or explicit ones, and its one-line mistakes (fast);
- HSDP (replicate 2 across the nodes, shard 2 within) with float8 tensorwise, FSDP float8 all-gather and
  precompute, launched through scripts/slurm_train.sh (a stand-in `srun` starts one task per node), and FSDP 2 x
  TP 2 through the plain-host variables: the same step lines and final weights as one 4-rank node;
- a node killed mid-step: the survivors name it in one line and exit within the collective timeout; torchrun's
  restart budget restarts the job when a replacement node joins, and it resumes from the newest complete
  checkpoint with the losses and final weights of the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

import launch
from tests.helpers.common import DEBUG_CONFIG, ROOT, free_port, store_process
from tests.helpers.kiln_process import SLURM_TRAIN, KilnResult, KilnRun, children, run_kiln, start_kiln

TIMEOUT_S = 600
COLLECTIVE_TIMEOUT_S = 30  # comm.train_timeout_seconds of these runs
STEP = re.compile(r"step: +(\d+)  loss: +(\S+)  .*  grad_norm: +(\S+)  lr:")
TINY = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "32"),
    *("--training.steps", "6", "--training.seed", "0", "--training.mixed_precision_param", "float32"),
    *("--metrics.log_freq", "1", "--activation_checkpoint.mode", "none", "--optimizer.lr", "3e-3"),
    *("--lr_scheduler.warmup_steps", "1", "--training.local_batch_size", "2"),
    *("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"),
    *("--comm.train_timeout_seconds", str(COLLECTIVE_TIMEOUT_S)),
)
P = "--parallelism."
HSDP_FLOAT8 = (
    *(f"{P}data_parallel_replicate_degree", "2", f"{P}data_parallel_shard_degree", "2"),
    *("--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather"),
    "--float8.precompute_float8_dynamic_scale_for_fsdp",
)
FSDP_TP = (f"{P}data_parallel_shard_degree", "2", f"{P}tensor_parallel_degree", "2")
# On top of this process's environment (with OMP_NUM_THREADS=1): no node layout of the machine running the tests.
NO_NODES: dict[str, str | None] = dict.fromkeys(
    ("NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "MAX_RESTARTS", "SLURM_JOB_ID", "SLURM_NNODES")
)


def run_node(args: list[str], *, ngpu: int, script: Path | None = None, cwd: Path = ROOT, **env: str) -> KilnResult:
    """NGPU=ngpu run_train.sh (or `script`) with `env` on top of NO_NODES, one OpenMP thread per rank."""
    return run_kiln(args, script=script, ngpu=ngpu, threads=1, env={**NO_NODES, **env}, cwd=cwd, timeout=TIMEOUT_S)


# ----------------------------------------------------------------------------- the node layout (fast)

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[007-010]"}


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("gpu[007-010]", "gpu007"), ("a1,b2", "a1"), ("gpu[3,5-6],cpu1", "gpu3"), ("r[1-2]-n[09-10]", "r1-n09")],
)
def test_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert launch.first_host(nodelist) == first


def test_node_layout_from_slurm() -> None:
    nodes = launch.node_layout(SLURM)
    assert nodes == launch.Nodes(4, 2, "gpu007:29500", "4242", "SLURM")
    assert nodes.torchrun_args() == [
        *("--nnodes", "4", "--rdzv_backend", "c10d", "--rdzv_endpoint", "gpu007:29500", "--rdzv_id", "4242"),
        *("--rdzv_conf", "is_host=0"),
    ]
    assert launch.node_layout({**SLURM, "SLURM_NODEID": "0"}).torchrun_args()[-1] == "is_host=1"
    assert launch.node_layout({**SLURM, "RDZV_PORT": "6000"}).endpoint == "gpu007:6000"
    # A one-node allocation keeps a local rendezvous on a free port: two such jobs on one node never meet.
    assert launch.node_layout({**SLURM, "SLURM_NNODES": "1", "SLURM_NODEID": "0"}).endpoint == "localhost:0"


def test_node_layout_from_explicit_variables_wins_over_slurm() -> None:
    env = {"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": "head:7000", "RDZV_ID": "run7"}
    assert launch.node_layout(env) == launch.Nodes(2, 1, "head:7000", "run7", "environment")
    assert launch.node_layout({**SLURM, **env}) == launch.Nodes(2, 1, "head:7000", "run7", "environment")
    assert launch.node_layout({}) == launch.Nodes(1, None, "localhost:0", "kiln", "environment")
    assert "--rdzv_conf" not in launch.node_layout({k: v for k, v in env.items() if k != "NODE_RANK"}).torchrun_args()


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"NNODES": "2"}, "NNODES=2 needs RDZV_ENDPOINT=host:port"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "h:1", "NODE_RANK": "2"}, "node rank 2 must be in 0..1"),
        ({"NNODES": "two"}, "NNODES must be a positive integer"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "head"}, "RDZV_ENDPOINT must be host:port, got 'head'"),
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "32", "SLURM_STEP_NUM_NODES": "4"}, "run one task per node"),
    ],
)
def test_node_layout_mistakes(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        launch.node_layout(env)


def test_config_is_checked_for_the_whole_world_before_any_rank_starts(tmp_path: Path) -> None:
    """NNODES x NGPU = 4 ranks: a shard degree of 2 is refused on every node before torchrun starts one."""
    args = [*TINY, f"{P}data_parallel_shard_degree", "2", "--job.dump_folder", str(tmp_path)]
    proc = run_node(args, ngpu=2, NNODES="2", NODE_RANK="1", RDZV_ENDPOINT="localhost:1")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line == (
        "kiln: error: parallelism: data_parallel_replicate_degree (1) x data_parallel_shard_degree (2) x "
        "tensor_parallel_degree (1) must equal the world size 4"
    )
    assert "[rank" not in proc.stdout


@pytest.mark.parametrize("ngpu", [1, 2])
def test_node_0_that_cannot_listen_on_the_rendezvous_port_is_one_line(tmp_path: Path, ngpu: int) -> None:
    """Another process holds RDZV_ENDPOINT's port (another job's rendezvous): node 0, which keeps the rendezvous,
    stops with one line naming the endpoint, exit 2, before any rank starts."""
    port = free_port()
    with store_process(port):
        args = [*TINY, "--job.dump_folder", str(tmp_path)]
        proc = run_node(args, ngpu=ngpu, NNODES="2", NODE_RANK="0", RDZV_ENDPOINT=f"localhost:{port}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"kiln: error: RDZV_ENDPOINT=localhost:{port}: node 0 keeps the rendezvous there and cannot listen on it: the "
        "port is in use (another job's rendezvous?) or the host is not this machine; choose a free port on node 0's "
        "host"
    ], proc.stderr[-2000:]
    assert "[rank" not in proc.stdout


def test_spent_restarts_after_a_lost_rank_are_one_line(tmp_path: Path) -> None:
    """torchrun's ChildFailedError after the restarts are spent: one line naming the lost ranks, 75. First failure a
    rank killed by a signal: that rank (torchrun stopped the others); a rank that saw others vanish (exit 75): what
    the first such rank wrote to the lost file, or that nobody could name them; any other failure keeps torchrun's
    report (None)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failed(*codes: int) -> ChildFailedError:
        return ChildFailedError("train.py", {r: ProcessFailure(r, 100 + r, c, "") for r, c in enumerate(codes)})

    empty, lost = os.devnull, tmp_path / "lost"
    lost.write_text("lost ranks 2, 3 (node 1, host h) (rank 0 found out in step 4)\nlost ranks 1, 2, 3 (host h)\n")
    tail = "; its restarts are spent (MAX_RESTARTS=0); run it again to resume from the newest complete checkpoint\n"
    for codes, lost_file, what in [
        ((75, -15), lost, "ranks 2, 3 (node 1, host h) (rank 0 found out in step 4)"),
        ((75, -15), empty, "ranks that no rank could name (rank 0 found a collective failed)"),
        ((-9, 75), lost, f"rank 0 (host {socket.gethostname()}), killed by SIGKILL; torchrun stopped the other ranks"),
    ]:
        out = io.StringIO()
        assert launch.failure_report(failed(*codes), empty, str(lost_file), 0, out) == 75
        assert out.getvalue() == f"kiln: error: the job lost {what}{tail}"
    assert launch.failure_report(failed(1, -15), empty, empty, 0, io.StringIO()) is None


# ----------------------------------------------------------------------------- two nodes on one machine


def steps_of(text: str) -> list[tuple[int, str, str]]:
    """(step, loss, grad_norm) of every step line, as printed (4 decimals)."""
    return [(int(s), loss, norm) for s, loss, norm in (m.groups() for m in map(STEP.search, text.splitlines()) if m)]


def final_weights(dump: Path) -> dict:
    """The model weights of {dump}/checkpoint/step-6, read as kiln reads checkpoints."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainer.checkpoint.manager import is_model_key, read_metadata
    from trainer.checkpoint.reader import SafeFileSystemReader

    path = str(dump / "checkpoint" / "step-6")
    md = read_metadata(path)
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if is_model_key(k) and isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=SafeFileSystemReader(path, md), no_dist=True)
    return sd


def rank0_lines(text: str) -> str:
    """The lines of global rank 0 in the output of a node that shows several ranks (torchrun's `[rankN]:` prefix)."""
    return "".join(line for line in text.splitlines(keepends=True) if line.startswith("[rank0]:"))


def assert_same_weights(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def start_node(
    node_rank: int, endpoint: str, dump: Path, *args: str, max_restarts: int = 0, log_rank: str = "0"
) -> KilnRun:
    """One simulated node: run_train.sh with NNODES=2 in its own session, its output read line by line."""
    if node_rank == 0:
        pids_far_from_wrapping()
    env = {**NO_NODES, "NNODES": "2", "NODE_RANK": str(node_rank), "RDZV_ENDPOINT": endpoint}
    env.update(RDZV_ID="sim", MAX_RESTARTS=str(max_restarts))
    args = [*TINY, *args, "--job.dump_folder", dump]
    proc = start_kiln(args, ngpu=2, threads=1, log_rank=log_rank, env=env, merge_stderr=True, new_session=True)
    return KilnRun(proc, timeout=TIMEOUT_S)


def pids_far_from_wrapping(margin: int = 1000) -> None:
    """torchrun's rendezvous orders the nodes of one host by their agent's pid, so node 0, started first, holds
    ranks 0 and 1 (and the job's store) unless the pid counter wraps before node 1 starts (pid_max is 32768 on some
    machines, and a full suite starts tens of thousands of processes). Use up the pids left before a near wrap."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    while int(Path("/proc/sys/kernel/ns_last_pid").read_text()) > pid_max - margin:
        subprocess.run(["true"], check=True)


def two_nodes(dump: Path, *args: str) -> str:
    """Both nodes to the end through the plain-host variables; node 0's output."""
    endpoint = f"localhost:{free_port()}"
    with contextlib.ExitStack() as stack:  # one node failing leaves the other waiting in a collective: end it too
        nodes = [stack.enter_context(start_node(n, endpoint, dump, *args)) for n in (0, 1)]
        for node in nodes:
            assert node.finish() == 0, node.text[-4000:]
    return "".join(node.text for node in nodes)


def two_nodes_under_slurm(dump: Path, tmp: Path, *args: str) -> str:
    """scripts/slurm_train.sh as sbatch would run it, with SLURM's variables for 2 nodes and a stand-in `srun`
    that starts its command once per node with that node's SLURM_NODEID (nodes on localhost)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        'while [[ "$1" == -* ]]; do shift; done\n'
        "pids=()\n"
        "for ((i = 0; i < SLURM_NNODES; i++)); do\n"
        '  SLURM_NODEID=$i SLURM_STEP_NUM_NODES=$SLURM_NNODES SLURM_STEP_NUM_TASKS=$SLURM_NNODES "$@" &\n'
        "  pids+=($!)\n"
        "done\n"
        'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc\n'
    )
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT)}
    env.update(SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost", RDZV_PORT=str(free_port()))
    proc = run_node([*args, "--job.dump_folder", str(dump)], ngpu=2, script=SLURM_TRAIN, cwd=tmp, **env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("kiln: node 0 of 2 nodes x 2 ranks (SLURM), rendezvous localhost:") == 1, proc.stdout
    assert proc.stdout.count("kiln: node 1 of 2 nodes x 2 ranks (SLURM), rendezvous localhost:") == 1, proc.stdout
    return proc.stdout


def one_node(dump: Path, *args: str) -> str:
    proc = run_node([*TINY, *args, "--job.dump_folder", str(dump)], ngpu=4)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def hsdp_two_nodes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("hsdp2")
    return tmp / "run", two_nodes_under_slurm(tmp / "run", tmp, *TINY, *HSDP_FLOAT8)


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_float8_across_two_nodes_equals_one_node(hsdp_two_nodes: tuple[Path, str], tmp_path: Path) -> None:
    dump2, out2 = hsdp_two_nodes
    out1 = one_node(tmp_path, *HSDP_FLOAT8)
    print("2 nodes:", steps_of(out2), "\n1 node :", steps_of(out1))
    assert [s for s, _, _ in steps_of(out2)] == list(range(1, 7))
    assert steps_of(out2) == steps_of(out1)
    assert "FSDP all-gathers 14 Float8Linear weights as 1-byte float8" in out2
    assert_same_weights(final_weights(dump2), final_weights(tmp_path))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_x_tp_across_two_nodes_equals_one_node(tmp_path: Path) -> None:
    out2 = two_nodes(tmp_path / "two", *FSDP_TP)
    out1 = one_node(tmp_path / "one", *FSDP_TP)
    print("2 nodes:", steps_of(out2), "\n1 node :", steps_of(out1))
    assert [s for s, _, _ in steps_of(out2)] == list(range(1, 7))
    assert steps_of(out2) == steps_of(out1)
    assert_same_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_node_is_named_and_the_restarted_job_resumes_exactly(
    hsdp_two_nodes: tuple[Path, str], tmp_path: Path
) -> None:
    """Node 1 is killed (every process) in step 4; node 0's ranks name it in one line within the collective
    timeout; its torchrun (MAX_RESTARTS=1) restarts the job when a replacement node 1 joins, from step-2."""
    dump2, straight = hsdp_two_nodes
    endpoint = f"localhost:{free_port()}"
    with (
        contextlib.ExitStack() as started
    ):  # a failed check leaves no node behind (node 0 would wait for a replacement)
        out0, out1, stopped, line, detect_s = _kill_and_replace(endpoint, tmp_path, started)
    print(f"detected {detect_s:.1f} s after the kill: {line.strip()}")
    # Found by the lost connections (gloo says "closed" or "reset" by peer), not by waiting out the collective
    # timeout: a verdict that holds under any load (the seconds do not: 5.5 s idle, 72 s at a load average of 35).
    assert re.search(r"Connection (closed|reset) by peer", line) and "Timed out" not in line, line
    resume = 2 * ((stopped - 1) // 2)  # the newest checkpoint complete before the step that failed
    loaded = f"Loaded checkpoint {tmp_path / 'checkpoint' / f'step-{resume}'} (full state)"
    assert loaded in out0, out0[-4000:]
    # Global rank 0 after the restart is on whichever node torchrun's rendezvous sorts first: by host, then by its
    # agent's pid, so on one host the replacement node holds ranks 0 and 1 when the pids wrapped in between
    # (pid_max 32768 here; two full-suite runs failed with no step of rank 0 left on node 0).
    resumed = steps_of(rank0_lines(out0.split(loaded, 1)[1] + out1))
    print(f"stopped in step {stopped}; resumed from step-{resume}:", resumed, "\nstraight:", steps_of(straight))
    assert resumed == steps_of(straight)[resume:], out0[-4000:] + out1[-4000:]
    assert_same_weights(final_weights(tmp_path), final_weights(dump2))
    # One line from each survivor that found out before torchrun stopped it (node 0 shows both its ranks: the first
    # to fail prints its line, torchrun may stop the other before it does), no traceback on node 0.
    assert out0.count("kiln: error: ") in (1, 2) and "Traceback" not in out0, out0[-4000:]


def _kill_and_replace(endpoint: str, dump: Path, started: contextlib.ExitStack) -> tuple[str, str, int, str, float]:
    """Kill node 1 once node 0 logged step 3, check node 0's line, start a replacement node 1, run to the end;
    node 0's and the replacement's output, the step node 0 stopped in, its line and the seconds from the kill to
    the line."""
    node0 = started.enter_context(start_node(0, endpoint, dump, *HSDP_FLOAT8, max_restarts=1, log_rank="0,1"))
    node1 = started.enter_context(start_node(1, endpoint, dump, *HSDP_FLOAT8, max_restarts=1))
    node0.wait_for("step:  3 ")
    node1.kill()
    killed = time.monotonic()
    detected, line = node0.wait_for("kiln: error: ")
    m = re.search(r"kiln: error: rank [01] stopped in step (\d+): lost ranks 2, 3 \(node 1, host \S+\); ", line)
    assert m, line
    assert line.rstrip().endswith("; torchrun restarts the job (MAX_RESTARTS) from the newest complete checkpoint")
    replacement = started.enter_context(start_node(1, endpoint, dump, *HSDP_FLOAT8, max_restarts=1))
    rc0, rc1 = node0.finish(), replacement.finish()
    assert rc0 == 0 and rc1 == 0, node0.text[-4000:] + replacement.text[-4000:]
    return node0.text, replacement.text, int(m.group(1)), line, detected - killed


# ----------------------------------------------------------------------------- one rank of a node killed


@pytest.mark.slow
@pytest.mark.distributed
def test_kill_9_of_one_rank_names_that_rank_only(tmp_path: Path) -> None:
    """kill -9 of rank 3 of a PP 2 x CP 2 job (the last stage): every rank's line and the launcher's last line name
    rank 3 alone, not the ranks torchrun stopped after it nor those that ended before the one that names them."""
    args = [*TINY, f"{P}pipeline_parallel_degree", "2", f"{P}context_parallel_degree", "2"]
    args += ["--training.steps", "100000", "--checkpoint.interval", "100000", "--job.dump_folder", str(tmp_path)]
    proc = start_kiln(args, ngpu=4, threads=1, log_rank="0,1,2,3", env=NO_NODES, merge_stderr=True)  # every rank shown
    with KilnRun(proc, timeout=TIMEOUT_S) as node:
        node.wait_for("step:  2 ")
        ranks = children(node.proc.pid)
        assert len(ranks) == 4, ranks
        os.kill(ranks[3], signal.SIGKILL)
        rc, out = node.finish(), node.text
    lines = [line for line in out.splitlines() if "kiln: error:" in line]
    assert rc == 75 and lines, out[-4000:]
    host = socket.gethostname()
    # The ranks that found out, each before torchrun stopped it, name rank 3 alone: a peer torchrun stops by SIGTERM
    # marks itself leaving first (without that, "lost ranks 1, 3" in 2 of 8 runs). The launcher's last line, from
    # the ranks' exit statuses, names rank 3 too.
    named = rf"rank [012] stopped in step \d+: lost rank 3 \(host {host}\); a collective failed"
    for line in lines[:-1]:
        assert re.search(named, line), out[-4000:]
    assert lines[-1] == (
        f"kiln: error: the job lost rank 3 (host {host}), killed by SIGKILL; torchrun stopped the other ranks; its "
        "restarts are spent (MAX_RESTARTS=0); run it again to resume from the newest complete checkpoint"
    ), out[-4000:]
    assert out.rstrip().endswith(lines[-1]) and "Traceback" not in out, out[-4000:]


LOST_RENDEZVOUS = (
    "kiln: error: the rendezvous at <endpoint>, kept by node 0, is unreachable: node 0 is down or cut off, and "
    "torchrun cannot go on or restart the job without it; run it again to resume from the newest complete checkpoint"
)


def kill_one_of_two_nodes(dump: Path, killed: int) -> tuple[int, str]:
    """Two nodes (MAX_RESTARTS=0), node `killed` killed once node 0 logged step 2: the other's status and output."""
    endpoint = f"localhost:{free_port()}"
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(start_node(n, endpoint, dump, "--training.steps", "100000")) for n in (0, 1)]
        nodes[0].wait_for("step:  2 ")
        nodes[killed].kill()
        return nodes[1 - killed].finish(), nodes[1 - killed].text


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_node_with_restarts_spent_is_named_by_the_launcher(tmp_path: Path) -> None:
    """Node 1 killed, MAX_RESTARTS=0: node 0's last line, the launcher's own, names node 1's ranks, whether or not
    the rank it shows (LOG_RANK 0) printed its line before torchrun stopped it."""
    rc, out = kill_one_of_two_nodes(tmp_path, killed=1)
    last = out.rstrip().splitlines()[-1]
    assert rc == 75, out[-4000:]
    assert re.fullmatch(
        r"kiln: error: the job lost ranks 2, 3 \(node 1, host \S+\) \(rank [01] found out in step \d+\); its restarts "
        r"are spent \(MAX_RESTARTS=0\); run it again to resume from the newest complete checkpoint",
        last,
    ), out[-4000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_node_keeping_the_rendezvous_and_rank_0_is_named(tmp_path: Path) -> None:
    """Node 0 killed: it keeps the rendezvous (NODE_RANK 0 does) and, started first, ranks 0 and 1, whose rank 0
    keeps the job's store. Node 1's last line, the launcher's own, names what was lost, no traceback: its ranks'
    finding (they name node 0's ranks, read from the store while it was up) or, when torchrun's agent asks the
    gone rendezvous for new nodes before a rank has ended, the rendezvous."""
    rc, out = kill_one_of_two_nodes(tmp_path, killed=0)
    last = out.rstrip().splitlines()[-1]
    assert rc == 75 and "Traceback" not in out, out[-4000:]
    then = "run it again to resume from the newest complete checkpoint"
    assert re.fullmatch(
        r"kiln: error: the job lost ranks 0, 1 \(node 0, host \S+\), which kept the job's store at \S+ \(unreachable\) "
        rf"\(rank [23] found out in step \d+\); its restarts are spent \(MAX_RESTARTS=0\); {then}",
        last,
    ) or re.fullmatch(re.escape(LOST_RENDEZVOUS).replace("<endpoint>", r"localhost:\d+"), last), out[-4000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_lost_rendezvous_is_named(tmp_path: Path) -> None:
    """Node 0 keeps the rendezvous; started after node 1, it holds ranks 2 and 3 (torchrun's rendezvous orders the
    nodes of one host by their agent's pid). Node 0 killed: node 1's agent finds the rendezvous gone when it next
    asks it for new nodes (every 0.1 s), before its ranks have named the lost ones (5 s). Node 1's last line, the
    launcher's own, names the rendezvous and node 0; no traceback."""
    endpoint = f"localhost:{free_port()}"
    pids_far_from_wrapping()
    with contextlib.ExitStack() as stack:
        node1 = stack.enter_context(start_node(1, endpoint, tmp_path, "--training.steps", "100000"))
        node0 = stack.enter_context(start_node(0, endpoint, tmp_path, "--training.steps", "100000"))
        node1.wait_for("step:  2 ")  # node 1 holds rank 0, which logs the steps
        node0.kill()
        rc, out = node1.finish(), node1.text
    assert rc == 75 and "Traceback" not in out, out[-4000:]
    assert out.rstrip().splitlines()[-1] == LOST_RENDEZVOUS.replace("<endpoint>", endpoint), out[-4000:]
