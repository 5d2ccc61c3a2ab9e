"""The model-shape checks (issue 36, hole 5): every field of every source in type and range before anything
computes with it, the memory estimate against the machine, and the launcher running them before torchrun (the
dry run still plans any size)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train as train_entry
from kiln_base.config import (
    MODEL_FIELDS,
    TRAINING_BYTES_PER_PARAM,
    check_model_fields,
    check_model_memory,
    model_params,
)
from kiln_base.errors import ConfigError
from models import LLAMA3_FLAVORS, ModelArgs, Transformer, num_params
from models.args import stored_model_args
from tests.helpers.common import HANG_TIMEOUT_S, ROOT, tiny_run_args


def test_every_model_field_has_a_type_and_range() -> None:
    assert set(MODEL_FIELDS) == {f.name for f in dataclasses.fields(ModelArgs)}
    for name, args in LLAMA3_FLAVORS.items():
        args = dataclasses.replace(args, vocab_size=128256)
        args.check_fields(f"flavor {name}")  # every shipped flavor passes


BAD_FIELDS = [
    ("n_heads", 0, "model n_heads must be in [1, 2147483647], got 0"),
    ("n_kv_heads", -16, "model n_kv_heads must be in [1, 2147483647], got -16"),
    ("dim", 2**31, "model dim must be in [1, 2147483647], got 2147483648"),
    ("n_layers", True, "model n_layers must be an int, got True"),
    ("vocab_size", "2256", "model vocab_size must be an int, got '2256'"),
    ("multiple_of", [256], "model multiple_of must be an int, got [256]"),
    ("norm_eps", math.nan, "model norm_eps must be in (0, 1], got nan"),
    ("rope_theta", -1.0, "model rope_theta must be a finite number > 0, got -1.0"),
    ("ffn_dim_multiplier", 0.0, "model ffn_dim_multiplier must be in (0, 1000000], got 0.0"),
    ("rope_scaling", 1, "model rope_scaling must be a bool, got 1"),
    ("context_len", None, "model context_len must be an int, got None"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_FIELDS, ids=[f[0] for f in BAD_FIELDS])
def test_a_field_out_of_type_or_range_is_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_model_fields({field: value}, "somewhere")
    assert str(refused.value) == f"somewhere: {message}"


def test_rope_scaling_factors_must_not_divide_by_zero() -> None:
    with pytest.raises(ConfigError, match="rope_high_freq_factor > rope_low_freq_factor"):
        check_model_fields({"rope_scaling": True, "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 4.0}, "x")


def test_stored_model_args_refuse_what_kiln_json_may_hold() -> None:
    good = dataclasses.asdict(dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=2256))
    assert stored_model_args(good, "kiln.json") == ModelArgs(**good)
    with pytest.raises(ConfigError, match="kiln.json: model n_heads must be"):
        stored_model_args({**good, "n_heads": 0}, "kiln.json")
    with pytest.raises(ConfigError, match="has model_args.evil, unknown to this kiln"):
        stored_model_args({**good, "evil": 1}, "kiln.json")
    with pytest.raises(ConfigError, match="stores no model_args"):
        stored_model_args([1, 2], "kiln.json")


@pytest.mark.parametrize("flavor", ["debugmodel", "3.2-1B", "8B"])
def test_model_params_counts_what_the_model_builds(flavor: str) -> None:
    args = dataclasses.replace(LLAMA3_FLAVORS[flavor], vocab_size=128256 if flavor != "debugmodel" else 2256)
    with torch.device("meta"):
        model = Transformer(args)
    assert model_params(args.shape()) == num_params(model)


def test_memory_check_refuses_what_the_machine_cannot_hold() -> None:
    shape = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=2256).shape()
    need = model_params(shape) * TRAINING_BYTES_PER_PARAM
    check_model_memory(shape, 1, 0, 1, 1, need, "the test's memory")  # exactly fits
    with pytest.raises(ConfigError, match=r"needs at least .* more than the test's memory"):
        check_model_memory(shape, 1, 0, 1, 1, need - 1, "the test's memory")
    check_model_memory(shape, 2, 0, 1, 2, need, "x")  # two ranks of half the model each
    with pytest.raises(ConfigError, match=r"GiB of logits"):
        check_model_memory(shape, 1, 10**6, 1, 1, need + 10**6, "x")  # 10**6 tokens x vocab x 8 bytes


# ----------------------------------------------------------------------------- before any rank builds


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--model.n_layers", "1000000"), "needs at least 12,703.0 GiB"),
        (("--model.dim", "2147483648"), "model dim must be in [1, 2147483647], got 2147483648"),
        (("--model.vocab_size", "100000000", "--model.dim", "4096"), "more than this machine's RAM"),
    ],
)
def test_the_launchers_check_refuses_a_model_before_torchrun(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: tuple[str, ...], needle: str
) -> None:
    capsys.readouterr()
    assert train_entry.check_config(tiny_run_args("--job.dump_folder", str(tmp_path), *args), world_size=1) is None
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kiln: error: ") and needle in err, err


def test_a_dry_run_still_plans_a_model_no_machine_here_holds(tmp_path: Path) -> None:
    """~100 GiB of training state: refused at start (above), planned by --job.dry_run with the estimate printed."""
    big = ("--model.dim", "16384", "--model.n_heads", "128", "--model.n_layers", "2", "--model.vocab_size", "128256")
    assert train_entry.check_config(tiny_run_args("--job.dump_folder", str(tmp_path), *big), world_size=1) is None
    proc = subprocess.run(
        [sys.executable, "train.py", *tiny_run_args("--job.dump_folder", str(tmp_path), *big, "--job.dry_run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "start-up check (not applied to a dry run)" in proc.stdout and "nothing was allocated" in proc.stdout
