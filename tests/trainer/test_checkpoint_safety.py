"""Checkpoint reliability: no checkpoint runs code; housekeeping never loses a good checkpoint.

A: a crafted `.metadata`, optimizer item or data-loader item (each would run `touch MARKER` under DCP's
defaults, which the tests show first) is refused through train.py with one line and exit 2, and MARKER never
appears; a truncated `.metadata` too; scripts/convert_hf.py likewise.
B: one run per folder (lock); a rollback in place is refused and deletes nothing; a weights-only save is an export,
never a resume point; backups, moved and incomplete `step-N` folders are left alone; an unusable folder fails at
start, before the model is built.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import train as train_entry
from kiln_base.config import parse_args
from tests.helpers.checkpoints import TINY, names, snapshot
from tests.helpers.hostile import rewrite_item
from tests.helpers.kiln_process import run_kiln, run_python
from tests.helpers.scripts import load_script
from trainer.trainer import Trainer

CKPT = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"]


@pytest.fixture(autouse=True)
def small_model_with_kiln_logs(small_model: None, caplog: pytest.LogCaptureFixture) -> None:
    """In-process runs use a 2-layer, dim-64 debugmodel (1 MB saves) and log kiln's INFO lines (conftest.py ends any
    process group or determinism a test leaves)."""
    caplog.set_level(logging.INFO, logger="kiln")


class Payload:
    """Unpickled, this runs `touch marker` through os.system: what a crafted checkpoint would do on resume."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def train(dump: Path, *args: str) -> int:
    """train.py's main in this process (as `python train.py ...`); its exit status."""
    rc = train_entry.main([*TINY, "--job.dump_folder", str(dump), *args])
    if dist.is_initialized():
        dist.destroy_process_group()
    return rc


def refused(dump: Path, capsys: pytest.CaptureFixture, *args: str) -> str:
    """Run train.py's main, expect exit 2 with exactly one `kiln: error:` line; return that line."""
    capsys.readouterr()
    rc = train(dump, *args)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("kiln: error: "), err
    return err


def good_run(dump: Path, steps: int = 2, *args: str) -> Path:
    assert train(dump, *CKPT, "--training.steps", str(steps), *args) == 0
    return dump / "checkpoint"


def torch_saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- A: no code runs


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = good_run(tmp_path / "run")
    step, marker = folder / "step-2", tmp_path / "pwned"
    with open(step / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.planner_data = Payload(marker)  # a real index with one extra object inside
    (step / ".metadata").write_bytes(pickle.dumps(md))
    dcp.FileSystemReader(str(step)).read_metadata()  # DCP's own reader runs it: the file is live
    assert marker.exists()
    marker.unlink()

    before = snapshot(folder)
    err = refused(tmp_path / "run", capsys, *CKPT, "--training.steps", "4")
    assert f"checkpoint {step} refused: its .metadata needs the global posix.system" in err, err
    assert not marker.exists()
    assert snapshot(folder) == before


@pytest.mark.parametrize("fqn", ["optimizer.param_groups.output.weight.lr", "dataloader.buffer", "train_state.step"])
def test_crafted_non_tensor_item_is_refused_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, fqn: str
) -> None:
    folder = good_run(tmp_path / "run")
    step, marker = folder / "step-2", tmp_path / "pwned"
    rewrite_item(step, fqn, torch_saved(Payload(marker)))
    torch.load(io.BytesIO(torch_saved(Payload(marker))), weights_only=False)  # what DCP's planner does: live
    assert marker.exists()
    marker.unlink()

    err = refused(tmp_path / "run", capsys, *CKPT, "--training.steps", "4")
    assert f"checkpoint {step} refused: item '{fqn}' needs the global posix.system, which is not plain data" in err
    assert not marker.exists()
    assert names(folder) == ["step-2"]


def test_data_loader_position_is_never_unpickled(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Plain bytes pass torch.load(weights_only=True); bytes holding a pickle (what kiln once pickle.loads-ed)
    must still not run: the position is plain integers, and anything else is refused."""
    folder = good_run(tmp_path / "run")
    step, marker = folder / "step-2", tmp_path / "pwned"
    rewrite_item(step, "dataloader.buffer", torch_saved(pickle.dumps(Payload(marker))))
    err = refused(tmp_path / "run", capsys, *CKPT, "--training.steps", "4")
    assert "dataloader.buffer is b" in err and "but kiln writes a list of token ids" in err, err
    assert not marker.exists()


def test_truncated_metadata_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = good_run(tmp_path / "run")
    meta = folder / "step-2" / ".metadata"
    os.truncate(meta, meta.stat().st_size // 2)
    before = snapshot(folder)
    err = refused(tmp_path / "run", capsys, *CKPT, "--training.steps", "4")
    assert f"checkpoint folder {folder} has no usable checkpoint: checkpoint {meta} is corrupt or truncated" in err
    assert snapshot(folder) == before


def test_convert_hf_refuses_crafted_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    conv = load_script("convert_hf")
    folder = good_run(tmp_path / "run")
    marker = tmp_path / "pwned"
    with open(folder / "step-2" / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.planner_data = Payload(marker)
    (folder / "step-2" / ".metadata").write_bytes(pickle.dumps(md))
    capsys.readouterr()
    assert conv.main(["to_hf", str(folder), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refused: its .metadata needs the global posix.system" in err, err
    assert not marker.exists() and not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------------- B: housekeeping


def test_one_run_per_folder_and_a_killed_holder_does_not_block(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # A real kiln run holds the folder (this process); a second run, as users start it, is refused at once.
    holder = Trainer(parse_args([*TINY, "--job.dump_folder", str(tmp_path), *CKPT]))
    try:
        proc = run_kiln(
            [*TINY, "--job.dump_folder", tmp_path, *CKPT, "--training.steps", "2"],
            launcher="python",
            threads=1,
            timeout=300,
        )
    finally:
        holder.close()
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert f"is in use by another kiln run (pid {os.getpid()} on {socket.gethostname()}" in err, err
    assert "Model llama3" not in proc.stdout  # refused before building anything
    assert not (tmp_path / "checkpoint" / "step-2").exists()

    # A run killed while holding the lock leaves the file (and its pid@host) behind, but not the lock.
    lock = tmp_path / "checkpoint" / ".kiln.lock"
    killed = run_python(
        f"import fcntl, os, signal; fd = os.open({str(lock)!r}, os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
        "os.pwrite(fd, b'4242@elsewhere\\n', 0); os.kill(os.getpid(), signal.SIGKILL)",
        timeout=60,
    )
    assert killed.returncode == -9 and lock.read_text() == "4242@elsewhere\n"
    assert good_run(tmp_path, 2).joinpath("step-2", ".metadata").exists()
    assert lock.read_text() == f"{os.getpid()}@{socket.gethostname()}\n"


def test_rollback_in_place_is_refused_and_deletes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue: load_step 2 + keep_latest_k 1 with step-4 and step-6 present deleted the loaded step and each new save."""
    folder = good_run(tmp_path, 6)
    assert names(folder) == ["step-2", "step-4", "step-6"]
    before = snapshot(folder)
    rollback = [*CKPT, "--training.steps", "8", "--checkpoint.load_step", "2", "--checkpoint.keep_latest_k", "1"]
    err = refused(tmp_path, capsys, *rollback)
    assert f"checkpoint.load_step 2 is older than step-4, step-6 in {folder}" in err, err
    assert snapshot(folder) == before

    # Done as the message says (later steps moved out), the rollback runs; retention keeps the newest save only.
    for s in ("step-4", "step-6"):
        shutil.move(folder / s, tmp_path / s)
    assert train(tmp_path, *rollback) == 0
    assert names(folder) == ["step-8"]


def test_retention_deletes_only_what_kiln_published_here(tmp_path: Path) -> None:
    """A checkpoint kiln did not publish in this folder (torchtitan's: no kiln.json; a copy from elsewhere) is
    resumed from but never deleted by keep_latest_k; kiln's own superseded saves are."""
    folder = good_run(tmp_path / "src", 2)
    dst = tmp_path / "run" / "checkpoint"
    dst.mkdir(parents=True)
    shutil.copytree(folder / "step-2", dst / "step-2")  # a copy: kiln.json says it was written elsewhere
    copied = snapshot(dst)
    every_step = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1"]
    assert train(tmp_path / "run", *every_step, "--training.steps", "4") == 0
    assert names(dst) == ["step-2", "step-4"]  # step-3 (kiln's own, superseded) went; the copy stayed
    assert {k: v for k, v in snapshot(dst).items() if k.startswith("step-2")} == copied


def test_weights_only_save_is_an_export_not_a_resume_point(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue: re-running with more steps loaded the weights-only final save, restarted at 0, overwrote step-2."""
    folder = good_run(tmp_path, 4, "--checkpoint.last_save_model_weights_only")
    assert names(folder) == ["export-step-4", "step-2"]
    full, export = snapshot(folder / "step-2"), snapshot(folder / "export-step-4")
    caplog.clear()
    trainer = Trainer(parse_args([*TINY, "--job.dump_folder", str(tmp_path), *CKPT, "--training.steps", "6"]))
    try:
        assert trainer.step == 2
        trainer.train()
    finally:
        trainer.close()
    assert f"Loaded checkpoint {folder / 'step-2'} (full state)" in caplog.text
    assert names(folder) == ["export-step-4", "step-2", "step-4", "step-6"]
    assert snapshot(folder / "step-2") == full and snapshot(folder / "export-step-4") == export


def test_backups_moved_and_incomplete_steps_are_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    folder = good_run(tmp_path, 4)
    shutil.copytree(folder / "step-2", folder / "step-2.old")  # the user's backup
    shutil.move(folder / "step-4", folder / "step-4.old")  # the user moved it aside
    shutil.copytree(folder / "step-2", folder / "step-6", ignore=shutil.ignore_patterns(".metadata"))  # bad copy
    shutil.copytree(folder / "step-2", folder / "step-8")
    os.truncate(folder / "step-8" / ".metadata", 100)  # a truncated index
    (folder / "step-9.tmp").mkdir()  # not a save kiln started
    theirs = snapshot(folder)

    caplog.clear()
    assert train(tmp_path, *CKPT, "--training.steps", "3") == 0  # saves step-3 only
    log = caplog.text
    assert f"Loaded checkpoint {folder / 'step-2'} (full state)" in log
    assert f"{folder / 'step-6'} has no .metadata" in log and f"{folder / 'step-8' / '.metadata'} is corrupt" in log
    assert f"Leaving {folder / 'step-9.tmp'} alone" in log
    assert names(folder) == ["step-2", "step-2.old", "step-3", "step-4.old", "step-6", "step-8", "step-9.tmp"]
    assert {k: v for k, v in snapshot(folder).items() if k in theirs} == theirs

    # A save that would land on the incomplete step-6 is refused at start, before anything is touched.
    before = snapshot(folder)
    err = refused(tmp_path, capsys, *CKPT, "--training.steps", "6")
    assert f"checkpoint folder {folder} already holds step-6, which this run (steps 4-6) would save again" in err
    assert snapshot(folder) == before


def test_unusable_folder_fails_at_start(tmp_path: Path, capsys: pytest.CaptureFixture, caplog) -> None:
    (tmp_path / "file").write_text("not a folder")
    err = refused(tmp_path / "file", capsys, *CKPT, "--training.steps", "1000")
    assert f"checkpoint folder {tmp_path / 'file' / 'checkpoint'} (job.dump_folder + checkpoint.folder)" in err
    assert "Model llama3" not in caplog.text  # before the model is built

    ro = tmp_path / "ro"
    (ro / "checkpoint").mkdir(parents=True)
    immutable = False
    if os.geteuid() == 0:  # root writes through mode bits: make the folder immutable instead
        immutable = subprocess.run(["chattr", "+i", str(ro / "checkpoint")], capture_output=True).returncode == 0
        if not immutable:  # no chattr (a container without CAP_LINUX_IMMUTABLE): a folder no one can create
            ro = Path("/proc/self")
    else:
        (ro / "checkpoint").chmod(0o555)
    try:
        err = refused(ro, capsys, *CKPT, "--training.steps", "1000")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro / "checkpoint")], check=True)
        elif os.geteuid() != 0:
            (ro / "checkpoint").chmod(0o755)
    assert f"checkpoint folder {ro / 'checkpoint'} (job.dump_folder + checkpoint.folder) is not usable" in err, err
    assert "Model llama3" not in caplog.text


@pytest.mark.distributed
def test_two_ranks_both_refuse_a_locked_folder(tmp_path: Path) -> None:
    """Only rank 0 takes the lock; rank 1 must learn of the refusal and stop too (no hang in a collective)."""
    import fcntl

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    fd = os.open(folder / ".kiln.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, b"777@otherhost\n", 0)
    try:
        proc = run_kiln(
            [*TINY, "--job.dump_folder", tmp_path, *CKPT, "--training.steps", "2"],
            launcher="torchrun",
            ngpu=2,
            threads=1,
            timeout=300,
        )
    finally:
        os.close(fd)
    errors = [line for line in proc.stderr.splitlines() if "kiln: error:" in line]
    assert len(errors) == 2, proc.stderr[-3000:]  # one line from each rank
    assert all("is in use by another kiln run (pid 777 on otherhost" in line for line in errors), errors
    # Both ranks printed the refusal (above), so neither hung in a collective; rank 0 exits 2, and rank 1 either
    # exits 2 too or is stopped by torchrun, which ends the other ranks once one has failed (a race, either way).
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert names(folder) == []


@pytest.mark.parametrize(
    ("values", "dtype", "refused"),
    [
        ([3e38, 3e38, 1.0], torch.float32, False),  # finite values whose sum overflows to inf: loaded
        ([-3e38, -3e38], torch.bfloat16, False),
        ([1.0, float("inf"), 2.0], torch.float32, True),
        ([1.0, float("nan")], torch.float16, True),
        ([float("inf"), float("-inf")], torch.float32, True),  # their sum is NaN either way
    ],
)
def test_the_finite_check_of_loaded_values(values: list[float], dtype: torch.dtype, refused: bool) -> None:
    from kiln_base.errors import CheckpointError
    from trainer.checkpoint.reader import check_loaded_state

    sd = {"model": {"w": torch.tensor(values).to(dtype)}, "other": {"ok": torch.ones(3)}}
    if refused:
        with pytest.raises(CheckpointError, match="'model.w' holds NaN or infinite values"):
            check_loaded_state(sd, "ckpt", None, 10)
    else:
        check_loaded_state(sd, "ckpt", None, 10)
