"""Checksums of every checkpoint file (trainer/checkpoint/checksums.py): recorded in kiln.json where each
file is written (in the background thread under async saves), verified before a load reads a record; a damaged
file is one line naming it, a checkpoint without checksums loads with one line saying it is unverified."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import threading
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest

import train as train_entry
from tests.helpers.checkpoints import TINY, train_tiny
from tests.helpers.common import LogLines
from trainer.checkpoint import checksums as checkpoint_checksums
from trainer.checkpoint.checksums import file_checksum
from trainer.checkpoint.reader import _Window, load_metadata

CKPT = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2")


def test_every_file_is_recorded_and_an_async_save_checksums_off_the_training_thread(
    tmp_path: Path, small_model: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each data file's checksum is taken from its bytes as they are written (in the thread writing it: a background
    one under async), never by reading the file back; only the small `.metadata` is read to checksum it."""
    threads: dict[str, set[str]] = {}
    read_back: list[str] = []
    write = checkpoint_checksums._ChecksummedFile.write

    def recording_write(self: Any, data: Any) -> int:
        threads.setdefault(self.name, set()).add(threading.current_thread().name)
        return write(self, data)

    def recording_read(path: str) -> str:
        read_back.append(os.path.basename(path))
        return file_checksum(path)

    monkeypatch.setattr(checkpoint_checksums._ChecksummedFile, "write", recording_write)
    monkeypatch.setattr(checkpoint_checksums, "file_checksum", recording_read)
    train_tiny(tmp_path, *CKPT, "--training.steps", "4", "--checkpoint.async_mode", "async")
    for step in ("step-2", "step-4"):  # step-2 saved in the background, step-4 (the last) synchronously
        folder = tmp_path / "checkpoint" / step
        sums = json.loads((folder / "kiln.json").read_text())["checksums"]
        on_disk = {p.name for p in folder.iterdir()} - {"kiln.json"}
        assert set(sums) == on_disk == {".metadata", "__0_0.distcp"}, on_disk  # no sidecar left behind
        assert sums == {name: file_checksum(str(folder / name)) for name in on_disk}
    assert read_back == [".metadata", ".metadata"], read_back
    main = threading.main_thread().name
    shard = str(tmp_path / "checkpoint" / "step-2.tmp" / "__0_0.distcp")
    assert threads[shard] and main not in threads[shard], threads
    assert threads[str(tmp_path / "checkpoint" / "step-4.tmp" / "__0_0.distcp")] == {main}, threads


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


def test_the_written_checksum_is_the_files_and_torch_saves_own_is_off_only_while_writing(tmp_path: Path) -> None:
    """The CRC-32 taken as the bytes go out equals the file's own, over pieces checksummed inline (headers, a small
    tensor) and on the helper thread (a tensor of several 8 MiB pieces); the records inside carry no CRC of
    torch.save's (switched off for the write), and torch.save computes its CRC again afterwards."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = {"big": torch.randn(5_000_000), "small": torch.randn(7, 3), "step": 3, "name": "x"}
    folder = tmp_path / "ckpt"
    writer = checkpoint_checksums.ChecksummingWriter(str(folder))
    dcp.save(state, checkpoint_id=str(folder), storage_writer=writer, no_dist=True)
    data = sorted(p.name for p in folder.glob("*.distcp"))
    assert data and writer.sums == {name: file_checksum(str(folder / name)) for name in data}
    assert writer.bytes == sum((folder / name).stat().st_size for name in data)
    md = load_metadata(str(folder))
    crcs = []
    for info in md.storage_data.values():
        with open(folder / info.relative_path, "rb") as f, zipfile.ZipFile(_Window(f, info.offset, info.length)) as z:
            crcs += [m.CRC for m in z.infolist() if m.filename.endswith(("/data/0", "/data.pkl"))]
    assert len(crcs) >= 4 and set(crcs) == {0}, crcs  # torch.save's own CRC-32s: not computed
    assert torch.serialization.get_crc32_options() is True
    plain = io.BytesIO()
    torch.save(torch.ones(4), plain)
    with zipfile.ZipFile(plain) as z:
        assert all(m.CRC != 0 for m in z.infolist() if m.filename.endswith("/data/0"))  # on again after the write


def test_a_file_seeked_while_written_is_read_back(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "f"
    with ThreadPoolExecutor(1) as pool, open(path, "wb") as f:
        stream = checkpoint_checksums._ChecksummedFile(f, pool)
        stream.write(b"a" * (3 << 20))
        assert stream.sequential and stream.written == 3 << 20
        assert f"crc32:{stream.crc:08x}" == f"crc32:{zlib.crc32(b'a' * (3 << 20)):08x}"
        stream.seek(0)
        assert not stream.sequential
