"""Fault tolerance on TorchFT ([fault_tolerance], docs/fault_tolerance.md) through run_train.sh, as users start it:
two replica groups of 2 gloo ranks each, each its own run_train.sh, and a torchft lighthouse started in this process.

- with no fault the two groups of FSDP 2 give the losses of HSDP 2 x 2 (fp32, deterministic, the same global batch),
  also with float8 (tensorwise, FSDP float8 all-gather) and compile inside the groups;
- a group killed with SIGKILL mid-run: the other trains on alone (its step lines stay 1..N, each once), the killed
  group restarted heals from it (weights, optimizer, LR schedule, step) and both finish in step: the same averaged
  losses and bitwise equal weights in their last checkpoints (LocalSGD, DiLoCo: at a sync, of what it synced);
- DiLoCo with no fault: the groups' weights meet at each sync in torchtitan's outer Nesterov SGD step;
- each mistake gives its one line (the lighthouse unreachable: within process_group_timeout_ms, not a hang).
- a group that joins with other DiLoCo settings than the live group's is refused with one line where it heals.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.common import tiny_run_args
from tests.helpers.kiln_process import KilnResult, KilnRun, assert_one_line_error, run_kiln, start_kiln
from tests.helpers.run_files import tensorboard_scalars

pytest.importorskip("torchft", reason="fault tolerance needs the torchft extra (pip install -e '.[ft]')")

TIMEOUT_S = 300
TINY = tiny_run_args("--model.n_layers", "2", "--training.deterministic", "--metrics.log_freq", "1")


def ft_args(replica_id: int, *extra: str) -> list[str]:
    return [
        *TINY,
        "--fault_tolerance.enable",
        "--fault_tolerance.group_size",
        "2",
        "--fault_tolerance.replica_id",
        str(replica_id),
        *extra,
    ]


@contextlib.contextmanager
def lighthouse(min_replicas: int, join_timeout_ms: int = 1000) -> Iterator[str]:
    """A torchft lighthouse in this process: a quorum needs `min_replicas` groups and waits up to `join_timeout_ms`
    for the groups that are alive (heartbeating) to ask; a group silent for 1 s is lost."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=1000
    )
    try:
        yield server.address()
    finally:
        server.shutdown()


def start_group(replica_id: int, lighthouse: str, cwd: Path, *extra: str) -> KilnRun:
    """One replica group: `NGPU=2 run_train.sh` in its own session (the test kills its whole tree)."""
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    proc = start_kiln(
        ft_args(replica_id, *extra), ngpu=2, threads=1, env=env, cwd=cwd, merge_stderr=True, new_session=True
    )
    return KilnRun(proc, timeout=TIMEOUT_S)


def steps_logged(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"\[rank0\]:.* step:\s+(\d+)\s+loss:", text)]


def losses_logged(text: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"\[rank0\]:.* step:\s+(\d+)\s+loss:\s+(\S+)", text)}


def trained_state(step_dir: Path) -> dict[str, object]:
    """A kiln checkpoint's weights, optimizer state and LR schedule (DCP, read on one process): all but the
    group's own data-loader position and train state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if k not in ("dataloader", "train_state")}


def bitwise_equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, type(a)) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


FLOAT8_COMPILE = (
    *("--float8.enable_float8_linear", "--float8.recipe_name", "tensorwise"),
    *("--float8.enable_fsdp_float8_all_gather", "--training.compile"),
)


@pytest.mark.slow
@pytest.mark.distributed
# fp32 inside the groups ran too, with the same assertions: the groups' cross-group averaging is the same code with
# float8 and compile inside (FSDP's all-gather changes, the replica groups' all-reduce does not), which this run also
# pins for float8 + compile with FSDP 2 and HSDP 2 x 2 (tests/e2e/test_composition.py's PINNED_ELSEWHERE).
@pytest.mark.parametrize("inside", ["float8_compile"])
def test_two_groups_without_a_fault_give_hsdp_losses(inside: str, tmp_path: Path) -> None:
    """Two groups of FSDP 2 through the lighthouse == HSDP 2 x 2 in one job, within 1e-5 at every step (the
    lighthouse waits for both groups: a group that came later would heal from the first at its first step), with
    float8 (tensorwise, FSDP float8 all-gather) and compile inside each group, as without fault tolerance."""
    steps, tb = ("--training.steps", "5"), ("--metrics.enable_tensorboard",)
    if inside == "float8_compile":
        steps += FLOAT8_COMPILE
    hsdp = run_kiln(
        [
            *TINY,
            *steps,
            *tb,
            "--job.dump_folder",
            str(tmp_path / "hsdp"),
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
        ngpu=4,
        threads=1,
        cwd=tmp_path,
        timeout=TIMEOUT_S,
    )
    assert hsdp.returncode == 0, hsdp.output[-3000:]
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(lighthouse(min_replicas=2))
        outputs = [
            stack.enter_context(
                start_group(g, address, tmp_path, *steps, *tb, "--job.dump_folder", str(tmp_path / f"ft{g}"))
            )
            for g in (0, 1)
        ]
        assert [o.finish() for o in outputs] == [0, 0], outputs[0].text[-3000:] + outputs[1].text[-3000:]
    want = tensorboard_scalars(tmp_path / "hsdp" / "tb" / "rank_0")
    for g in (0, 1):
        got = tensorboard_scalars(tmp_path / f"ft{g}" / "tb" / "rank_0")
        assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5]
        for step in want:
            assert abs(got[step]["kiln/loss"] - want[step]["kiln/loss"]) < 1e-5
        assert "2 of 2 replica groups live; global batch 8 sequences" in outputs[g].text
        if inside == "float8_compile":
            assert "float8 + compile: inductor tile_reductions on" in outputs[g].text
            assert re.search(
                r"float8 in use: FSDP all-gathers [1-9]\d* Float8Linear weights as 1-byte", outputs[g].text
            )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["synchronous", "local_sgd", "diloco"])
def test_a_killed_group_is_left_out_then_heals_from_the_live_one(mode: str, tmp_path: Path) -> None:
    """Kill group 1 (SIGKILL of its run_train.sh tree) two steps after both groups train together: group 0 trains on
    alone; group 1 restarted heals from group 0 (synchronous: at its first step; LocalSGD, DiLoCo: at its first sync)
    and both train on in step, with bitwise equal weights in their checkpoints of the first step after it that is a
    checkpoint step and, under LocalSGD, a sync step (under DiLoCo with 2 fragments, sync_steps 4: the sync of
    fragment 0 (tok_embeddings, layers.0), equal there; fragment 1, synced two steps before, apart). Neither group has
    a last step: however long the restart takes (under load, or delayed 60 s), the survivor is still training when the
    restarted group comes back (with a fixed count it ended first); the test stops both once they saved that
    checkpoint (a constant lr)."""
    semi_sync = {
        "synchronous": (),
        "local_sgd": ("--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps", "3"),
        "diloco": (
            *("--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4"),
            *("--fault_tolerance.num_fragments", "2"),
        ),
    }[mode]
    # The steps (step % period == phase) whose checkpoints (every 10th step) both write from the same synced weights
    period, phase = {"synchronous": (10, 0), "local_sgd": (30, 0), "diloco": (20, 10)}[mode]
    constant_lr = ("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0")
    run = (
        *semi_sync,
        *constant_lr,
        *("--training.seq_len", "128", "--training.steps", "100000"),
        *("--checkpoint.enable_checkpoint", "--checkpoint.interval", "10", "--job.dump_folder", str(tmp_path / "out")),
        *("--fault_tolerance.process_group_timeout_ms", "5000"),
    )
    with contextlib.ExitStack() as stack:
        # LocalSGD: a sync waits for the groups that are alive, so that the restarted group meets the survivor at
        # its first sync (a quorum of one would let it train on alone until their syncs coincide)
        join_ms = 1000 if mode == "synchronous" else 30_000
        address = stack.enter_context(lighthouse(min_replicas=1, join_timeout_ms=join_ms))
        g0 = stack.enter_context(start_group(0, address, tmp_path, *run))
        g1 = stack.enter_context(start_group(1, address, tmp_path, *run))
        _, met = g0.wait_for(r"step \d+: 2 of 2 replica groups live")  # at the first quorum the one behind heals
        for _ in range(2):
            g0.wait_for(r"\[rank0\]:.* step:\s+\d+ ")
        g1.kill()
        restarted = stack.enter_context(start_group(1, address, tmp_path, *run))  # at once: it starts slowly
        g0.wait_for(r"step \d+: 1 of 2 replica groups live")
        rejoined = int(re.search(r"step (\d+): 2 of 2", g0.wait_for(r"step \d+: 2 of 2 replica groups live")[1])[1])
        step = next(s for s in itertools.count(rejoined + 1) if s % period == phase)
        for group in (g0, restarted):
            group.wait_for(rf"Saved checkpoint .*/step-{step} ")
    # The survivor, from the groups' first quorum on: every step once, in order (before it, the groups start alone,
    # and at it the one behind heals from the other, even the survivor: steps 1, 8, 9, ... seen on loaded cores);
    # told when it went on alone and when the group came back.
    logged = steps_logged(g0.text.split(met, 1)[1])
    assert logged == list(range(logged[0], logged[-1] + 1)) and logged[-1] >= step, g0.text[-4000:]
    alone = "1 of 2 replica groups live" + ("; global batch 4 sequences" if mode == "synchronous" else "")
    assert re.search(rf"step \d+: {alone}", g0.text)
    # The restarted group resumed from its last complete checkpoint, then healed from the live group.
    assert "healed from a live replica group" in restarted.text, restarted.text[-4000:]
    assert step in steps_logged(restarted.text)
    folder = tmp_path / "out" / "checkpoint"
    s0, s1 = (trained_state(folder / f"ft_replica_{g}" / f"step-{step}") for g in (0, 1))
    if mode != "synchronous":  # each group steps its own AdamW on its own batches; the weights meet at every sync
        fragment_1 = ("layers.1.", "norm.", "output.") if mode == "diloco" else ()
        weights = [k for k in s0 if isinstance(s0[k], torch.Tensor)]
        synced = [k for k in weights if not k.startswith(fragment_1)]
        apart = [k for k in weights if k not in synced]
        assert "tok_embeddings.weight" in synced and all(torch.equal(s0[k], s1[k]) for k in synced)
        assert len(apart) == (11 if mode == "diloco" else 0) and not any(torch.equal(s0[k], s1[k]) for k in apart)
        assert not bitwise_equal(s0["optimizer"], s1["optimizer"])
        return
    assert f"replica group 1 rejoined at step {rejoined}" in restarted.text
    # In step after healing: the same cross-group averaged loss at every step both ran, the same weights.
    after = {s: v for s, v in losses_logged(restarted.text).items() if rejoined <= s <= step}
    assert after and all(losses_logged(g0.text)[s] == v for s, v in after.items())
    assert "tok_embeddings.weight" in s0 and "optimizer" in s0 and bitwise_equal(s0, s1)


@pytest.mark.slow
@pytest.mark.distributed
def test_semi_sync_groups_train_alone_and_meet_at_every_sync(tmp_path: Path) -> None:
    """semi_sync_method local_sgd, sync_steps 3: each group steps on its own batches (their losses differ from the
    first step), and their weights are bitwise equal after each sync (step 6) and only then (steps 2 and 4)."""
    run = (
        "--training.steps",
        "6",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "2",
        "--fault_tolerance.semi_sync_method",
        "local_sgd",
        "--fault_tolerance.sync_steps",
        "3",
        "--job.dump_folder",
        str(tmp_path / "out"),
    )
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(lighthouse(min_replicas=2))
        outputs = [stack.enter_context(start_group(g, address, tmp_path, *run)) for g in (0, 1)]
        assert [o.finish() for o in outputs] == [0, 0], outputs[0].text[-3000:] + outputs[1].text[-3000:]
    assert losses_logged(outputs[0].text)[1] != losses_logged(outputs[1].text)[1]
    assert "the sync before step 4: 2 of 2 replica groups live" in outputs[0].text
    folder = tmp_path / "out" / "checkpoint"
    for step, equal in ((2, False), (4, False), (6, True)):
        s0, s1 = (trained_state(folder / f"ft_replica_{g}" / f"step-{step}") for g in (0, 1))
        weights = [k for k in s0 if isinstance(s0[k], torch.Tensor)]
        assert weights and all(torch.equal(s0[k], s1[k]) for k in weights) == equal, step


@pytest.mark.slow
@pytest.mark.distributed
def test_diloco_groups_meet_in_torchtitans_outer_nesterov_step(tmp_path: Path) -> None:
    """semi_sync_method diloco, sync_steps 2, fragment_sync_delay 1 (one fragment: the whole model): each group sends
    its pseudo-gradient (its weights at the last sync minus its weights now) after its steps 1 and 3 and applies the
    groups' average at steps 2 and 4. The weights differ after steps 1 and 3 and are bitwise equal after 2 and 4, and
    they follow torchtitan's outer optimizer (SGD, lr 0.7, momentum 0.9, Nesterov) over the pseudo-gradients averaged
    across the groups: with M1, M3 the groups' mean weights after steps 1 and 3, the first sync W2 = W0 - 0.7 x 1.9
    x (W0 - M1) gives the first pseudo-gradient (M1 - W2) / 0.33 without the initial W0, and torch's SGD, stepped on it
    and then on W2 - M3, must give W4.
    Then both groups stop after step 5 (apart: between syncs) and resume from their checkpoints at once: DiLoCo's
    outer state is not in them, so at the first sync's quorum (after step 6) one group heals from the other: their
    weights are bitwise equal from then on (steps 6 and 7)."""
    run = (
        *("--checkpoint.enable_checkpoint", "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path / "out")),
        *("--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "2"),
        *("--fault_tolerance.fragment_sync_delay", "1"),
    )
    outputs = []
    for steps in (5, 7):
        with contextlib.ExitStack() as stack:
            address = stack.enter_context(lighthouse(min_replicas=2))
            steps_arg = ("--training.steps", str(steps))
            outputs = [stack.enter_context(start_group(g, address, tmp_path, *run, *steps_arg)) for g in (0, 1)]
            assert [o.finish() for o in outputs] == [0, 0], outputs[0].text[-3000:] + outputs[1].text[-3000:]
        if steps == 5:
            assert losses_logged(outputs[0].text)[1] != losses_logged(outputs[1].text)[1]
            assert "the sync before step 2: 2 of 2 replica groups live" in outputs[0].text  # its quorum: after step 1
    assert sum("healed from a live replica group: weights, optimizer and lr of step 6" in o.text for o in outputs) == 1
    folder = tmp_path / "out" / "checkpoint"
    states = {s: [trained_state(folder / f"ft_replica_{g}" / f"step-{s}") for g in (0, 1)] for s in range(1, 8)}
    weights = [k for k, v in states[1][0].items() if isinstance(v, torch.Tensor)]
    assert "tok_embeddings.weight" in weights and "output.weight" in weights
    for step in range(1, 8):
        a, b = states[step]
        assert all(torch.equal(a[k], b[k]) for k in weights) == (step in (2, 4, 6, 7)), step
    for k in weights:
        (m1, m3), w2 = ((states[s][0][k] + states[s][1][k]) / 2 for s in (1, 3)), states[2][0][k]
        first = (m1 - w2) / (0.7 * 1.9 - 1)
        param = torch.nn.Parameter(m1 + first)  # W0
        outer = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
        param.grad = first
        outer.step()
        torch.testing.assert_close(param.data, w2, rtol=0, atol=2e-6)
        param.grad = w2 - m3
        outer.step()  # the second outer step moves the weights by ~1e-3; rounding of the above: < 5e-7
        torch.testing.assert_close(param.data, states[4][0][k], rtol=0, atol=2e-6, msg=k)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_group_started_with_other_diloco_settings_is_refused_where_it_heals(tmp_path: Path) -> None:
    """Group 0 runs DiLoCo with sync_steps 2; group 1 joins it with sync_steps 4 (a group restarted with another
    schedule): at its first sync it is behind and heals from group 0, sees the other setting and stops with one line
    (exit 2) instead of taking group 0's weights at every sync and training on as if it belonged to the job."""
    diloco = ("--fault_tolerance.semi_sync_method", "diloco", "--job.dump_folder", str(tmp_path / "out"))
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(lighthouse(min_replicas=1, join_timeout_ms=30_000))
        steps = ("--training.steps", "100000", "--lr_scheduler.warmup_steps", "0")  # alive until group 1 is refused
        env = {"TORCHFT_LIGHTHOUSE": address}
        live = stack.enter_context(
            KilnRun(
                start_kiln(
                    ft_args(0, *diloco, "--fault_tolerance.sync_steps", "2", *steps),
                    **dict(ngpu=1, threads=1, env=env, cwd=tmp_path, merge_stderr=True, new_session=True),
                ),
                timeout=TIMEOUT_S,
            )
        )
        live.wait_for(r"step:\s+3\s")
        other = ft_args(1, *diloco, "--fault_tolerance.sync_steps", "4")
        joining = stack.enter_context(
            KilnRun(start_kiln(other, ngpu=1, threads=1, env=env, cwd=tmp_path, merge_stderr=True), timeout=TIMEOUT_S)
        )
        assert joining.finish() == 2, joining.text[-4000:]
    errors = [line for line in joining.text.splitlines() if "kiln: error:" in line]
    assert errors == [
        "kiln: error: fault_tolerance.sync_steps is 4 in replica group 1 but 2 in the live group it heals from: every "
        "group of a job must run the same; start this group again with 2 (or stop every group and start them all "
        "with one value)"
    ], joining.text[-4000:]
    assert "Traceback" not in joining.text and "healed from a live replica group" not in joining.text


@pytest.mark.slow
@pytest.mark.distributed
def test_a_second_group_with_a_taken_replica_id_is_refused_and_the_first_trains_on(tmp_path: Path) -> None:
    """Two groups started with replica_id 0 (a copied launch line): they would train as one job, both reading group
    0's samples and nobody group 1's. The later one stops at its first quorum with one line naming the key and the
    free id (exit 2); the first, which met it there, trains on alone."""
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(lighthouse(min_replicas=1))
        env = {"TORCHFT_LIGHTHOUSE": address}
        run = ("--training.steps", "100000", "--job.dump_folder", str(tmp_path / "out"))
        kw = dict(ngpu=1, threads=1, env=env, cwd=tmp_path, merge_stderr=True, new_session=True)
        first = stack.enter_context(KilnRun(start_kiln(ft_args(0, *run), **kw), timeout=TIMEOUT_S))
        first.wait_for(r"step:\s+2\s")
        second = stack.enter_context(KilnRun(start_kiln(ft_args(0, *run), **kw), timeout=TIMEOUT_S))
        assert second.finish() == 2, second.text[-4000:]
        first.wait_for(r"step \d+: 1 of 2 replica groups live")  # after the refused group, alone again
        _, line = first.wait_for(r"\[rank0\]:.* step:\s+\d+ ")
    errors = [line for line in second.text.splitlines() if "kiln: error:" in line]
    assert errors == [
        "kiln: error: fault_tolerance.replica_id = 0 is taken: a replica group started before this one with the same "
        "id is live in the quorum (every group of a job needs its own id in [0, group_size) = [0, 2); live: 0); "
        "start this group with a free id (1)"
    ], second.text[-4000:]
    assert "Traceback" not in second.text and "step:" not in second.text
    assert "kiln: error" not in first.text and "Traceback" not in first.text, first.text[-4000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lighthouse_gone_mid_run_is_one_line_after_the_quorum_timeout(tmp_path: Path) -> None:
    """The lighthouse (torchft_lighthouse, its own process) killed while a group trains: the group's next quorum
    times out after comm.init_timeout_seconds and it stops with one line, exit 75 (lost), its checkpoint kept; not
    torchft's traceback and exit 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        ["torchft_lighthouse", "--min_replicas", "1", "--join_timeout_ms", "100", "--bind", f"[::]:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with contextlib.ExitStack() as stack:
        stack.callback(server.kill)
        run = ("--training.steps", "100000", "--comm.init_timeout_seconds", "10", "--job.dump_folder", str(tmp_path))
        args = [*ft_args(0, *run, "--checkpoint.enable_checkpoint", "--checkpoint.interval", "5")]
        args[args.index("--fault_tolerance.group_size") + 1] = "1"
        env = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
        proc = start_kiln(args, ngpu=1, threads=1, env=env, cwd=tmp_path, merge_stderr=True, new_session=True)
        group = stack.enter_context(KilnRun(proc, timeout=TIMEOUT_S))
        group.wait_for(r"Saved checkpoint .*step-5 ")
        server.kill()
        assert group.finish(timeout=120) == 75, group.text[-4000:]
    lines = [line for line in group.text.splitlines() if "kiln: error:" in line]
    assert len(lines) == 2 and "Traceback" not in group.text, group.text[-4000:]
    assert re.search(
        r"^\[rank0\]:kiln: error: rank 0 stopped in step \d+: no fault-tolerance quorum within "
        rf"comm.init_timeout_seconds = 10 s: the lighthouse at TORCHFT_LIGHTHOUSE=http://localhost:{port} is down",
        lines[0],
    ), lines
    assert lines[1].startswith(f"kiln: error: the job lost the torchft lighthouse at http://localhost:{port}"), lines
    assert (tmp_path / "checkpoint" / "ft_replica_0" / "step-5").is_dir()


# ----------------------------------------------------------------------------- mistakes, one line each


def run_group(*args: str, cwd: Path, ngpu: int = 1, **env: str) -> KilnResult:
    return run_kiln(args, ngpu=ngpu, threads=1, env=env, cwd=cwd, timeout=TIMEOUT_S)


FT_MISTAKES = [
    (
        ("--fault_tolerance.replica_id", "2"),
        {},
        "fault_tolerance.replica_id must be in [0, group_size) = [0, 2), got 2",
    ),
    (("--fault_tolerance.group_size", "0"), {}, "fault_tolerance.group_size must be the number of replica groups"),
    (
        ("--fault_tolerance.group_size", str(2**62)),
        {},
        f"fault_tolerance.group_size must be in [0, 4096] (replica groups; each reads 1/group_size of every global "
        f"batch), got {2**62}",
    ),
    (
        ("--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.should_quantize"),
        {},
        "fault_tolerance.should_quantize needs CUDA GPUs (torchft's triton kernels); this run is on cpu",
    ),
    (
        ("--parallelism.pipeline_parallel_degree", "2"),
        {},
        "parallelism.pipeline_parallel_degree = 2: not supported with fault_tolerance.enable yet",
    ),
    (
        ("--parallelism.context_parallel_degree", "2"),
        {},
        "parallelism.context_parallel_degree = 2: not supported with fault_tolerance.enable yet",
    ),
    (("--parallelism.data_parallel_replicate_degree", "2"), {}, "the replica groups are the replicate dimension"),
    ((), {"TORCHFT_LIGHTHOUSE": ""}, "TORCHFT_LIGHTHOUSE is not set"),
]
FT_MISTAKE_IDS = [
    *("replica_id", "group_size", "group_size_huge", "diloco_quantize"),
    *("pp", "cp", "dp_replicate", "no_lighthouse_env"),
]


@pytest.mark.parametrize(("extra", "env", "needle"), FT_MISTAKES, ids=FT_MISTAKE_IDS)
def test_mistakes_are_one_line_in_the_launchers_check(
    extra: tuple[str, ...],
    env: dict[str, str],
    needle: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
) -> None:
    """What run_train.sh checks before torchrun (train.check_config for NGPU 2) stops each with its one line."""
    import train

    for key, value in {"TORCHFT_LIGHTHOUSE": "http://localhost:1", **env}.items():
        monkeypatch.setenv(key, value)
    assert train.check_config(ft_args(0, "--job.dump_folder", str(tmp_path), *extra), world_size=2) is None
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith("kiln: error: ") and needle in line, line


@pytest.mark.parametrize(("extra", "env", "needle"), [FT_MISTAKES[0], FT_MISTAKES[-1]], ids=["replica_id", "env"])
def test_mistakes_are_one_line_before_any_rank(
    extra: tuple[str, ...], env: dict[str, str], needle: str, tmp_path: Path
) -> None:
    """Through run_train.sh (NGPU 2): a config mistake and the environment's, exit 2 before torchrun starts a rank
    (the others take the same path: test_mistakes_are_one_line_in_the_launchers_check)."""
    env = {"TORCHFT_LIGHTHOUSE": "http://localhost:1", **env}
    proc = run_group(*ft_args(0, "--job.dump_folder", str(tmp_path), *extra), cwd=tmp_path, ngpu=2, **env)
    assert_one_line_error(proc, needle)
    assert "[rank0]" not in proc.stdout, proc.stdout[-2000:]


def test_without_torchft_is_one_line(tmp_path: Path) -> None:
    """fault_tolerance.enable where torchft is not importable (a sitecustomize hides the installed one)."""
    hide = tmp_path / "no_torchft"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\n\nsys.modules['torchft'] = None  # as if not installed\n")
    pythonpath = os.pathsep.join(p for p in (str(hide), os.environ.get("PYTHONPATH", "")) if p)
    proc = run_group(
        *ft_args(0, "--job.dump_folder", str(tmp_path / "out")),
        cwd=tmp_path,
        TORCHFT_LIGHTHOUSE="http://localhost:1",
        PYTHONPATH=pythonpath,
    )
    assert_one_line_error(proc, "fault_tolerance.enable needs the torchft package, which is not installed", ".[ft]")


@pytest.mark.distributed
def test_an_unreachable_lighthouse_is_one_line_within_the_timeout(tmp_path: Path) -> None:
    """Nothing listens at TORCHFT_LIGHTHOUSE: the group's ranks end with one line after process_group_timeout_ms
    (1 s here), not at a collective's timeout."""
    with socket_bound() as port:  # a port nobody answers on
        t0 = time.monotonic()
        proc = run_group(
            *ft_args(0, "--job.dump_folder", str(tmp_path), "--fault_tolerance.process_group_timeout_ms", "1000"),
            cwd=tmp_path,
            ngpu=2,
            TORCHFT_LIGHTHOUSE=f"http://localhost:{port}",
        )
        elapsed = time.monotonic() - t0
    assert_one_line_error(
        proc,
        f"no torchft lighthouse answers at TORCHFT_LIGHTHOUSE=http://localhost:{port}",
        "process_group_timeout_ms = 1000",
    )
    assert elapsed < 120, elapsed


class socket_bound:
    """A TCP port bound (so no one else takes it) but never listened on: connections to it are refused."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
