"""Checkpoints in object storage through run_train.sh (issue 57, docs/checkpoint.md "Object storage").

An s3:// checkpoint.folder without s3fs installed used to train, exit 0 and write a local folder named `s3:` under
the dump folder; now it is one line naming the key, the URL and what to install, exit 2, before any rank starts.
With s3fs, against moto's S3 server on localhost (the `s3` fixture): steps are complete only with their kiln.json,
a resume from the bucket continues bitwise, keep_latest_k deletes only what kiln proves it wrote and superseded, and
the checksums are checked on the downloaded bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.common import ROOT, tiny_run_args
from tests.helpers.kiln_process import assert_one_line_error, run_kiln
from tests.helpers.loss_runs import drive
from tests.helpers.s3_server import S3Server
from tests.helpers.scripts import load_script

URL = "s3://bucket/run/checkpoint"


def _without_s3fs(tmp_path: Path) -> dict[str, str]:
    """An environment whose Pythons cannot import s3fs (a sitecustomize that blocks it), for a machine that has it."""
    blocker = tmp_path / "no_s3fs"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['s3fs'] = None\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.mark.parametrize("ngpu", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_s3_folder_without_s3fs_is_one_line_and_writes_no_local_s3_folder(tmp_path: Path, ngpu: int) -> None:
    args = tiny_run_args("--job.dump_folder", str(tmp_path / "out"), "--training.steps", "2")
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "1", "--checkpoint.folder", URL]
    proc = run_kiln(args, ngpu=ngpu, threads=1, env=_without_s3fs(tmp_path), cwd=tmp_path)
    assert_one_line_error(proc, f"checkpoint.folder {URL}: s3:// needs the s3fs package", "pip install -e '.[s3]'")
    assert "step:" not in proc.stdout  # refused before training
    assert not list(tmp_path.rglob("s3:*")) and not (ROOT / "s3:").exists()


def test_convert_hf_refuses_a_url_instead_of_writing_a_local_s3_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    conv = load_script("convert_hf")
    assert conv.main(["from_hf", str(tmp_path), URL]) == 2
    assert capsys.readouterr().err.startswith(f"convert_hf: error: folder {URL}: convert_hf reads and writes local")
    assert conv.main(["to_hf", URL, str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.startswith(f"convert_hf: error: checkpoint {URL}: convert_hf reads and writes")
    assert not list(tmp_path.rglob("s3:*"))


def _files(s3: S3Server, prefix: str) -> dict[str, list[str]]:
    """{step prefix: its object names} under `prefix`."""
    out: dict[str, list[str]] = {}
    for key in s3.keys(prefix):
        head, _, name = key.partition("/")
        out.setdefault(head, []).append(name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_s3_saves_complete_steps_resumes_bitwise_and_keeps_only_what_it_proves(
    s3: S3Server, tmp_path: Path, nproc: int
) -> None:
    url = s3.url("run/checkpoint")
    args = ("--checkpoint.folder", url, "--checkpoint.interval", "2", "--training.steps", "4")
    straight = drive(tmp_path / "straight", *args, nproc=nproc)
    shards = [f"__{r}_0.distcp" for r in range(nproc)]
    step_files = sorted([".kiln-saving", ".metadata", "kiln.json", *shards])
    assert _files(s3, "run/checkpoint") == {"step-2": step_files, "step-4": step_files}  # the lock is gone
    marker = json.loads(s3.read("run/checkpoint/step-4/kiln.json"))
    assert marker["written_to"] == f"{url}/step-4" and sorted(marker["checksums"]) == sorted([".metadata", *shards])
    assert not list(tmp_path.rglob("s3:*"))

    # step-4 loses its kiln.json (a save killed before its marker); step-6 is a prefix kiln never started
    s3.remove("run/checkpoint/step-4/kiln.json")
    for name in (".metadata", shards[0]):
        s3.write(f"run/checkpoint/step-6/{name}", s3.read(f"run/checkpoint/step-4/{name}"))
    resumed = drive(tmp_path / "resumed", *args, "--checkpoint.keep_latest_k", "1", nproc=nproc)
    log = (tmp_path / "resumed.log").read_text()
    assert f"Loaded checkpoint {url}/step-2 (full state)" in log
    assert f"Removing {url}/step-4/: a save that was killed" in log
    assert resumed["first_step"] == 3 and resumed["losses"] == straight["losses"][2:]  # bitwise
    # keep_latest_k 1: only the newest step kiln wrote; step-6, not kiln's, untouched
    assert _files(s3, "run/checkpoint") == {"step-4": step_files, "step-6": sorted([".metadata", shards[0]])}


@pytest.mark.slow
def test_s3_a_flipped_bit_in_the_bucket_stops_the_resume_naming_the_object(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url("run/checkpoint")
    args = tiny_run_args("--job.dump_folder", str(tmp_path), "--model.n_layers", "2")
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--checkpoint.folder", url]
    run_kiln([*args, "--training.steps", "2"], ngpu=1, threads=1, check=True)
    key = "run/checkpoint/step-2/__0_0.distcp"
    data = bytearray(s3.read(key))
    data[len(data) // 2] ^= 0x01
    s3.write(key, bytes(data))
    proc = run_kiln([*args, "--training.steps", "4"], ngpu=1, threads=1)
    assert_one_line_error(proc, f"checkpoint file {url}/step-2/__0_0.distcp is damaged: its checksum is crc32:")
    assert s3.keys("run/checkpoint") == sorted(
        f"step-2/{n}" for n in (".kiln-saving", ".metadata", "kiln.json", "__0_0.distcp")
    )


@pytest.mark.distributed
def test_s3_a_flipped_bit_another_rank_finds_is_named_by_its_url(s3: S3Server, tmp_path: Path) -> None:
    """2 ranks: rank 1 checks its own __1_0.distcp (read once); the line rank 0 prints names the object, not rank
    1's download folder (each rank downloads into a temporary folder of its own)."""
    url = s3.url("run2/checkpoint")
    args = tiny_run_args("--job.dump_folder", str(tmp_path), "--model.n_layers", "2")
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--checkpoint.folder", url]
    run_kiln([*args, "--training.steps", "2"], ngpu=2, threads=1, check=True)
    key = "run2/checkpoint/step-2/__1_0.distcp"
    data = bytearray(s3.read(key))
    data[len(data) // 2] ^= 0x01
    s3.write(key, bytes(data))
    proc = run_kiln([*args, "--training.steps", "4"], ngpu=2, threads=1)
    assert_one_line_error(proc, f"checkpoint file {url}/step-2/__1_0.distcp is damaged: its checksum is crc32:")


def test_s3_a_held_lock_object_stops_a_second_run_naming_the_holder(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url("run/checkpoint")
    s3.write("run/checkpoint/.kiln.lock", b"4242@trainer-7 since 2026-12-02 10:00:00\n")
    args = tiny_run_args("--job.dump_folder", str(tmp_path), "--training.steps", "2")
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.folder", url]
    proc = run_kiln(args, ngpu=1, threads=1)
    assert_one_line_error(
        proc, f"checkpoint folder {url} is in use by another kiln run (4242@trainer-7 since 2026-12-02 10:00:00;"
    )
    assert s3.keys("run/checkpoint") == [".kiln.lock"]  # neither replaced nor removed
