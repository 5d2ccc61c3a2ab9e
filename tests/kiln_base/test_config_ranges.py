"""Numeric ranges and config-file mistakes: every numeric key has a range that refuses the values just outside it
(each with a line naming key, range and value), and a config file that is no UTF-8 TOML, or gives a string for a
boolean or integer, is refused with a line naming the file; through train.py, one line and exit 2."""

from __future__ import annotations

import math
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from kiln_base.config import JobConfig, Range, parse_args
from kiln_base.errors import ConfigError
from tests.helpers.kiln_process import run_kiln


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


def toml_literal(value: Any) -> str:
    """`value` as TOML writes it (nan and inf are TOML floats)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf"
    return repr(value)


@pytest.mark.parametrize("path", ["command line", "TOML"])
@pytest.mark.parametrize("section,key,value", BAD_VALUES, ids=[f"{s}.{k}={v}" for s, k, v in BAD_VALUES])
def test_every_out_of_range_value_is_refused(section: str, key: str, value: Any, path: str, tmp_path: Path) -> None:
    """The same line whichever way the value comes: the command line, or the TOML file."""
    argv = [f"--{section}.{key}", str(value)]
    if path == "TOML":
        (tmp_path / "c.toml").write_text(f"[{section}]\n{key} = {toml_literal(value)}\n")
        argv = ["--job.config_file", str(tmp_path / "c.toml")]
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
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
    proc = run_kiln([*args, "--job.print_config"], launcher="python", timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(message), proc.stderr


def test_bool_string_in_toml_exits_2_through_train_py(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[training]\ncompile = "yes"\n')
    proc = run_kiln(["--job.config_file", path, "--job.print_config"], launcher="python", timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "training.compile: expected a TOML boolean" in proc.stderr
