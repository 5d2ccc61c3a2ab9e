"""metrics.enable_wandb, read back from an offline run's own files: every scalar TensorBoard gets (the step metrics,
the float8 numerics), the step lines' values, the merged config, torchtitan's environment variables; one run per
job; without the wandb package the config check stops the run (the launcher's side: tests/e2e/test_launcher.py)."""

from __future__ import annotations

import json
import logging
import re
import struct
import sys
from pathlib import Path

import pytest

from kiln_base.config import parse_args
from kiln_base.errors import ConfigError
from tests.helpers.common import run_trainer, tiny_run_args
from tests.helpers.run_files import read_offline_run, tensorboard_scalars
from trainer.components.scalar_writers import open_scalar_writers, wandb_init_args

STEP_LINE = re.compile(
    r"step: +(\d+) +loss: +([\d.]+) +memory: +([\d.]+)GiB\(([\d.]+)%\) +tps: ([\d,]+) .*"
    r"grad_norm: +([\d.]+) +lr: ([\d.e+-]+)"
)


def as_float32(x: float) -> float:
    """x as TensorBoard stores it (float32); W&B keeps the float64 kiln logged."""
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """W&B without a server; none of the caller's WANDB_* naming leaks into the test."""
    for var in ("WANDB_PROJECT", "WANDB_RUN_NAME", "WANDB_TEAM", "WANDB_NAME", "WANDB_ENTITY", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return monkeypatch


@pytest.mark.slow
def test_offline_run_holds_what_tensorboard_and_the_step_lines_show(
    tmp_path: Path, offline: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    offline.setenv("WANDB_RUN_NAME", "tiny-fp8")
    args = tiny_run_args(
        *("--job.dump_folder", str(tmp_path), "--model.n_layers", "1", "--training.steps", "4"),
        *("--metrics.log_freq", "2", "--metrics.enable_wandb", "--metrics.enable_tensorboard"),
        *("--float8.enable_float8_linear", "--float8.numerics_log_freq", "2"),
    )
    caplog.set_level(logging.INFO, logger="kiln")
    run_trainer(args)

    run = read_offline_run(tmp_path)
    assert (run.project, run.name) == ("kiln", "tiny-fp8")
    assert run.config == json.loads(json.dumps(parse_args(args).to_dict()))  # the merged config, every section
    tb = tensorboard_scalars(tmp_path / "tb" / "rank_0")
    assert sorted(run.history) == sorted(tb) == [1, 2, 4]
    for step, row in run.history.items():
        assert sorted(row) == sorted(tb[step]), step  # the same names: kiln/* every log step, float8/* on 2 and 4
        assert {tag: as_float32(v) for tag, v in row.items()} == tb[step], step
    assert sum(tag.startswith("float8/") for tag in run.history[2]) > 20  # numerics through the same writer

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    steps = [STEP_LINE.search(line) for line in lines]
    assert len(steps) == 3 and all(steps), lines
    for m in steps:
        assert m is not None
        row = run.history[int(m.group(1))]
        assert f"{row['kiln/loss']:.4f}" == m.group(2)
        assert f"{row['kiln/memory_gib']:.2f}" == m.group(3) and f"{row['kiln/memory_pct']:.2f}" == m.group(4)
        assert f"{round(row['kiln/tps']):,}" == m.group(5)
        assert f"{row['kiln/grad_norm']:.4f}" == m.group(6) and f"{row['kiln/lr']:.4e}" == m.group(7)


def test_one_wandb_run_per_job_from_the_first_log_rank(tmp_path: Path, offline: pytest.MonkeyPatch) -> None:
    """LOG_RANK=1,0: rank 1 prints and owns the run; rank 0 prints, but opens no second run."""
    cfg = parse_args([*tiny_run_args("--job.dump_folder", str(tmp_path)), "--metrics.enable_wandb"])
    assert open_scalar_writers(cfg.metrics, cfg.job.dump_folder, {}, rank=0, log_ranks=["1", "0"]) is None
    assert open_scalar_writers(cfg.metrics, cfg.job.dump_folder, {}, rank=2, log_ranks=["1", "0"]) is None
    writers = open_scalar_writers(cfg.metrics, cfg.job.dump_folder, {"k": 1}, rank=1, log_ranks=["1", "0"])
    assert writers is not None
    writers.add_scalar("kiln/loss", 2.5, 3)
    writers.add_scalar("kiln/loss", 2.0, 4)
    writers.close()
    run = read_offline_run(tmp_path)  # exactly one run folder (read_offline_run unpacks one)
    assert run.config == {"k": 1} and run.name == tmp_path.name
    assert run.history == {3: {"kiln/loss": 2.5}, 4: {"kiln/loss": 2.0}}


def test_scalars_written_after_a_flush_land_in_their_step(tmp_path: Path, offline: pytest.MonkeyPatch) -> None:
    """MetricsLogger flushes at each log step; a later writer of the same step (validation) must not be lost."""
    cfg = parse_args([*tiny_run_args("--job.dump_folder", str(tmp_path)), "--metrics.enable_wandb"])
    writers = open_scalar_writers(cfg.metrics, cfg.job.dump_folder, {}, rank=0, log_ranks=["0"])
    assert writers is not None
    writers.add_scalar("float8/a", 1.0, 10)
    writers.add_scalar("kiln/loss", 3.0, 10)
    writers.flush()
    writers.add_scalar("validation/loss", 3.5, 10)
    writers.add_scalar("kiln/loss", 2.0, 20)
    writers.close()
    history = read_offline_run(tmp_path).history
    assert history == {10: {"float8/a": 1.0, "kiln/loss": 3.0, "validation/loss": 3.5}, 20: {"kiln/loss": 2.0}}


def test_torchtitan_environment_names_the_run() -> None:
    env = {"WANDB_TEAM": "lab", "WANDB_PROJECT": "p", "WANDB_RUN_NAME": "r", "WANDB_RUN_TAGS": "fp8, 8b,"}
    args = wandb_init_args({**env, "WANDB_RUN_GROUP": "g", "WANDB_FORK_FROM": "abc?_step=10"}, "/x/out")
    assert args == {
        "entity": "lab",
        "project": "p",
        "name": "r",
        "tags": ["fp8", "8b"],
        "group": "g",
        "fork_from": "abc?_step=10",
    }
    # Unset (or empty): kiln's project, the dump folder's name; nothing else passed, so older wandb versions work.
    assert wandb_init_args({"WANDB_TEAM": ""}, "/x/llama8b_fp8/") == {"project": "kiln", "name": "llama8b_fp8"}


def test_wandb_without_the_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails and find_spec finds nothing
    with pytest.raises(ConfigError, match=r"metrics.enable_wandb needs the wandb package, which is not installed"):
        parse_args([*tiny_run_args(), "--metrics.enable_wandb"])
    parse_args(tiny_run_args())  # not asked for: no package needed
    parse_args([*tiny_run_args(), "--metrics.enable_wandb", "--job.dry_run"])  # a dry run logs nothing


def test_wandb_refusing_to_start_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online without a login (no key in the environment, netrc or wandb's settings): one line naming the ways out."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    import wandb

    wandb.teardown()  # wandb keeps the settings of its first run in this process (an earlier test's offline mode)
    cfg = parse_args([*tiny_run_args("--job.dump_folder", str(tmp_path)), "--metrics.enable_wandb"])
    try:
        with pytest.raises(ConfigError, match=r"W&B could not start a run: .*API key.*wandb login.*WANDB_MODE=offl"):
            open_scalar_writers(cfg.metrics, cfg.job.dump_folder, {}, rank=0, log_ranks=["0"])
    finally:
        wandb.teardown()
