"""Pipeline parallelism: the model cut into stages, each rank running its stages under a
torch.distributed.pipelining schedule (torchtitan's approach).

    plan = pipeline_plan(...)                      kiln_base.config: which modules each stage holds (checked)
    parts = [stage_model(meta_model, plan.stages[i]) for i in plan.stage_ids(pp_rank)]
    parallelize_llama(part, ...) for each part     TP -> AC -> compile -> FSDP, as for a whole model
    materialize each part                          to_empty + the layout-independent init (same seed, same weights)
    pipeline = Pipeline(parts, plan, ...)          PipelineStage per part + the schedule
    pipeline.step(inputs, labels, loss_scale)      forward + backward of every micro-batch
    pipeline.evaluate(inputs, labels)              forward only (validation), through stages of its own
    pipeline.evaluate_rows(inputs, labels, fn)     forward only, a value per row (downstream evaluation)

A stage is a deep copy of the meta-device model with the modules of other stages removed (tok_embeddings, norm
and output set to None; blocks deleted from `layers`, a ModuleDict keyed by layer id): its parameters keep the
whole model's names (`layers.5.attention.wq.weight` on whichever stage holds block 5), so a pipeline's
checkpoint is the whole model's, and loads into any other layout. `StagedModel` shows the stages a rank runs as
one module under those names, for the optimizer, the checkpoint, the init and the hooks.

Document masking (models/attention.py): only the first stage receives the token ids; the others receive hidden
states. Every rank of a pipeline reads the same batches, so the schedule hands each stage what the micro-batch's
mask is built from as a keyword argument: its document ids where the data records them (token files), else its
token ids (torch splits keyword tensors into micro-batches like the inputs, and passes them to every stage), and
each stage builds the micro-batch's mask from them (Transformer.forward's `doc_ids` / `token_ids`): the mask a
single process builds for those rows.

Context parallelism: each rank of a pipeline stage holds its CP part of every sequence (the Trainer shards the batch
before the schedule, ContextParallel.shard_batch), and every stage is handed those tokens' positions the same way,
by keyword, for RoPE; the blocks' attention exchanges keys and values over the CP group as without a pipeline.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
from torch.distributed.tensor import DTensor

from kiln_base.config import PipelinePlan
from kiln_base.internals import after_pipeline_metadata_inference, bound_pipeline_waits, forward_only_schedule
from models.moe import reset_moe_counts

if TYPE_CHECKING:
    from models import Transformer

logger = logging.getLogger("kiln")

ROOT_MODULES = ("tok_embeddings", "norm", "output")


def stage_model(whole: Transformer, modules: Sequence[str]) -> Transformer:
    """A deep copy of the (meta-device) model holding only `modules`: tok_embeddings / norm / output set to None
    and blocks deleted from `layers` unless listed. Cheap on the meta device: no storage is copied."""
    model = copy.deepcopy(whole)
    keep = set(modules)
    for name in ROOT_MODULES:
        if name not in keep:
            setattr(model, name, None)
    for layer_id in list(model.layers.keys()):
        if f"layers.{layer_id}" not in keep:
            del model.layers[layer_id]
    return model


class StagedModel(nn.Module):
    """The stages one rank runs, as one module under the whole model's names: the embedding, norm and output if
    a local stage holds them, and every local block in `layers` (keyed by layer id). It shares the stages'
    modules and parameters; the schedule runs the stages, so it has no forward. The stage models themselves
    (FSDP's roots, each with its RoPE table) are `parts`, in stage order."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.model_args = getattr(parts[0], "model_args")  # noqa: B009 (nn.Module types attributes as tensors)
        for name in ROOT_MODULES:
            setattr(self, name, next((getattr(p, name) for p in parts if getattr(p, name) is not None), None))
        blocks = [cast(nn.ModuleDict, p.get_submodule("layers")) for p in parts]
        self.layers = nn.ModuleDict({k: block for layers in blocks for k, block in layers.items()})
        self.parts = list(parts)  # a plain list: not registered again (their modules are, above)

    def forward(self, *args: Any) -> None:
        raise RuntimeError("a pipeline's stages run through its schedule (Pipeline.step), not as one module")


class Pipeline:
    """This rank's stages wrapped in torch's PipelineStage, and the schedule that runs them over the pipeline
    group: forward and backward of `plan.microbatches` micro-batches per `step`, gradients accumulated (not
    scaled: the loss is, so the logged loss is the mean over the global batch, as torchtitan does)."""

    def __init__(
        self,
        parts: Sequence[nn.Module],
        plan: PipelinePlan,
        stage_ids: Sequence[int],
        group: dist.ProcessGroup,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],  # (logits, labels, None)
        microbatch_size: int,
        document_masks: bool = False,
    ) -> None:
        """`document_masks`: the model masks attention by document, so every stage is handed the token ids."""
        self.plan, self.device, self.group, self.loss_fn = plan, device, group, loss_fn
        self.parts, self.stage_ids, self.microbatch_size = list(parts), tuple(stage_ids), microbatch_size
        self.document_masks = document_masks
        if device.type == "cpu":  # gloo: a send or receive would otherwise wait for a frozen stage forever
            bound_pipeline_waits(group)
        n = len(plan.stages)
        self.has_first, self.has_last = 0 in stage_ids, n - 1 in stage_ids
        self.stages, self.schedule = self._schedule(plan.microbatches, self._loss)
        self.scale = 1  # set per step: the micro-batch losses summed into one optimizer step's gradients
        self._eval: dict[int, Any] = {}  # validation schedules by micro-batch count, built at first use
        self._rows: dict[tuple[int, int], Any] = {}  # evaluation schedules by (micro-batch count, length)
        logger.info(
            f"Pipeline: {plan.schedule}, {n} stages over {plan.degree} ranks (this rank: stages "
            f"{', '.join(map(str, stage_ids))}), {plan.microbatches} micro-batches per local batch"
        )

    def _schedule(
        self, microbatches: int, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> tuple[list[PipelineStage], Any]:
        """A PipelineStage per local stage model and the plan's schedule over them, for `microbatches` a batch."""
        n = len(self.plan.stages)
        stages = [
            PipelineStage(p, i, n, self.device, group=self.group)
            for p, i in zip(self.parts, self.stage_ids, strict=True)
        ]
        for stage, part in zip(stages, self.parts, strict=True):
            # The first step's metadata inference routes placeholder tokens: they must not count for the bias.
            after_pipeline_metadata_inference(stage, lambda part=part: reset_moe_counts(part))
        cls = get_schedule_class(self.plan.schedule)
        looped = issubclass(cls, PipelineScheduleMulti)
        schedule = cls(stages if looped else stages[0], n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
        return stages, schedule

    def _inputs(
        self, inputs: torch.Tensor, positions: torch.Tensor | None, doc_ids: torch.Tensor | None = None
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """The schedule's positional inputs (the first stage's) and the keyword inputs every stage gets: under a
        document mask the batch's document ids (`doc_ids`, where its data records them) or else its token ids; under
        context parallelism the positions of this rank's tokens, one row per sequence (the schedule splits keyword
        tensors by rows, as it splits the inputs)."""
        args = (inputs,) if self.has_first else ()
        kwargs: dict[str, torch.Tensor] = {}
        if self.document_masks:
            kwargs = {"token_ids": inputs} if doc_ids is None else {"doc_ids": doc_ids}
        if positions is not None:
            kwargs["positions"] = positions.expand(inputs.shape[0], -1)
        return args, kwargs

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch, scaled so that the gradients sum to those of the mean. (At the
        first step torch also calls it on placeholder outputs, to learn the shapes: only the schedule's `losses`
        are the micro-batches'.)"""
        return self.loss_fn(logits, labels, None) / self.scale

    def step(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        accumulation: int,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one local batch through every stage; the batch's mean loss on every rank of the
        pipeline (summed in from the last stage's rank: one scalar all-reduce over the pipeline group).
        `accumulation`: the local batches whose gradients this optimizer step sums. `positions`: under context
        parallelism, where this rank's tokens sit in the sequence (its loss is then the mean over its tokens,
        which is the sum over them divided by the sequence's tokens / cp: ContextParallel.shard_batch). `doc_ids`:
        the batch's document ids, where its data records them (document masking)."""
        self.scale = self.plan.microbatches * accumulation
        args, kwargs = self._inputs(inputs, positions, doc_ids)
        target = labels if self.has_last else None
        losses: list[Any] | None = [] if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        return self._summed(losses, accumulation)

    def evaluate(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward and loss of one local batch through every stage, without backward (validation, under
        torch.no_grad): the batch's mean loss on every rank of the pipeline. It runs stages and a schedule of its
        own over the same stage models, one per micro-batch count (a validation batch may differ from a training
        batch in rows and length; the training stages keep the buffers made for theirs)."""
        n = inputs.shape[0] // self.microbatch_size
        if n not in self._eval:
            self._eval[n] = self._forward_only(n, lambda logits, target: self.loss_fn(logits, target, None) / n)
        args, kwargs = self._inputs(inputs, positions, doc_ids)
        target = labels if self.has_last else None
        losses: list[Any] | None = [] if self.has_last else None
        self._eval[n].eval(*args, target=target, losses=losses, **kwargs)
        return self._summed(losses, 1)

    def _forward_only(self, n: int, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
        """A schedule of its own over the stage models for `n` micro-batches, run forward only (`.eval`), with `fn`
        on the last stage's outputs; the V schedule keeps only its forward actions."""
        schedule = self._schedule(n, fn)[1]
        if self.plan.schedule == "ZBVZeroBubble":
            forward_only_schedule(schedule)
        return schedule

    def evaluate_rows(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        row_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward only through every stage (downstream evaluation, under torch.no_grad): `row_fn(logits, labels)`
        of each micro-batch on the last stage, one value per row, the batch's (rows,) on every rank of the pipeline.
        Stages and schedules of its own, one per (micro-batch count, length): torch's stages keep the buffers made
        for the shapes they first ran."""
        n = inputs.shape[0] // self.microbatch_size
        key = (n, inputs.shape[1])
        if key not in self._rows:
            self._rows[key] = self._forward_only(n, row_fn)
        args, kwargs = self._inputs(inputs, positions)
        target = labels if self.has_last else None
        outs: list[Any] | None = [] if self.has_last else None
        self._rows[key].eval(*args, target=target, losses=outs, **kwargs)
        if outs:
            rows = torch.cat([x.full_tensor() if isinstance(x, DTensor) else x for x in outs]).float()
        else:
            rows = torch.zeros(inputs.shape[0], device=self.device)
        dist.all_reduce(rows, group=self.group)  # the last stage's values, zeros elsewhere: exact
        return rows

    def _summed(self, losses: list[Any] | None, factor: int) -> torch.Tensor:
        """The last stage's micro-batch losses (each already divided by the micro-batch count) summed, x `factor`,
        on every rank of the pipeline: one scalar all-reduce over the pipeline group."""
        if losses:  # the last stage: its micro-batches' scaled losses (DTensors under loss parallel)
            scaled = torch.stack([x.full_tensor() if isinstance(x, DTensor) else x for x in losses])
            loss = (scaled.sum() * factor).detach().float()
        else:
            loss = torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.group)  # no host sync: the non-finite guard and the log read it later
        return loss
