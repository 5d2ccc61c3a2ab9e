"""Checksums of every checkpoint file (trainer/checkpoint/checksums.py): recorded in kiln.json where each
file is written (in the background thread under async saves), verified before a load reads a record; a damaged
file is one line naming it, a checkpoint without checksums loads with one line saying it is unverified."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import zlib
from pathlib import Path

import pytest

import train as train_entry
from tests.helpers.checkpoints import TINY, train_tiny
from tests.helpers.common import LogLines
from trainer.checkpoint import checksums as checkpoint_checksums
from trainer.checkpoint.checksums import file_checksum

CKPT = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2")


def test_every_file_is_recorded_and_an_async_save_checksums_off_the_training_thread(
    tmp_path: Path, small_model: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: dict[str, str] = {}

    def recording(path: str) -> str:
        threads[path] = threading.current_thread().name
        return file_checksum(path)

    monkeypatch.setattr(checkpoint_checksums, "file_checksum", recording)
    train_tiny(tmp_path, *CKPT, "--training.steps", "4", "--checkpoint.async_mode", "async")
    for step in ("step-2", "step-4"):  # step-2 saved in the background, step-4 (the last) synchronously
        folder = tmp_path / "checkpoint" / step
        sums = json.loads((folder / "kiln.json").read_text())["checksums"]
        on_disk = {p.name for p in folder.iterdir()} - {"kiln.json"}
        assert set(sums) == on_disk == {".metadata", "__0_0.distcp"}, on_disk  # no sidecar left behind
        assert sums == {name: file_checksum(str(folder / name)) for name in on_disk}
    shard = str(tmp_path / "checkpoint" / "step-2.tmp" / "__0_0.distcp")
    assert threads[shard] != threading.main_thread().name
    assert threads[str(tmp_path / "checkpoint" / "step-4.tmp" / "__0_0.distcp")] == threading.main_thread().name


def _resume(dump: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = train_entry.main([*TINY, "--job.dump_folder", str(dump), *CKPT, "--training.steps", "4"])
    return code, capsys.readouterr().err.strip()


def test_a_flipped_bit_is_one_line_naming_the_file_and_old_checkpoints_load_unverified(
    tmp_path: Path, small_model: None, capsys: pytest.CaptureFixture
) -> None:
    train_tiny(tmp_path / "good", *CKPT, "--training.steps", "2")
    good = tmp_path / "good" / "checkpoint" / "step-2"
    dump = tmp_path / "flipped"
    shutil.copytree(good, dump / "checkpoint" / "step-2")
    damaged = dump / "checkpoint" / "step-2" / "__0_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of the file: inside a tensor, which would load
    damaged.write_bytes(bytes(data))
    code, err = _resume(dump, capsys)
    assert code == 2
    assert err.startswith(f"kiln: error: checkpoint file {damaged} is damaged: its checksum is crc32:"), err
    assert len(err.splitlines()) == 1, err
    # The same file as another run's starting point (checkpoint.initial_load_path): refused the same way.
    argv = [*TINY, "--job.dump_folder", str(tmp_path / "new"), "--checkpoint.initial_load_path", str(damaged.parent)]
    assert train_entry.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kiln: error: checkpoint file {damaged} is damaged"), err

    old = tmp_path / "old"  # saved before kiln recorded checksums
    shutil.copytree(good, old / "checkpoint" / "step-2")
    marker = old / "checkpoint" / "step-2" / "kiln.json"
    saved = json.loads(marker.read_text())
    del saved["checksums"]
    marker.write_text(json.dumps(saved))
    lines = LogLines(logging.WARNING)
    logging.getLogger("kiln").addHandler(lines)
    try:
        code, err = _resume(old, capsys)
    finally:
        logging.getLogger("kiln").removeHandler(lines)
    assert code == 0, err
    unverified = [line for line in lines.lines if "checksums" in line]
    assert unverified == [
        f"Checkpoint {old / 'checkpoint' / 'step-2'} records no checksums (saved by an older kiln or another tool): "
        "unverified"
    ]


def _copy(good: Path, dump: Path) -> Path:
    step = dump / "checkpoint" / "step-2"
    shutil.copytree(good, step)
    return step


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_record_that_exists_but_cannot_be_read_is_refused_naming_it(
    tmp_path: Path, small_model: None, capsys: pytest.CaptureFixture
) -> None:
    """A kiln.json cut in half (or not an object, or its checksums not a map) is damage, not an older kiln's record:
    refused when resuming (as checkpoint.initial_load_path it was already: kiln reads the model shape there)."""
    train_tiny(tmp_path / "good", *CKPT, "--training.steps", "2")
    good = tmp_path / "good" / "checkpoint" / "step-2"
    text = (good / "kiln.json").read_text()
    for name, record in [("cut", text[: len(text) // 2]), ("list", "[]"), ("sums", '{"checksums": [1]}')]:
        step = _copy(good, tmp_path / name)
        (step / "kiln.json").write_text(record)
        code, err = _resume(tmp_path / name, capsys)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith(f"kiln: error: checkpoint record {step / 'kiln.json'} "), err


def test_a_file_without_a_checksum_is_refused_whatever_the_record_lists(
    tmp_path: Path, small_model: None, capsys: pytest.CaptureFixture
) -> None:
    """A flipped bit beside a deleted checksum entry, or an emptied checksum map: the files a load reads are those
    in the folder, each must have a checksum."""
    train_tiny(tmp_path / "good", *CKPT, "--training.steps", "2")
    good = tmp_path / "good" / "checkpoint" / "step-2"
    for name in ("deleted", "empty"):
        step = _copy(good, tmp_path / name)
        flip_bit(step / "__0_0.distcp", (step / "__0_0.distcp").stat().st_size // 2)
        saved = json.loads((step / "kiln.json").read_text())
        saved["checksums"] = {} if name == "empty" else {".metadata": saved["checksums"][".metadata"]}
        (step / "kiln.json").write_text(json.dumps(saved))
        code, err = _resume(tmp_path / name, capsys)
        assert code == 2 and len(err.splitlines()) == 1, err
        missing = ".metadata" if name == "empty" else "__0_0.distcp"
        assert err.startswith(f"kiln: error: checkpoint file {step / missing} has no checksum in "), err


def test_the_checksum_covers_every_chunk(
    tmp_path: Path, small_model: None, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksum is computed in pieces (_CHUNK, 8 MiB): with 4 KiB pieces (the tiny checkpoint's files span
    many), the whole file's CRC-32, and a bit flipped past the first piece is found."""
    monkeypatch.setattr(checkpoint_checksums, "_CHUNK", 4096)
    train_tiny(tmp_path / "good", *CKPT, "--training.steps", "2")
    good = tmp_path / "good" / "checkpoint" / "step-2"
    shard = good / "__0_0.distcp"
    assert shard.stat().st_size > 3 * 4096
    assert file_checksum(str(shard)) == f"crc32:{zlib.crc32(shard.read_bytes()):08x}"
    step = _copy(good, tmp_path / "flipped")
    flip_bit(step / "__0_0.distcp", shard.stat().st_size - 5)  # in the last piece
    code, err = _resume(tmp_path / "flipped", capsys)
    assert code == 2 and err.startswith(f"kiln: error: checkpoint file {step / '__0_0.distcp'} is damaged"), err
