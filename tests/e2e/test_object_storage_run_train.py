"""Checkpoints in object storage through run_train.sh (issue 57, docs/checkpoint.md "Object storage").

An s3:// checkpoint.folder without s3fs installed used to train, exit 0 and write a local folder named `s3:` under
the dump folder; now it is one line naming the key, the URL and what to install, exit 2, before any rank starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.common import ROOT, tiny_run_args
from tests.helpers.kiln_process import assert_one_line_error, run_kiln
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
