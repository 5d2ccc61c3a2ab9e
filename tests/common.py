"""What many tests share: the repo root and the arguments of a tiny, exact (fp32) debug-model run."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = str(ROOT / "train_configs" / "debug_model.toml")


def tiny_run_args(*extra: str, ac: str = "none") -> list[str]:
    """train.py arguments for the debug model at seq 32, batch 2, fp32 compute, then `extra` (later wins).

    Steps, lr and warm-up are pinned to the values the tests were written and measured with (the debug config's
    are tuned for the README's first run)."""
    return [
        *("--job.config_file", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2"),
        *("--training.steps", "10", "--optimizer.lr", "8e-4", "--lr_scheduler.warmup_steps", "2"),
        *("--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", ac),
        *extra,
    ]
