"""A stranger's checkpoint, read by every loader kiln has (resume, checkpoint.initial_load_path, scripts/convert_hf.py),
as issue 36 attacked it: each hole refused with exit 2 and one `kiln: error:` line naming the file or key and what
would be valid; nothing saved is lost and no new folder appears. In-process train.py; run_train.sh with NGPU 1 and 2:
tests/e2e/test_hostile_run_train.py.

1 links: the lock, a `.tmp` in the way: refused, their targets untouched.
2 records pointing out of the folder: `.metadata` records, an HF index's weight_map.
3 sizes: a deflated record, a record longer than it declares, a stream transform.
4 loaded values: train step (against the folder's name), settings, LR schedule, data position, optimizer step.
also: BUILD on a class in `.metadata`; a tensor record holding a pickle; a kill at any moment of a save.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import train as train_entry
from tests.helpers.common import ROOT, tiny_run_args
from tests.helpers.hostile import (
    SMALL_ARGS,
    deflated,
    read_item,
    read_md,
    record_index,
    rewrite_item,
    snapshot,
    storage_member,
    torch_saved,
    write_md,
)

ARGS = tiny_run_args(*SMALL_ARGS)
CKPT = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2")


def main(dump: Path, *args: str, base: list[str] = ARGS) -> int:
    """train.py's main in this process (as `python train.py ...`); its exit status."""
    rc = train_entry.main([*base, "--job.dump_folder", str(dump), *args])
    if dist.is_initialized():
        dist.destroy_process_group()
    return rc


def refused(dump: Path, capsys: pytest.CaptureFixture, *args: str, base: list[str] = ARGS) -> str:
    """Exit 2 with exactly one `kiln: error:` line, the checkpoint folder unchanged (nothing lost, no new folder);
    the line."""
    folder = dump / "checkpoint"
    before = snapshot(folder) if folder.exists() else {}
    capsys.readouterr()
    rc = main(dump, *args, base=base)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("kiln: error: "), err
    assert (snapshot(folder) if folder.exists() else {}) == before
    return err


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dump folder whose checkpoint/step-2 is a full checkpoint of the small model."""
    dump = tmp_path_factory.mktemp("good")
    assert main(dump, *CKPT, "--training.steps", "2") == 0
    return dump


@pytest.fixture
def run(good: Path, tmp_path: Path) -> Path:
    """A fresh copy of `good` to attack."""
    shutil.copytree(good, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def step2(run: Path) -> Path:
    return run / "checkpoint" / "step-2"


def resume(run: Path, capsys: pytest.CaptureFixture) -> str:
    return refused(run, capsys, *CKPT, "--training.steps", "4")


def exp_avg(step: Path) -> str:
    return next(i.fqn for i in read_md(step).storage_data if i.fqn.endswith("tok_embeddings.weight.exp_avg"))


# ---------------------------------------------------------------------------------------------- 1: links


def test_a_linked_lock_file_is_refused_and_its_target_untouched(run: Path, tmp_path: Path, capsys) -> None:
    lock = run / "checkpoint" / ".kiln.lock"
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    lock.unlink()
    lock.symlink_to(victim)
    err = resume(run, capsys)
    assert f"{lock} is a symbolic link; kiln never writes, truncates or removes through a link" in err, err
    assert victim.read_text() == "precious\n"

    lock.unlink()
    lock.symlink_to(tmp_path / "created")  # dangling: O_CREAT would create the file wherever it points
    assert "is a symbolic link" in resume(run, capsys)
    assert not (tmp_path / "created").exists()


@pytest.mark.parametrize("what", ["file", "fifo"])
def test_a_save_name_held_by_a_file_is_refused_at_start(run: Path, what: str, capsys) -> None:
    name = run / "checkpoint" / "step-4"
    name.write_text("x") if what == "file" else os.mkfifo(name)
    err = resume(run, capsys)
    assert "already holds step-4 (not a folder), which this run (steps 3-4) would save again" in err, err


def test_a_linked_tmp_in_the_way_of_a_save_is_refused_at_start(run: Path, tmp_path: Path, capsys) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / ".kiln-saving").write_text("{}")  # it even looks like kiln's own killed save
    (target / "keep").write_text("x")
    (run / "checkpoint" / "step-4.tmp").symlink_to(target)
    err = resume(run, capsys)
    assert "already holds step-4.tmp (a symbolic link), which this run (steps 3-4) would save again" in err, err
    assert sorted(p.name for p in target.iterdir()) == [".kiln-saving", "keep"]


# ---------------------------------------------------------------------------------------------- 2: records


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_records_naming_files_outside_the_folder_are_refused(run: Path, where: str, capsys) -> None:
    """An outside copy of the weights would train (exit 0) before: the record is refused, whatever it names."""
    step = step2(run)
    md = read_md(step)
    index = record_index(md, "tok_embeddings.weight")
    info = md.storage_data[index]
    shutil.copy(step / info.relative_path, run / "outside.distcp")
    name = str(run / "outside.distcp") if where == "absolute" else "../../outside.distcp"
    md.storage_data[index] = dataclasses.replace(info, relative_path=name)
    write_md(step, md)
    err = resume(run, capsys)
    assert f"record 'tok_embeddings.weight' names '{name}', outside {step}" in err, err
    assert "must name files inside its own folder" in err


# ---------------------------------------------------------------------------------------------- 3: sizes


def test_a_deflated_record_is_refused_before_it_inflates(run: Path, capsys) -> None:
    """10 MB of zeros deflate into ~10 KB, within the declared size of the tensor: the compression is refused."""
    step = step2(run)
    fqn = exp_avg(step)
    record = read_item(step, fqn)
    rewrite_item(step, fqn, deflated(record, storage_member(record), 10_000_000))
    err = resume(run, capsys)
    assert f"item '{fqn}' has a compressed member" in err and "kiln reads records that are stored" in err, err


def test_a_deflated_bytes_item_is_refused(run: Path, capsys) -> None:
    step = step2(run)
    rewrite_item(step, "train_state.settings", deflated(torch_saved(json.dumps({"x": "a" * 20_000_000}))))
    err = resume(run, capsys)
    assert "item 'train_state.settings' has a compressed member" in err, err


def test_a_record_longer_than_it_declares_is_refused(run: Path, capsys) -> None:
    step = step2(run)
    fqn = exp_avg(step)
    big = torch.zeros(2_000_000)[: 2256 * 64].view(2256, 64)  # the right shape over a 8 MB storage
    rewrite_item(step, fqn, torch_saved(big))
    err = resume(run, capsys)
    assert f"record '{fqn}' is 8,00" in err and "more than the" in err and "its entry declares" in err, err


def test_a_record_stored_through_a_transform_is_refused(run: Path, capsys) -> None:
    step = step2(run)
    md = read_md(step)
    index = record_index(md, "norm.weight")
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], transform_descriptors=["stream.zstd/1"])
    write_md(step, md)
    err = resume(run, capsys)
    assert "record 'norm.weight' is stored through ['stream.zstd/1']" in err, err


# ---------------------------------------------------------------------------------------------- 4: loaded values


def _set(fqn: str, value: Any) -> Any:
    return lambda step: rewrite_item(step, fqn, torch_saved(value))


def _marker_step(step: Path) -> None:
    marker = json.loads((step / "kiln.json").read_text())
    (step / "kiln.json").write_text(json.dumps({**marker, "step": 7}))


def _optimizer_step(step: Path) -> None:
    fqn = next(i.fqn for i in read_md(step).storage_data if i.fqn.endswith("norm.weight.step"))
    rewrite_item(step, fqn, torch_saved(torch.tensor(-5.0)))


def _nan_moment(step: Path) -> None:
    rewrite_item(step, exp_avg(step), torch_saved(torch.full((2256, 64), math.nan)))


VALUES = {
    "step -100": (_set("train_state.step", -100), "train_state.step is -100, but kiln writes the step of the folder"),
    "step 10**18": (_set("train_state.step", 10**18), "train_state.step is 1000000000000000000, but kiln writes"),
    "step of another folder": (_set("train_state.step", 4), "train_state.step is 4, but kiln writes the step of the"),
    "kiln.json step": (_marker_step, "its kiln.json says step 7, its name step 2"),
    "settings a list": (_set("train_state.settings", "[1, 2]"), "train_state.settings is '[1, 2]', but kiln writes a"),
    "settings nested": (_set("train_state.settings", "[" * 100_000 + "]" * 100_000), "train_state.settings is '[[["),
    "settings an int": (_set("train_state.settings", 3), "train_state.settings is 3, but kiln writes a JSON object"),
    "epoch a string": (_set("lr_scheduler.last_epoch", "two"), "lr_scheduler.last_epoch is 'two', but kiln writes"),
    "lr not finite": (_set("lr_scheduler.base_lrs", [math.inf]), "lr_scheduler.base_lrs is [inf], but kiln writes"),
    "token id past the vocabulary": (_set("dataloader.buffer", [5, 10**6]), "dataloader.buffer is 1000000, but"),
    "negative token id": (_set("dataloader.buffer", [-1]), "dataloader.buffer is -1, but kiln writes token ids"),
    "negative position": (_set("dataloader.sequences", -3), "dataloader.sequences is -3, but kiln writes a position"),
    "optimizer step negative": (_optimizer_step, ".step is -5.0, but kiln writes AdamW's step count"),
    "moment NaN": (_nan_moment, ".exp_avg' holds NaN or infinite values, but kiln never saves after a non-finite"),
}


@pytest.mark.parametrize("case", list(VALUES))
def test_loaded_values_are_checked_before_any_is_applied(run: Path, case: str, capsys) -> None:
    edit, needle = VALUES[case]
    edit(step2(run))
    err = resume(run, capsys)
    assert f"checkpoint {step2(run)}" in err and needle in err, err


# ---------------------------------------------------------------------------------------------- also seen


class Payload:
    """Unpickled, this runs `touch marker` through os.system: what a crafted checkpoint would do on resume."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_tensor_record_holding_a_pickle_is_named_not_retried(run: Path, tmp_path: Path, capsys) -> None:
    """torch's own message advises retrying with weights_only=False; kiln names the item and the global."""
    rewrite_item(step2(run), "tok_embeddings.weight", torch_saved(Payload(tmp_path / "pwned")))
    err = resume(run, capsys)
    assert "item 'tok_embeddings.weight' needs the global posix.system, which is not plain data" in err, err
    assert "weights_only=False" not in err and not (tmp_path / "pwned").exists()


def test_build_on_an_admitted_class_is_refused_and_changes_nothing(run: Path, capsys) -> None:
    """GLOBAL pathlib.PosixPath then BUILD {'kiln_attack': 1}: no code runs, but the class would change for the
    whole process."""
    step = step2(run)
    good = (step / ".metadata").read_bytes()
    build = b"\x80\x04\x8c\x07pathlib\x8c\tPosixPath\x93N}\x8c\x0bkiln_attack\x4b\x01s\x86b0"  # no memo entries
    (step / ".metadata").write_bytes(build + good[2:])  # then kiln's own index, unchanged
    assert pickle.loads(build + good[2:]) is not None and pathlib.PosixPath.kiln_attack == 1  # plain pickle: live
    del pathlib.PosixPath.kiln_attack
    err = resume(run, capsys)
    assert "its .metadata sets attributes on PosixPath, which is not a DCP metadata record" in err, err
    assert not hasattr(pathlib.PosixPath, "kiln_attack")


def test_a_kill_at_any_moment_of_a_save_leaves_a_folder_the_next_start_resumes(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Killed while marking a new `.tmp` (before, a `step-4.tmp` without its mark made every later start refuse
    the folder) or while deleting one: the next start removes kiln's private leftovers and resumes."""
    import trainer.checkpoint.folder as folder_module

    real_write_json = folder_module.write_json

    def killed(path: str, obj: dict) -> None:
        if path.endswith(folder_module.SAVING):
            raise KeyboardInterrupt  # the process dies here: nothing after this line runs
        real_write_json(path, obj)

    monkeypatch.setattr(folder_module, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        folder_module.prepare_save(str(run / "checkpoint"), "step-4")
    monkeypatch.undo()
    left = sorted(p.name for p in (run / "checkpoint").iterdir())
    assert "step-4.tmp" not in left and any(n.startswith(".kiln-new-step-4-") for n in left), left
    (run / "checkpoint" / ".kiln-removing-step-0-1-ab").mkdir()  # killed half-way through a deletion
    (run / "checkpoint" / ".kiln-removing-step-0-1-ab" / "__0_0.distcp").write_text("x")

    capsys.readouterr()
    assert main(run, *CKPT, "--training.steps", "4") == 0, capsys.readouterr().err
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == [".kiln.lock", "step-2", "step-4"]


# ---------------------------------------------------------------------------------------------- the other loaders


def _convert() -> Any:
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "scripts" / "convert_hf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert_refused(capsys: pytest.CaptureFixture, *argv: str) -> str:
    capsys.readouterr()
    assert _convert().main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("convert_hf: error: "), err
    return err


@pytest.fixture(scope="module")
def hf_folder(good: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    assert _convert().main(["to_hf", str(good / "checkpoint"), str(out)]) == 0
    return out


def test_initial_load_and_convert_refuse_records_outside_the_folder(run: Path, tmp_path: Path, capsys) -> None:
    step = step2(run)
    md = read_md(step)
    index = record_index(md, "norm.weight")
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path="../../../etc/passwd")
    write_md(step, md)
    source = ("--checkpoint.initial_load_path", str(step), "--model.flavor", "from_checkpoint")
    err = refused(tmp_path / "fresh", capsys, "--training.steps", "1", *source)
    assert "record 'norm.weight' names '../../../etc/passwd', outside" in err, err
    err = convert_refused(capsys, "to_hf", str(step), str(tmp_path / "hf"))
    assert "names '../../../etc/passwd', outside" in err and not (tmp_path / "hf").exists()


def _hf_copy(hf_folder: Path, tmp_path: Path, **config: Any) -> Path:
    out = tmp_path / "hf"
    shutil.copytree(hf_folder, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **config}))
    return out


HF_CONFIGS = {
    "num_attention_heads 0": ({"num_attention_heads": 0}, "num_attention_heads must be in [1, 2147483647], got 0"),
    "intermediate_size 0": ({"intermediate_size": 0}, "intermediate_size must be in [1, 2147483647], got 0"),
    "num_key_value_heads -16": ({"num_key_value_heads": -16}, "num_key_value_heads must be in [1, 2147483647]"),
    "hidden_size a string": ({"hidden_size": "64"}, 'hidden_size = "64": not an integer'),
    "rms_norm_eps a list": ({"rms_norm_eps": [1]}, "rms_norm_eps = [1]: not a number"),
    "rope factor a string": (
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": "x",
                "low_freq_factor": 1,
                "high_freq_factor": 4,
                "original_max_position_embeddings": 64,
            }
        },
        'rope_parameters.factor = "x": not a number',
    ),
    "num_hidden_layers 10**6": ({"num_hidden_layers": 10**6}, "needs at least"),
    **{
        f"rope_theta {theta}": (
            {"rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_theta": theta},
            f"config.json: model rope_theta must be a finite number > 0, got {theta}",
        )
        for theta in (math.inf, math.nan)
    },
    "rope_theta negative": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}, "rope_theta": -1.0},
        "config.json: rope_theta = -1.0: not a positive number",
    ),
}


@pytest.mark.parametrize("case", list(HF_CONFIGS))
def test_hf_config_shapes_are_checked_before_any_build(hf_folder: Path, tmp_path: Path, case: str, capsys) -> None:
    config, needle = HF_CONFIGS[case]
    folder = _hf_copy(hf_folder, tmp_path, **config)
    source = ("--checkpoint.initial_load_path", str(folder), "--model.flavor", "from_checkpoint")
    capsys.readouterr()
    argv = tiny_run_args("--job.dump_folder", str(tmp_path / "out"), *source)  # the shape: config.json's alone
    cfg = train_entry.check_config(argv, world_size=1)
    err = capsys.readouterr().err.strip()
    assert cfg is None and len(err.splitlines()) == 1 and needle in err, err
    if case != "num_hidden_layers 10**6":  # scripts/convert_hf.py reads the same config (the memory is the run's)
        err = convert_refused(capsys, "from_hf", str(folder), str(tmp_path / "ckpt"))
        assert needle in err and not (tmp_path / "ckpt").exists(), err


def test_a_config_json_that_is_a_list_is_refused(hf_folder: Path, tmp_path: Path, capsys) -> None:
    folder = _hf_copy(hf_folder, tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    err = convert_refused(capsys, "from_hf", str(folder), str(tmp_path / "ckpt"))
    assert "config.json: not a JSON object" in err, err


def test_a_weight_map_naming_a_file_outside_is_refused(hf_folder: Path, tmp_path: Path, capsys) -> None:
    folder = _hf_copy(hf_folder, tmp_path)
    shutil.move(folder / "model.safetensors", tmp_path / "elsewhere.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "elsewhere.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = {"weight_map": dict.fromkeys(names, "../elsewhere.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    err = convert_refused(capsys, "from_hf", str(folder), str(tmp_path / "ckpt"))
    assert "names '../elsewhere.safetensors', outside" in err, err
    source = ("--checkpoint.initial_load_path", str(folder), "--model.flavor", "from_checkpoint")
    err = refused(tmp_path / "fresh", capsys, "--training.steps", "1", *source, base=tiny_run_args())
    assert "names '../elsewhere.safetensors', outside" in err, err


def test_a_safetensors_header_larger_than_the_model_is_refused_before_reading(
    hf_folder: Path, tmp_path: Path, capsys
) -> None:
    from safetensors.torch import load_file, save_file

    folder = _hf_copy(hf_folder, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = torch.zeros(1_000_000)  # a sparse file could back any size
    save_file(weights, str(folder / "model.safetensors"))
    err = convert_refused(capsys, "from_hf", str(folder), str(tmp_path / "ckpt"))
    assert "weight 'model.norm.weight' has shape (1000000,), but the model of config.json has (64,)" in err, err


def test_a_weight_stored_as_integers_is_refused(hf_folder: Path, tmp_path: Path, capsys) -> None:
    """An int64 norm weight of the right shape was copied into the float weights without a word."""
    from safetensors.torch import load_file, save_file

    folder = _hf_copy(hf_folder, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(64, dtype=torch.int64)
    save_file(weights, str(folder / "model.safetensors"))
    err = convert_refused(capsys, "from_hf", str(folder), str(tmp_path / "ckpt"))
    assert f"{folder / 'model.safetensors'}: weight 'model.norm.weight' is stored as I64; a model weight must" in err
    assert not (tmp_path / "ckpt").exists(), err


def test_a_damaged_safetensors_file_is_named(hf_folder: Path, tmp_path: Path, capsys) -> None:
    folder = _hf_copy(hf_folder, tmp_path)
    os.truncate(folder / "model.safetensors", 1000)
    err = convert_refused(capsys, "from_hf", str(folder), str(tmp_path / "ckpt"))
    assert f"{folder / 'model.safetensors'}: cannot read it as safetensors (SafetensorError" in err, err


def test_convert_never_writes_through_a_link(good: Path, hf_folder: Path, tmp_path: Path, capsys) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").symlink_to(victim)  # safetensors writes by name: refused
    err = convert_refused(capsys, "to_hf", str(good / "checkpoint"), str(out))
    assert f"{out / 'model.safetensors'} is a symbolic link" in err, err
    (out / "model.safetensors").unlink()
    (out / "config.json").symlink_to(victim)  # a JSON file is written aside and renamed over the link itself
    assert _convert().main(["to_hf", str(good / "checkpoint"), str(out)]) == 0
    assert victim.read_text() == "precious" and not (out / "config.json").is_symlink()

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step-0.tmp").symlink_to(tmp_path / "elsewhere")
    err = convert_refused(capsys, "from_hf", str(hf_folder), str(ckpt))
    assert "step-0.tmp already exists; not overwriting it" in err and not (tmp_path / "elsewhere").exists(), err
