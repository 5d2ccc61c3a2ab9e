"""Pipeline parallelism end to end, against one process from the same seed (the same weights in every layout).

One spawned group of 2 gloo ranks trains, through `parse_args` + `Trainer`, PP 2 under every schedule kiln runs
(fp32, deterministic, the debug model with 2 blocks, global batch 4, 4 steps): the losses must equal the one-process
run's within 1e-5 relative, and every parameter's gradient after step 1 (gathered by name from both stages) the
one-process gradient. The same group then checks, under 1F1B: resume from its own step-2 checkpoint (bitwise), a
SIGTERM stop with its save and the resume from it (bitwise), a resume from the one-process run's step-2 (and the
one process resumes from the pipeline's), the resume-change table (a handled and a refused change), initial weights
from checkpoint.initial_load_path, the float8 first-step check and numerics observatory over both stages, and MXFP8.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kiln_base.config import PP_SCHEDULES
from kiln_base.errors import CheckpointError, TrainingStopped
from kiln_base.internals import pipeline_warmup_sends_to_own_rank
from tests.helpers.common import DEBUG_CONFIG, ROOT, LogLines, open_trainer
from tests.helpers.distributed import reopen_group, run_distributed
from tests.helpers.grads import GradsAtStep1
from trainer.hooks import StepHook, StepOutput

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = [
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "32"),
    *("--training.global_batch_size", "4", "--training.local_batch_size", "4", "--training.steps", "4"),
    *("--training.seed", "0", "--training.mixed_precision_param", "float32", "--training.deterministic"),
    *("--metrics.log_freq", "1", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1"),
    *("--activation_checkpoint.mode", "none", "--checkpoint.interval", "2"),
]
CKPT = ("--checkpoint.enable_checkpoint",)
MXFP8 = ("--float8.enable_float8_linear", "--float8.recipe_name", "mxfp8_rceil", "--float8.emulate")
PP2 = ("--parallelism.pipeline_parallel_degree", "2")
# torch 2.11 cannot start the V schedule on gloo (kiln refuses it there: kiln_base/config/checks.py
# check_pipeline_device); the oldest-torch leg runs the others.
SCHEDULES = [s for s in PP_SCHEDULES if PP_SCHEDULES[s] != "v" or not pipeline_warmup_sends_to_own_rank()]


class SigtermAt(StepHook):
    """Sends this process SIGTERM after step `step` (rank 0 only): the stop agreement ends the run a step later."""

    def __init__(self, step: int) -> None:
        self.step = step

    def post_step(self, out: StepOutput) -> None:
        if out.step == self.step and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)


_KEEP: list[Any] = []  # closed Trainers: the first one's process group holds the store at MASTER_PORT


def _train(argv: list[str], store: str, hooks: tuple[StepHook, ...] = ()) -> tuple[list[float], dict[str, Any]]:
    """One Trainer run on this rank's group (reopened through `store` after an earlier run closed it): its logged
    losses and its gradients after step 1. Every Trainer is kept: the lost-rank watch of each later one connects
    to the store of the group run_distributed started, which lives as long as something refers to it."""
    reopen_group(store)
    torch._dynamo.reset()
    with open_trainer(argv) as trainer:
        _KEEP.append(trainer)
        grads = GradsAtStep1(trainer.model)
        trainer.train(extra_hooks=[grads, *hooks])
    return trainer.losses, grads.grads


def _pipeline_group(folder: str, one_rank_step2: str) -> dict[str, Any]:
    """On each of 2 ranks: every scenario in turn."""
    out: dict[str, Any] = {}
    records = LogLines(logging.INFO)
    logging.getLogger("kiln").addHandler(records)
    logging.getLogger("kiln").setLevel(logging.INFO)
    stores = iter(f"{folder}/store_{i}" for i in range(100))
    dump = Path(folder)
    dump.mkdir(parents=True, exist_ok=True)

    def run(name: str, *args: str, hooks: tuple[StepHook, ...] = ()) -> list[float]:
        records.lines.clear()
        losses, grads = _train([*COMMON, *PP2, *args, "--job.dump_folder", str(dump / name)], next(stores), hooks)
        out[name] = {"losses": losses, "grads": grads, "lines": list(records.lines)}
        return losses

    def copy_step2(src: Path, name: str) -> None:
        if dist.get_rank() == 0:
            shutil.copytree(src / "checkpoint" / "step-2", dump / name / "checkpoint" / "step-2")

    for schedule in SCHEDULES:  # 1F1B's run also saves steps 2 and 4
        run(schedule, "--parallelism.pipeline_parallel_schedule", schedule, *(CKPT if schedule == "1F1B" else ()))
    reopen_group(next(stores))
    copy_step2(dump / "1F1B", "resumed")
    copy_step2(Path(one_rank_step2), "from_one_rank")
    dist.barrier()
    run("resumed", *CKPT)
    run("from_one_rank", *CKPT)
    try:
        run("sigterm", *CKPT, hooks=(SigtermAt(2),))
    except TrainingStopped as e:
        out["sigterm"] = {"stopped": str(e)}
    run("sigterm", *CKPT)  # the same command again: resumes from the stop's save
    reopen_group(next(stores))
    copy_step2(dump / "1F1B", "changed_lr")
    copy_step2(dump / "1F1B", "changed_seq_len")
    dist.barrier()
    run("changed_lr", *CKPT, "--optimizer.lr", "1e-3")
    try:
        run("changed_seq_len", *CKPT, "--training.seq_len", "16")
    except CheckpointError as e:
        out["changed_seq_len"] = {"refused": str(e)}
    f8 = ("--float8.enable_float8_linear", "--float8.emulate", "--float8.numerics_log_freq", "2")
    run("numerics", *f8)
    try:
        run("mxfp8", *MXFP8)
    except AssertionError as e:  # torchao's MXFP8 needs a newer torch than 2.11 (the oldest-torch leg)
        out["mxfp8"] = {"unsupported": str(e)}
        reopen_group(next(stores))
    run("initial_load", "--checkpoint.initial_load_path", f"{one_rank_step2}/checkpoint/step-2")
    logging.getLogger("kiln").removeHandler(records)
    buffer = io.BytesIO()  # tensors through the result queue would be shared memory of a process about to exit
    torch.save(out, buffer)
    return buffer.getvalue()


def _one_rank(folder: Path, *args: str) -> tuple[list[float], dict[str, Any]]:
    """One process (this test's): the reference."""
    with open_trainer([*COMMON, *args, "--job.dump_folder", str(folder)]) as trainer:
        grads = GradsAtStep1(trainer.model)
        trainer.train(extra_hooks=[grads])
    return trainer.losses, grads.grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("pipeline")
    one_losses, one_grads = _one_rank(folder / "one", *CKPT)
    ranks = [
        torch.load(io.BytesIO(r)) for r in run_distributed(_pipeline_group, 2, str(folder / "pp"), str(folder / "one"))
    ]
    shutil.copytree(folder / "pp" / "1F1B" / "checkpoint" / "step-2", folder / "one_from_pp" / "checkpoint" / "step-2")
    moved, _ = _one_rank(folder / "one_from_pp", *CKPT)
    mxfp8 = _one_rank(folder / "one_mxfp8", *MXFP8)[0] if "unsupported" not in ranks[0]["mxfp8"] else None
    initial, _ = _one_rank(folder / "one_initial", "--checkpoint.initial_load_path", f"{folder}/one/checkpoint/step-2")
    one = {"losses": one_losses, "grads": one_grads}
    more = {"one_mxfp8": mxfp8, "one_initial_load": initial}
    return {"one": one, "ranks": ranks, "one_from_pp": moved, **more, "dir": folder}


def _merged(runs: dict[str, Any], name: str, key: str) -> Any:
    """Both ranks' values of a scenario: losses (the same on both), grads merged by name."""
    r0, r1 = (r[name] for r in runs["ranks"])
    if key == "grads":
        assert not set(r0["grads"]) & set(r1["grads"]), "each parameter lives on one stage"
        return r0["grads"] | r1["grads"]
    assert r0[key] == r1[key], (r0[key], r1[key])  # every rank of the pipeline logs the same loss
    return r0[key]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_one_process(schedule: str, runs: dict[str, Any]) -> None:
    one = runs["one"]
    losses = _merged(runs, schedule, "losses")
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    grads = _merged(runs, schedule, "grads")
    assert set(grads) == set(one["grads"])
    for name, g in one["grads"].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_resume_is_bitwise_and_each_stage_saves_its_part(runs: dict[str, Any]) -> None:
    from trainer.checkpoint.manager import read_metadata

    straight = _merged(runs, "1F1B", "losses")
    assert _merged(runs, "resumed", "losses") == straight[2:]
    md = read_metadata(str(runs["dir"] / "pp" / "1F1B" / "checkpoint" / "step-2"))
    names = set(runs["one"]["grads"])
    assert names <= set(md.state_dict_metadata)  # the whole model's names, from both stages' ranks
    files = sorted(p.name for p in (runs["dir"] / "pp" / "1F1B" / "checkpoint" / "step-2").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]


def test_checkpoints_move_between_pipeline_and_one_process(runs: dict[str, Any]) -> None:
    one = runs["one"]["losses"]
    torch.testing.assert_close(
        torch.tensor(_merged(runs, "from_one_rank", "losses")), torch.tensor(one[2:]), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(torch.tensor(runs["one_from_pp"]), torch.tensor(one[2:]), rtol=1e-5, atol=0)


def test_initial_load_fills_each_stage(runs: dict[str, Any]) -> None:
    """checkpoint.initial_load_path (one process's step-2, model only): each stage loads its part."""
    losses = _merged(runs, "initial_load", "losses")
    assert losses[0] < runs["one"]["losses"][0] - 0.2  # trained weights, not the seed's
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(runs["one_initial_load"]), rtol=1e-5, atol=0)


def test_sigterm_saves_and_the_same_command_resumes(runs: dict[str, Any]) -> None:
    for r in runs["ranks"]:
        assert r["sigterm"]["losses"] == _merged(runs, "1F1B", "losses")[3:]  # resumed at step 4
    assert (runs["dir"] / "pp" / "sigterm" / "checkpoint" / "step-3").is_dir()


def test_resume_change_table_under_pipelining(runs: dict[str, Any]) -> None:
    lines = runs["ranks"][0]["changed_lr"]["lines"]
    assert any("with changed optimizer.lr (0.003 there, 0.001 in this run)" in line for line in lines), lines
    for r in runs["ranks"]:
        assert "was saved with other training.seq_len (32 there, 16 in this run)" in r["changed_seq_len"]["refused"]


def test_float8_check_and_numerics_cover_both_stages(runs: dict[str, Any]) -> None:
    lines = runs["ranks"][0]["numerics"]["lines"]
    # The first-step check counts both stages' Linears (2 blocks x 7; output filtered): 14 of 15 on every rank.
    assert "float8 in use: 14/15 Linears are Float8Linear" in lines, lines
    # The logging rank's line reads both stages' 7 float8 Linears each (gathered over the pipeline).
    assert any(line.startswith("float8 numerics step 2 (14 layers): lowest SQNR") for line in lines), lines
    layers = {}
    for rank in (0, 1):
        path = runs["dir"] / "pp" / "numerics" / "float8_numerics" / f"rank_{rank}.jsonl"
        layers[rank] = {json.loads(line)["layer"].split(".")[1] for line in path.read_text().splitlines()}
    assert layers == {0: {"0"}, 1: {"1"}}  # each rank records its own stage's blocks


def test_mxfp8_emulated_matches_one_process(runs: dict[str, Any]) -> None:
    """MXFP8 scales 32-element blocks; a pipeline micro-batch of 32 tokens keeps the one-process blocks."""
    if "unsupported" in runs["ranks"][0]["mxfp8"]:  # torchao's MXFP8 needs torch >= 2.13: the oldest-torch leg only
        assert tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13), runs["ranks"][0]
        pytest.skip(f"no MXFP8 training with torch {torch.__version__}: {runs['ranks'][0]['mxfp8']['unsupported']}")
    losses = _merged(runs, "mxfp8", "losses")
    assert losses != _merged(runs, "1F1B", "losses")  # float8 rounding: not the high-precision run
    # Measured 8.9e-6 at step 4 (1e-7 at step 1): float8 rounding amplifies the micro-batches' reordered sums.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(runs["one_mxfp8"]), rtol=5e-5, atol=0)
    lines = runs["ranks"][0]["mxfp8"]["lines"]
    assert any(line.startswith("float8 in use: emulated MXFP8 matmuls in the first step") for line in lines), lines


def test_run_train_sh_trains_a_pipeline(runs: dict[str, Any], tmp_path: Path) -> None:
    """The launcher users run: NGPU=2, Interleaved1F1B over 2 ranks; rank 0 (a first-stage rank) logs the loss."""
    env = {**os.environ, "NGPU": "2", "CONFIG_FILE": DEBUG_CONFIG}
    args = [*COMMON[2:], *PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    proc = subprocess.run(
        ["bash", "run_train.sh", *args, "--job.dump_folder", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\[rank0\]:.*step: +\d+  loss: +([\d.]+)", proc.stdout)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(runs["one"]["losses"]), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("nproc", "args", "message"),
    [
        ("1", [*PP2], "pipeline_parallel_degree x data_parallel_replicate_degree x tensor_parallel_degree = 2"),
        ("2", [*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "1"], "layers_per_stage 1 (ceil((2 blocks"),
        (  # validation runs through the pipeline's schedule: its batch must split into micro-batches too
            "2",
            [*PP2, "--validation.enable", "--validation.local_batch_size", "1"],
            "schedule 1F1B needs at least 2 micro-batches (one per stage); validation.local_batch_size 1 / ",
        ),
    ],
    ids=["ngpu1", "ngpu2", "validation_microbatches"],
)
def test_run_train_sh_refuses_before_torchrun(nproc: str, args: list[str], message: str, tmp_path: Path) -> None:
    env = {**os.environ, "NGPU": nproc, "CONFIG_FILE": DEBUG_CONFIG}
    argv = [*COMMON[2:], *args, "--job.dump_folder", str(tmp_path)]
    proc = subprocess.run(
        ["bash", "run_train.sh", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("kiln: error: parallelism") and message in line, line
    assert "[rank" not in proc.stdout  # refused before torchrun started a rank
