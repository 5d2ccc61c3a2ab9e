"""The gradients a layout's run is compared with one process's by."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from trainer.hooks import StepHook


class GradsAtStep1(StepHook):
    """Each parameter's gradient after step 1 (clipped, as the optimizer used it), whole (a DTensor's gathered), by
    name. Read as the step ends, before any post-step hook (a validation through a pipeline's schedule with FSDP
    leaves no gradients behind)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.grads = model, {}

    @contextlib.contextmanager
    def _read_after(self) -> Iterator[None]:
        yield
        for name, p in self.model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            self.grads[name] = g.detach().clone()

    def step_context(self, step: int) -> contextlib.AbstractContextManager:
        return self._read_after() if step == 1 else contextlib.nullcontext()
