"""metrics.attention_flops: which FLOP count MFU and TFLOP/s use; the start-up lines state both counts and the
convention, and the dry run prints the same line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.helpers.common import open_trainer, tiny_run_args


@pytest.mark.parametrize("convention", ["full", "causal"])
def test_mfu_uses_the_stated_convention(convention: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from models import flops_per_token

    caplog.set_level(logging.INFO, logger="kiln")
    argv = tiny_run_args(
        *("--training.steps", "1", "--metrics.peak_tflops", "1e-6", "--model.n_layers", "1"),
        *("--metrics.attention_flops", convention, "--job.dump_folder", str(tmp_path)),
    )
    with open_trainer(argv) as trainer:
        trainer.train()
        model, args = trainer.model, trainer.model.model_args
        counts = {c: flops_per_token(args, model, 32, c) for c in ("full", "causal")}
    assert counts["full"] - counts["causal"] == 6 * 1 * 16 * 16 * 32  # 6 L H Q T: half the attention matmuls
    assert trainer.flops_per_token == counts[convention]
    text = caplog.text
    line = f"FLOPs/token: {counts['full'] / 1e9:.3f} G attention full (torchtitan, PaLM), {counts['causal'] / 1e9:.3f}"
    assert line in text and f"MFU and TFLOP/s count {convention} (metrics.attention_flops)" in text
    how = "in full, as torchtitan" if convention == "full" else "causal (half), as Megatron-LM"
    assert f"FLOPs with attention counted {how}" in text


def test_dry_run_states_both_counts() -> None:
    from kiln_base.config import parse_args
    from trainer.tools.dry_run import dry_run

    argv = ["--model.flavor", "8B", "--model.vocab_size", "128256", "--training.seq_len", "8192", "--job.dry_run"]
    text = dry_run(parse_args(argv))
    assert "FLOPs/token: 57.914 G attention full (torchtitan, PaLM), 51.472 G causal (Megatron-LM)" in text, text
