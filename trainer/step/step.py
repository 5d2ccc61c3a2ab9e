"""The training step as an object: built once from the plan (trainer/build.py `step`), called once per step.

It owns everything between "the loop wants step N" and "step N's update is applied": reading the step's
micro-batches, each rank's part of them (context parallelism), the forward under the compute precision and loss
parallel, the loss and its backward, the gradient norm and clip, the optimizer and LR-schedule step. Validation
and downstream evaluation use the same forward (`evaluate`, `log_likelihood`), and the eval batch layout is the
step's too (`eval_layout`). Two variants, chosen once by the build: `TrainStep` (the whole model on this rank) and
`PipelineStep` (this rank's stages, through the pipeline's schedule).

What changes a step without being part of every step wraps it through `StepWrapper`'s few calls, at fixed points:
fault tolerance (the quorum before the step, the gradient average after backward, the commit before the update),
the non-finite skip (around the update) and an MoE's load balancing (the aux loss added to each micro-batch's
backpropagated loss, the expert bias after the update, their logged values). A new step-level feature is a wrapper
(or a change here) and a line in the build; the Trainer's loop does not change. The step never logs on its own,
syncs with the host, or saves.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim.lr_scheduler import LambdaLR

from float8.converter import Float8Converter
from parallelisms.context_parallel import ContextParallel
from parallelisms.grad_norm import clip_grad_norm_
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import Pipeline
from trainer.checkpoint.resume import TrainState
from trainer.components.loss import LossFn, row_log_likelihood
from trainer.evaluation.downstream import Layout


@dataclass
class Batch:
    """The part of a micro-batch this rank computes: token ids and labels (bs, seq) and, under context parallelism,
    the tokens' positions in their sequences and the loss normalizer (ContextParallel.shard_batch); under a document
    mask over token files, the tokens' document ids (trainer/data/documents.py)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    normalizer: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None


@dataclass
class StepResult:
    loss: torch.Tensor  # the language-model loss: mean over micro-batches (and live replica groups), on the device
    grad_norm: torch.Tensor  # global norm before clipping (parallelisms/grad_norm.py)
    lr: float | torch.Tensor  # the lr the update applied (on the device under training.skip_nonfinite_steps)
    data_time: float  # seconds spent waiting for the step's batches
    applied: bool = True  # False: the update was not applied on any rank (fault tolerance); the loop runs it again
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)  # further per-step values a model or wrapper adds


class StepWrapper:
    """What wraps the step, at fixed points; every call is a no-op here. `start` runs before the loop takes the
    next step number (`progress.step` may move: a healing replica group); the rest inside step `step`."""

    def start(self, progress: TrainState) -> None:
        """Before the step's number is taken and before any of its batches is read."""

    def gradients_ready(self, loss: torch.Tensor) -> torch.Tensor:
        """After backward, before the clip: the step's loss as it is to be logged (and the gradients, in place)."""
        return loss

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        """After each micro-batch's forward (TrainStep's; a pipeline's schedule backpropagates its own loss): the
        loss its backward runs on, given the language-model loss. The step still returns and logs the latter."""
        return loss

    def may_update(self, step: int) -> bool:
        """Before the update: False drops it on this rank (every rank decides alike)."""
        return True

    def around_update(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor
    ) -> contextlib.AbstractContextManager:
        """Entered around the optimizer step."""
        return contextlib.nullcontext()

    def applied_lr(self, lr: float | torch.Tensor) -> float | torch.Tensor:
        """The lr the update applied, given the schedule's."""
        return lr

    def after_update(self, step: int) -> None:
        """After the optimizer step, before the LR-schedule step."""

    def scalars(self) -> dict[str, torch.Tensor]:
        """After the update: further values of the step to log (StepResult.scalars), on the device."""
        return {}

    def close(self) -> None:
        """Once, when the run ends."""


class TrainStep:
    """The whole model on this rank: each micro-batch forward, loss and backward on its own."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: LambdaLR,
        dataloader: Iterator[tuple[torch.Tensor, ...]],  # (inputs, labels[, doc_ids]) batches (trainer/data/)
        dims: ParallelDims,
        grad_accum_steps: int,
        loss_fn: LossFn,
        amp: contextlib.AbstractContextManager,
        loss_parallel: bool,
        cp: ContextParallel | None,
        max_norm: float,
        device: torch.device,
        float8: Float8Converter | None = None,
        wrappers: Sequence[StepWrapper] = (),
        pipeline: Pipeline | None = None,  # PipelineStep's: this rank's stages and their schedule
    ) -> None:
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.dims, self.grad_accum_steps, self.device = dims, grad_accum_steps, device
        self.loss_fn, self.amp, self.loss_parallel, self.cp = loss_fn, amp, loss_parallel, cp
        self.max_norm = max_norm if max_norm > 0 else float("inf")
        self.float8, self.wrappers, self.pipeline = float8, list(wrappers), pipeline
        # foreach: batched kernels on CUDA. A CPU has none (torch loops over the tensors either way), and there the
        # first foreach dispatch over DTensors costs ~0.6 s of a 4-rank run's first step (sharding propagation).
        self.foreach = device.type == "cuda"
        self.norm_group: dist.ProcessGroup | None = None  # the ranks whose parameters make one model's norm

    # ------------------------------------------------------------------ the step

    def start(self, progress: TrainState) -> None:
        for w in self.wrappers:
            w.start(progress)

    def close(self) -> None:
        for w in self.wrappers:
            w.close()

    def __call__(self, step: int) -> StepResult:
        """Accumulate gradients over the step's micro-batches, clip, step the optimizer and LR schedule."""
        self.optimizer.zero_grad()
        loss_sum = torch.zeros((), device=self.device)
        data_time = 0.0
        for _ in range(self.grad_accum_steps):
            t0 = time.perf_counter()
            # A token-file batch of a document-masked run adds its tokens' document ids: docs = [doc_ids].
            inputs, labels, *docs = (t.to(self.device, non_blocking=True) for t in next(self.dataloader))
            data_time += time.perf_counter() - t0
            loss_sum += self.forward_backward(inputs, labels, *docs)
        loss = loss_sum / self.grad_accum_steps
        for w in self.wrappers:
            loss = w.gradients_ready(loss)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.max_norm, self.norm_group, self.foreach)
        lr: float | torch.Tensor = float(self.lr_scheduler.get_last_lr()[0])  # this step's, for the log
        if not all(w.may_update(step) for w in self.wrappers):
            return StepResult(loss, grad_norm, lr, data_time, applied=False)
        with contextlib.ExitStack() as around:
            for w in self.wrappers:
                around.enter_context(w.around_update(step, loss_sum, grad_norm))
            self.optimizer.step()
            if self.float8 is not None:
                self.float8.post_optimizer_hook(self.model)
        for w in self.wrappers:
            lr = w.applied_lr(lr)
            w.after_update(step)
        self.lr_scheduler.step()
        scalars = {name: value for w in self.wrappers for name, value in w.scalars().items()}
        return StepResult(loss, grad_norm, lr, data_time, scalars=scalars)

    # ------------------------------------------------------------------ the forward, for training and evaluation

    def local_batch(self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None) -> Batch:
        """What this rank computes of a micro-batch its data-parallel rank reads: all of it (with its document ids,
        when its data records them), or under context parallelism its part of every sequence, the tokens' positions
        and the loss normalizer (document masks are refused with CP: kiln_base/config/checks.py)."""
        if self.cp is None:
            return Batch(inputs, labels, doc_ids=doc_ids)
        assert doc_ids is None, "document masks with context parallelism are refused at config time"
        return Batch(*self.cp.shard_batch(inputs, labels))

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Loss parallel (TP): cross-entropy over vocab-sharded logits; the loss and its backward run inside."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def forward(self, batch: Batch, reduce: Callable[[torch.Tensor, Batch], torch.Tensor]) -> torch.Tensor:
        """The one forward: the model on this rank's part of the batch under the compute precision, then `reduce`
        (the loss, or each row's log-likelihood) on its logits. The caller holds loss_context()."""
        with self.amp:
            logits = self.model(batch.inputs, positions=batch.positions, doc_ids=batch.doc_ids)
        return reduce(logits, batch)

    def _loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.loss_fn(logits, batch.labels, batch.normalizer)

    def forward_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward and fp32 cross-entropy of one micro-batch (under context parallelism, of this rank's part)."""
        return self.forward(self.local_batch(inputs, labels, doc_ids), self._loss)

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One micro-batch: loss in fp32, scaled for gradient accumulation; returns the unscaled loss."""
        with self.loss_context():
            loss = objective = self.forward_loss(inputs, labels, doc_ids)
            for w in self.wrappers:
                objective = w.objective(objective)  # an MoE's aux loss (trainer/step/moe_balance.py)
            (objective / self.grad_accum_steps).backward()
        return _whole(loss).detach()

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Validation (the caller holds torch.no_grad): the batch's mean loss over this rank's tokens, as training
        computes it, without backward."""
        with self.loss_context():
            return _whole(self.forward_loss(inputs, labels, doc_ids))

    def log_likelihood(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Downstream evaluation (the caller holds torch.no_grad): per row, the summed log-likelihood of the labels
        that are not -100, (rows,), on every rank of the model replica (under context parallelism each rank scores
        its part of the rows, summed over the CP group)."""
        with self.loss_context():
            rows = self._rows(self.local_batch(inputs, labels))
        if self.cp is not None:
            dist.all_reduce(rows, group=self.dims.cp_mesh.get_group())
        return rows

    def _rows(self, batch: Batch) -> torch.Tensor:
        return self.forward(batch, lambda logits, b: row_log_likelihood(logits, b.labels))

    def global_mean(self, loss: torch.Tensor) -> float:
        """Mean over data- and context-parallel ranks; called on log steps only (.item() syncs with the host)."""
        if self.dims.dp_enabled or self.dims.cp_enabled:
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dims.loss_mesh.get_group())
        return loss.item()

    def eval_layout(self, compiled: bool) -> Layout:
        """How downstream evaluation pads its batches for this layout: every length a multiple of the ranks that
        split a sequence (TP x the CP chunks), and fixed lengths when compiled (no recompiles)."""
        dims = self.dims
        return Layout(
            dp_rank=dims.dp_mesh.get_local_rank(),
            dp_degree=dims.dp_degree,
            dp_group=dims.dp_mesh.get_group() if dims.dp_degree > 1 else None,
            quantum=dims.tp * (self.cp.layout.n_chunks if self.cp is not None else 1),
            shapes="fixed" if compiled else self._free_shapes,
        )

    _free_shapes = "tight"  # the lengths uncompiled batches take: as long as their longest row


class PipelineStep(TrainStep):
    """This rank's pipeline stages: every micro-batch through every stage by the pipeline's schedule, the loss on
    every rank of the pipeline, the gradient norm combined over the pipeline's ranks."""

    _free_shapes = "divisors"  # the schedule splits a batch into micro-batches of its rows

    pipeline: Pipeline

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        assert self.pipeline is not None, "a PipelineStep runs the plan's pipeline"
        self.norm_group = self.dims.pp_mesh.get_group()  # each rank holds some stages: their norms combine

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        b = self.local_batch(inputs, labels, doc_ids)
        with self.amp, self.loss_context():
            return self.pipeline.step(b.inputs, b.labels, self.grad_accum_steps, b.positions, b.doc_ids)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        b = self.local_batch(inputs, labels, doc_ids)
        with self.amp, self.loss_context():
            return self.pipeline.evaluate(b.inputs, b.labels, b.positions, b.doc_ids)

    def _rows(self, batch: Batch) -> torch.Tensor:
        with self.amp:
            return self.pipeline.evaluate_rows(batch.inputs, batch.labels, row_log_likelihood, batch.positions)


def _whole(loss: torch.Tensor) -> torch.Tensor:
    """Loss parallel's loss is a replicated DTensor: its value as a plain tensor."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
