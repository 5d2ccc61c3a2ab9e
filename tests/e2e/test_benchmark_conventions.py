"""benchmarks/run.py gives MFU and TFLOP/s under both FLOP conventions (attention full and causal), from the row's
start-up line, and derives a torchtitan row's causal figures from a kiln row of the same preset."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import run

START = (
    "INFO Model llama3 8B: 8 layers, 2,802,061,312 params, vocab 128256, seq 8192; FLOPs/token: 29.000 G attention "
    "full (torchtitan, PaLM), 26.000 G causal (Megatron-LM); MFU and TFLOP/s count {used} (metrics.attention_flops)"
)
STEP = "step:  {n}  loss:  8.0000  memory: 40.00GiB(50.00%)  tps: 10,000  mfu: {mfu}%  grad_norm:  1.0000"


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, used: str, mfu: float) -> run.Row:
    script = tmp_path / f"fake_{used}.py"
    lines = [START.format(used=used), *(STEP.format(n=n, mfu=mfu) for n in (1, 2, 3))]
    script.write_text("".join(f"print({line!r})\n" for line in lines))
    monkeypatch.setattr(run, "train_args", lambda *a: [])
    popen = run.subprocess.Popen
    monkeypatch.setattr(run.subprocess, "Popen", lambda cmd, **kw: popen([cmd[0], str(script)], **kw))
    row = run.Row("llama3_8b_8l", "bf16", True, "op", 1, warmup=1, steps=2, tokens_per_step=8192)
    return run.run_one(row, run.PRESETS["tiny"], [], tmp_path, timeout=60)


@pytest.mark.parametrize("used", ["full", "causal"])
def test_both_conventions_from_either_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, used: str) -> None:
    """tps 10,000 x 29 / 26 GFLOP: 290 / 260 TFLOP/s; the logged mfu is rescaled to the other convention."""
    logged = 29.0 if used == "full" else 26.0  # the same run's mfu, as printed under each setting
    row = _run(tmp_path, monkeypatch, used, logged)
    assert (row.gflops_per_token, row.gflops_per_token_causal) == (29.0, 26.0)
    assert row.mfu_full == pytest.approx(29.0) and row.mfu_causal == pytest.approx(26.0)
    assert row.tflops_full == pytest.approx(290.0) and row.tflops_causal == pytest.approx(260.0)
    line = run.md_line(run.append_row(tmp_path, row))
    assert "| 29.00% / 26.00% | 290.0 / 260.0 |" in line, line


def test_a_torchtitan_row_gets_causal_figures_from_its_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run.append_row(tmp_path, _run(tmp_path, monkeypatch, "full", 29.0))
    tt = run.Row("llama3_8b_8l", "bf16", True, "op", 1, 1, 2, 8192, tps=9000.0, mfu=26.1, engine="torchtitan")
    run.fill_conventions(tt, used="full")
    record = run.append_row(tmp_path, tt)
    assert record["mfu_causal"] == pytest.approx(26.1 * 26 / 29) and record["tflops_causal"] == pytest.approx(234.0)
    assert "| 26.10% / 23.40% | 261.0 / 234.0 |" in run.summary(tmp_path)
