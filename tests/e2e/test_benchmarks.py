"""benchmarks/run.py (row selection, per-row JSONL/markdown, speedups, timeouts) and benchmarks/row.py's block timer."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from benchmarks import row as bench_row
from benchmarks import run
from benchmarks.row import BlockTimer
from trainer.hooks import StepOutput

MATRIX = [("bf16", True, "op"), ("tensorwise", True, "op"), ("rowwise", True, "op")]


def test_rows_select_by_index_range_and_id() -> None:
    assert run.select(MATRIX, None) == [0, 1, 2]
    assert run.select(MATRIX, "2,0-1") == [2, 0, 1]
    assert run.select(MATRIX, "rowwise/compile/ac-op,0") == [2, 0]
    with pytest.raises(ValueError, match="out of range 0-2"):
        run.select(MATRIX, "3")
    with pytest.raises(ValueError, match="not an index, a range or one of"):
        run.select(MATRIX, "rowwise")


def _row(precision: str, tps: float, blocks_ms: float, error: str | None = None) -> run.Row:
    row = run.Row("p", precision, True, "op", 1, 2, 4, tokens_per_step=8192, tps=tps, blocks_ms=blocks_ms)
    row.step_ms, row.measured_steps, row.error = 1e3 * 8192 / tps, 4, error
    row.args = ["--model.n_layers", "8", "--training.seq_len", "8192", "--float8.recipe_name", precision]
    return row


def test_rows_are_appended_one_by_one_with_speedups(tmp_path: Path) -> None:
    first = run.append_row(tmp_path, _row("tensorwise", 1200.0, 600.0))  # before its bf16 baseline: no speedup
    assert first["speedup"] is None
    run.append_row(tmp_path, _row("bf16", 1000.0, 800.0))
    third = run.append_row(tmp_path, _row("rowwise", 1100.0, 640.0))
    assert third["speedup"] == pytest.approx(1.1) and third["blocks_speedup"] == pytest.approx(1.25)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["precision"] for r in records] == ["tensorwise", "bf16", "rowwise"]
    md = (tmp_path / "results.md").read_text().splitlines()
    assert md[0].startswith("| preset | row |") and len(md) == 2 + 3
    assert "| p | rowwise/compile/ac-op | 1,100 |" in md[-1] and "| 1.10x | 1.25x |" in md[-1]
    # The summary recomputes every speedup against the final bf16 row: the early tensorwise row gets its own.
    summary = run.summary(tmp_path)
    assert "| p | tensorwise/compile/ac-op | 1,200 |" in summary and "| 1.20x | 1.33x |" in summary


def test_another_shape_is_not_a_baseline(tmp_path: Path) -> None:
    run.append_row(tmp_path, _row("bf16", 1000.0, 800.0))
    other = _row("rowwise", 1100.0, 640.0)
    other.args[1] = "4"  # 4 layers: not comparable with the 8-layer bf16 row
    assert run.append_row(tmp_path, other)["speedup"] is None


def test_a_row_that_times_out_is_killed_and_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-row timeout kills the row's whole process group and keeps what it measured."""
    script = tmp_path / "slow.py"
    script.write_text(
        "import time\n"
        "print('step:  1  loss:  8.0000  memory:  0.10GiB(1.00%)  tps: 100  mfu: n/a', flush=True)\n"
        "print('step:  2  loss:  7.0000  memory:  0.20GiB(2.00%)  tps: 200  mfu: n/a', flush=True)\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(run, "train_args", lambda *a: [])
    popen = run.subprocess.Popen

    def fake_popen(cmd: list[str], **kw: object) -> object:
        return popen([cmd[0], str(script)], **kw)

    monkeypatch.setattr(run.subprocess, "Popen", fake_popen)
    row = run.Row("p", "bf16", False, "none", 1, warmup=1, steps=3, tokens_per_step=100)
    t0 = time.perf_counter()
    out = run.run_one(row, run.PRESETS["tiny"], [], tmp_path, timeout=5)
    assert time.perf_counter() - t0 < 40
    assert out.error == "timeout after 5 s (1 of 3 measured steps)"
    assert (out.tps, out.memory_gib, out.final_loss, out.step_ms) == (200.0, 0.2, 7.0, 500.0)
    assert "tps: 200" in (tmp_path / "logs" / "bf16_eager_ac-none.log").read_text()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def test_block_timer_times_forward_and_backward_of_measured_steps() -> None:
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": _Block(), "1": _Block()})
    emb = nn.Linear(64, 64)  # the step's part before the blocks: its output requires grad
    timer = BlockTimer(model, warmup=1, cuda=False)
    for step in (1, 2, 3):
        timer.pre_step(step)
        for _micro in range(2):  # gradient accumulation: both micro-batches count
            h = emb(torch.randn(256, 64))
            for block in model.layers.values():
                h = block(h)
            h.square().mean().backward()
        timer.post_step(StepOutput(step, step == 3, torch.zeros(()), torch.zeros(()), 0.0))
    timer.close()
    assert len(timer.per_step) == 2  # step 1 is warm-up
    assert all(f > 0 and b > 0 for f, b in timer.per_step)
    assert timer.summary().startswith("blocks: ") and "median of 2 steps" in timer.summary()
    assert run.BLOCKS.search(timer.summary())


def test_torchtitan_step_line_parses() -> None:
    """torchtitan 0.2.2's step line (components/metrics.py, colours off) as run.py reads it for --engine torchtitan."""
    line = (
        "[rank0]:[titan] 2026-11-23 12:00:00,000 - root - INFO - step:  5  loss:  7.12345  grad_norm:  1.2345  "
        "memory: 40.12GiB(50.63%)  tps: 1,234  tflops: 321.23  mfu: 32.47%"
    )
    m = run.TT_STEP.search(line)
    assert m and (m["step"], m["loss"], m["mem"], m["tps"], m["mfu"]) == ("5", "7.12345", "40.12", "1,234", "32.47%")


def test_gpu_bundle_check_uses_the_presets_shape() -> None:
    """scripts/check_gpu_bundle.py compares torchtitan's 8B_8L with kiln's llama3_8b_8l model built from its own copy
    of the preset's shape flags (entry points do not import each other): the copy must match the preset."""
    from scripts.check_gpu_bundle import KILN_SHAPE

    preset = run.PRESETS["llama3_8b_8l"]
    every = ["--job.config_file", preset["config"], *preset["args"]]
    keys = ("--job.config_file", "--model.n_layers", "--model.vocab_size", "--training.seq_len")
    for key in (*keys, "--training.local_batch_size"):
        assert run._flag(KILN_SHAPE, key, "") == run._flag(every, key, "?"), key


def test_the_moe_gpu_preset_plans_on_a_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """--check dry-runs every row of the MoE GPU preset here: bf16, Linear-only float8 rowwise (the routers' gates
    and the output layer kept high precision) and MXFP8 parse, build on meta and fit an 80 GB GPU by the estimate;
    a row that does not plan exits 1 naming it."""
    assert run.main(["--preset", "qwen3_30b_a3b_4l", "--check"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ": plans; " in line]
    assert [line.split(":")[0] for line in lines] == [
        "bf16/compile/ac-op",
        "rowwise/compile/ac-op",
        "mxfp8_rceil/compile/ac-op",
    ]
    assert all("parameters: 3,114,814,464 total, 849,890,304 active per token" in line for line in lines), lines
    assert "float8: 16/21 Linears converted (recipe rowwise)" in lines[1]
    assert "float8: 16/21 Linears converted (recipe mxfp8_rceil)" in lines[2]
    total = re.search(r"total ([\d.]+) GiB", lines[0])
    assert total and float(total.group(1)) < 80, lines[0]
    assert run.main(["--preset", "qwen3_30b_a3b_4l", "--check", "--rows", "0", "--", "--model.flavor", "9B"]) == 1
    assert "bf16/compile/ac-op: does not plan: model.flavor '9B'" in capsys.readouterr().out


def test_kernel_categories_of_h200_kernel_names() -> None:
    """Names from the 2026-11-26 H200 profile (docs/performance.md): Inductor's fused kernels are named after every
    op they fuse, the matmul feeding them included, and are never counted as GEMMs."""
    names = {
        "nvjet_sm90_qqtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT": "gemm",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
        "triton_tem_fused_mm_1": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128": "attention",
        "triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_clone_exp2_floor_log2_mul_reciprocal": "casts/amax",
        "triton_poi_fused__to_copy_clamp_exp2_floor_log2_mul_reciprocal_t_20": "casts/amax",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norms",
        "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>": "optimizer",
        "triton_poi_fused_mul_silu_3": "other",
    }
    assert {n: bench_row.category(n) for n in names} == names


def test_kernel_breakdown_counts_overlap_once_for_idle() -> None:
    spans = [("nvjet_gemm", 0.0, 40.0), ("flash_fwd", 30.0, 50.0), ("triton_poi_fused_amax", 70.0, 80.0)]
    parts = bench_row.breakdown(spans, window_us=100.0)  # shares are of kernel time + idle (110 us here)
    assert (parts["gemm"], parts["attention"], parts["casts/amax"]) == (40.0, 20.0, 10.0)
    assert parts["idle"] == 100.0 - 60.0  # busy 0-50 and 70-80
    line = bench_row.format_breakdown(parts, steps=2)
    assert line.startswith("kernels: ") and "idle 36.4% (0.04 ms) of 0.11 ms" in line and line.endswith("over 2 steps")


def test_profiled_steps_are_left_out_of_the_measured_ones(tmp_path: Path) -> None:
    """--profile N: the last N steps are profiled (a kernels line) and neither the step medians nor the block
    timer count them."""
    code = run.main(
        ["--preset", "tiny", "--precision", "bf16", "--warmup", "1", "--steps", "2", "--profile", "1"]
        + ["--out", str(tmp_path)]
    )
    assert code == 0
    (row,) = run.load_rows(tmp_path)
    assert row["error"] is None and row["measured_steps"] == 2
    assert row["kernels"].startswith("kernels: ") and row["kernels"].endswith("over 1 steps")
    log = (tmp_path / "logs" / "bf16_eager_ac-none.log").read_text()
    assert "step:  4" in log and "median of 2 steps" in log


def test_kiln_cuda_step_line_extras_parse() -> None:
    line = (
        "02:50:59 INFO step:  5  loss:  7.7183  memory: 43.96GiB(31.44%)  tps: 33,922  mfu: 57.77%  grad_norm:  1.0"
        "  lr: 1.2500e-04  data: 0.0%  eta: 0:00:01  active: 41.99GiB  mfu_fp8: 28.77%"
    )
    assert run.STEP.search(line)
    assert run.ACTIVE.search(line)["active"] == "41.99" and run.MFU_FP8.search(line)["mfu_fp8"] == "28.77"


def test_inductor_knob_sets_and_restores_nothing_else() -> None:
    """--bench.inductor key=value: dotted keys, booleans and ints converted; an unknown key fails naming it."""
    import torch._inductor.config as inductor_config

    from kiln_base.internals import set_inductor_option

    with inductor_config.patch({"triton.tile_reductions": True, "max_autotune_gemm_search_space": "DEFAULT"}):
        set_inductor_option("triton.tile_reductions=false")
        assert inductor_config.triton.tile_reductions is False
        set_inductor_option("max_autotune_gemm_search_space=EXHAUSTIVE")
        assert inductor_config.max_autotune_gemm_search_space == "EXHAUSTIVE"
    with pytest.raises(AttributeError, match="no_such_option"):
        set_inductor_option("triton.no_such_option=1")


def test_projection_adds_the_measured_parts_of_a_32_layer_step() -> None:
    """The 8-GPU projection: 8 measured blocks x 4, the rest of the step as measured, the optimizer over the 8B's
    parameters / 8 GPUs, and the communication FSDP cannot hide; tokens/s per GPU = seq / step."""
    from benchmarks import projection

    row = {
        "precision": "tensorwise",
        "step_ms": 215.8,
        "blocks_ms": 141.3,
        "kernels": "kernels: gemm 46.6% (211.21 ms), optimizer 14.7% (66.54 ms), idle 3.7% (16.71 ms) of 453 ms "
        "over 2 steps",
    }
    parts = projection.parts_of(row)
    assert parts == projection.Parts("tensorwise", 215.8, 141.3, 33.27)
    measured, full = projection.shape(8), projection.shape(32)
    assert (measured.params, full.params) == (2_795_573_248, 8_030_261_248)
    assert (measured.n_layers, full.n_layers, full.embedding_params) == (8, 32, 128256 * 4096)
    free = projection.project(parts, measured, full, gpus=8, link_gbs=1e12)  # communication costs nothing
    optimizer = 33.27 * (full.params / 8) / measured.params
    assert free.exposed_comm_ms == pytest.approx(0, abs=1e-6)
    assert free.step_ms == pytest.approx(141.3 * 4 + (215.8 - 141.3 - 33.27) + optimizer)
    assert free.tps == pytest.approx(8192 / (free.step_ms / 1e3))
    slow = projection.project(parts, measured, full, gpus=8, link_gbs=350.0)
    assert 5 < slow.exposed_comm_ms < 30 and slow.block_comm_ms < slow.blocks_ms / 32  # overlappable per block
    fp8 = projection.project(parts, measured, full, gpus=8, link_gbs=350.0, fp8_allgather=True)
    assert fp8.block_comm_ms < slow.block_comm_ms
    assert projection.parts_of({**row, "kernels": None}) is None  # no profile, no optimizer time: no projection


def test_optimizer_benchmark_times_each_variant_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import optimizer_step

    assert optimizer_step.step_bytes(10, 4) == 10 * 28 and optimizer_step.step_bytes(10, 2) == 10 * 20
    assert optimizer_step.main(["--flavor", "debugmodel", "--steps", "1", "--variants", "fused,foreach"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| fused |") or line.startswith("| foreach |")]
    assert len(rows) == 2 and all("failed" not in r for r in rows)
    assert float(rows[0].split("|")[2]) > 0
