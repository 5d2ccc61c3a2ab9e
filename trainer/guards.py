"""NaN/inf guard: stop before a non-finite loss or gradient reaches the weights or a checkpoint.

The check runs every step between gradient clipping and the optimizer step, so the weights, the optimizer
state and every checkpoint already on disk stay as they were. Cost: reading the verdict is one host-device
sync per step on CUDA (free on CPU). There is no sync-free way to *stop* a run: GradScaler-style skipping
and clip_grad_norm_(error_if_nonfinite=True) sync too. The sync comes after backward, when the GPU queue
is nearly drained anyway, so it costs little next to a corrupted run.
"""

from __future__ import annotations

import os
import re

import torch


class NonFiniteError(RuntimeError):
    """Training produced a NaN or inf loss or gradient norm; the run stops (exit 1)."""


def last_checkpoint(folder: str) -> str:
    """The newest `step-N` checkpoint in `folder`, or 'none'."""
    steps = []
    if os.path.isdir(folder):
        steps = [int(m.group(1)) for e in os.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", e))]
    return os.path.join(folder, f"step-{max(steps)}") if steps else "none"


def check_finite(step: int, loss: torch.Tensor, grad_norm: torch.Tensor, checkpoint_folder: str) -> None:
    """Raise NonFiniteError naming the step and the last good checkpoint if loss or grad norm is not finite."""
    if hasattr(grad_norm, "full_tensor"):  # DTensor: clip_grad_norm_ already reduced it (Replicate)
        grad_norm = grad_norm.full_tensor()
    ok = torch.isfinite(loss) & torch.isfinite(grad_norm)
    if not ok.item():  # the one host-device sync per step
        raise NonFiniteError(
            f"non-finite values at step {step}: loss {loss.item()}, grad_norm {grad_norm.item()}; stopped before "
            f"the optimizer step (weights and checkpoints untouched). Last good checkpoint: "
            f"{last_checkpoint(checkpoint_folder)}"
        )
