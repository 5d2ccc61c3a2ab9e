"""float8: which Linears are converted and how, validation (exit 2, one line), losses tracking bf16, FSDP hook.

On CPU torch._scaled_mm has a real kernel, so these tests run torchao's float8 path un-emulated (emulate=False)
unless a test says otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from float8.converter import Float8Converter, build_float8_converter, too_small_to_gain
from kiln_base.config import Float8, parse_args
from kiln_base.errors import ConfigError
from models import LLAMA3_FLAVORS, Transformer
from tests.helpers.common import (
    DEBUG_CONFIG,
    ROOT,
    needs_cpu_rowwise,
    open_trainer,
    run_trainer,
    tiny_run_args,
)
from tests.helpers.distributed import run_distributed
from tests.helpers.kiln_process import run_python
from trainer.trainer import Trainer

BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1")
BLOCK_LINEARS += ("feed_forward.w2", "feed_forward.w3")


def meta_model(flavor: str = "debugmodel", vocab: int = 2256) -> Transformer:
    args = dataclasses.replace(LLAMA3_FLAVORS[flavor], vocab_size=vocab, max_seq_len=64)
    with torch.device("meta"):
        return Transformer(args)


def converted(model: nn.Module, **flags: object) -> tuple[Float8Converter, nn.Module]:
    conv = Float8Converter(Float8(enable_float8_linear=True, **flags))
    conv.convert(model)
    return conv, model


# ----------------------------------------------------------------------------- module selection


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_recipe_converts_block_linears_and_keeps_output(recipe: str) -> None:
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear

    conv, model = converted(meta_model(), recipe_name=recipe)
    mods = dict(model.named_modules())
    for i in range(6):
        for name in BLOCK_LINEARS:
            m = mods[f"layers.{i}.{name}"]
            assert isinstance(m, Float8Linear), (i, name, type(m))
            c = m.config
            want = ScalingGranularity.TENSORWISE if recipe == "tensorwise" else ScalingGranularity.AXISWISE
            assert c.cast_config_input.scaling_granularity is want
            assert c.cast_config_weight.scaling_granularity is want
            assert c.cast_config_grad_output.scaling_granularity is want
            assert c.round_scales_to_power_of_2 is (recipe != "tensorwise")
            assert not c.emulate and not c.enable_fsdp_float8_all_gather
            # rowwise_with_gw_hp: grad_weight GEMM in high precision, grad_input's weight scaled per tensor.
            gw_hp = c.cast_config_input_for_grad_weight.scaling_type is ScalingType.DISABLED
            assert gw_hp is (recipe == "rowwise_with_gw_hp")
            if gw_hp:
                assert c.cast_config_weight_for_grad_input.scaling_granularity is ScalingGranularity.TENSORWISE
    assert type(mods["output"]) is nn.Linear
    assert [(d.fqn, d.reason) for d in conv.decisions if not d.converted] == [("output", "filter_fqns 'output'")]
    assert sum(d.converted for d in conv.decisions) == 42


def test_filter_fqns_and_indivisible_dims_are_skipped_with_reasons(caplog: pytest.LogCaptureFixture) -> None:
    from torchao.float8.float8_linear import Float8Linear

    caplog.set_level(logging.INFO, logger="kiln")
    model = nn.Sequential()
    model.add_module("up", nn.Linear(32, 64, bias=False))
    model.add_module("odd", nn.Linear(64, 40))  # 40 is not a multiple of 16
    model.add_module("w2", nn.Linear(40, 48))
    model.add_module("head", nn.Linear(48, 16))
    conv, model = converted(model, filter_fqns=["w2"], emulate=True)
    assert isinstance(model.up, Float8Linear) and model.up.config.emulate
    assert isinstance(model.head, Float8Linear)
    assert type(model.odd) is nn.Linear and type(model.w2) is nn.Linear
    assert conv.decisions == [
        ("up", True, ""),
        ("odd", False, "in/out features 64/40 not divisible by 16"),
        ("w2", False, "filter_fqns 'w2'"),
        ("head", True, ""),
    ]
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("float8")]
    assert line == (
        "float8 tensorwise + emulate: converted 2 of 4 Linears to Float8Linear; skipped 2: "
        "odd (in/out features 64/40 not divisible by 16); w2 (filter_fqns 'w2')"
    )
    # The converted model still runs (emulated float8) and its output tracks the high-precision one.
    x = torch.randn(8, 32)
    ref = x
    for lin in model:
        ref = nn.functional.linear(ref, lin.weight, lin.bias)
    torch.testing.assert_close(model(x), ref, rtol=0.15, atol=0.15)


def test_custom_filter_converts_output_and_summary_collapses_layers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kiln")
    conv, model = converted(meta_model(), filter_fqns=["w2"], recipe_name="rowwise")
    assert [d.fqn for d in conv.decisions if not d.converted] == [f"layers.{i}.feed_forward.w2" for i in range(6)]
    assert type(model.output).__name__ == "Float8Linear"
    assert any(
        r.getMessage().endswith("skipped 6: layers.*.feed_forward.w2 x6 (filter_fqns 'w2')") for r in caplog.records
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_auto_filter_thresholds_match_torchao(recipe: str) -> None:
    """Our reasons-giving thresholds agree with torchao's own `_auto_filter_for_recipe` on a grid of shapes."""
    from torchao.float8 import _auto_filter_for_recipe

    torchao_keeps = _auto_filter_for_recipe(recipe, filter_fqns=[])
    sizes = [256, 1024, 1040, 2048, 2064, 4096, 4112, 8192, 14336]
    for k in sizes:
        for n in sizes:
            with torch.device("meta"):
                lin = nn.Linear(k, n, bias=False)
            assert (too_small_to_gain(recipe, k, n) is None) == torchao_keeps(lin, "x"), (recipe, k, n)


def test_auto_filter_on_llama3_8b_skips_only_the_kv_projections() -> None:
    """The seed's model: with the auto filter, the 4096->1024 wk/wv GEMMs stay bf16 under both recipes."""
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        conv, _ = converted(meta_model("8B", vocab=128256), recipe_name=recipe, auto_filter_small_kn=True)
        skipped = {re.sub(r"\.\d+\.", ".*.", d.fqn) for d in conv.decisions if not d.converted}
        assert skipped == {"output", "layers.*.attention.wk", "layers.*.attention.wv"}, (recipe, skipped)
        assert sum(d.converted for d in conv.decisions) == 32 * 5
    # The debug model's GEMMs are all far below the thresholds: nothing converts.
    conv, _ = converted(meta_model(), auto_filter_small_kn=True)
    assert not any(d.converted for d in conv.decisions)
    assert conv.decisions[0].reason.startswith("auto filter: tensorwise GEMM K=256 N=256 too small")


def test_config_flags_reach_torchao_config() -> None:
    conv = Float8Converter(Float8(enable_float8_linear=True, enable_fsdp_float8_all_gather=True, emulate=True))
    assert conv.config.enable_fsdp_float8_all_gather and conv.config.emulate
    conv = Float8Converter(Float8(enable_float8_linear=True, recipe_name="tensorwise"))
    assert not conv.config.enable_fsdp_float8_all_gather and not conv.config.emulate
    assert build_float8_converter(Float8()) is None


def test_seed_command_config_converts_8b_on_meta() -> None:
    """`CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --float8.enable_float8_linear --float8.recipe_name
    rowwise` passes validation and converts every block Linear of the (meta, never materialised) 8B model."""
    cfg = parse_args(
        [
            "--job.config_file",
            str(ROOT / "train_configs" / "llama3_8b.toml"),
            "--float8.enable_float8_linear",
            "--float8.recipe_name",
            "rowwise",
            "--job.dry_run",  # skips the tokenizer-file check: the real Llama3 tokenizer is not in the repo
        ]
    )
    conv = build_float8_converter(cfg.float8)
    conv.convert(meta_model("8B", vocab=128256))
    assert sum(d.converted for d in conv.decisions) == 32 * 7
    assert [d.fqn for d in conv.decisions if not d.converted] == ["output"]


# ----------------------------------------------------------------------------- validation

BAD_FLOAT8 = [
    (
        ["--float8.enable_float8_linear", "--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
        "float8.enable_fsdp_float8_all_gather needs tensorwise scaling, but float8.recipe_name is 'rowwise'",
    ),
    (
        [
            "--float8.enable_float8_linear",
            "--float8.recipe_name",
            "rowwise_with_gw_hp",
            "--float8.enable_fsdp_float8_all_gather",
        ],
        "needs tensorwise scaling, but float8.recipe_name is 'rowwise_with_gw_hp'",
    ),
    (
        ["--float8.enable_float8_linear", "--float8.precompute_float8_dynamic_scale_for_fsdp"],
        "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather",
    ),
    (["--float8.recipe_name", "rowwise"], "float8.recipe_name set but float8 is off"),
    (
        ["--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"],
        "float8.enable_fsdp_float8_all_gather, float8.precompute_float8_dynamic_scale_for_fsdp set but float8 is off",
    ),
    (["--float8.emulate"], "float8.emulate set but float8 is off"),
    (["--float8.auto_filter_small_kn"], "float8.auto_filter_small_kn set but float8 is off"),
]


@pytest.mark.parametrize("argv,message", BAD_FLOAT8)
def test_bad_float8_combination_raises_config_error(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert message in str(e.value)


def test_valid_combinations_pass() -> None:
    for argv in (
        ["--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather"],
        [
            "--float8.enable_float8_linear",
            "--float8.recipe_name",
            "tensorwise",
            "--float8.enable_fsdp_float8_all_gather",
        ],
        [
            "--float8.enable_float8_linear",
            "--float8.enable_fsdp_float8_all_gather",
            "--float8.precompute_float8_dynamic_scale_for_fsdp",
        ],
        ["--float8.filter_fqns", "output,w2"],  # a filter list alone is harmless (torchtitan TOMLs always set it)
    ):
        parse_args(argv)


# Environment checks run in a subprocess with torch/importlib patched: this machine has no GPU and a new torchao.
PATCH_OLD_SM = (
    "import torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1; "
    "torch.cuda.get_device_capability = lambda i=None: (8, 0); "
    "torch.cuda.get_device_name = lambda i=None: 'NVIDIA A100-SXM4-80GB'"
)
PATCH_TORCHAO_VERSION = (
    "import importlib.metadata as md; _v = md.version; "
    "md.version = lambda name: {version!r} if name == 'torchao' else _v(name)"
)
PATCH_NO_TORCHAO = (
    "import importlib.metadata as md; _v = md.version\n"
    "def version(name):\n"
    "    if name == 'torchao': raise md.PackageNotFoundError(name)\n"
    "    return _v(name)\n"
    "md.version = version"
)
ENV_CASES = [
    ("", BAD_FLOAT8[0][0], BAD_FLOAT8[0][1]),
    ("", BAD_FLOAT8[2][0], BAD_FLOAT8[2][1]),
    ("", BAD_FLOAT8[3][0], BAD_FLOAT8[3][1]),
    (
        PATCH_OLD_SM,
        ["--float8.enable_float8_linear"],
        "float8.enable_float8_linear: NVIDIA A100-SXM4-80GB (capability 8.0) has no float8 matmuls (needs 8.9+",
    ),
    (
        PATCH_TORCHAO_VERSION.format(version="0.9.1"),
        ["--float8.enable_float8_linear"],
        "needs torchao>=0.18, found 0.9.1",
    ),
    (PATCH_NO_TORCHAO, ["--float8.enable_float8_linear"], "needs torchao, which is not installed"),
]


@pytest.mark.slow  # six subprocesses that import torch (and torchao): ~50 s on a loaded 2-core machine
@pytest.mark.parametrize(
    "patch,argv,message", ENV_CASES, ids=["rowwise_all_gather", "precompute", "flag_off", "sm80", "old", "missing"]
)
def test_entry_point_exits_2_with_one_line(patch: str, argv: list[str], message: str) -> None:
    """`python train.py ...` (with a patch applied first where the machine cannot show the case) exits 2."""
    code = f"{patch}\nimport sys, train\nsys.exit(train.main(sys.argv[1:]))"
    argv = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", "/tmp/kiln_f8_invalid", *argv]
    proc = run_python(code, *argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "Training" not in proc.stdout  # nothing was built


def test_gpu_capability_check_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from float8.environment import check_float8_environment

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: f"GPU{i}")
    caps = {0: (9, 0), 1: (8, 6)}  # one H100-class GPU, one RTX 30xx-class
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[i])
    with pytest.raises(ConfigError, match=r"GPU1 \(capability 8.6\) has no float8 matmuls"):
        check_float8_environment(Float8(enable_float8_linear=True))
    check_float8_environment(Float8(enable_float8_linear=True, emulate=True))  # emulation needs no float8 GPU
    caps[1] = (8, 9)  # Ada (L4, RTX 40xx) has float8 tensor cores
    check_float8_environment(Float8(enable_float8_linear=True))


def test_float8_validation_import_is_light() -> None:
    code = "import sys, kiln_base.config, float8.environment\n"
    code += "assert 'torch' not in sys.modules and 'torchao' not in sys.modules"
    code += "\nimport float8.converter; assert 'torchao' not in sys.modules, 'converter imports torchao eagerly'"
    run_python(code, check=True)


# ----------------------------------------------------------------------------- training


def train(tmp_path: Path, *overrides: str, steps: int = 20) -> Trainer:
    argv = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), "--training.seq_len", "64"]
    argv += ["--model.n_layers", "2"]
    argv += ["--training.local_batch_size", "4", "--training.steps", str(steps), "--training.seed", "0"]
    argv += ["--training.mixed_precision_param", "bfloat16"]  # bf16 autocast, as asked: the single-device path
    argv += ["--optimizer.lr", "8e-4", "--lr_scheduler.warmup_steps", "2"]  # what the tolerances were measured at
    return run_trainer([*argv, "--activation_checkpoint.mode", "none", *overrides])


def _tail_mean(losses: list[float], n: int = 10) -> float:
    return sum(losses[-n:]) / n


@pytest.fixture(scope="module")
def baseline_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The high-precision baseline: float8 off, fp32 compute. (bf16 autocast without float8 would be the closer
    baseline, but on a CPU without bf16 matrix units its 20 steps take minutes; float8's matmuls do not.)"""
    return train(tmp_path_factory.mktemp("fp32"), "--training.mixed_precision_param", "float32").losses


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    [
        "tensorwise",
        pytest.param("rowwise", marks=needs_cpu_rowwise),
        pytest.param("rowwise_with_gw_hp", marks=needs_cpu_rowwise),
    ],
)
def test_float8_recipe_tracks_bf16(
    recipe: str, baseline_losses: list[float], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """20 steps of the 2-block debug model, same seed and data, bf16 autocast compute over fp32 master weights
    (the single-device path), against the fp32 baseline.

    Tolerance 1% on the mean of the last 10 losses. The runs are deterministic, so this is not about noise:
    measured here, the three recipes land within 0.06% of the fp32 baseline (mean of the last 10: 7.085 vs
    7.081; docs/float8.md has 200-step runs) while the loss falls from 8.2 to 7.1; 1% leaves room for other
    CPUs' kernels and still fails a run whose float8 casts are broken (an input scaled by 2 lands 18% off).
    rowwise_with_gw_hp under CPU autocast is the case that crashed before kiln's input-cast hook.
    """
    caplog.set_level(logging.INFO, logger="kiln")
    trainer = train(
        tmp_path, "--float8.enable_float8_linear", "--float8.recipe_name", recipe, "--metrics.peak_tflops", "1"
    )
    losses = trainer.losses
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert baseline_losses[0] - _tail_mean(baseline_losses) > 1.0  # the baseline learns
    gap = abs(_tail_mean(losses) - _tail_mean(baseline_losses)) / _tail_mean(baseline_losses)
    print(f"{recipe}: last-10 mean {_tail_mean(losses):.4f} vs fp32 {_tail_mean(baseline_losses):.4f} ({gap:.3%})")
    assert gap < 0.01, (losses, baseline_losses)
    assert losses != baseline_losses  # float8 really ran
    assert type(trainer.model.layers["0"].attention.wq).__name__ == "Float8Linear"
    # mfu against the bf16 peak (1 TFLOP/s here), mfu_fp8 against the float8 peak (2x): exactly half.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    mfu, mfu_fp8 = (float(x) for x in re.search(r"mfu: ([\d.]+)%.*mfu_fp8: ([\d.]+)%$", lines[-1]).groups())
    assert mfu_fp8 == pytest.approx(mfu / 2, abs=0.011)


ROWWISE_FP32 = ["--float8.enable_float8_linear", "--float8.recipe_name", "rowwise"]
ROWWISE_FP32 += ["--training.mixed_precision_param", "float32"]


@pytest.mark.slow
@needs_cpu_rowwise
def test_rowwise_single_device_fp32_compute(baseline_losses: list[float], tmp_path: Path) -> None:
    """The seed's 1-GPU failure: rowwise with fp32 weights and no mixed precision. torchao>=0.18 asks the rowwise
    kernel for bf16 and upcasts, so this trains and tracks the bf16 run (measured: within 0.1%)."""
    losses = train(tmp_path, *ROWWISE_FP32).losses
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert abs(_tail_mean(losses) - _tail_mean(baseline_losses)) / _tail_mean(baseline_losses) < 0.01


@pytest.mark.slow
@needs_cpu_rowwise
def test_rowwise_fp32_compiled_matches_eager(tmp_path: Path) -> None:
    """Same, with --training.compile (inductor, per block): 3 steps match eager. Compiling costs ~50 s of CPU
    on a cold cache, so the model is small (2 blocks: one compiled graph serves both; seq 32, batch 2) and the
    run short; the eager test above shows the longer trajectory. At this size the loss is noisy step to step
    (measured eager: 8.42, 8.24, 8.36, 8.11, 7.87 at lr 3e-3), so 5 steps at lr 3e-3 show it fall."""
    small = [*ROWWISE_FP32, "--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "2"]
    small += ["--optimizer.lr", "3e-3"]
    compiled = train(tmp_path / "compiled", *small, "--training.compile", steps=5).losses
    eager = train(tmp_path / "eager", *small, steps=5).losses
    assert compiled[-1] < compiled[0]
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- FSDP precompute hook


def test_precompute_hook_is_a_noop_without_fsdp_sharded_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 16, bias=False))
    conv = Float8Converter(
        Float8(
            enable_float8_linear=True,
            enable_fsdp_float8_all_gather=True,
            precompute_float8_dynamic_scale_for_fsdp=True,
            filter_fqns=[],
        )
    )
    conv.convert(model)
    before = [p.detach().clone() for p in model.parameters()]
    conv.post_optimizer_hook(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # float8-all-gather weights exist, but not FSDP-sharded ones: nothing was precomputed.
    assert all(type(p).__name__ == "WeightWithDynamicFloat8CastTensor" for p in model.parameters())
    assert all(p._precomputed_scale is None for p in model.parameters())


def _fsdp_precompute_rank(dump: str) -> tuple[int, list[float]]:
    from torch.distributed.tensor import DTensor

    argv = tiny_run_args(
        *("--job.dump_folder", dump, "--training.steps", "3", "--training.seed", "0"),
        *("--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather"),
        "--float8.precompute_float8_dynamic_scale_for_fsdp",
    )
    with open_trainer(argv) as trainer:
        trainer.train()
        fp8_max = torch.finfo(torch.float8_e4m3fn).max
        checked = 0
        for name, mod in trainer.model.named_modules():
            if type(mod).__name__ != "Float8Linear":
                continue
            w = mod.weight
            assert isinstance(w, DTensor), name
            scale = w._local_tensor._precomputed_scale  # set by the hook after the last optimizer step
            full_amax = w.full_tensor().abs().max().double().clamp(min=1e-12)
            torch.testing.assert_close(scale, (fp8_max / full_amax).float(), rtol=1e-6, atol=0)
            checked += 1
        return checked, trainer.losses


@pytest.mark.distributed
def test_precompute_hook_sets_global_scales_under_fsdp(tmp_path: Path) -> None:
    """2 gloo ranks, FSDP2 with float8 all-gather: after each step every shard's precomputed scale is the
    scale of the whole (unsharded) weight, i.e. the hook ran and all-reduced the amaxes."""
    results = run_distributed(_fsdp_precompute_rank, 2, str(tmp_path))
    assert results[0][0] == results[1][0] == 42
    assert results[0][1] == results[1][1] and all(math.isfinite(x) for x in results[0][1])


def test_cpu_rowwise_needs_a_cpu_kernel_with_row_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch whose CPU _scaled_mm takes per-tensor scales only (2.11), a rowwise CPU run is a config error
    naming the recipe and the ways out, not an internal assert at the first matmul."""
    import kiln_base.internals
    from float8.environment import check_cpu_float8

    monkeypatch.setattr(kiln_base.internals, "cpu_scaled_mm_supports_rowwise", lambda: False)
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        with pytest.raises(ConfigError, match=f"float8.recipe_name {recipe}: torch .* per-tensor scales only"):
            check_cpu_float8(Float8(enable_float8_linear=True, recipe_name=recipe))
    check_cpu_float8(Float8(enable_float8_linear=True, recipe_name="tensorwise"))
    check_cpu_float8(Float8(enable_float8_linear=True, recipe_name="rowwise", emulate=True))
    check_cpu_float8(Float8(enable_float8_linear=False))
