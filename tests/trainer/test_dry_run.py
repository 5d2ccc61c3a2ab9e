"""Dry run: meta build + float8 + parallel plan under a fake process group; the plan's content and estimates."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import train
from kiln_base.config import (
    ActivationCheckpoint,
    Degrees,
    JobConfig,
    RunPlan,
    SequenceSplit,
    Training,
    memory_estimate,
    parse_args,
)
from kiln_base.config.plan import BatchPlan
from models import LLAMA3_FLAVORS
from tests.helpers.common import DEBUG_CONFIG, ROOT
from tests.helpers.sac import LAYERS, SAVE_LIST, batch, debug_model, loss_fn
from trainer.build import local_params
from trainer.tools.dry_run import dry_run
from trainer.tools.saved_activations import measure_saved_activations


def test_debug_plan_fsdp_tp_float8() -> None:
    cfg = parse_args(
        ["--job.config_file", DEBUG_CONFIG, "--job.dry_run"]
        + ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
        + ["--float8.enable_float8_linear", "--activation_checkpoint.selective_ac_option", "op"]
    )
    plan = dry_run(cfg)
    lines = plan.splitlines()
    assert "simulated world: 4 = dp_replicate 1 x dp_shard 2 x tp 2" in plan
    assert "parameters: 6,270,208" in plan
    assert "float8: 42/43 Linears converted (recipe tensorwise)" in plan
    assert any(line.split()[:2] == ["output", "x1"] and "filter_fqns 'output'" in line for line in lines)
    wq = next(line for line in lines if line.split()[0] == "layers.*.attention.wq" and "Parallel" in line)
    assert "Float8ColwiseParallel" in wq and "dim 0" in wq
    wo = next(line for line in lines if line.split()[0] == "layers.*.attention.wo" and "Parallel" in line)
    assert "Float8RowwiseParallel" in wo and "dim 1" in wo
    assert "selective per-op" in plan and "save list:" in plan
    assert "optimizer (AdamW m+v fp32)" in plan
    assert (
        "mixed precision: bfloat16 compute on a GPU, float32 on a CPU (training.mixed_precision_param = auto)" in plan
    )


def test_rowwise_uses_high_precision_tp_styles_and_cli_exits_0(capsys: pytest.CaptureFixture) -> None:
    argv = ["--job.config_file", str(ROOT / "train_configs" / "llama3_8b.toml"), "--job.dry_run"]
    argv += ["--float8.enable_float8_linear", "--float8.recipe_name", "rowwise"]
    argv += ["--parallelism.tensor_parallel_degree", "8"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert "vocab 128256" in out  # Llama 3's tokenizer file is absent here: its size is used
    assert "float8: 224/225 Linears converted (recipe rowwise)" in out and "weight scaling axiswise" in out
    assert " ColwiseParallel " in out and "Float8ColwiseParallel" not in out


@pytest.mark.parametrize("save_list", [None, SAVE_LIST], ids=["no_ac", "per_op_sac"])
def test_activation_estimate_matches_report(save_list: frozenset | None) -> None:
    """The dry run's activation formula against the measured bytes (minus autocast's weight casts)."""
    model = debug_model(None, save_list)
    measured = measure_saved_activations(model, loss_fn(model, batch()))
    ac = ActivationCheckpoint(mode="none") if save_list is None else ActivationCheckpoint("selective", "op")
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=2256, n_layers=LAYERS)
    cfg = JobConfig(training=Training(local_batch_size=2, seq_len=64), activation_checkpoint=ac)
    degrees = Degrees(1, 1, 1, 1, 1)
    batch_plan = BatchPlan.of(cfg, degrees)
    plan = RunPlan(degrees, SequenceSplit(1, False), batch_plan, pipeline=None, shape=args.shape())
    est = memory_estimate(cfg, plan, local_params(model), "cuda")  # bf16 compute, as the measured autocast
    activations = measured.total_bytes - measured.bytes_of("aten._to_copy")
    assert abs(est["activations (one micro-batch)"] / activations - 1) < 0.2, (est, activations)
    n = sum(p.numel() for p in model.parameters())
    assert est["params (fp32)"] == 4 * n and est["optimizer (AdamW m+v fp32)"] == 8 * n


@pytest.mark.parametrize("overrides", [[], ["--model.n_layers", "2", "--model.vocab_size", "4096"]])
def test_dry_run_plans_the_model_the_trainer_builds(
    overrides: list[str], tmp_path: Path, make_trainer: Callable[[list[str]], Any]
) -> None:
    """One build path: the dry run's parameter count and layer count equal the Trainer's for the same config,
    including the model.n_layers / vocab_size overrides that an earlier, separate dry-run build ignored."""
    import re

    base = ["--job.config_file", DEBUG_CONFIG, *overrides]
    base += ["--job.dump_folder", str(tmp_path), "--training.seq_len", "32", "--training.local_batch_size", "1"]
    plan = dry_run(parse_args([*base, "--job.dry_run"]))
    planned = int(re.search(r"parameters: ([\d,]+)", plan).group(1).replace(",", ""))
    layers = int(re.search(r", (\d+) layers", plan).group(1))
    trainer = make_trainer(base)
    assert (planned, layers) == (trainer.n_params, len(trainer.model.layers))
    assert layers == (2 if overrides else LLAMA3_FLAVORS["debugmodel"].n_layers)


WIDTH_OVERRIDES = ["--model.flavor", "8B", "--model.n_layers", "1", "--model.dim", "1024", "--model.n_heads", "8"]
WIDTH_OVERRIDES += ["--model.n_kv_heads", "2", "--model.multiple_of", "256"]


def test_model_width_overrides_build_the_narrowed_8b_shape() -> None:
    """model.dim / n_heads / n_kv_heads / multiple_of (and ffn_dim_multiplier) replace the flavor's: the 8B shape
    at a quarter of its width keeps head_dim 128, GQA 4:1 and the 3.5x FFN (1.3 x 8/3, rounded to 256)."""
    from models.args import ffn_hidden_dim
    from trainer.build import model_args

    cfg = parse_args(WIDTH_OVERRIDES)
    args = model_args(cfg.model, seq_len=64, tokenizer_words=2256)
    assert (args.dim, args.n_heads, args.n_kv_heads, args.n_layers, ffn_hidden_dim(args)) == (1024, 8, 2, 1, 3584)
    assert args.ffn_dim_multiplier == 1.3 and args.rope_theta == LLAMA3_FLAVORS["8B"].rope_theta
    plan = dry_run(parse_args([*WIDTH_OVERRIDES, "--job.dry_run"]))
    attention, ffn, embed_and_output, norms = 2 * 1024 * 1024 + 2 * 1024 * 256, 3 * 1024 * 3584, 2 * 2256 * 1024, 3
    assert f"parameters: {attention + ffn + embed_and_output + norms * 1024:,}" in plan
    wider = parse_args([*WIDTH_OVERRIDES, "--model.ffn_dim_multiplier", "2.0"])
    assert ffn_hidden_dim(model_args(wider.model, seq_len=64, tokenizer_words=2256)) == 5632  # 2 x 2730 -> 256s


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--model.n_heads", "12"],
            "model.n_heads 12, model.n_kv_heads 2 (flavor 8B + overrides): n_heads must divide",
        ),
        (["--model.n_heads", "1024"], "heads of even size (RoPE rotates pairs)"),
        (["--model.n_kv_heads", "3"], "n_kv_heads must divide n_heads"),
    ],
)
def test_model_width_overrides_that_do_not_split_into_heads_exit_2(
    extra: list[str], message: str, capfd: pytest.CaptureFixture
) -> None:
    assert train.main([*WIDTH_OVERRIDES, *extra, "--job.dry_run"]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error: model.dim 1024, ") and message in lines[0], lines


def test_width_overrides_with_from_checkpoint_may_only_repeat_the_stored_shape() -> None:
    from kiln_base.config import FROM_CHECKPOINT, Model
    from kiln_base.errors import ConfigError
    from trainer.build import model_args
    from trainer.checkpoint.initial_load import InitialSource

    stored = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=2256)  # n_kv_heads None: 16 kv heads
    source = InitialSource("ckpt", "kiln", stored)
    same = Model(flavor=FROM_CHECKPOINT, dim=256, n_heads=16, n_kv_heads=16)
    assert model_args(same, 64, 2256, source) == dataclasses.replace(stored, max_seq_len=64)
    with pytest.raises(
        ConfigError, match=r"^model.n_kv_heads 4 differs from ckpt's 16 \(model.flavor from_checkpoint\)"
    ):
        model_args(Model(flavor=FROM_CHECKPOINT, n_kv_heads=4), 64, 2256, source)


@pytest.mark.parametrize(
    "world,layout",
    [
        (4, ["--model.n_kv_heads", "2", "--parallelism.tensor_parallel_degree", "4"]),  # TP over 2 KV heads
        (2, ["--parallelism.tensor_parallel_degree", "3"]),  # TP does not divide NGPU
        (2, ["--parallelism.data_parallel_shard_degree", "3"]),  # the degrees do not make the world
        (4, ["--model.n_layers", "1", "--parallelism.pipeline_parallel_degree", "4"]),  # more stages than blocks
        (2, ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"]),  # CP chunks vs seq_len
        (2, ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"]),  # sequence parallel vs seq
        (2, ["--training.global_batch_size", "3"]),  # the batch does not divide over the data-parallel ranks
        (2, ["--parallelism.context_parallel_degree", "2", "--model.flavor", "debugmodel_flex_attn"]),  # CP x mask
    ],
)
def test_dry_run_refuses_what_the_launcher_refuses_in_its_line(
    world: int, layout: list[str], capfd: pytest.CaptureFixture
) -> None:
    """The dry run plans through the launcher's function (trainer/build.py run_plan), so a layout the launcher
    refuses for `world` ranks the dry run refuses for that world in the same line (the dry run used plan_run
    without the device rules: it planned TP 4 over 2 KV heads)."""
    argv = ["--job.config_file", DEBUG_CONFIG, *layout]
    assert train.check_config(argv, world_size=world, local_ranks=world) is None
    launcher = capfd.readouterr().err.strip().splitlines()
    assert train.print_dry_run(parse_args([*argv, "--job.dry_run"]), world) == 2
    dry = capfd.readouterr().err.strip().splitlines()
    assert len(launcher) == 1 and launcher[0].startswith("kiln: error: "), launcher
    assert dry == launcher, (dry, launcher)
