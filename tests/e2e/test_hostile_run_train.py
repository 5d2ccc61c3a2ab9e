"""Issue 36's hostile and broken inputs through run_train.sh, as users start kiln: exit 2 and one `kiln: error:`
line naming the file or key, no traceback, nothing saved lost, no new folder; with NGPU 1 and 2 where ranks matter.

Before torchrun (the launcher's check, no rank starts): a model shape from an HF config.json or a kiln.json, the
TP plan for it, the memory the model needs, NGPU, a FIFO as data, a tokenizer too large, a TOML nested too deep.
In the ranks: a crafted checkpoint (train step, a record outside the folder), a linked lock file, a full disk at
a save, a read-only dump folder with profiling on. The loaders' every case: tests/trainer/test_hostile_checkpoints.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.common import ROOT, tiny_run_args
from tests.helpers.hostile import (
    SMALL_ARGS,
    read_md,
    record_index,
    rewrite_item,
    run_train_sh,
    snapshot,
    torch_saved,
    write_md,
)
from tests.helpers.kiln_process import assert_one_line_error

CKPT = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2")


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dump folder whose checkpoint/step-2 was saved by 2 FSDP ranks through run_train.sh (small model)."""
    dump = tmp_path_factory.mktemp("two-ranks")
    proc = run_train_sh(
        *tiny_run_args(*SMALL_ARGS, *CKPT, "--training.steps", "2", "--job.dump_folder", str(dump)), cwd=dump, ngpu=2
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return dump


@pytest.fixture(scope="module")
def hf_model(two_rank_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    convert = [
        sys.executable,
        str(ROOT / "scripts" / "convert_hf.py"),
        "to_hf",
        str(two_rank_checkpoint / "checkpoint"),
    ]
    subprocess.run([*convert, str(out)], check=True, capture_output=True, timeout=600)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# ---------------------------------------------------------------------------------------------- before torchrun


def test_hf_config_with_zero_heads_is_refused_before_any_rank(hf_model: Path, tmp_path: Path) -> None:
    folder = _copy(hf_model, tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    source = ("--checkpoint.initial_load_path", str(folder), "--model.flavor", "from_checkpoint")
    proc = run_train_sh(*tiny_run_args(*source, "--job.dump_folder", str(tmp_path / "o")), cwd=tmp_path, ngpu=2)
    line = assert_one_line_error(proc)
    assert f"{folder / 'config.json'}: num_attention_heads must be in [1, 2147483647], got 0" in line, line
    assert "[rank0]" not in proc.stdout and not (tmp_path / "o").exists()


def test_one_kv_head_with_tensor_parallel_2_is_refused_before_any_rank(hf_model: Path, tmp_path: Path) -> None:
    folder = _copy(hf_model, tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 1}))
    source = ("--checkpoint.initial_load_path", str(folder), "--model.flavor", "from_checkpoint")
    tp = ("--parallelism.tensor_parallel_degree", "2")
    proc = run_train_sh(*tiny_run_args(*source, *tp, "--job.dump_folder", str(tmp_path / "o")), cwd=tmp_path, ngpu=2)
    line = assert_one_line_error(proc)
    assert "parallelism.tensor_parallel_degree (2) must divide the model's n_kv_heads (1)" in line, line
    assert "[rank0]" not in proc.stdout


def test_a_kiln_json_of_a_million_layers_is_refused_for_memory(two_rank_checkpoint: Path, tmp_path: Path) -> None:
    step = _copy(two_rank_checkpoint / "checkpoint" / "step-2", tmp_path / "step-2")
    marker = json.loads((step / "kiln.json").read_text())
    marker["model_args"]["n_layers"] = 1_000_000
    (step / "kiln.json").write_text(json.dumps(marker))
    source = ("--checkpoint.initial_load_path", str(step), "--model.flavor", "from_checkpoint")
    proc = run_train_sh(*tiny_run_args(*source, "--job.dump_folder", str(tmp_path / "o")), cwd=tmp_path)
    line = assert_one_line_error(proc)
    assert "1000000 layers, dim 64" in line and "more than this machine's RAM" in line, line


@pytest.mark.parametrize(
    ("env", "args", "needle"),
    [
        ({"NGPU": "100000"}, (), "NGPU=100000: this node has no GPU and"),
        ({"NGPU": "9" * 5000}, (), "NGPU=99999999999999999...: this node has no GPU and"),
        ({}, ("--training.dataset_path", "{fifo}"), "fifo.jsonl is a FIFO (named pipe), not a regular file"),
        (
            {},
            ("--validation.enable", "--validation.dataset_path", "{fifo}"),
            "fifo.jsonl is a FIFO (named pipe), not a regular file",
        ),
        ({}, ("--validation.enable", "--validation.dataset_path", "{dev}"), "dev.jsonl is a device"),
        ({}, ("--model.tokenizer_path", "{big}"), "big.model is 41,943,040 bytes, more than kiln reads"),
        ({}, ("--job.config_file", "{deep}"), "deep.toml: malformed TOML: arrays or tables nested deeper"),
        ({}, ("--training.dataset_path", "{deep_record}"), "record 1 (line 1): not valid JSON (nested deeper"),
    ],
    ids=["ngpu", "ngpu-digits", "fifo", "validation-fifo", "validation-device", "tokenizer", "toml", "record"],
)
def test_bounds_at_start(tmp_path: Path, env: dict[str, str], args: tuple[str, ...], needle: str) -> None:
    if env.get("NGPU") == "100000" and (os.cpu_count() or 0) * 4 >= 100000:  # pragma: no cover
        pytest.skip("more than 25,000 cores: 100,000 CPU ranks (4 a core) would be allowed here")
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "dev.jsonl").symlink_to("/dev/zero")
    with open(tmp_path / "big.model", "wb") as f:
        f.truncate(40 * 2**20)  # sparse: the size alone is refused, nothing is read
    (tmp_path / "deep.toml").write_text("[training]\nsteps = " + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp_path / "deep.jsonl").write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    paths = {"fifo": tmp_path / "fifo.jsonl", "big": tmp_path / "big.model", "deep": tmp_path / "deep.toml"}
    paths.update(deep_record=tmp_path / "deep.jsonl", dev=tmp_path / "dev.jsonl")
    argv = tiny_run_args("--job.dump_folder", str(tmp_path / "o"), *(a.format(**paths) for a in args))
    proc = run_train_sh(*argv, cwd=tmp_path, ngpu=env.get("NGPU", 1), timeout=300)
    line = assert_one_line_error(proc)
    assert needle in line, line
    if "FIFO" in needle or "device" in needle:  # refused under the key the path was given under
        key = next(a for a in args if a.endswith(".dataset_path"))[2:]
        assert line.startswith(f"kiln: error: {key}: "), line
    assert "[rank0]" not in proc.stdout


# ---------------------------------------------------------------------------------------------- in the ranks


def _resume(dump: Path, ngpu: int, *args: str, **kwargs: object) -> subprocess.CompletedProcess:
    argv = tiny_run_args(*SMALL_ARGS, *CKPT, "--training.steps", "4", "--job.dump_folder", str(dump), *args)
    return run_train_sh(*argv, cwd=dump, ngpu=ngpu, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("ngpu", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_crafted_train_step_is_refused_on_every_rank(two_rank_checkpoint: Path, tmp_path: Path, ngpu: int) -> None:
    dump = _copy(two_rank_checkpoint, tmp_path / "run")
    step = dump / "checkpoint" / "step-2"
    rewrite_item(step, "train_state.step", torch_saved(-100))
    before = snapshot(dump / "checkpoint")
    line = assert_one_line_error(_resume(dump, ngpu))
    assert f"checkpoint {step}: train_state.step is -100, but kiln writes the step of the folder's name (2)" in line
    assert snapshot(dump / "checkpoint") == before


@pytest.mark.slow
@pytest.mark.distributed
def test_a_record_outside_the_folder_and_a_linked_lock_are_refused_with_two_ranks(
    two_rank_checkpoint: Path, tmp_path: Path
) -> None:
    dump = _copy(two_rank_checkpoint, tmp_path / "run")
    step = dump / "checkpoint" / "step-2"
    md = read_md(step)
    index = record_index(md, "tok_embeddings.weight")
    shutil.copy(step / md.storage_data[index].relative_path, tmp_path / "outside.distcp")
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path=str(tmp_path / "outside.distcp"))
    write_md(step, md)
    before = snapshot(dump / "checkpoint")
    line = assert_one_line_error(_resume(dump, 2))
    assert f"names '{tmp_path / 'outside.distcp'}', outside {step}" in line, line
    assert snapshot(dump / "checkpoint") == before

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = dump / "checkpoint" / ".kiln.lock"
    lock.unlink()
    lock.symlink_to(victim)
    line = assert_one_line_error(_resume(dump, 2))
    assert f"{lock} is a symbolic link; kiln never writes, truncates or removes through a link" in line, line
    assert victim.read_text() == "precious\n"


def _file_size_limit() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (600 * 1024, 600 * 1024))  # a full disk for the ~1 MB shard file


@pytest.mark.slow
def test_a_full_disk_at_a_save_names_the_folder_and_the_intact_checkpoint(
    two_rank_checkpoint: Path, tmp_path: Path
) -> None:
    """Writes past 600 KB fail (EFBIG, as ENOSPC would): torch's own line was `[enforce fail at
    inline_container.cc] unexpected pos`."""
    dump = _copy(two_rank_checkpoint, tmp_path / "run")
    folder = dump / "checkpoint"
    line = assert_one_line_error(_resume(dump, 1, preexec_fn=_file_size_limit))
    assert f"saving checkpoint step-4 into {folder} failed (" in line and "the disk holding it has" in line, line
    assert f"{folder / 'step-2'} is the newest complete checkpoint and is intact" in line, line
    assert sorted(p.name for p in folder.iterdir()) == [".kiln.lock", "step-2"]  # the partial step-4.tmp removed


@pytest.mark.slow
def test_profiling_into_a_read_only_dump_folder_is_refused_at_start(tmp_path: Path) -> None:
    """It segfaulted (exit 139) at the first trace. Read-only for root too: the immutable attribute."""
    dump = tmp_path / "ro"
    dump.mkdir()
    if subprocess.run(["chattr", "+i", str(dump)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here")
    try:
        argv = tiny_run_args(*SMALL_ARGS, "--profiling.enable_profiling", "--profiling.profile_freq", "4")
        proc = run_train_sh(*argv, "--training.steps", "5", "--job.dump_folder", str(dump), cwd=tmp_path)
    finally:
        subprocess.run(["chattr", "-i", str(dump)], check=True)
    line = assert_one_line_error(proc)
    assert f"profiling.save_traces_folder: {dump}/" in line and "is not usable" in line, line
