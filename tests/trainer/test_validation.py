"""Validation ([validation], trainer/evaluation/validate.py): it never touches training, it is deterministic, it
shows in the step log and TensorBoard, and a short validation set ends cleanly.

The runs are shared: the tiny fp32 debug model (2 layers), 6 steps, with validation off, every 2 steps and every 4
steps, and the every-2 run again interrupted at step 3 and resumed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import train
from kiln_base.config import Validation
from kiln_base.errors import ConfigError
from tests.helpers.common import TOKENIZER_PATH, kiln_log_lines, open_trainer, tiny_run_args
from trainer.components.tokenizer import load_tokenizer
from trainer.data.sources import DATASETS, check_data_source
from trainer.evaluation.validate import ValidationResult

STEPS = 6
VAL = ("--validation.enable", "--validation.steps", "3")


def _run(dump: Path, *extra: str) -> dict[str, Any]:
    """Train the tiny run to STEPS with `extra`; what a comparison needs: logged losses (every step), step lines,
    validation losses by step, final weights, data position and RNG state."""
    argv = tiny_run_args(
        *("--job.dump_folder", str(dump), "--training.steps", str(STEPS), "--metrics.log_freq", "1"),
        *("--training.seed", "0", "--training.data_prefetch", "0", "--model.n_layers", "2"),
        *extra,
    )
    with kiln_log_lines() as lines:
        with open_trainer(argv) as trainer:
            trainer.train()
            out = {
                "losses": list(trainer.losses),
                "val": dict(trainer.validator.losses) if trainer.validator is not None else {},
                "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                "data": trainer.dataloader.state_dict(),
                "rng": torch.get_rng_state(),
                "step_lines": [line for line in lines.lines if line.startswith("step:")],
                "warnings": [line for line in lines.lines if line.startswith("validation:")],
            }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("validation")
    ckpt = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "3")
    out = {
        "off": _run(root / "off"),
        "freq2": _run(root / "freq2", *VAL, "--validation.freq", "2", "--metrics.enable_tensorboard"),
        "freq4": _run(root / "freq4", *VAL, "--validation.freq", "4"),
    }
    # Interrupted after step 3 (a checkpoint), then resumed to STEPS with the same command.
    first = tiny_run_args("--job.dump_folder", str(root / "resumed"), "--training.steps", "3", "--training.seed", "0")
    first += ["--model.n_layers", "2", "--training.data_prefetch", "0", "--metrics.log_freq", "1"]
    with open_trainer([*first, *VAL, "--validation.freq", "2", *ckpt]) as t:
        t.train()
        out["resumed_first"] = {"losses": list(t.losses), "val": dict(t.validator.losses)}
    out["resumed"] = _run(root / "resumed", *VAL, "--validation.freq", "2", *ckpt)
    out["tb"] = {"dir": str(root / "freq2" / "tb" / "rank_0")}
    return out


def test_validation_never_touches_training(runs: dict[str, dict[str, Any]]) -> None:
    """Training losses, final weights, the data position and the RNG state are bitwise those of the run without
    validation, validating every 2 or every 4 steps."""
    off = runs["off"]
    for name in ("freq2", "freq4"):
        on = runs[name]
        assert on["losses"] == off["losses"], name
        assert on["data"] == off["data"], name
        assert torch.equal(on["rng"], off["rng"]), name
        assert all(torch.equal(on["weights"][k], w) for k, w in off["weights"].items()), name


def test_resume_with_validation_is_the_uninterrupted_run(runs: dict[str, dict[str, Any]]) -> None:
    """Steps 4-6 resumed from the step-3 checkpoint of a validating run: the losses of the run that never stopped
    and never validated, and the validation losses of the validating run at the same steps."""
    first, resumed, off, freq2 = runs["resumed_first"], runs["resumed"], runs["off"], runs["freq2"]
    assert first["losses"] + resumed["losses"] == off["losses"]
    assert {**first["val"], **resumed["val"]} == freq2["val"]
    assert sorted(resumed["val"]) == [4, 6]  # step 1 and multiples of freq, counted from the run's start


def test_validation_is_deterministic_across_freq(runs: dict[str, dict[str, Any]]) -> None:
    """Every validation reads the set from its start: the same loss at the same step whatever the frequency."""
    v2, v4 = runs["freq2"]["val"], runs["freq4"]["val"]
    assert sorted(v2) == [1, 2, 4, 6] and sorted(v4) == [1, 4]  # torchtitan's rule: step 1 and multiples of freq
    assert v4 == {1: v2[1], 4: v2[4]}
    assert v2[6] < v2[1] - 0.05  # it measures learning: the held-out loss falls as training goes (8.08 -> 8.00)


def test_step_line_and_tensorboard_show_validation(runs: dict[str, dict[str, Any]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs["freq2"]
    shown = {int(line.split()[1]): line for line in run["step_lines"] if "val_loss:" in line}
    assert sorted(shown) == [1, 2, 4, 6]
    for step, line in shown.items():
        loss, ppl = float(line.split("val_loss:")[1].split()[0]), float(line.split("val_ppl:")[1].split()[0])
        assert loss == pytest.approx(run["val"][step], abs=5e-5) and ppl == pytest.approx(
            ValidationResult(run["val"][step], 1).perplexity, rel=1e-4
        )
    assert not any("val_loss" in line for line in run["step_lines"] if int(line.split()[1]) in (3, 5))
    events = EventAccumulator(runs["tb"]["dir"])
    events.Reload()
    val = {e.step: e.value for e in events.Scalars("kiln/val_loss")}
    assert val == pytest.approx(run["val"], abs=1e-6)
    assert [e.step for e in events.Scalars("kiln/val_ppl")] == [1, 2, 4, 6]


def test_bundled_validation_split_is_held_out() -> None:
    """The default validation set is the bundled corpus's held-out split: no record is in both files."""
    files = {name: DATASETS[name].path for name in ("kiln_corpus", "kiln_corpus_validation")}
    texts = {name: [json.loads(line)["text"] for line in open(path)] for name, path in files.items()}
    assert Validation().dataset == "kiln_corpus_validation" and len(texts["kiln_corpus_validation"]) == 496
    assert set(texts["kiln_corpus"]).isdisjoint(texts["kiln_corpus_validation"])


def test_unknown_validation_dataset_names_the_validation_key() -> None:
    with pytest.raises(ConfigError, match="validation.dataset: unknown dataset 'c5'; registered: .*validation"):
        check_data_source(Validation(enable=True, dataset="c5"))
    check_data_source(Validation(enable=True))


def _small_set(path: Path, records: int, words: int) -> tuple[str, int]:
    """A .jsonl of `records` records; its path and how many windows of the tiny run's seq 32 + 1 it packs into."""
    texts = [f"record {i} " + "word " * words for i in range(records)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = load_tokenizer(str(TOKENIZER_PATH))
    return str(path), sum(len(tokenizer.encode(t, bos=True, eos=True)) for t in texts) // 33


def test_short_validation_set_is_validated_whole_and_said_once(tmp_path: Path) -> None:
    """A set of a few batches with validation.steps 50: every validation reads it whole (the run goes on) and one
    warning says so."""
    data, windows = _small_set(tmp_path / "val.jsonl", 12, 30)
    val = ("--validation.enable", "--validation.freq", "2", "--validation.steps", "50")
    run = _run(tmp_path / "run", *val, "--validation.dataset_path", data)
    assert sorted(run["val"]) == [1, 2, 4, 6]
    (warning,) = run["warnings"]
    assert 2 <= windows // 2 < 50
    assert f"holds {windows // 2} batches of 2 sequences, fewer than validation.steps 50" in warning, warning


def test_validation_set_smaller_than_one_batch_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, windows = _small_set(tmp_path / "val.jsonl", 1, 20)
    assert windows == 1  # a batch is 2 windows
    argv = tiny_run_args("--job.dump_folder", str(tmp_path), "--training.steps", "2")
    assert train.main([*argv, "--validation.enable", "--validation.dataset_path", data]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kiln: error: validation.dataset_path {data} is too small for one validation batch"), line
