"""torchtitan's TOML files and flags run as they are (kiln_base/config/torchtitan_compat.py).

The fixtures under tests/fixtures/torchtitan/ are torchtitan's own Llama 3 configs of every TOML release
(v0.1.0 .. v0.2.2) and the key list of each release's JobConfig, copied from the torchtitan repository by
tests/fixtures/torchtitan/refresh.py: the outside thing these tests check against.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest

import train
from kiln_base.config import JobConfig, Model, Validation, parse_args, resolve_input_path
from kiln_base.config.torchtitan_compat import KILN_TOKENIZER, ROWS, ROWS_LIST, Honour, Ignore, Map, markdown_table
from kiln_base.errors import ConfigError
from tests.helpers.common import ROOT
from tests.helpers.kiln_process import run_kiln

FIXTURES = ROOT / "tests" / "fixtures" / "torchtitan"
RELEASES = ("v0.1.0", "v0.2.0", "v0.2.1", "v0.2.2")
CONFIGS = ("debug_model", "llama3_8b", "llama3_70b", "llama3_405b")
TT_KEYS: dict[str, dict[str, Any]] = json.loads((FIXTURES / "job_config_keys.json").read_text())["keys"]
DOC = ROOT / "docs" / "migrating-from-torchtitan.md"


def fixture(release: str, name: str) -> str:
    return str(FIXTURES / release / f"{name}.toml")


def kiln_keys() -> set[str]:
    cfg = JobConfig()
    return {f"{s.name}.{f.name}" for s in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, s.name))}


def get(cfg: JobConfig, name: str) -> Any:
    section, key = name.split(".")
    return getattr(getattr(cfg, section), key)


# ----------------------------------------------------------------------------- the table against torchtitan


def test_table_has_every_torchtitan_key_with_its_releases() -> None:
    assert len(TT_KEYS) == len(ROWS) == 175
    assert sorted(ROWS) == sorted(TT_KEYS)
    wrong = {name: (row.releases, TT_KEYS[name]["releases"]) for name, row in ROWS.items()}
    assert {n: r for n, r in wrong.items() if list(r[0]) != r[1]} == {}


def test_honoured_rows_are_kiln_keys_and_only_they() -> None:
    kiln = kiln_keys()
    for row in ROWS_LIST:
        if isinstance(row.action, Honour):
            assert row.name in kiln, f"{row.name} is honoured but kiln has no such key"
        elif row.name in kiln:  # a row on a kiln key may only rewrite its value, never ignore kiln's key
            assert isinstance(row.action, Map), row.name


def _toml(values: dict[str, Any]) -> str:
    """A TOML file of dotted names -> values ([a.b] tables for nested sections); None (no TOML null) left out."""
    tables: dict[str, list[str]] = {}
    for name, value in values.items():
        if value is not None:
            table, _, key = name.rpartition(".")
            tables.setdefault(table, []).append(f"{key} = {json.dumps(value)}")
    return "".join(f"[{table}]\n" + "\n".join(lines) + "\n\n" for table, lines in tables.items())


@pytest.mark.parametrize("release", RELEASES)
def test_a_file_spelling_out_every_torchtitan_default_runs(release: str, tmp_path: Path) -> None:
    """torchtitan's default of every key of the release is accepted, and each mapped default lands on a kiln key
    (a file like the one torchtitan's --job.save_config_file writes)."""
    defaults = {name: k["defaults"][release] for name, k in TT_KEYS.items() if release in k["releases"]}
    defaults.pop("job.config_file")
    path = tmp_path / "all_defaults.toml"
    path.write_text(_toml(defaults))
    cfg = parse_args(["--job.config_file", str(path), "--job.dry_run"])
    assert cfg.training.dataset == "kiln_corpus" and not cfg.float8.enable_float8_linear


def _effective_default_differences() -> set[str]:
    """torchtitan keys whose default, as kiln reads it, differs from what kiln does when the key is absent."""
    kiln = JobConfig()
    differ = set()
    for name, row in ROWS.items():
        for default in TT_KEYS[name]["defaults"].values():
            if default is None or isinstance(row.action, Ignore):
                continue
            assigned = {name: default} if isinstance(row.action, Honour) else row.action.fn(default)
            if any(get(kiln, target) != value for target, value in assigned.items()):
                differ.add(name)
    return differ


def test_doc_lists_the_defaults_that_differ() -> None:
    section = DOC.read_text().split("## Defaults that differ")[1].split("\n## ")[0]
    differ = _effective_default_differences()
    assert {"checkpoint.keep_latest_k", "checkpoint.last_save_model_only", "float8.filter_fqns"} <= differ
    assert [name for name in sorted(differ) if f"`{name}`" not in section] == []


def test_doc_table_is_generated_from_the_code_table() -> None:
    text = DOC.read_text()
    table = text.split("from kiln_base/config/torchtitan_compat.py -->\n")[1].split("<!-- END generated table -->")[0]
    assert table == markdown_table(), "stale: run python scripts/torchtitan_keys_doc.py"
    assert table.count("\n| `") == len(ROWS)


# ----------------------------------------------------------------------------- torchtitan's own configs


@pytest.mark.parametrize(
    "release,name",
    [
        pytest.param(r, n, marks=[pytest.mark.slow] if n == "llama3_405b" else [], id=f"{r}-{n}")
        for r in RELEASES
        for n in CONFIGS
    ],
)
def test_torchtitan_config_dry_run_exits_0(release: str, name: str, capsys: pytest.CaptureFixture) -> None:
    assert train.main(["--job.config_file", fixture(release, name), "--job.dry_run"]) == 0
    out = capsys.readouterr().out
    flavor = {"debug_model": "debugmodel", "llama3_8b": "8B", "llama3_70b": "70B", "llama3_405b": "405B"}[name]
    assert f"kiln dry run: llama3 {flavor}," in out
    tp = 8 if name in ("llama3_70b", "llama3_405b") else 1
    assert f"x tp {tp}\n" in out
    if name == "llama3_405b":  # model.converters = ["float8"] + all-gather + precompute, as shipped
        assert "float8: 882/883 Linears converted (recipe tensorwise)" in out
    else:
        assert re.search(r"float8: 0/\d+ Linears converted", out)


def test_debug_configs_of_every_release_mean_the_same_run() -> None:
    """v0.1.0's names (lr_min, tokenizer_path, [float8], checkpoint.enable_checkpoint) and v0.2's (min_lr_factor,
    hf_assets_path, [quantize.linear.float8], checkpoint.enable, [compile]) resolve to one kiln config."""
    configs = [parse_args(["--job.config_file", fixture(r, "debug_model")]) for r in RELEASES]
    assert [c.parallelism.pipeline_parallel_schedule for c in configs] == ["1F1B", *["Interleaved1F1B"] * 3]
    for c in configs:
        c.job.config_file = None  # the one difference: the file's own path
        c.parallelism.pipeline_parallel_schedule = "1F1B"  # v0.2's names one, not read at pipeline degree 1
        assert not c.validation.enable  # v0.2's files add a [validation] section that is off
        c.validation = Validation()
    assert all(c == configs[0] for c in configs[1:])
    c = configs[0]
    assert (
        (c.training.dataset, c.model.tokenizer_path)
        == ("kiln_corpus", resolve_input_path(KILN_TOKENIZER))
        == ("kiln_corpus", resolve_input_path(Model().tokenizer_path))
    )
    assert (c.lr_scheduler.warmup_steps, c.lr_scheduler.decay_ratio, c.lr_scheduler.min_lr_factor) == (2, 0.8, 0.0)
    assert (c.float8.enable_float8_linear, c.float8.filter_fqns, c.training.compile) == (False, ["output"], False)


def test_v02_configs_map_checkpoint_compile_and_float8() -> None:
    cfg = parse_args(["--job.config_file", fixture("v0.2.2", "llama3_405b"), "--job.dry_run"])
    assert cfg.checkpoint.last_save_model_weights_only and not cfg.checkpoint.enable_checkpoint
    assert cfg.training.compile and cfg.parallelism.enable_async_tensor_parallel
    f8 = cfg.float8
    assert f8.enable_float8_linear and f8.enable_fsdp_float8_all_gather and f8.precompute_float8_dynamic_scale_for_fsdp
    assert cfg.model.tokenizer_path == resolve_input_path("./assets/hf/Llama-3.1-405B/original/tokenizer.model")


# ----------------------------------------------------------------------------- mappings, CLI and TOML

MAPPINGS = [
    (["--model.converters", "float8"], {"float8.enable_float8_linear": True}),
    (["--model.converters", "quantize.linear.float8"], {"float8.enable_float8_linear": True}),
    (["--model.converters", "float8", "--float8.recipe_name", "rowwise"], {"float8.recipe_name": "rowwise"}),
    (
        ["--model.converters=float8", "--quantize.linear.float8.recipe_name", "rowwise_with_gw_hp"],
        {"float8.enable_float8_linear": True, "float8.recipe_name": "rowwise_with_gw_hp"},
    ),
    (
        ["--model.converters", "float8", "--quantize.linear.float8.enable_fsdp_float8_all_gather"],
        {"float8.enable_fsdp_float8_all_gather": True},
    ),
    (["--quantize.linear.float8.filter_fqns", "output,w2"], {"float8.filter_fqns": ["output", "w2"]}),
    (["--lr_scheduler.lr_min", "0.1"], {"lr_scheduler.min_lr_factor": 0.1}),
    (["--checkpoint.enable"], {"checkpoint.enable_checkpoint": True}),
    (["--checkpoint.last_save_model_only=true"], {"checkpoint.last_save_model_weights_only": True}),
    (["--compile.enable"], {"training.compile": True}),
    (["--training.compile", "--compile.no-enable"], {"training.compile": False}),
    (["--debug.seed", "7", "--debug.deterministic"], {"training.seed": 7, "training.deterministic": True}),
    (["--training.dataset", "c4_test"], {"training.dataset": "kiln_corpus"}),
    (["--training.dataset", "c4"], {"training.dataset": "c4"}),
    (
        ["--model.hf_assets_path", "/m/Llama-3.1-8B/"],
        {"model.tokenizer_path": "/m/Llama-3.1-8B/original/tokenizer.model"},
    ),
    (
        ["--model.tokenizer_path", "./tests/assets/test_tiktoken.model"],
        {"model.tokenizer_path": resolve_input_path(KILN_TOKENIZER)},
    ),
    (["--comm.mode", "fake_backend"], {"job.dry_run": True}),
    (["--parallelism.pipeline_parallel_degree", "1", "--metrics.no-enable_wandb"], {}),
    (
        ["--parallelism.pipeline_parallel_schedule", "zbvzerobubble"],
        {"parallelism.pipeline_parallel_schedule": "ZBVZeroBubble"},
    ),
    (["--metrics.enable_wandb"], {"metrics.enable_wandb": True}),  # honoured (trainer/components/scalar_writers.py)
    (  # float8 on the experts: the grouped-GEMM converter beside the Linears', its fqns -> float8.moe_fqns
        [
            *("--model.converters", "quantize.linear.float8,quantize.grouped_mm.float8"),
            *("--quantize.linear.float8.recipe_name", "rowwise", "--quantize.grouped_mm.float8.fqns", "experts"),
        ],
        {"float8.enable_float8_linear": True, "float8.moe_fqns": ["experts"], "float8.recipe_name": "rowwise"},
    ),
]


@pytest.mark.parametrize("argv,expected", MAPPINGS, ids=[" ".join(a) for a, _ in MAPPINGS])
def test_cli_mapping_sets_kiln_key(argv: list[str], expected: dict[str, Any]) -> None:
    cfg = parse_args([*argv, "--job.dry_run"])
    assert {name: get(cfg, name) for name in expected} == expected


def test_toml_nested_quantize_table_and_cli_override(tmp_path: Path) -> None:
    path = tmp_path / "tt.toml"
    path.write_text('[model]\nconverters = ["float8"]\n[quantize.linear.float8]\nrecipe_name = "rowwise"\n')
    cfg = parse_args(["--job.config_file", str(path), "--job.dry_run"])
    assert cfg.float8.enable_float8_linear and cfg.float8.recipe_name == "rowwise"
    cfg = parse_args(
        ["--job.config_file", str(path), "--job.dry_run", "--quantize.linear.float8.recipe_name", "tensorwise"]
    )
    assert cfg.float8.recipe_name == "tensorwise"  # the command line wins, as for kiln's own keys


def test_each_translation_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tt.toml"
    path.write_text('[model]\nconverters = ["float8"]\n[parallelism]\nexpert_parallel_comm_backend = "standard"\n')
    with caplog.at_level(logging.INFO, logger="kiln"):
        parse_args(["--job.config_file", str(path), "--job.dry_run", "--model.converters", "float8"])
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count('torchtitan key model.converters = ["float8"] -> float8.enable_float8_linear = true') == 1
    assert [line for line in lines if "expert_parallel_comm_backend" in line] == [
        'torchtitan key parallelism.expert_parallel_comm_backend = "standard" ignored: torch\'s all-to-all'
    ]
    assert len(lines) == 2


# ----------------------------------------------------------------------------- refusals and unknown names

REFUSALS = [
    (
        ["--parallelism.pipeline_parallel_schedule_csv", "s.csv"],
        '--parallelism.pipeline_parallel_schedule_csv = "s.csv": schedules from a CSV file are not supported; '
        "choose parallelism.pipeline_parallel_schedule",
    ),
    (
        ["--parallelism.context_parallel_load_balancer", "ptrr"],
        '--parallelism.context_parallel_load_balancer = "ptrr": the per-token round-robin balancer serves',
    ),
    (["--parallelism.pipeline_parallel_schedule", "DualPipeV"], '"DualPipeV": DualPipeV overlaps expert-parallel'),
    (["--model.converters", "float8,mx"], '--model.converters = ["float8", "mx"]: converter \'mx\': MX (mxfp8)'),
    (["--model.converters", "quantize.grouped_mm.float8"], "without a Linear float8 converter: kiln's float8 on"),
    (["--model.converters", "float8,quantize.grouped_mm.mx"], "kiln runs MXFP8 on the experts as float8.recipe_name"),
    (["--training.dtype", "bfloat16"], '--training.dtype = "bfloat16": all-bfloat16 training is not supported'),
    (["--compile.components", "loss"], '--compile.components = ["loss"]: kiln compiles the model'),
    (["--comm.mode", "local_tensor"], '--comm.mode = "local_tensor": simulating ranks on one device'),
    (["--parallelism.expert_parallel_comm_backend", "deepep"], '"deepep": kiln\'s expert parallelism sends tokens'),
    (["--job.print_args"], "--job.print_args = true: kiln has --job.print_config"),
    (["--quantize.linear.float8.recipe_name", "rowwize"], "'rowwize' is not a valid choice; choose from tensorwise"),
    (["--parallelism.pipeline_parallel_degree", "four"], "--parallelism.pipeline_parallel_degree: expected an int"),
    (["--parallelism.pipeline_parallel_degree"], "--parallelism.pipeline_parallel_degree: needs a value"),
]


@pytest.mark.parametrize("argv,message", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_refusal_names_key_value_and_alternative(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args([*argv, "--job.dry_run"])
    assert message in str(e.value)


UNKNOWN = [
    (["--parallelism.pipeline_paralel_degree", "2"], "did you mean 'parallelism.pipeline_parallel_degree'?"),
    (["--validation.enabel"], "unknown key 'validation.enabel'; did you mean 'validation.enable'?"),
    (["--valdation.enable"], "unknown section 'valdation'; did you mean 'validation'?"),
    (["--quantize.linear.float8.recipe", "rowwise"], "did you mean 'quantize.linear.float8.recipe_name'?"),
    (["--training.no-stpes"], "--training.stpes: unknown key 'training.stpes'; did you mean 'training.steps'?"),
    (["--training.stpes", "3"], "--training.stpes: unknown key 'training.stpes'; did you mean 'training.steps'?"),
]


@pytest.mark.parametrize("argv,message", UNKNOWN, ids=[" ".join(a) for a, _ in UNKNOWN])
def test_unknown_names_stay_errors_with_a_suggestion(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)


def test_toml_refusal_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tt.toml"
    path.write_text('[parallelism]\npipeline_parallel_schedule_csv = "s.csv"\n')
    with pytest.raises(ConfigError, match=r'tt.toml: parallelism.pipeline_parallel_schedule_csv = "s.csv": schedules'):
        parse_args(["--job.config_file", str(path)])
    path.write_text("[quantize.linear.float8]\nrecipe = 'rowwise'\n")
    with pytest.raises(ConfigError, match=r"tt.toml: quantize.linear.float8.recipe: unknown key .* did you mean"):
        parse_args(["--job.config_file", str(path)])


@pytest.mark.parametrize(
    "argv",
    [
        ["--parallelism.pipeline_parallel_schedule_csv", "s.csv"],  # ignore-if refusal
        ["--model.converters", "mx"],  # map refusal
        ["--quantize.linear.float8.recipe_name", "rowwize"],  # bad choice
        ["--validation.enabel"],  # unknown name
    ],
    ids=["ignore_if", "map", "choice", "unknown"],
)
def test_each_refusal_kind_exits_2_with_one_line(argv: list[str]) -> None:
    proc = run_kiln(["--job.config_file", fixture("v0.2.2", "debug_model"), *argv], launcher="python", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error: ") and "Traceback" not in proc.stdout


# ----------------------------------------------------------------------------- training through run_train.sh


@pytest.mark.slow
@pytest.mark.parametrize("release", ["v0.1.0", "v0.2.2"])
def test_debug_config_trains_through_run_train_sh(release: str, tmp_path: Path) -> None:
    """torchtitan's debug config, as shipped, trains on CPU; the overrides only shrink it and pick fp32 compute."""
    args = ["--training.mixed_precision_param", "float32", "--training.seq_len", "32"]
    args += ["--training.local_batch_size", "2", "--training.steps", "2", "--job.dump_folder", str(tmp_path)]
    proc = run_kiln(args, ngpu=1, config_file=fixture(release, "debug_model"), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    losses = [float(m) for m in re.findall(r"step: +\d+  loss: +([-\d.naninf]+)", out)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out[-3000:]
    assert out.count('training.dataset = "c4_test" -> training.dataset = "kiln_corpus"') == 1
    assert "Pipeline:" not in out  # pipeline_parallel_degree = 1: off (v0.2.2's schedule is not read)
