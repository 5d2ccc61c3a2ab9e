"""Token-data mistakes through run_train.sh, each one line (exit 2) before any step: negative ids behind a stats
sidecar, a folder of token files and text, a source given twice, an empty dataset_path (the launcher's check, on 1
and 2 ranks); a mix source replaced under a checkpoint, and a switch between text data and token files on resume
(a rank's load)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.common import tiny_run_args
from tests.helpers.kiln_process import assert_one_line_error, run_kiln
from tests.helpers.megatron_data import corpus_documents
from tests.helpers.scripts import load_script
from trainer.data.token_files import write_index


def _pair(prefix: Path, first: int = 0, dtype: type = np.uint16) -> Path:
    """prefix.bin/.idx of 100 corpus documents from `first` on (no stats sidecar)."""
    docs = corpus_documents(limit=first + 100)[first:]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    np.concatenate([np.array(d, dtype=dtype) for d in docs]).tofile(f"{prefix}.bin")
    write_index(f"{prefix}.idx", np.dtype(dtype), np.array([len(d) for d in docs]))
    return prefix


def _padded(d: Path) -> list[str]:
    """int32 tokens with -1 padding (as some pipelines write), its sidecar made by tokenize_data.py --stats."""
    prefix = _pair(d / "pad", dtype=np.int32)
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.int32)
    tokens[1000:1100] = -1
    tokens.tofile(f"{prefix}.bin")
    assert load_script("tokenize_data").main(["--stats", f"{prefix}.bin"]) == 0
    return ["--training.dataset_path", str(prefix)]


def _mixed_folder(d: Path) -> list[str]:
    _pair(d / "data" / "web")
    shutil.copy(
        Path(__file__).parents[2] / "assets" / "corpus" / "kiln_corpus_validation.jsonl", d / "data" / "x.jsonl"
    )
    return ["--training.dataset_path", str(d / "data")]


def _twice(d: Path) -> list[str]:
    web = _pair(d / "web")
    return ["--training.dataset_mix", f"{web}:0.5,{web}.bin:0.5"]


CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "negative ids": (_padded, "pad.bin: holds token id -1, outside the tokenizer's vocabulary"),
    "text beside token files": (_mixed_folder, "data: holds token files (web.idx, 1 in all) and text files (x.jsonl"),
    "a source twice": (_twice, "training.dataset_mix[1].path: "),
    "empty dataset_path": (lambda d: ["--training.dataset_path", ""], "--training.dataset_path is empty"),
}


@pytest.mark.parametrize("ngpu", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_a_token_data_mistake_is_one_line_before_any_rank(tmp_path: Path, case: str, ngpu: int) -> None:
    make, needle = CASES[case]
    proc = run_kiln([*tiny_run_args("--training.steps", "1"), *make(tmp_path)], ngpu=ngpu)
    line = assert_one_line_error(proc, needle)
    assert "step:" not in proc.stdout, line


def _run(tmp_path: Path, *extra: str) -> list[str]:
    return tiny_run_args("--model.n_layers", "1", "--training.steps", "2", "--job.dump_folder", str(tmp_path / "run"),
                         "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", *extra)  # fmt: skip


@pytest.mark.slow  # trains 2 steps, then starts a rank for each resume
def test_a_replaced_source_of_a_mix_is_refused_on_resume_naming_it(tmp_path: Path) -> None:
    """wiki/train and books/train (two sources of one file name): replacing wiki/train's files under the
    checkpoint is other data, named (it resumed silently when sources were keyed by their base name)."""
    wiki, books = _pair(tmp_path / "wiki" / "train"), _pair(tmp_path / "books" / "train", first=100)
    mix = ("--training.dataset_mix", f"{wiki}:0.5,{books}:0.5")
    run_kiln(_run(tmp_path, *mix), ngpu=1, check=True)
    _pair(tmp_path / "wiki" / "train", first=200)
    refused = run_kiln([*_run(tmp_path, *mix), "--training.steps", "3"], ngpu=1)
    assert_one_line_error(refused, "other data (token_sources: wiki/train: files: train.bin: ",
                          "training.allow_data_change")  # fmt: skip


@pytest.mark.slow  # trains 2 steps, then starts 2 ranks
def test_a_text_checkpoint_resumed_on_token_files_says_the_switch_is_not_supported(tmp_path: Path) -> None:
    run_kiln(_run(tmp_path), ngpu=1, check=True)  # the bundled corpus: the text path
    step = tmp_path / "run" / "checkpoint" / "step-2"
    tokens = ("--training.dataset_path", str(_pair(tmp_path / "d")), "--training.steps", "3")
    for extra in ((), ("--training.allow_data_change",)):
        proc = run_kiln([*_run(tmp_path), *tokens, *extra], ngpu=2)
        assert_one_line_error(
            proc,
            f"checkpoint {step} was saved training on text data and this run trains on token files: switching a "
            "run between text data and token files is not supported on resume; start a new checkpoint.folder (with "
            f"checkpoint.initial_load_path {step} to start from its weights)",
        )
