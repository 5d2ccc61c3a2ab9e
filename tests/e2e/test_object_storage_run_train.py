"""Checkpoints in object storage through run_train.sh (issue 57, docs/checkpoint.md "Object storage").

An s3:// checkpoint.folder without s3fs installed used to train, exit 0 and write a local folder named `s3:` under
the dump folder; now it is one line naming the key, the URL and what to install, exit 2, before any rank starts.
With s3fs, against moto's S3 server on localhost (the `s3` fixture): steps are complete only with their kiln.json,
a resume from the bucket continues bitwise, keep_latest_k deletes only what kiln proves it wrote and superseded, and
the checksums are checked on the downloaded bytes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.common import ROOT, tiny_run_args
from tests.helpers.gcs_server import GCSServer
from tests.helpers.kiln_process import assert_one_line_error, run_kiln
from tests.helpers.loss_runs import drive
from tests.helpers.s3_server import S3Server
from tests.helpers.scripts import load_script

URL = "s3://bucket/run/checkpoint"


def _without(tmp_path: Path, package: str) -> dict[str, str]:
    """An environment whose Pythons cannot import `package` (a sitecustomize that blocks it), for a machine that has
    it."""
    blocker = tmp_path / f"no_{package}"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.mark.parametrize("ngpu", [1, pytest.param(2, marks=pytest.mark.distributed)])
@pytest.mark.parametrize("scheme,package,extra", [("s3", "s3fs", "s3"), ("gs", "gcsfs", "gcs")])
def test_a_url_folder_without_its_package_is_one_line_and_writes_no_local_folder(
    tmp_path: Path, ngpu: int, scheme: str, package: str, extra: str
) -> None:
    url = f"{scheme}://bucket/run/checkpoint"
    args = tiny_run_args("--job.dump_folder", str(tmp_path / "out"), "--training.steps", "2")
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "1", "--checkpoint.folder", url]
    proc = run_kiln(args, ngpu=ngpu, threads=1, env=_without(tmp_path, package), cwd=tmp_path)
    assert_one_line_error(
        proc, f"checkpoint.folder {url}: {scheme}:// needs the {package} package", f"pip install -e '.[{extra}]'"
    )
    assert "step:" not in proc.stdout  # refused before training
    assert not list(tmp_path.rglob(f"{scheme}:*")) and not (ROOT / f"{scheme}:").exists()


def test_convert_hf_refuses_an_unusable_url_instead_of_writing_a_local_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    conv = load_script("convert_hf")
    assert conv.main(["from_hf", str(tmp_path), "gs://b/run/checkpoint"]) == 2
    assert capsys.readouterr().err == (
        "convert_hf: error: folder gs://b/run/checkpoint: gs:// needs the gcsfs package, which is not installed (pip "
        "install gcsfs, or kiln's extra: pip install -e '.[gcs]')\n"
    )
    assert conv.main(["to_hf", "hdfs://n/ckpt", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.startswith("convert_hf: error: checkpoint hdfs://n/ckpt: hdfs:// is not an object")
    assert not list(tmp_path.rglob("gs:*")) and not list(tmp_path.rglob("hdfs:*"))


@pytest.mark.slow
def test_initial_weights_from_a_url_load_checked_and_a_flipped_bit_is_one_line(
    bucket: S3Server | GCSServer, tmp_path: Path
) -> None:
    """checkpoint.initial_load_path s3:// / gs://: a checkpoint folder's newest step, its shape read from kiln.json
    (model.flavor from_checkpoint), its files downloaded and checked as a local folder's: a flipped bit in the bucket
    is one line naming the object. (That the weights load exactly: the HF test below compares two URL sources.)"""
    url = bucket.url("src/ckpt")
    args = tiny_run_args("--model.n_layers", "2", "--training.steps", "2")
    save = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--checkpoint.folder", url]
    run_kiln([*args, "--job.dump_folder", str(tmp_path / "first"), *save], ngpu=1, threads=1, check=True)
    start = [*args, "--model.flavor", "from_checkpoint", "--checkpoint.initial_load_path", url]
    proc = run_kiln([*start, "--job.dump_folder", str(tmp_path / "second")], ngpu=1, threads=1, check=True)
    assert f"Loaded initial weights from {url}/step-2 (kiln)" in proc.stdout + proc.stderr
    key = "src/ckpt/step-2/__0_0.distcp"
    data = bytearray(bucket.read(key))
    data[len(data) // 2] ^= 0x01
    bucket.write(key, bytes(data))
    proc = run_kiln([*start, "--job.dump_folder", str(tmp_path / "bad")], ngpu=1, threads=1)
    assert_one_line_error(proc, f"checkpoint file {url}/step-2/__0_0.distcp is damaged: its checksum is crc32:")


@pytest.mark.slow
def test_convert_hf_to_and_from_s3_and_a_run_from_the_hf_url(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """convert_hf to_hf from an s3:// checkpoint into an s3:// HF folder, from_hf from it into an s3:// checkpoint
    folder (published as a run's save: kiln.json with save order and place); a run starts from the HF URL with the
    same losses, bitwise, as from the kiln URL (the conversion is exact in float32; both are downloaded and read by
    the local readers). s3 only: the store's calls are those the gs:// tests above make."""
    drive(tmp_path / "first", "--checkpoint.folder", s3.url("a/ckpt"), "--checkpoint.interval", "2",
          "--training.steps", "2")  # fmt: skip
    conv = load_script("convert_hf")
    assert conv.main(["to_hf", s3.url("a/ckpt"), s3.url("a/hf")]) == 0
    hf_keys = s3.keys("a/hf")
    assert "config.json" in hf_keys and "model.safetensors" in hf_keys
    assert conv.main(["from_hf", s3.url("a/hf"), s3.url("b/ckpt")]) == 0
    assert s3.keys("b/ckpt") == sorted(
        f"step-0/{n}" for n in (".kiln-saving", ".metadata", "__0_0.distcp", "kiln.json")
    )
    marker = json.loads(s3.read("b/ckpt/step-0/kiln.json"))
    assert marker["written_to"] == s3.url("b/ckpt/step-0") and marker["model_weights_only"] is True
    capsys.readouterr()
    assert conv.main(["from_hf", s3.url("a/hf"), s3.url("b/ckpt")]) == 2  # never over a checkpoint
    assert capsys.readouterr().err.startswith(f"convert_hf: error: {s3.url('b/ckpt/step-0')} already exists; kiln")
    start = ("--model.flavor", "from_checkpoint", "--training.steps", "2", "--checkpoint.initial_load_path")
    from_kiln = drive(tmp_path / "kiln", *start, s3.url("a/ckpt"))
    from_hf = drive(tmp_path / "hf", *start, s3.url("a/hf"))
    assert f"Loaded initial weights from {s3.url('a/hf')} (Hugging Face)" in (tmp_path / "hf.log").read_text()
    assert from_hf["losses"] == from_kiln["losses"]


def _files(s3: S3Server | GCSServer, prefix: str) -> dict[str, list[str]]:
    """{step prefix: its object names} under `prefix`."""
    out: dict[str, list[str]] = {}
    for key in s3.keys(prefix):
        head, _, name = key.partition("/")
        out.setdefault(head, []).append(name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "bucket,nproc,async_mode",
    [("s3", 1, "disabled"), pytest.param("s3", 2, "async", marks=pytest.mark.distributed), ("gs", 1, "disabled")],
    indirect=["bucket"],
)
def test_saves_complete_steps_resumes_bitwise_and_keeps_only_what_it_proves(
    bucket: S3Server | GCSServer, tmp_path: Path, nproc: int, async_mode: str
) -> None:
    """On 2 ranks the saves are async: each rank uploads its own data object in the background, rank 0 the index
    and kiln.json once both are up (the synchronous 2-rank upload: the flipped-bit test below)."""
    s3 = bucket
    url = s3.url("run/checkpoint")
    args = ("--checkpoint.folder", url, "--checkpoint.interval", "2", "--training.steps", "4")
    args += ("--checkpoint.async_mode", async_mode)
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
    background = "Checkpoint step-2: staged in " in (tmp_path / "straight.log").read_text()
    assert background == (async_mode == "async")  # the path this case tests ("... uploading in background")
    assert resumed["first_step"] == 3 and resumed["losses"] == straight["losses"][2:]  # bitwise
    # keep_latest_k 1: only the newest step kiln wrote; step-6, not kiln's, untouched
    assert _files(s3, "run/checkpoint") == {"step-4": step_files, "step-6": sorted([".metadata", shards[0]])}


@pytest.mark.slow
@pytest.mark.parametrize("ngpu", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_flipped_bit_in_the_bucket_stops_the_resume_naming_the_object(
    s3: S3Server, tmp_path: Path, ngpu: int
) -> None:
    """s3 only: the checksums are checked on the downloaded bytes, the same code whichever store they came from. On
    2 ranks rank 1 checks its own __1_0.distcp (read once); the line rank 0 prints names the object, not rank 1's
    download folder (each rank downloads into a temporary folder of its own)."""
    url = s3.url("run/checkpoint")
    args = tiny_run_args("--job.dump_folder", str(tmp_path), "--model.n_layers", "2")
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--checkpoint.folder", url]
    run_kiln([*args, "--training.steps", "2"], ngpu=ngpu, threads=1, check=True)
    shards = [f"__{r}_0.distcp" for r in range(ngpu)]
    key = f"run/checkpoint/step-2/{shards[-1]}"
    data = bytearray(s3.read(key))
    data[len(data) // 2] ^= 0x01
    s3.write(key, bytes(data))
    proc = run_kiln([*args, "--training.steps", "4"], ngpu=ngpu, threads=1)
    assert_one_line_error(proc, f"checkpoint file {url}/step-2/{shards[-1]} is damaged: its checksum is crc32:")
    assert s3.keys("run/checkpoint") == sorted(
        f"step-2/{n}" for n in (".kiln-saving", ".metadata", "kiln.json", *shards)
    )


def test_a_held_lock_object_stops_a_second_run_naming_the_holder(bucket: S3Server | GCSServer, tmp_path: Path) -> None:
    s3 = bucket
    url = s3.url("run/checkpoint")
    s3.write("run/checkpoint/.kiln.lock", b"4242@trainer-7 since 2026-12-02 10:00:00\n")
    args = tiny_run_args("--job.dump_folder", str(tmp_path), "--training.steps", "2")
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.folder", url]
    proc = run_kiln(args, ngpu=1, threads=1)
    assert_one_line_error(
        proc, f"checkpoint folder {url} is in use by another kiln run (4242@trainer-7 since 2026-12-02 10:00:00;"
    )
    assert s3.keys("run/checkpoint") == [".kiln.lock"]  # neither replaced nor removed
