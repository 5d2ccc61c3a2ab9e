"""Config manager: precedence, CLI syntaxes, strict types, and one-line exit-2 errors for user mistakes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kiln_base.config import JobConfig, format_help, parse_args, to_toml
from kiln_base.errors import ConfigError
from tests.helpers.common import DEBUG_CONFIG, ROOT
from tests.helpers.kiln_process import KilnResult, run_kiln, run_python


def test_precedence_defaults_toml_cli() -> None:
    assert JobConfig().training.steps == 10000
    cfg = parse_args(["--job.config_file", DEBUG_CONFIG])
    assert cfg.training.steps == 30 and cfg.optimizer.lr == 3e-3 and cfg.lr_scheduler.warmup_steps == 5
    cfg = parse_args(["--job.config_file", DEBUG_CONFIG, "--training.steps", "7", "--optimizer.lr=1e-3"])
    assert cfg.training.steps == 7 and cfg.optimizer.lr == 1e-3


def test_cli_syntaxes() -> None:
    cfg = parse_args(
        [
            "--float8.enable_float8_linear",
            "--float8.recipe_name",
            "rowwise",
            "--training.compile=true",
            "--float8.filter_fqns",
            "output,w2",
            "--float8.no-emulate",
            "--metrics.enable_tensorboard",
            "false",
        ]
    )
    assert cfg.float8.enable_float8_linear and cfg.float8.recipe_name == "rowwise"
    assert cfg.training.compile is True
    assert cfg.float8.filter_fqns == ["output", "w2"]
    assert cfg.float8.emulate is False and cfg.metrics.enable_tensorboard is False
    cfg = parse_args(["--training.compile", "--training.no-compile"])  # last one wins
    assert cfg.training.compile is False


def test_optional_fields_accept_none() -> None:
    cfg = parse_args(["--lr_scheduler.decay_ratio", "0.8", "--training.seed", "none"])
    assert cfg.lr_scheduler.decay_ratio == 0.8 and cfg.training.seed is None


def test_every_key_has_help_and_print_config_round_trips(tmp_path: Path) -> None:
    text = format_help()
    recipes = "tensorwise,rowwise,rowwise_with_gw_hp,mxfp8_rceil,mxfp8_rceil_wgrad_with_hp,nvfp4"
    assert f"--float8.recipe_name {{{recipes}}}" in text
    cfg = parse_args(["--training.steps", "3", "--float8.enable_float8_linear", "--float8.recipe_name", "rowwise"])
    out = tmp_path / "merged.toml"
    out.write_text(to_toml(cfg))
    again = parse_args(["--job.config_file", str(out)])
    assert again.to_dict() | {"job": {}} == cfg.to_dict() | {"job": {}}


# Ten (and more) kinds of bad input: each exits 2 before anything heavy, with one line naming the problem.
BAD_INPUTS = [
    (["--trainig.steps", "3"], "unknown section 'trainig'; did you mean 'training'?"),
    (["--training.stpes", "3"], "unknown key 'training.stpes'; did you mean 'training.steps'?"),
    (["--training.steps", "ten"], "--training.steps: expected an integer, got 'ten'"),
    (["--optimizer.lr", "fast"], "--optimizer.lr: expected a number, got 'fast'"),
    (["--training.compile", "maybe"], "--training.compile: expected true or false, got 'maybe'"),
    (["--float8.recipe_name", "rowwize"], "'rowwize' is not a valid choice; choose from tensorwise, rowwise"),
    (["--activation_checkpoint.mode", "some"], "'some' is not a valid choice; choose from none, selective, full"),
    (  # an optional key's none (one contiguous chunk per rank) is a choice too
        ["--parallelism.context_parallel_load_balancer", "zigzag"],
        "'zigzag' is not a valid choice; choose from headtail (or none)",
    ),
    (["--job.config_file", "missing.toml"], "config file not found: missing.toml"),
    (["--model.tokenizer_path", "/nonexistent/tokenizer.model"], "model.tokenizer_path: file not found"),
    (["--training.dataset_path", "/nonexistent/data.jsonl"], "training.dataset_path: not found: /nonexistent"),
    (["--training.local_batch_size", "0"], "training.local_batch_size must be >= 1, got 0"),
    (["--activation_checkpoint.selective_ac_option", "x"], "selective_ac_option must be 'op' or a positive"),
    (["--training.seq_len"], "--training.seq_len: needs a value"),
    (
        ["--training.no-steps"],
        "--training.no-steps: training.steps is not a boolean flag (only booleans have a --no- form); it takes an "
        "integer >= 1: --training.steps VALUE",
    ),
    (["--optimizer.no_lr"], "optimizer.lr is not a boolean flag (only booleans have a --no- form); it takes a number"),
    (["training.steps"], "unexpected argument 'training.steps'"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS)
def test_bad_input_raises_config_error(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        parse_args(argv)
    assert message in str(e.value)


def _run_train(*args: str) -> KilnResult:
    return run_kiln(args, launcher="python")


def test_malformed_toml_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[training]\nsteps = 3\nseq_len = "\n')
    with pytest.raises(ConfigError, match=r"bad.toml: malformed TOML: .*line 3"):
        parse_args(["--job.config_file", str(bad)])


def test_toml_wrong_type_and_unknown_key_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "c.toml"
    bad.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(
        ConfigError, match=r"c.toml: training.steps: expected a TOML integer \(unquoted\), got the string .ten."
    ):
        parse_args(["--job.config_file", str(bad)])
    bad.write_text("[float8]\nrecipe = 'rowwise'\n")
    with pytest.raises(ConfigError, match=r"unknown key 'float8.recipe'; did you mean 'float8.recipe_name'"):
        parse_args(["--job.config_file", str(bad)])


@pytest.mark.parametrize("argv,message", [BAD_INPUTS[0], BAD_INPUTS[2], BAD_INPUTS[7], BAD_INPUTS[8]])
def test_entry_point_exits_2_with_one_line(argv: list[str], message: str) -> None:
    proc = _run_train(*argv)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error: ") and message in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_garbage_tokenizer_file_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.model"
    bad.write_text("this is not a tiktoken file\n")
    proc = _run_train("--job.config_file", DEBUG_CONFIG, "--model.tokenizer_path", str(bad))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("kiln: error: model.tokenizer_path")
    assert str(bad) in proc.stderr and "Traceback" not in proc.stderr


def test_config_import_is_light() -> None:
    code = "import sys, kiln_base.config; assert 'torch' not in sys.modules, 'config imports torch'"
    run_python(code, check=True)


def test_run_train_sh_reports_config_errors_before_torchrun() -> None:
    proc = run_kiln(["--training.stpes", "3"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kiln: error: --training.stpes: unknown key 'training.stpes'; did you mean 'training.steps'?"
    ]


def test_mixed_precision_auto_resolves_by_device() -> None:
    from kiln_base.config import resolve_mixed_precision

    assert parse_args([]).training.mixed_precision_param == "auto"
    assert resolve_mixed_precision("auto", "cuda") == "bfloat16"
    assert resolve_mixed_precision("auto", "cpu") == "float32"  # measured faster on every CPU so far
    assert resolve_mixed_precision("bfloat16", "cpu") == "bfloat16"  # asked for: honoured
    assert resolve_mixed_precision("float32", "cuda") == "float32"


def test_last_config_file_wins_and_paths_are_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_train.sh passes CONFIG_FILE first: a --job.config_file after it must win, like any key given twice."""
    (tmp_path / "a.toml").write_text("[training]\nsteps = 3\n")
    (tmp_path / "b.toml").write_text('[training]\nsteps = 4\ndataset_path = "d.jsonl"\n[job]\ndump_folder = "o"\n')
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--job.config_file", "a.toml", "--job.config_file", "b.toml"])
    assert cfg.training.steps == 4 and cfg.job.config_file == str(tmp_path / "b.toml")
    assert cfg.job.dump_folder == str(tmp_path / "o") and cfg.training.dataset_path == str(tmp_path / "d.jsonl")
    # kiln's own configs and assets are found from anywhere; the current directory wins when both have the path.
    cfg = parse_args(["--job.config_file", "train_configs/debug_model.toml"])
    assert cfg.job.config_file == str(ROOT / "train_configs" / "debug_model.toml")
    assert cfg.model.tokenizer_path == str(ROOT / "assets" / "tokenizer" / "tokenizer.model")
    (tmp_path / "assets" / "tokenizer").mkdir(parents=True)
    (tmp_path / "assets" / "tokenizer" / "tokenizer.model").write_text("mine")
    cfg = parse_args(["--job.config_file", "train_configs/debug_model.toml"])
    assert cfg.model.tokenizer_path == str(tmp_path / "assets" / "tokenizer" / "tokenizer.model")


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (
            ["--parallelism.tensor_parallel_degree", "3"],
            2,
            "tensor_parallel_degree = 3 does not divide the world size 2",
        ),
        (["--parallelism.data_parallel_shard_degree", "3"], 4, "must equal the world size 4"),
        (["--training.global_batch_size", "6", "--training.local_batch_size", "4"], 1, "global_batch_size (6)"),
        (["--training.global_batch_size", "8", "--training.local_batch_size", "2"], 3, "(2 x 3 = 6)"),
        (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"], 2, "seq_len (33) must be"),
    ],
)
def test_check_world_checks_degrees_and_batch(argv: list[str], world: int, message: str) -> None:
    from kiln_base.config import check_world

    with pytest.raises(ConfigError) as e:
        check_world(parse_args(argv), world)
    assert message in str(e.value)
    check_world(parse_args(["--training.global_batch_size", "8", "--training.local_batch_size", "2"]), 4)  # fits


# ----------------------------------------------------------------------------- renamed keys

SQNR_OLD, SQNR_NEW = "float8.sqnr_log_freq", "float8.numerics_log_freq"


def test_deprecated_sqnr_log_freq_reads_as_numerics_log_freq(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """kiln's key before the numerics observatory: read as the new key, from a file or the command line, with
    one warning line naming both; the same value under both names is accepted."""
    old_file = tmp_path / "old.toml"
    old_file.write_text("[float8]\nenable_float8_linear = true\nsqnr_log_freq = 5\n")
    runs = {
        "toml": ["--job.config_file", str(old_file)],
        "cli": ["--float8.enable_float8_linear", "--float8.sqnr_log_freq", "5"],
        "both, equal": ["--float8.enable_float8_linear", "--float8.sqnr_log_freq=5", "--float8.numerics_log_freq=5"],
    }
    for how, argv in runs.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kiln"):
            cfg = parse_args(argv)
        assert cfg.float8.numerics_log_freq == 5, how
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert warnings == [f"{SQNR_OLD} is deprecated, read as {SQNR_NEW} = 5: rename it to {SQNR_NEW}"], how
    # the command line overrides the file whichever name either uses
    assert (
        parse_args(["--job.config_file", str(old_file), "--float8.numerics_log_freq", "0"]).float8.numerics_log_freq
        == 0
    )


def test_deprecated_and_new_name_disagreeing_is_a_config_error(tmp_path: Path) -> None:
    both = tmp_path / "both.toml"
    both.write_text("[float8]\nenable_float8_linear = true\nsqnr_log_freq = 5\nnumerics_log_freq = 10\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--job.config_file", str(both)])
    assert str(e.value) == (
        f"{both}: {SQNR_OLD} = 5 and {both}: {SQNR_NEW} = 10 disagree: {SQNR_OLD} is the deprecated name of "
        f"{SQNR_NEW}; give {SQNR_NEW} only"
    )
    with pytest.raises(ConfigError, match=r"--float8.sqnr_log_freq = 2 and --float8.numerics_log_freq = 3 disagree"):
        parse_args(["--float8.enable_float8_linear", "--float8.sqnr_log_freq", "2", "--float8.numerics_log_freq", "3"])
    with pytest.raises(ConfigError, match=r"--float8.sqnr_log_freq: needs a value"):
        parse_args(["--float8.sqnr_log_freq"])


@pytest.mark.parametrize("ngpu", ["1", "2"])
def test_run_train_sh_refuses_disagreeing_renamed_keys_with_one_line(ngpu: str) -> None:
    args = ["--float8.enable_float8_linear", "--float8.sqnr_log_freq", "2", "--float8.numerics_log_freq", "3"]
    proc = run_kiln(args, ngpu=ngpu)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kiln: error: --float8.sqnr_log_freq = 2 and --float8.numerics_log_freq = 3 disagree: float8.sqnr_log_freq "
        "is the deprecated name of float8.numerics_log_freq; give float8.numerics_log_freq only"
    ]


def test_launcher_config_check_leaves_the_rename_warning_to_the_ranks() -> None:
    """run_train.sh checks the config before torchrun and each rank parses it again: only the rank's log says it."""
    code = "import sys, train; sys.exit(0 if train.check_config(sys.argv[1:]) else 2)"
    argv = ["--float8.enable_float8_linear", "--float8.sqnr_log_freq", "5"]
    proc = run_python(code, *argv, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
