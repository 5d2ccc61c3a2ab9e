"""A flipped bit in one rank's checkpoint file, through run_train.sh on 2 ranks (FSDP, the checkpoint saved in the
background): one line naming the file, exit 2 (trainer/checkpoint/checksums.py; every rank checks its
share of the files and all raise the first mismatch)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.common import tiny_run_args
from tests.helpers.kiln_process import assert_one_line_error, run_kiln

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


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
