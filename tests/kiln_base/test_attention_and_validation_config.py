"""The document-masked flavors and the [validation] section as config: torchtitan's names and keys honoured, and
the rules (varlen needs CUDA, validation's sequences split over TP ranks, a validation dataset found)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kiln_base.config import (
    FLAVORS,
    ModelShape,
    Validation,
    check_config_alone,
    check_parallel_plan,
    check_world,
    parse_args,
)
from kiln_base.errors import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "torchtitan"
TORCHTITAN_FLAVORS = ("debugmodel_flex_attn", "debugmodel_varlen_attn", "8B_flex", "8B_varlen")  # v0.2.1+


def test_torchtitan_flavor_names_parse() -> None:
    assert set(TORCHTITAN_FLAVORS) <= set(FLAVORS)
    for flavor in TORCHTITAN_FLAVORS:
        assert parse_args(["--model.flavor", flavor, "--job.dry_run"]).model.flavor == flavor


def test_torchtitan_validation_section_is_honoured() -> None:
    """torchtitan's v0.2.2 debug file with validation turned on: its [validation] keys, as they mean there."""
    cfg = parse_args(["--job.config_file", str(FIXTURES / "v0.2.2" / "debug_model.toml"), "--validation.enable"])
    v = cfg.validation
    assert (v.enable, v.dataset, v.freq, v.steps) == (True, "c4_validation", 5, 10)
    assert (v.local_batch_size, v.seq_len, v.dataset_path) == (None, None, None)  # unset: training's


def test_varlen_needs_cuda() -> None:
    cfg = parse_args(["--model.flavor", "8B_varlen", "--job.dry_run"])
    shape = ModelShape(4096, 32, 32, 8, 14336, 128256, "varlen")  # 8B's
    check_parallel_plan(cfg, shape, "cuda")
    with pytest.raises(ConfigError) as e:
        check_parallel_plan(cfg, shape, "cpu")
    assert str(e.value) == (
        "model.flavor 8B_varlen: varlen attention runs flash attention's variable-length kernel, which needs CUDA; "
        "this run is on cpu: use model.flavor 8B_flex (the same document mask, through flex attention)"
    )
    fp32 = parse_args(["--model.flavor", "8B_varlen", "--training.mixed_precision_param", "float32", "--job.dry_run"])
    with pytest.raises(ConfigError, match="varlen attention .flash attention. computes in bfloat16 or float16"):
        check_parallel_plan(fp32, shape, "cuda")
    flex = dataclasses.replace(shape, attn_type="flex")
    check_parallel_plan(parse_args(["--model.flavor", "8B_flex", "--job.dry_run"]), flex, "cpu")


def test_validation_sequences_must_split_over_tp_ranks() -> None:
    args = ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64", "--job.dry_run"]
    check_world(parse_args([*args, "--validation.enable", "--validation.seq_len", "32"]), 2)
    check_world(parse_args([*args, "--validation.seq_len", "33"]), 2)  # off: not read
    with pytest.raises(ConfigError, match=r"validation.seq_len \(33\) must be divisible by tensor_parallel_degree"):
        check_world(parse_args([*args, "--validation.enable", "--validation.seq_len", "33"]), 2)


def test_validation_dataset_mistakes_name_the_validation_keys(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=f"validation.dataset_path: not found: {missing}"):
        parse_args(["--validation.enable", "--validation.dataset_path", missing])
    parse_args(["--validation.dataset_path", missing])  # validation off: the key is not read
    assert Validation().dataset == "kiln_corpus_validation"
    cfg = parse_args(["--validation.enable", "--validation.steps", "-1"])
    check_config_alone(cfg)
    with pytest.raises(ConfigError, match=r"validation.steps must be -1 or >= 1 \(-1 = the whole validation set\)"):
        parse_args(["--validation.steps", "0"])
