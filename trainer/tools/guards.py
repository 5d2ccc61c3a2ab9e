"""NaN/inf guard: stop a run whose loss or gradient norm went non-finite, before it can save a bad state.

Every step records, on the device and without a host sync, the first step whose loss or local grad norm was
not finite. The verdict is read (one all-reduce + one sync) only on log steps and right before a checkpoint
save, so non-log steps stay sync-free (docs/performance.md) and no checkpoint is ever written after a bad
step. The price: weights in memory may already hold the bad update when the run stops; every checkpoint on
disk is from before it, and the error names the newest one to resume from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln_base.errors import NonFiniteError


def last_checkpoint(folder: str) -> str:
    """The newest complete `step-N` checkpoint in `folder` (unfinished `.tmp` saves never count), or 'none'."""
    from trainer.components.checkpoint import complete_steps, step_dir

    steps = complete_steps(folder)
    return step_dir(folder, steps[-1]) if steps else "none"


class NonFiniteGuard:
    _FINE = 2**62  # sentinel: no bad step seen; MIN over ranks then gives the earliest bad step anywhere

    def __init__(self, device: torch.device) -> None:
        self.first_bad = torch.full((), self._FINE, dtype=torch.long, device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Device-side bookkeeping only: no sync, no collective (a DTensor norm is checked on its local part)."""
        if hasattr(grad_norm, "to_local"):
            grad_norm = grad_norm.to_local()
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.first_bad = torch.where(bad, torch.minimum(self.first_bad, torch.tensor(step)), self.first_bad)

    def check(self, checkpoint_folder: str) -> None:
        """Raise NonFiniteError on every rank if any rank saw a non-finite value (syncs; log/save steps only)."""
        first_bad = self.first_bad.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        step = int(first_bad.item())
        if step != self._FINE:
            raise NonFiniteError(
                f"non-finite loss or grad norm at step {step}; stopped before any later checkpoint save. "
                f"Last good checkpoint: {last_checkpoint(checkpoint_folder)}"
            )
