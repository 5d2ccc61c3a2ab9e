"""A flipped bit in one rank's checkpoint file, through run_train.sh on 2 ranks (FSDP, the checkpoint saved in the
background): one line naming the file, exit 2 (trainer/checkpoint/checksums.py; every rank checks its
share of the files and all raise the first mismatch). With 1 rank and 2: a kiln.json cut in half, and a flipped bit
beside a checksum entry deleted from kiln.json, each one line naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.common import tiny_run_args
from tests.helpers.kiln_process import assert_one_line_error, run_kiln

pytestmark = pytest.mark.slow
NGPU = [1, pytest.param(2, marks=pytest.mark.distributed)]


@pytest.mark.distributed
def test_a_flipped_bit_in_rank_1s_file_stops_the_resume_naming_it(tmp_path: Path) -> None:
    args = tiny_run_args("--job.dump_folder", str(tmp_path), "--model.n_layers", "2")
    args += ["--training.local_batch_size", "1"]
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async"]
    run_kiln([*args, "--training.steps", "4"], ngpu=2, threads=1, check=True)
    folder = tmp_path / "checkpoint"
    shutil.rmtree(folder / "step-4")  # step-2, saved in the background, is the one to resume
    damaged = folder / "step-2" / "__1_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    proc = run_kiln([*args, "--training.steps", "6"], ngpu=2, threads=1)
    assert_one_line_error(proc, f"checkpoint file {damaged} is damaged: its checksum is crc32:")


@pytest.mark.parametrize("ngpu", NGPU)
def test_a_cut_record_and_a_deleted_checksum_entry_stop_the_resume_naming_the_file(tmp_path: Path, ngpu: int) -> None:
    args = tiny_run_args("--model.n_layers", "2", "--training.local_batch_size", "1")
    args += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"]
    run_kiln(
        [*args, "--job.dump_folder", str(tmp_path / "good"), "--training.steps", "2"], ngpu=ngpu, threads=1, check=True
    )
    for case in ("cut", "deleted"):
        step = tmp_path / case / "checkpoint" / "step-2"
        shutil.copytree(tmp_path / "good" / "checkpoint" / "step-2", step)
        marker = step / "kiln.json"
        shard = step / f"__{ngpu - 1}_0.distcp"  # the last rank's file
        if case == "cut":
            marker.write_text(marker.read_text()[: marker.stat().st_size // 2])
            needle = f"checkpoint record {marker} exists but cannot be read"
        else:
            saved = json.loads(marker.read_text())
            del saved["checksums"][shard.name]
            marker.write_text(json.dumps(saved))
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0x01
            shard.write_bytes(bytes(data))
            needle = f"checkpoint file {shard} has no checksum in {marker}"
        proc = run_kiln(
            [*args, "--job.dump_folder", str(tmp_path / case), "--training.steps", "4"], ngpu=ngpu, threads=1
        )
        assert_one_line_error(proc, needle)
