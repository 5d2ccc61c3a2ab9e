"""Reliability: numeric ranges and config-file mistakes, bad data records, the global sample order (FSDP on 2
ranks follows the 1-rank loss curve; a checkpoint resumes 1 -> 2 -> 1 ranks), resume compatibility of changed
settings, and preemption (SIGTERM saves and exits 143, a restart resumes exactly; Ctrl-C exits 130)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import train as train_entry
from kiln_base.config import JobConfig, Range, Training, parse_args
from kiln_base.errors import CheckpointError, ConfigError, DataError
from models import LLAMA3_FLAVORS, ModelArgs, Transformer
from tests.helpers.common import ROOT, tiny_run_args
from tests.helpers.distributed import run_distributed
from trainer.components.checkpoint import read_metadata
from trainer.components.data import build_dataloader
from trainer.components.optim import lr_factor
from trainer.components.preemption import StopOnSignal
from trainer.components.resume import check_resume
from trainer.components.tokenizer import Tokenizer
from trainer.trainer import Trainer

TOKENIZER_PATH = str(ROOT / "assets" / "tokenizer" / "tokenizer.model")
DRIVER = str(ROOT / "tests" / "helpers" / "loss_driver.py")


@pytest.fixture(autouse=True)
def no_leftover_process_group():
    """A Trainer that fails in __init__ never reaches close(): do not leak its process group or determinism."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.use_deterministic_algorithms(False)


# ============================================================================= 1. numeric ranges, config files


def numeric_keys() -> list[tuple[str, str, Any, type]]:
    """(section, key, its Range, int or float) for every numeric key of the config."""
    out = []
    for section in fields(JobConfig):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            tp = hints[f.name]
            base = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
            if base in (int, float):
                out.append((section.name, f.name, f.metadata.get("valid"), base))
    return out


NUMERIC = numeric_keys()


def test_every_numeric_key_has_a_range() -> None:
    assert len(NUMERIC) >= 30
    missing = [f"{s}.{k}" for s, k, valid, _ in NUMERIC if not isinstance(valid, Range)]
    assert not missing, f"numeric keys without a validated range: {missing}"
    defaults = JobConfig()
    for s, k, valid, _ in NUMERIC:  # every default lies in its own range
        value = getattr(getattr(defaults, s), k)
        assert value is None or valid.contains(value), f"{s}.{k} default {value!r}"


def out_of_range(valid: Range | None, tp: type) -> list[Any]:
    """Values just outside `valid` (and nan/inf for floats, 2**63 for unbounded ints)."""
    if valid is None:  # test_every_numeric_key_has_a_range reports it
        return []
    bad: list[Any] = [float("nan"), float("inf")] if tp is float else []
    if valid.lo is not None:
        v = valid.lo if valid.lo_open else valid.lo - 1
        while v in valid.also:
            v -= 1
        bad.append(tp(v))
    if valid.hi is not None:
        bad.append(tp(valid.hi if valid.hi_open else valid.hi + 1))
    elif tp is int:
        bad.append(2**63)
    return bad


BAD_VALUES = [(s, k, v) for s, k, valid, tp in NUMERIC for v in out_of_range(valid, tp)]


@pytest.mark.parametrize("section,key,value", BAD_VALUES, ids=[f"{s}.{k}={v}" for s, k, v in BAD_VALUES])
def test_every_out_of_range_value_is_refused(section: str, key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args([f"--{section}.{key}", str(value)])
    message = str(e.value)
    assert message.startswith(f"{section}.{key} must be ") and message.endswith(f", got {value!r}"), message


# The cases of kiln issue 11, with the exact line a user sees.
RANGE_CASES = [
    ("--training.global_batch_size", "0", "training.global_batch_size must be -1 or >= 1 (-1 = local_batch_size "
     "x data-parallel degree), got 0"),
    ("--optimizer.beta1", "1", "optimizer.beta1 must be in [0, 1), got 1.0"),
    ("--optimizer.beta2", "-0.5", "optimizer.beta2 must be in [0, 1), got -0.5"),
    ("--optimizer.eps", "0", "optimizer.eps must be a finite number > 0, got 0.0"),
    ("--optimizer.weight_decay", "-0.1", "optimizer.weight_decay must be a finite number >= 0, got -0.1"),
    ("--optimizer.lr", "inf", "optimizer.lr must be a finite number > 0, got inf"),
    ("--optimizer.lr", "nan", "optimizer.lr must be a finite number > 0, got nan"),
    ("--training.max_norm", "nan", "training.max_norm must be a finite number (<= 0 disables clipping), got nan"),
    ("--training.seed", str(2**64), f"training.seed must be in [0, {2**64 - 1}] (torch.manual_seed's range), "
     f"got {2**64}"),
    ("--comm.init_timeout_seconds", "0", "comm.init_timeout_seconds must be in [1, 1000000000] (seconds), got 0"),
    ("--comm.train_timeout_seconds", "-5", "comm.train_timeout_seconds must be in [1, 1000000000] (seconds), got -5"),
]  # fmt: skip


@pytest.mark.parametrize("flag,value,message", RANGE_CASES, ids=[f"{f}={v}" for f, v, _ in RANGE_CASES])
def test_issue_cases_name_key_and_range(flag: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args([flag, value])
    assert str(e.value) == message


def test_range_edges_are_accepted() -> None:
    cfg = parse_args(
        [
            *("--optimizer.beta1", "0", "--optimizer.weight_decay", "0", "--training.global_batch_size", "-1"),
            *("--training.max_norm", "-1", "--training.seed", str(2**64 - 1), "--checkpoint.load_step", "-1"),
            *("--checkpoint.keep_latest_k", "0", "--lr_scheduler.decay_ratio", "1"),
        ]
    )
    assert cfg.optimizer.beta1 == 0.0 and cfg.training.seed == 2**64 - 1 and cfg.training.max_norm == -1.0


CONFIG_FILES = [
    ("bom", b"\xef\xbb\xbf[training]\nsteps = 3\n", "starts with a UTF-8 byte-order mark (BOM); save the file as "
     "UTF-8 without BOM"),
    ("latin1", b'[job]\ndescription = "caf\xe9"\n', "not UTF-8 text (byte 0xe9 at line 2); TOML files must be UTF-8"),
    ("utf16", "[training]\nsteps = 3\n".encode("utf-16"), "not UTF-8 text (byte 0xff at line 1)"),
    ("bool_string", b'[float8]\nenable_float8_linear = "yes"\n', "float8.enable_float8_linear: expected a TOML "
     "boolean (true or false, unquoted), got the string 'yes'"),
    ("int_string", b'[training]\nsteps = "10"\n', "training.steps: expected a TOML integer (unquoted), got the "
     "string '10'"),
    ("toml_nan", b"[training]\nmax_norm = nan\n", "training.max_norm must be a finite number (<= 0 disables "
     "clipping), got nan"),
]  # fmt: skip


@pytest.mark.parametrize("name,content,message", CONFIG_FILES, ids=[c[0] for c in CONFIG_FILES])
def test_config_file_mistakes(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    path = tmp_path / f"{name}.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", str(path)])
    assert message in str(e.value) and (str(path) in str(e.value) or name == "toml_nan")


def test_config_file_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"--job.config_file {tmp_path} is a directory; give a TOML file"):
        parse_args(["--job.config_file", str(tmp_path)])


def test_cli_boolean_strings_still_work() -> None:
    cfg = parse_args(["--training.compile", "true", "--float8.emulate=false", "--training.deterministic", "yes"])
    assert cfg.training.compile is True and cfg.float8.emulate is False and cfg.training.deterministic is True


@pytest.mark.parametrize(
    "args,message",
    [
        (["--training.global_batch_size", "0"], "kiln: error: training.global_batch_size must be -1 or >= 1"),
        (["--optimizer.beta2", "1.5"], "kiln: error: optimizer.beta2 must be in [0, 1), got 1.5"),
    ],
)
def test_bad_range_exits_2_with_one_line_through_train_py(args: list[str], message: str) -> None:
    # --job.print_config: were the value accepted, the run would print the config and exit 0, not train
    proc = subprocess.run(
        [sys.executable, "train.py", *args, "--job.print_config"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(message), proc.stderr


def test_bool_string_in_toml_exits_2_through_train_py(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[training]\ncompile = "yes"\n')
    proc = subprocess.run(
        [sys.executable, "train.py", "--job.config_file", str(path), "--job.print_config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "training.compile: expected a TOML boolean" in proc.stderr


# ============================================================================= 2. data records

TOKENIZER = Tokenizer(TOKENIZER_PATH)
GOOD = [json.dumps({"text": f"record {i} " + "word " * 30}) for i in range(6)]  # 69 tokens each


def loader(path: Path, rank: int = 0, world: int = 1, batch: int = 2, seq_len: int = 32, prefetch: int = 2):
    cfg = Training(seq_len=seq_len, local_batch_size=batch, dataset_path=str(path), data_prefetch=prefetch)
    return build_dataloader(cfg, TOKENIZER, rank, world)


def drain(dl: Any, n: int = 50) -> None:
    try:
        for _ in range(n):
            next(dl)
    finally:
        dl.close()


BAD_RECORDS = [  # (lines after the six good ones, the problem at record 7)
    ('{"text": null}', "record 7 (line 7): 'text' is null; every record needs a string 'text' field"),
    ('{"body": "x"}', "record 7 (line 7): no 'text' field (has: body); every record needs a string 'text' field"),
    ('{"text": 42}', "record 7 (line 7): 'text' is a number, not a string; every record needs a string 'text' field"),
    ('{"text": ["a"]}', "record 7 (line 7): 'text' is an array, not a string"),
    ('{"text": {"a": 1}}', "record 7 (line 7): 'text' is an object, not a string"),
    ('"just a string"', "record 7 (line 7): not a JSON object but"),
    ('{"text": "x"', "record 7 (line 7): not valid JSON (Expecting ',' delimiter, column 13)"),
    ('\n\n{"text": null}', "record 7 (line 9): 'text' is null"),  # blank lines are not records
]


@pytest.mark.parametrize("bad,message", BAD_RECORDS, ids=[b[1][:30] for b in BAD_RECORDS])
def test_bad_record_halfway_names_file_record_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([*GOOD, bad]) + "\n")
    with pytest.raises(DataError) as e:
        drain(loader(path))
    assert str(e.value).startswith(f"data file {path}, {message}"), str(e.value)


def test_bad_record_in_second_file_of_a_folder_and_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("\n".join(GOOD) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join([*GOOD[:2], '{"text": null}']) + "\n")
    errors = []
    for rank in range(2):  # every rank streams the whole dataset: all meet the same record
        with pytest.raises(DataError) as e:
            drain(loader(tmp_path, rank=rank, world=2))
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"data file {tmp_path / 'b.jsonl'}, record 3 (line 3): 'text' is null")


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["empty", "blank_lines"])
def test_empty_jsonl(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=f"no records in {path}"):
        drain(loader(path))


def test_dataset_too_small_for_one_sequence(tmp_path: Path) -> None:
    path = tmp_path / "tiny.jsonl"
    path.write_text('{"text": "hi"}\n')
    with pytest.raises(DataError, match="is too small to fill one sequence of training.seq_len \\+ 1 = 33 tokens"):
        drain(loader(path))


def test_bad_record_mid_run_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 1 (2 x 33 tokens) reads record 1 (69 tokens); step 2 needs record 2, which is null: the run stops
    with one line and status 2."""
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([GOOD[0], '{"text": null}', *GOOD[1:]]) + "\n")
    assert len(TOKENIZER.encode(json.loads(GOOD[0])["text"], bos=True, eos=True)) == 69
    caplog.set_level(logging.INFO, logger="kiln")
    argv = [*tiny_run_args("--model.n_layers", "1"), "--job.dump_folder", str(tmp_path), "--training.steps", "3"]
    assert train_entry.main([*argv, "--training.dataset_path", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kiln: error: data file {path}, record 2 (line 2): 'text' is null; every record needs a string 'text' field\n"
    )
    assert "step:  1 " in caplog.text and "step:  2 " not in caplog.text


# ============================================================================= 3. global sample order


def test_global_batch_is_the_same_for_every_layout(tmp_path: Path) -> None:
    """Step N's global batch (8 sequences) is the same whatever (DP degree, local batch); so is the state."""
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"doc {i} " + "w " * (5 + i % 17)}) for i in range(60)) + "\n")
    batches, states = {}, {}
    for world, batch in [(1, 8), (2, 4), (4, 2), (8, 1)]:
        loaders = [loader(path, rank=r, world=world, batch=batch, prefetch=r % 2 * 2) for r in range(world)]
        batches[world] = [torch.cat([next(dl)[0] for dl in loaders]) for _ in range(3)]
        states[world] = [dl.state_dict() for dl in loaders]
        for dl in loaders:
            dl.close()
    for world in (2, 4, 8):
        assert all(torch.equal(a, b) for a, b in zip(batches[1], batches[world], strict=True)), world
        assert all(s == states[1][0] for s in states[world]), world
    state = states[1][0]
    assert state["sequences"] == 24
    restored = torch.load(io.BytesIO(_saved(state)), weights_only=True)  # plain types only: no pickled objects
    assert restored == state


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ============================================================================= 4. resume compatibility (in-process)

SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, rope_theta=500000)
TINY = tiny_run_args("--training.deterministic")


@pytest.fixture
def small_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(LLAMA3_FLAVORS, "debugmodel", SMALL)


def run_trainer(dump: Path, *args: str) -> Trainer:
    trainer = Trainer(parse_args([*TINY, "--job.dump_folder", str(dump), *args]))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


CKPT = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "3", "--training.steps", "4")


def run_to_step_3(tmp_path: Path) -> None:
    """Train 4 steps (saves step-3 and step-4), then move step-4 out: kiln refuses a rollback in place, so a
    user resuming from step-3 with other settings first moves the later checkpoint aside."""
    run_trainer(tmp_path, *CKPT)
    (tmp_path / "checkpoint" / "step-4").rename(tmp_path / "step-4.moved")


def test_checkpoint_loader_and_settings_load_with_weights_only(tmp_path: Path, small_model: None) -> None:
    run_trainer(tmp_path, *CKPT)
    step = tmp_path / "checkpoint" / "step-3"
    md = read_metadata(str(step))
    items = {}
    for index, info in md.storage_data.items():
        if index.fqn.startswith(("dataloader.", "train_state.")):
            with open(step / info.relative_path, "rb") as f:
                f.seek(info.offset)
                items[index.fqn] = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    assert set(items) == {
        *("dataloader.sequences", "dataloader.epoch", "dataloader.shard", "dataloader.record", "dataloader.buffer"),
        *("train_state.step", "train_state.settings"),
    }
    assert items["dataloader.sequences"] == 6 and items["train_state.step"] == 3  # 3 steps x 2 sequences
    settings = json.loads(items["train_state.settings"])
    assert settings["training.steps"] == 4 and settings["training.seq_len"] == 32
    assert settings["data"]["files"] == [
        ["kiln_corpus.jsonl", os.path.getsize(ROOT / "assets/corpus/kiln_corpus.jsonl")]
    ]


def test_changed_steps_rebuild_the_lr_schedule_at_the_resumed_step(
    tmp_path: Path, small_model: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Saved at step 3 of 4 (the old schedule decays: lr factor 0.5 for step 4); resumed with 20 steps, step 4
    uses the 20-step schedule's lr (factor 1.0), and every later lr is that schedule's."""
    run_to_step_3(tmp_path)
    caplog.set_level(logging.WARNING, logger="kiln")
    resumed = Trainer(parse_args([*TINY, "--job.dump_folder", str(tmp_path), *CKPT[:3], "--training.steps", "20",
                                  "--checkpoint.load_step", "3"]))  # fmt: skip
    try:
        cfg = resumed.cfg
        sched = cfg.lr_scheduler

        def lr(step: int, total: int) -> float:
            decay = round((total - sched.warmup_steps) * sched.decay_ratio)
            return cfg.optimizer.lr * lr_factor(step, sched.warmup_steps, decay, total, "linear", 0.0)

        assert lr(3, 4) != lr(3, 20)
        assert resumed.step == 3 and resumed.optimizer.param_groups[0]["lr"] == lr(3, 20)
        assert "changed training.steps (4 there, 20 in this run)" in caplog.text
        resumed.train()  # 17 more steps: each logged lr is the 20-step schedule's
    finally:
        resumed.close()
    assert resumed.lr_scheduler.last_epoch == 20 and resumed.last_lr == lr(19, 20)


def test_changed_optimizer_settings_apply(tmp_path: Path, small_model: None, caplog: pytest.LogCaptureFixture) -> None:
    run_to_step_3(tmp_path)
    caplog.set_level(logging.WARNING, logger="kiln")
    args = [*TINY, "--job.dump_folder", str(tmp_path), *CKPT, "--checkpoint.load_step", "3"]
    resumed = Trainer(parse_args([*args, "--optimizer.weight_decay", "0.3", "--optimizer.beta2", "0.99"]))
    group = resumed.optimizer.param_groups[0]
    resumed.close()
    assert group["weight_decay"] == 0.3 and group["betas"] == (0.9, 0.99)  # the checkpoint held 0.1 and 0.95
    assert "changed optimizer.weight_decay (0.1 there, 0.3 in this run)" in caplog.text


@pytest.mark.parametrize("change", ["dataset_path", "seq_len"])
def test_refused_changes_exit_2_and_touch_nothing(
    tmp_path: Path, small_model: None, capsys: pytest.CaptureFixture, change: str
) -> None:
    run_trainer(tmp_path, *CKPT)
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(GOOD) + "\n")
    extra = ["--training.dataset_path", str(other)] if change == "dataset_path" else ["--training.seq_len", "64"]
    (tmp_path / "checkpoint" / "step-9.tmp").mkdir()  # a stale temp folder: a refused run deletes nothing
    before = sorted(str(p) for p in (tmp_path / "checkpoint").rglob("*"))
    assert train_entry.main([*TINY, "--job.dump_folder", str(tmp_path), *CKPT, *extra]) == 2
    err = capsys.readouterr().err
    step = tmp_path / "checkpoint" / "step-4"
    want = {
        "dataset_path": f"kiln: error: checkpoint {step} was saved with other data (files: ",
        "seq_len": f"kiln: error: checkpoint {step} was saved with other training.seq_len (32 there, 64 in this run): "
        "its data position counts sequences of the saved length",
    }[change]
    assert err.count("\n") == 1 and err.startswith(want), err
    assert sorted(str(p) for p in (tmp_path / "checkpoint").rglob("*")) == before


def test_moved_data_resumes(tmp_path: Path, small_model: None) -> None:
    """The data's identity is its files' names and sizes, not its folder: a moved copy resumes."""
    run_to_step_3(tmp_path)
    moved = tmp_path / "moved" / "kiln_corpus.jsonl"
    moved.parent.mkdir()
    shutil.copy(ROOT / "assets" / "corpus" / "kiln_corpus.jsonl", moved)
    args = [*TINY, "--job.dump_folder", str(tmp_path), *CKPT, "--checkpoint.load_step", "3"]
    resumed = Trainer(parse_args([*args, "--training.dataset_path", str(moved)]))
    resumed.close()
    assert resumed.step == 3 and resumed.dataloader.state_dict()["sequences"] == 6


def test_check_resume_table() -> None:
    """Each row of docs/checkpoint.md's table: refused keys raise, handled and warned keys warn."""
    model = {**{f.name: f.default for f in dataclasses.fields(ModelArgs)}, "dim": 64}  # as a run records it
    base = {
        "data": {"files": [["a.jsonl", 10]]},
        "model.tokenizer": "abc",
        "training.seq_len": 32,
        "model": model,
        "training.steps": 10,
        "lr_scheduler": {"warmup_steps": 2},
        "optimizer.name": "AdamW",
        **{f"optimizer.{k}": 0.1 for k in ("lr", "beta1", "beta2", "eps", "weight_decay")},
        "training.global_batch_size": 8,
        "float8": {"enable_float8_linear": False},
        "training.mixed_precision_param": "float32",
    }
    assert check_resume(base, dict(base), "ckpt") == []
    for key, new in [("data", {"hub": "allenai/c4/en"}), ("model.tokenizer", "abd"), ("training.seq_len", 64),
                     ("model", {**model, "rope_theta": 1.0})]:  # fmt: skip
        with pytest.raises(CheckpointError, match=f"ckpt was saved with other {key} "):
            check_resume(base, {**base, key: new}, "ckpt")
    for key, new in [("training.steps", 20), ("lr_scheduler", {"warmup_steps": 5}), ("optimizer.eps", 0.2),
                     ("training.global_batch_size", 16), ("float8", {"enable_float8_linear": True}),
                     ("training.mixed_precision_param", "bfloat16")]:  # fmt: skip
        warnings = check_resume(base, {**base, key: new}, "ckpt")
        assert len(warnings) == 1 and f"changed {key} " in warnings[0], key


def test_changed_global_batch_continues_at_the_saved_sequence(tmp_path: Path, small_model: None) -> None:
    run_to_step_3(tmp_path)
    args = [*TINY, "--job.dump_folder", str(tmp_path), *CKPT, "--checkpoint.load_step", "3"]
    resumed = Trainer(parse_args([*args, "--training.local_batch_size", "4"]))
    resumed.close()
    assert resumed.dataloader.state_dict()["sequences"] == 6  # 3 steps x 2: the data goes on from there


# ============================================================================= 5. preemption: the stop agreement


def _stop_agreement(signalled_rank: int) -> bool:
    stop = StopOnSignal()
    if dist.get_rank() == signalled_rank:
        stop.received = signal.SIGTERM
    return stop.agreed()


@pytest.mark.distributed
def test_all_ranks_agree_to_stop_when_one_got_sigterm() -> None:
    assert run_distributed(_stop_agreement, 2, 1) == [True, True]
    assert run_distributed(_stop_agreement, 2, -1) == [False, False]


def test_sigterm_handler_is_scoped() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.agreed()
    assert signal.getsignal(signal.SIGTERM) == before


# ============================================================================= 6. whole runs: curve, elastic, SIGTERM

# The debug model with 2 layers, fp32, deterministic; 6 steps of 4 sequences of 32 tokens. Every run starts from the
# same weights-only checkpoint (step-0): FSDP initialises each shard from its own RNG stream, so a fresh 2-rank
# initialisation differs from the 1-rank one; from the same weights the curves must agree.
RUN = tiny_run_args("--training.deterministic", "--model.n_layers", "2", "--training.steps", "6",
                    "--checkpoint.enable_checkpoint")  # fmt: skip
ONE_RANK = ("--training.local_batch_size", "4")
TWO_RANKS = ("--training.local_batch_size", "2")
TIMEOUT = 600


def command(out: Path, dump: Path, args: tuple[str, ...], nproc: int) -> list[str]:
    launch = [sys.executable, DRIVER] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", DRIVER,
    ]  # fmt: skip
    layout = ONE_RANK if nproc == 1 else TWO_RANKS
    return [*launch, str(out), *RUN, *layout, "--job.dump_folder", str(dump), *args]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(TIMEOUT)}


def drive(dump: Path, *args: str, nproc: int = 1) -> dict[str, Any]:
    """Run to the end; return {'first_step', 'losses'} of rank 0 (exact floats)."""
    out = dump.with_suffix(".json")
    proc = subprocess.run(command(out, dump, args, nproc), env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    (dump.parent / f"{dump.name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def with_init(init: Path, dump: Path, step: Path | None = None) -> Path:
    """dump/checkpoint holding the initial weights (or a copy of checkpoint `step`)."""
    source = step if step is not None else init / "step-0"
    shutil.copytree(source, dump / "checkpoint" / source.name)
    return dump


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=TOKENIZER.n_words, n_layers=2, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=str(root / "init" / "step-0"))
    return root


@pytest.fixture(scope="module")
def straight_one(runs: Path) -> dict[str, Any]:
    """1 rank, local batch 4, checkpoints at steps 2, 4, 6."""
    return drive(with_init(runs / "init", runs / "one"), "--checkpoint.interval", "2")


@pytest.fixture(scope="module")
def straight_two(runs: Path) -> dict[str, Any]:
    """FSDP on 2 ranks, local batch 2: the same global batches."""
    return drive(with_init(runs / "init", runs / "two"), "--checkpoint.interval", "100", nproc=2)


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_two_ranks_follow_the_one_rank_curve(straight_one: dict, straight_two: dict) -> None:
    assert straight_one["first_step"] == straight_two["first_step"] == 1
    print("1 rank :", straight_one["losses"], "\n2 ranks:", straight_two["losses"])
    assert max_rel_diff(straight_one["losses"], straight_two["losses"]) < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
def test_elastic_resume_one_two_one_continues_the_curve(runs: Path, straight_one: dict) -> None:
    """step-2 of the 1-rank run resumes on 2 ranks (steps 3-6, saving step-4), whose step-4 resumes on 1 rank."""
    two = drive(with_init(runs / "init", runs / "e2", runs / "one" / "checkpoint" / "step-2"),
                "--checkpoint.interval", "2", nproc=2)  # fmt: skip
    one = drive(with_init(runs / "init", runs / "e1", runs / "e2" / "checkpoint" / "step-4"))
    assert two["first_step"] == 3 and one["first_step"] == 5
    print("straight:", straight_one["losses"][2:], "\n2 ranks :", two["losses"], "\n1 rank  :", one["losses"])
    assert max_rel_diff(two["losses"], straight_one["losses"][2:]) < 1e-5
    assert max_rel_diff(one["losses"], straight_one["losses"][4:]) < 1e-5


class Run:
    """A run in the background whose stdout lines can be awaited (no sleeps: the verdict never depends on timing)."""

    def __init__(self, dump: Path, *args: str, nproc: int = 1) -> None:
        self.out = dump.with_suffix(".json")
        self.proc = subprocess.Popen(
            command(self.out, dump, args, nproc), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    @staticmethod
    def _pump(stream: Any, lines: queue.Queue) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    def wait_for(self, text: str) -> None:
        while True:
            line = self.lines.get(timeout=TIMEOUT)
            assert line is not None, f"exited before printing {text!r}: {''.join(self.stderr)[-3000:]}"
            self.stdout.append(line)
            if text in line:
                return

    def finish(self) -> int:
        rc = self.proc.wait(timeout=TIMEOUT)
        while (line := self.lines.get(timeout=TIMEOUT)) is not None:
            self.stdout.append(line)
        return rc


def stop_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kiln:")]


@pytest.mark.slow
def test_sigterm_one_rank_saves_exits_143_and_resumes_exactly(runs: Path, straight_one: dict) -> None:
    dump = with_init(runs / "init", runs / "term1")
    run = Run(dump, "--checkpoint.interval", "100")
    run.wait_for("step:  1 ")
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 143
    (line,) = stop_lines("".join(run.stderr))
    stopped = json.loads(run.out.read_text())
    k = stopped["first_step"] + len(stopped["losses"]) - 1  # the last step it trained
    assert 1 <= k < 6
    step = dump / "checkpoint" / f"step-{k}"
    assert line == f"kiln: stopped by SIGTERM after step {k} of 6; saved {step}; run the same command again to resume"
    assert "Traceback" not in "".join(run.stderr)
    assert json.loads((step / "kiln.json").read_text())["model_weights_only"] is False
    resumed = drive(dump, "--checkpoint.interval", "100")
    print(f"stopped after step {k}; resumed:", resumed["losses"], "straight:", straight_one["losses"][k:])
    assert resumed["first_step"] == k + 1 and resumed["losses"] == straight_one["losses"][k:]  # exact


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_torchrun_two_ranks_saves_and_resumes_exactly(runs: Path, straight_two: dict) -> None:
    """SIGTERM to torchrun (what Kubernetes sends to the container's process), which forwards it to the ranks."""
    dump = with_init(runs / "init", runs / "term2")
    run = Run(dump, "--checkpoint.interval", "100", nproc=2)
    run.wait_for("step:  1 ")
    run.proc.send_signal(signal.SIGTERM)
    run.finish()  # torchrun's own status after a signal is its business (1, with its SignalException)
    lines = stop_lines("".join(run.stderr))
    stopped = json.loads(run.out.read_text())
    k = stopped["first_step"] + len(stopped["losses"]) - 1
    assert 1 <= k < 6
    step = dump / "checkpoint" / f"step-{k}"
    want = f"kiln: stopped by SIGTERM after step {k} of 6; saved {step}; run the same command again to resume"
    assert lines == [want, want]  # both ranks stopped after the same step
    resumed = drive(dump, "--checkpoint.interval", "100", nproc=2)
    print(f"stopped after step {k}; resumed:", resumed["losses"], "straight:", straight_two["losses"][k:])
    assert resumed["first_step"] == k + 1 and resumed["losses"] == straight_two["losses"][k:]  # exact


@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line(tmp_path: Path) -> None:
    run = Run(tmp_path / "int", "--checkpoint.interval", "100")
    run.wait_for("step:  1 ")
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130
    stderr = "".join(run.stderr)
    assert "Traceback" not in stderr
    (line,) = stop_lines(stderr)
    assert line.startswith("kiln: interrupted by SIGINT (Ctrl-C) at step ")
    assert line.endswith("; nothing saved since the last checkpoint")
