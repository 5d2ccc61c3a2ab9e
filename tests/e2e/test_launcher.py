"""run_train.sh as users run it: from any directory, CONFIG_FILE vs --job.config_file, and every user mistake
(also those only a rank can find, under torchrun with 1 or 2 ranks) ending as one line `kiln: error: ...`, exit 2.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers.common import ROOT, tiny_run_args
from tests.helpers.kiln_process import KilnResult, KilnRun, assert_one_line_error, run_kiln, run_python, start_kiln

TIMEOUT_S = 300


def run_train(*args: str, cwd: Path, ngpu: int | str | None = 1, **env: str) -> KilnResult:
    """`NGPU=ngpu run_train.sh args` from `cwd`, with `env` on top of this process's environment."""
    return run_kiln(args, ngpu=ngpu, env=env, cwd=cwd, timeout=TIMEOUT_S)


# ----------------------------------------------------------------------------- user mistakes, one line each


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Files whose mistake is in their contents."""
    d = tmp_path_factory.mktemp("bad")
    (d / "tokenizer.model").write_text("this is not a tiktoken file\n")
    (d / "notext.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    (d / "tiny.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    return {"dir": str(d)}


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A dump folder holding a checkpoint of a 2-layer debug model, saved through run_train.sh."""
    d = tmp_path_factory.mktemp("ckpt2")
    args = (
        "--model.n_layers",
        "2",
        "--training.steps",
        "1",
        "--checkpoint.enable_checkpoint",
        "--job.dump_folder",
        ".",
    )
    proc = run_train(*tiny_run_args(*args), cwd=d)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (d / "checkpoint" / "step-1").is_dir()
    return str(d)


# (id, arguments ({dir}, {ckpt2} filled from the fixtures), text the line must hold, found before any rank starts)
MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe")

MISTAKES = [
    (
        "tp3",
        ["--parallelism.tensor_parallel_degree", "3"],
        "tensor_parallel_degree = 3 does not divide the world",
        True,
    ),
    ("fsdp3", ["--parallelism.data_parallel_shard_degree", "3"], "must equal the world size", True),
    (
        "hsdp_x_tp",
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
        "does not divide the world size",
        True,
    ),
    ("no_steps", ["--training.no-steps"], "training.steps is not a boolean flag", True),
    ("global_batch", ["--training.global_batch_size", "3"], "training.global_batch_size (3) must be a multiple", True),
    (
        "tp_seq_len",
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.seq_len",
            "33",
        ],
        "training.seq_len (33) must be divisible",
        True,
    ),
    (
        "cp_seq_len",
        [*("--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")]
        + ["--training.seq_len", "30"],
        "training.seq_len (30) must split into 2 x context_parallel_degree = 4 chunks",
        True,
    ),
    (
        "cp_degree",
        ["--parallelism.context_parallel_degree", "4"],
        "context_parallel_degree x tensor_parallel_degree = 4 does not divide the world size 2",
        True,
    ),
    (
        "cp_block_causal",
        [*("--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")]
        + ["--model.flavor", "debugmodel_flex_attn"],
        "parallelism.context_parallel_degree 2 with model.flavor debugmodel_flex_attn (document-masked attention",
        True,
    ),
    (
        "cp_ptrr",
        ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_load_balancer", "ptrr"],
        'context_parallel_load_balancer = "ptrr": the per-token round-robin balancer serves',
        True,
    ),
    (
        "ep_degree",
        ["--parallelism.expert_parallel_degree", "4"],
        "parallelism.expert_parallel_degree (4) must divide data_parallel_shard_degree",
        True,
    ),
    (
        "ep_cp_multiple",
        ["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "3"],
        "parallelism.expert_parallel_degree (3) must be a multiple of context_parallel_degree (2)",
        True,
    ),
    (
        "ep_cp_shard",
        ["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4"],
        "parallelism.expert_parallel_degree (4) must divide data_parallel_shard_degree (1) x context_parallel_degree",
        True,
    ),
    (
        "ep_dense",
        ["--parallelism.expert_parallel_degree", "2"],
        "parallelism.expert_parallel_degree 2: model.flavor debugmodel is dense (no experts to split)",
        True,
    ),
    (
        "moe_tp_without_ep",
        [*MOE, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
        "parallelism.tensor_parallel_degree 2 with a mixture-of-experts model (model.flavor debugmodel_moe, 8 "
        "experts) needs expert parallelism over the TP ranks",
        True,
    ),
    (
        "moe_ep_tp_multiple",
        [*MOE, "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "3"],
        "parallelism.expert_parallel_degree (3) must be a multiple of tensor_parallel_degree (2)",
        True,
    ),
    (
        "ep_compile_per_op_sac",
        [*MOE, "--parallelism.expert_parallel_degree", "2", "--training.compile"]
        + ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
        "parallelism.expert_parallel_degree 2 with training.compile and per-op selective activation checkpointing",
        True,
    ),
    (
        "moe_aux_tp",
        [*MOE, "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]
        + ["--model.moe_aux_loss_coeff", "0.001"],
        "model.moe_aux_loss_coeff 0.001 with parallelism.tensor_parallel_degree 2: the aux loss pools",
        True,
    ),
    ("tokenizer_contents", ["--model.tokenizer_path", "{dir}/tokenizer.model"], "cannot parse tokenizer file", True),
    ("dataset_name", ["--training.dataset", "nosuch"], "training.dataset: unknown dataset 'nosuch'", True),
    (
        "dataset_record",
        ["--training.dataset_path", "{dir}/notext.jsonl"],
        "record 1 (line 1): no 'text' field (has: body)",
        True,
    ),
    (
        "dataset_too_small",
        ["--training.dataset_path", "{dir}/tiny.jsonl"],
        "tiny.jsonl is too small to fill one sequence",
        False,
    ),
    ("vocab_size", ["--model.vocab_size", "100"], "model.vocab_size (100) is smaller than the tokenizer", True),
    (
        "checkpoint_model",
        ["--job.dump_folder", "{ckpt2}", "--checkpoint.enable_checkpoint", "--model.n_layers", "1"],
        "holds another model",
        False,
    ),
    (
        "async_tp_cpu",
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.enable_async_tensor_parallel",
            "--training.compile",
        ],
        "needs CUDA",
        True,
    ),
    ("varlen_cpu", ["--model.flavor", "debugmodel_varlen_attn"], "use model.flavor debugmodel_flex_attn", True),
    (
        "validation_dataset_name",
        ["--validation.enable", "--validation.dataset", "nosuch"],
        "validation.dataset: unknown dataset 'nosuch'",
        True,
    ),
    (
        "float8_policy_keeps_every_block",
        ["--float8.enable_float8_linear", "--float8.high_precision_first_last", "3"],
        "float8.high_precision_first_last 3 keeps all 6 transformer blocks in high precision",
        True,
    ),
    (
        "float8_policy_beyond_the_model",
        ["--float8.enable_float8_linear", "--float8.high_precision_last", "7"],
        "float8.high_precision_last 7 is more than the model's 6 transformer blocks",
        True,
    ),
    (
        "bf16_wire_plain_replication",
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.mixed_precision_reduce",
            "bfloat16_wire",
        ],
        "plain replication (data_parallel_replicate_degree 2, data_parallel_shard_degree 1) has none",
        True,
    ),
    (
        "validation_too_small",
        ["--validation.enable", "--validation.dataset_path", "{dir}/tiny.jsonl"],
        "tiny.jsonl is too small to fill one sequence of validation.seq_len + 1",
        False,
    ),
]
# With one rank the degrees that need two ranks are not mistakes; these are.
SINGLE_RANK = {
    "tp3": (["--parallelism.tensor_parallel_degree", "3"], "does not divide the world size 1"),
    "fsdp3": (["--parallelism.data_parallel_shard_degree", "3"], "must equal the world size 1"),
    "cp_seq_len": (
        ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_load_balancer", "none"],
        "context_parallel_degree x tensor_parallel_degree = 2 does not divide the world size 1",
    ),
    "cp_degree": (["--parallelism.context_parallel_degree", "4"], "= 4 does not divide the world size 1"),
    "ep_dense": (["--parallelism.expert_parallel_degree", "2"], "(2) must divide data_parallel_shard_degree (1)"),
    "ep_cp_multiple": (
        ["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "3"],
        "context_parallel_degree x tensor_parallel_degree = 2 does not divide the world size 1",
    ),
    "ep_cp_shard": (
        ["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4"],
        "context_parallel_degree x tensor_parallel_degree = 2 does not divide the world size 1",
    ),
    "cp_block_causal": (
        ["--parallelism.context_parallel_degree", "2", "--model.flavor", "debugmodel_flex_attn"],
        "context_parallel_degree x tensor_parallel_degree = 2 does not divide the world size 1",
    ),
}


# The mistakes also run through run_train.sh (the rest only through the launcher's check below, which is what
# run_train.sh runs before torchrun: the same `except UserError` prints every one of them): one per error class and
# check the launcher finds it in (the world: ConfigError; the files: DataError; the model: ConfigError), and every
# mistake only a rank finds (each starts torchrun and its ranks), at NGPU 2 and 1.
RUN_TRAIN = {"tp3", "dataset_record", "float8_policy_keeps_every_block", "dataset_too_small", "checkpoint_model"}
RUN_TRAIN |= {"moe_tp_without_ep"}  # the model's shape against the degrees
RUN_TRAIN_NGPU1 = {"validation_too_small"}  # at NGPU 2 its path is dataset_too_small's: ranks' line, printed once


def _params(ngpu: int, names: set[str] | None = None) -> list:
    out = []
    for name, args, needle, pre in MISTAKES:
        if names is not None and name not in names:
            continue
        if ngpu == 1:
            if name in SINGLE_RANK:
                args, needle = SINGLE_RANK[name]
            elif any("tensor_parallel_degree" in a or "replicate_degree" in a for a in args):
                continue  # a 2-rank layout
        # Mistakes found by a rank start processes: 2 ranks are a distributed test, 1 rank a slow one.
        marks = [] if pre else [pytest.mark.distributed if ngpu > 1 else pytest.mark.slow]
        out.append(pytest.param(ngpu, args, needle, pre, id=f"ngpu{ngpu}-{name}", marks=marks))
    return out


@pytest.mark.parametrize(
    ("ngpu", "args", "needle", "pre"), _params(2, RUN_TRAIN) + _params(1, RUN_TRAIN | RUN_TRAIN_NGPU1)
)
def test_mistake_is_one_line_exit_2(
    ngpu: int,
    args: list[str],
    needle: str,
    pre: bool,
    bad_files: dict[str, str],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    paths = dict(bad_files, ckpt2=request.getfixturevalue("ckpt2") if "{ckpt2}" in args else "")
    args = [a.format(**paths) for a in args]
    proc = run_train(*tiny_run_args("--job.dump_folder", str(tmp_path / "out"), *args), cwd=tmp_path, ngpu=ngpu)
    assert_one_line_error(proc, needle)
    if pre:  # checked by the launcher for NGPU ranks: torchrun never started one, stderr is that line alone
        assert "[rank0]" not in proc.stdout and len(proc.stderr.splitlines()) == 1, proc.stdout[-2000:]
    else:  # found by a rank, reported once by the launcher
        assert "[rank0]" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize(("ngpu", "args", "needle", "pre"), _params(2) + _params(1))
def test_launcher_precheck_catches_exactly_the_pre_mistakes(
    ngpu: int, args: list[str], needle: str, pre: bool, bad_files: dict[str, str], capfd: pytest.CaptureFixture
) -> None:
    """The launcher's check before torchrun (train.check_config with the world size) finds the mistakes marked as
    found before any rank starts, each as one line `kiln: error: ...` on stderr, and passes the others on to the
    ranks (test_mistake_is_one_line_exit_2 runs run_train.sh for one mistake of each class: exit 2, that line)."""
    import train

    paths = dict(bad_files, ckpt2=str(bad_files["dir"]))  # no rank runs here: any folder stands in for ckpt2
    cfg = train.check_config([*tiny_run_args(), *(a.format(**paths) for a in args)], world_size=ngpu)
    err = capfd.readouterr().err
    assert (cfg is None) == pre, err
    assert (needle in err) == pre, err
    if pre:
        (line,) = err.splitlines()
        assert line.startswith("kiln: error: "), err


def test_dry_run_plans_ngpu_ranks_and_refuses_what_the_run_refuses_in_its_line(tmp_path: Path) -> None:
    """NGPU=2 with TP 3: the dry run plans the 2 ranks the launcher would start and ends in the launcher's line
    (before: it simulated 3 ranks and printed a plan the run refuses)."""
    args = tiny_run_args("--parallelism.tensor_parallel_degree", "3")
    run = run_train(*args, cwd=tmp_path, ngpu=2)
    dry = run_train(*args, "--job.dry_run", cwd=tmp_path, ngpu=2)
    assert_one_line_error(dry, "tensor_parallel_degree = 3 does not divide the world size 2")
    assert dry.stderr == run.stderr and dry.stdout == "", dry.stdout[-2000:]


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"NGPU": "0"}, "NGPU must be a positive integer"),
        ({"NGPU": "abc"}, "NGPU must be a positive integer"),
        ({"NGPU": "2", "LOG_RANK": "2"}, "LOG_RANK must be a comma-separated list of ranks in 0..1"),
        ({"NGPU": "1", "CONFIG_FILE": "nosuch.toml"}, "config file not found: "),
    ],
)
def test_launcher_environment_mistakes(env: dict[str, str], needle: str, tmp_path: Path) -> None:
    proc = run_train("--training.steps", "1", cwd=tmp_path, ngpu=None, **env)
    assert_one_line_error(proc, needle)


@pytest.mark.slow  # starts torchrun and its ranks
@pytest.mark.parametrize("ngpu", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_non_finite_stop_ends_in_kilns_line_and_exit_1(ngpu: int, tmp_path: Path) -> None:
    """The skip's own documented stop (N consecutive non-finite steps, NonFiniteError, exit 1) ends in the rank's
    one line, printed once by the launcher, as a user error does; before, torchrun's ChildFailedError traceback
    followed it."""
    args = tiny_run_args("--optimizer.lr", "1e20", "--training.skip_nonfinite_steps", "2", "--model.n_layers", "1")
    args += ["--training.steps", "6", "--job.dump_folder", str(tmp_path / "out")]
    proc = run_train(*args, cwd=tmp_path, ngpu=ngpu)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines[-1].startswith("kiln: error: non-finite loss or grad norm at 2 consecutive steps"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    assert sum("non-finite loss or grad norm at" in line for line in lines) == 1, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_run_train_sh_stops_both_ranks_with_their_line_and_exit_143(tmp_path: Path) -> None:
    """SIGTERM (what a scheduler sends) to run_train.sh with 2 ranks: each rank saves and says so in one line, and
    the launcher ends with the shell's status for SIGTERM, without torchrun's traceback of its own signal."""
    args = tiny_run_args("--training.steps", "10000", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "1000")
    with KilnRun(start_kiln([*args, "--job.dump_folder", "run"], ngpu=2, log_rank="0,1", cwd=tmp_path)) as run:
        run.wait_for("step:  1 ")  # both ranks log; the first step line means the loop runs
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish(timeout=TIMEOUT_S)
    out, err = run.text, "".join(run.stderr)
    assert rc == 143, out[-2000:] + err[-3000:]
    assert "Traceback" not in out + err and "SignalException" not in out + err, err[-3000:]
    stops = [line.split("kiln: ", 1)[1] for line in err.splitlines() if "kiln: stopped by SIGTERM" in line]
    assert len(stops) == 2 and stops[0] == stops[1], err[-3000:]
    saved = tmp_path / "run" / "checkpoint" / stops[0].split("; saved ")[1].split(";")[0].rsplit("/", 1)[-1]
    assert (saved / ".metadata").is_file(), stops[0]


# ----------------------------------------------------------------------------- paths and config precedence


@pytest.mark.slow  # trains through run_train.sh
def test_runs_from_any_directory_with_relative_paths(tmp_path: Path) -> None:
    """From a temporary directory: a relative CONFIG_FILE, dump folder and dataset; the bundled tokenizer is found
    through the config's kiln-relative `assets/...` path; the checkpoint lands under the launch directory."""
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"text": f"line {i} of my data."}) + "\n" for i in range(50))
    )
    (tmp_path / "my.toml").write_text(
        '[job]\ndump_folder = "runs/a"\n[model]\ntokenizer_path = "assets/tokenizer/tokenizer.model"\n'
        '[training]\ndataset_path = "data.jsonl"\nsteps = 2\nseq_len = 32\nlocal_batch_size = 2\n'
        "[checkpoint]\nenable_checkpoint = true\ninterval = 1\n"
        '[activation_checkpoint]\nmode = "none"\n'
    )
    proc = run_train(cwd=tmp_path, CONFIG_FILE="my.toml")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "runs" / "a" / "checkpoint" / "step-2").is_dir()
    assert not (ROOT / "runs").exists()
    for line in (
        f"Config file: {tmp_path / 'my.toml'}",
        f"Dump folder: {tmp_path / 'runs' / 'a'}",
        f"Tokenizer: {ROOT / 'assets' / 'tokenizer' / 'tokenizer.model'}",
        f"Dataset: {tmp_path / 'data.jsonl'}",
        f"Checkpoint folder: {tmp_path / 'runs' / 'a' / 'checkpoint'}",
    ):
        assert proc.stdout.count(line) == 1, (line, proc.stdout[-3000:])


def test_command_line_config_file_wins_over_config_file_env(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text("[training]\nsteps = 3\n")
    (tmp_path / "b.toml").write_text("[training]\nstpes = 3\n")  # a mistake, so the line names the file read
    proc = run_train("--job.config_file", "b.toml", cwd=tmp_path, CONFIG_FILE="a.toml")
    assert_one_line_error(proc, f"{tmp_path / 'b.toml'}: training.stpes: unknown key")
    proc = run_train("--job.config_file", "b.toml", cwd=tmp_path)  # over the default config too
    assert_one_line_error(proc, f"{tmp_path / 'b.toml'}: training.stpes")
    proc = run_train(cwd=tmp_path, CONFIG_FILE="b.toml")  # and CONFIG_FILE alone is read
    assert_one_line_error(proc, f"{tmp_path / 'b.toml'}: training.stpes")


def test_exit_now_keeps_the_status_and_what_was_written() -> None:
    """train.py and launch.py end through train.exit_now (no interpreter teardown): the exit status and output
    still buffered (stdout to a pipe is block-buffered) arrive."""
    code = "import sys, train; print('printed'); sys.stderr.write('written'); train.exit_now(3)"
    proc = run_python(code, env={"PYTHONUNBUFFERED": None})
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "printed\n", "written")


def test_uses_python3_when_python_is_missing(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to("/usr/bin/dirname")
    env = {"PATH": str(bin_dir)}  # and NGPU=1, nothing else; bash itself is started by its full path
    proc = run_kiln(["--training.stpes", "1"], ngpu=1, env=env, inherit_env=False, cwd=tmp_path, timeout=TIMEOUT_S)
    assert_one_line_error(proc, "neither python nor python3 is on PATH")
    # A wrapper, not a symlink: a venv's interpreter run through a link in another folder no longer finds its
    # pyvenv.cfg and starts without the venv's packages.
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    proc = run_kiln(["--training.stpes", "1"], ngpu=1, env=env, inherit_env=False, cwd=tmp_path, timeout=TIMEOUT_S)
    assert_one_line_error(proc, "did you mean 'training.steps'")  # launch.py ran, under python3


@pytest.mark.parametrize("ngpu", [1, 2])
def test_wandb_without_the_package_is_one_line_before_any_rank(ngpu: int, tmp_path: Path) -> None:
    """metrics.enable_wandb where wandb is not importable (a sitecustomize hides the installed one): the launcher's
    check stops the run before torchrun starts a rank."""
    hide = tmp_path / "no_wandb"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\n\nsys.modules['wandb'] = None  # as if not installed\n")
    pythonpath = os.pathsep.join(p for p in (str(hide), os.environ.get("PYTHONPATH", "")) if p)
    args = tiny_run_args("--job.dump_folder", str(tmp_path / "out"), "--metrics.enable_wandb")
    proc = run_train(*args, cwd=tmp_path, ngpu=ngpu, PYTHONPATH=pythonpath)
    assert_one_line_error(proc, "metrics.enable_wandb needs the wandb package, which is not installed")
    assert "[rank0]" not in proc.stdout and len(proc.stderr.splitlines()) == 1, proc.stdout[-2000:]


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"WANDB_MODE": "bogus"},
            "metrics.enable_wandb: W&B rejects its settings: WANDB_MODE='bogus': Input should be 'online', "
            "'offline', 'shared', 'disabled', 'dryrun' or 'run'",
        ),
        (
            {"WANDB_MODE": "offline", "WANDB_SILENT": "maybe"},
            "metrics.enable_wandb: W&B rejects its settings: WANDB_SILENT='maybe': Input should be a valid boolean, "
            "unable to interpret input",
        ),
        (
            {"WANDB_MODE": "offline", "WANDB_RUN_ID": "a/b"},
            "metrics.enable_wandb: W&B could not start a run: Run ID cannot contain the characters: :;,#?/' (W&B "
            "runs offline here, no login involved: check the WANDB_* variables)",
        ),
    ],
    ids=["mode", "silent", "offline-run-id"],
)
def test_wandb_settings_it_rejects_are_one_line(env: dict[str, str], line: str, tmp_path: Path) -> None:
    """W&B settings from the environment that W&B refuses: one line naming the variable, exit 2 (a traceback
    before); offline, the advice is not `wandb login`."""
    args = tiny_run_args("--job.dump_folder", str(tmp_path / "out"), "--training.steps", "1", "--metrics.enable_wandb")
    proc = run_train(*args, cwd=tmp_path, **env)
    assert assert_one_line_error(proc) == f"kiln: error: {line}"


@pytest.mark.distributed
def test_wandb_two_ranks_one_offline_run(tmp_path: Path) -> None:
    """NGPU=2, LOG_RANK=1,0: both ranks print step lines; one W&B run, owned by rank 1 (the first named), holds
    their losses."""
    from tests.helpers.run_files import read_offline_run

    args = tiny_run_args("--job.dump_folder", str(tmp_path / "out"), "--model.n_layers", "1", "--training.steps", "3")
    args += ["--metrics.log_freq", "1", "--metrics.enable_wandb"]
    proc = run_train(
        *args, cwd=tmp_path, ngpu=2, LOG_RANK="1,0", WANDB_MODE="offline", WANDB_SILENT="true", WANDB_RUN_NAME=""
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rank1]:" in proc.stdout and "Weights & Biases: run 'out'" in proc.stdout
    assert not [line for line in proc.stdout.splitlines() if line.startswith("[rank0]:") and "Weights & Biases" in line]
    run = read_offline_run(tmp_path / "out")  # exactly one run
    losses = [
        line.split("loss:")[1].split()[0] for line in proc.stdout.splitlines() if "[rank1]:" in line and "step:" in line
    ]
    assert [f"{run.history[s]['kiln/loss']:.4f}" for s in (1, 2, 3)] == losses


@pytest.mark.parametrize("held_out", [False, True], ids=["training data", "held-out split"])
def test_validating_on_the_training_data_is_said_at_start(held_out: bool, tmp_path: Path) -> None:
    """validation.dataset_path naming the training file (through another path): one warning line at start, and the
    run goes on (torchtitan validates on whatever it is given); the bundled held-out split: no warning."""
    corpus = ROOT / "assets" / "corpus"
    (tmp_path / "same.jsonl").symlink_to(corpus / "kiln_corpus.jsonl")
    data = corpus / "kiln_corpus_validation.jsonl" if held_out else tmp_path / "same.jsonl"
    args = tiny_run_args("--job.dump_folder", str(tmp_path / "out"), "--training.steps", "1", "--validation.enable")
    proc = run_train(*args, "--validation.steps", "1", "--validation.dataset_path", str(data), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    warned = [line for line in proc.stdout.splitlines() if "Validation reads the training data" in line]
    assert len(warned) == (0 if held_out else 1), proc.stdout[-3000:]


def test_a_config_mistake_on_a_node_without_gpus_is_refused_without_importing_torch(tmp_path: Path) -> None:
    """No GPU device file: the GPU count is 0 without torch, so a mistake the config shows costs no torch import
    (~1 s of CPU a refusal, before); with one, torch counts the GPUs as it always did."""
    code = (
        "import sys, launch; launch.GPU_DEVICE_FILES = {files!r}; status = launch.main(['--training.stepz', '3']); "
        "print(status, 'torch' in sys.modules)"
    )
    for files, torch_imported in (((), False), ((sys.executable,), True)):
        proc = run_python(code.format(files=files))
        assert proc.stdout.split() == ["2", str(torch_imported)], proc.output[-2000:]
        assert proc.stderr.startswith("kiln: error: --training.stepz: unknown key"), proc.stderr
