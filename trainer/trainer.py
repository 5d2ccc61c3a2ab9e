"""The Trainer: builds everything from the config (trainer/build.py's phases), then runs train_step until
training.steps, with the loop's other concerns as hooks (trainer/hooks.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from kiln_base.config import (
    CPU_BF16_COST,
    JobConfig,
    RunPlan,
    Training,
    check_memory_budget,
    memory_estimate,
    resolve_mixed_precision,
    validation_shape,
)
from kiln_base.errors import CheckpointError
from parallelisms.grad_norm import clip_grad_norm_
from parallelisms.grad_reduce import reduction_line
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import loss_parallel_enabled
from trainer import build
from trainer.checkpoint.folder import FolderClaim
from trainer.checkpoint.initial_load import InitialSource, load_initial, open_source
from trainer.checkpoint.manager import step_dir
from trainer.checkpoint.resume import apply_config_hyperparameters, check_resume
from trainer.components.dist import PeerWatch, set_determinism
from trainer.components.fault_tolerance import ReplicaGroup, data_parallel_share
from trainer.components.loss import build_loss_fn, row_log_likelihood
from trainer.components.metrics import MetricsLogger
from trainer.components.optim import build_lr_scheduler, build_optimizer
from trainer.components.scalar_writers import open_scalar_writers
from trainer.components.tokenizer import load_tokenizer
from trainer.hooks import StepHook, StepOutput, build_hooks
from trainer.tools.guards import NonFiniteGuard, NonFiniteSkip
from trainer.tools.saved_activations import SavedActivationReport, measure_saved_activations

if TYPE_CHECKING:
    from trainer.evaluation.downstream import DownstreamEval

logger = logging.getLogger("kiln")


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


def log_precision(param: str, precision: str, device_type: str) -> None:
    """One start-up line with the compute dtype chosen, and one warning when bf16 is forced on a CPU."""
    how = f"training.mixed_precision_param = {param}" + (f" on {device_type}" if param == "auto" else "")
    logger.info(f"Mixed precision: {precision} compute, float32 master weights and optimizer state ({how})")
    if precision == "bfloat16" and device_type == "cpu":
        logger.warning(f"bfloat16 compute on a CPU, as asked: {CPU_BF16_COST}; auto (float32) is faster there")


def log_attention(
    attn_type: str, mask_type: str, bos_id: int | None, device_type: str, boundaries: str | None = None
) -> None:
    """One start-up line on how the model attends (models/attention.py), where its documents come from (the data
    loader's `boundaries`, else BOS tokens), and what runs it on this device."""
    if mask_type == "causal":
        logger.info("Attention: causal (scaled_dot_product_attention)")
        return
    kernel = {"flex": "flex_attention", "varlen": "varlen_attn"}[attn_type]
    if attn_type == "flex" and device_type == "cpu":
        kernel = "scaled_dot_product_attention with the block mask evaluated densely (no flex backward on a CPU)"
    where = boundaries or f"a document starting at token {bos_id} (BOS)"
    logger.info(f"Attention: {mask_type}: causal within each document, {where}; {kernel}")


def log_model(cfg: JobConfig, built: build.BuiltModel, device_type: str, boundaries: str | None = None) -> None:
    """The start-up lines on the model: shape, parameters, FLOPs per token (both conventions), how it attends."""
    args = built.args
    flops = build.flops_line(built.flops_per_token_by_convention, cfg.metrics.attention_flops)
    logger.info(
        f"Model llama3 {cfg.model.flavor}: {args.n_layers} layers, {built.n_params:,} params, vocab "
        f"{args.vocab_size}, seq {cfg.training.seq_len}; {flops}"
    )
    log_attention(args.attn_type, args.attn_mask_type, args.bos_id, device_type, boundaries)


def check_budget(cfg: JobConfig, plan: RunPlan, built: build.BuiltModel, dims: ParallelDims, device_type: str) -> None:
    """training.memory_budget_gib against the plan's estimate of this rank's part (kiln_base.config.memory_estimate;
    a pipeline rank: its stages' blocks and the micro-batches its schedule keeps in flight), before any weight is
    allocated."""
    pp_rank = dims.pp_mesh.get_local_rank() if dims.pp_enabled else 0
    estimate = memory_estimate(cfg, plan, build.local_params(built.model), device_type, pp_rank)
    check_memory_budget(cfg, estimate)


def compute_precision(
    t: Training, dims: ParallelDims, device_type: str
) -> tuple[str, contextlib.AbstractContextManager]:
    """The compute dtype and the autocast that gives it (without FSDP's MixedPrecisionPolicy, autocast gives bf16
    compute over fp32 master weights); logs it and every gradient reduction's precision."""
    precision = resolve_mixed_precision(t.mixed_precision_param, device_type)
    log_precision(t.mixed_precision_param, precision, device_type)
    logger.info(reduction_line(t, dims.dp_replicate, dims.degrees.fsdp_shards, dims.tp, device_type, dims.pp))
    autocast = not dims.fully_shard_enabled and precision == "bfloat16"  # FSDP above shards over dp_shard x cp
    amp = torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    return precision, amp


def metrics_logger(
    cfg: JobConfig,
    device: torch.device,
    flops_per_token: float,
    float8: bool,
    data_tokens: Callable[[], dict[str, int]] | None = None,
) -> tuple[bool, MetricsLogger]:
    """Whether this rank logs (LOG_RANK), and its step-line logger with the scalar writers (TensorBoard, W&B)."""
    log_ranks = os.environ.get("LOG_RANK", "0").split(",")
    logging_rank = str(dist.get_rank()) in log_ranks
    writer = open_scalar_writers(cfg.metrics, cfg.job.dump_folder, cfg.to_dict(), dist.get_rank(), log_ranks)
    return logging_rank, MetricsLogger(
        cfg.metrics, device, flops_per_token, writer, logging_rank, float8, data_tokens=data_tokens
    )


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.checkpoint_claim: FolderClaim | None = None
        self.peers: PeerWatch | None = None
        self.ft: ReplicaGroup | None = None
        try:
            self._build(cfg)
        except BaseException:
            # A failed start lets go of the checkpoint folder's lock at once (callers in the same process, tests).
            if self.checkpoint_claim is not None:
                self.checkpoint_claim.release()
            if self.peers is not None:
                self.peers.close()
            raise

    def _build(self, cfg: JobConfig) -> None:
        """The phases of trainer/build.py, in order."""
        t = cfg.training
        self.float8 = build.float8_converter(cfg.float8, cfg.parallelism.tensor_parallel_degree)
        self.device, self.peers = build.process_group(cfg)
        self.checkpoint_claim = build.claim_checkpoint_folder(cfg)
        build.check_output_folders(cfg, self.device.type)
        source = open_source(cfg.checkpoint.initial_load_path) if cfg.checkpoint.initial_load_path else None
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path)
        # The RoPE table covers the longest sequence the run feeds: training's, or validation's when longer.
        longest = max(t.seq_len, validation_shape(cfg.validation, t)[1]) if cfg.validation.enable else t.seq_len
        args = build.model_args(cfg.model, longest, self.tokenizer.n_words, source, self.tokenizer.bos_id)
        self.plan = build.run_plan(cfg, args, dist.get_world_size(), self.device.type)
        self.parallel_dims = build.parallel_dims(self.plan, self.device.type)
        local_ranks = 1 if self.device.type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        build.check_fits(cfg, self.plan, local_ranks, self.device)
        dp_degree = data_parallel_share(cfg.fault_tolerance, 0, self.plan.degrees.dp_degree)[1]  # all groups'
        self.grad_accum_steps = self.plan.grad_accum_steps
        set_determinism(t.seed, t.deterministic)
        global_batch = self.grad_accum_steps * t.local_batch_size * dp_degree
        documents = build.document_mask(cfg.model.flavor, args, self.tokenizer)  # None: causal
        self.dataloader = build.data(cfg, self.tokenizer, self.parallel_dims, self.device, global_batch, documents)

        built = build.build_model(cfg, args, self.parallel_dims, self.float8, pipeline=self.plan.pipeline)
        self.model, self.flops_per_token, self.n_params = built.model, built.flops_per_token, built.n_params
        check_budget(cfg, self.plan, built, self.parallel_dims, self.device.type)
        log_model(cfg, built, self.device.type, getattr(self.dataloader, "boundaries", None))
        build.materialize(built.parts, self.device, build.init_seed(t.seed))
        self.precision, self.amp = compute_precision(t, self.parallel_dims, self.device.type)
        self.cp = built.cp  # each rank's part of a sequence (the blocks' attention shares it)
        self.loss_parallel = loss_parallel_enabled(self.parallel_dims, cfg.parallelism)  # vocab-sharded logits
        self.loss_fn = build_loss_fn(t.compile and not self.loss_parallel)
        self.pipeline = build.pipeline(cfg, built, self.parallel_dims, self.device, self.loss_fn)  # None without PP
        self.validator = build.validator(
            cfg, self.tokenizer, self.parallel_dims, self.device, self.eval_loss, self._global_mean_loss, documents
        )

        self.downstream = self._downstream_eval(cfg) if cfg.eval.enable else None  # [eval]: tasks load now

        self.optimizer = build_optimizer(list(self.model.parameters()), cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.step = 0
        self.settings = build.run_settings(cfg, args, global_batch, self.dataloader)
        states = {
            "model": self.model,
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "dataloader": self.dataloader,
            "train_state": self,
        }
        self.checkpointer = build.checkpointer(cfg, self.checkpoint_claim, source, states, built.held_elsewhere)
        self.step = self._resume_or_start(source, built.held_elsewhere, t.steps)
        if cfg.fault_tolerance.enable:
            self.ft = ReplicaGroup(
                cfg.fault_tolerance,
                self.model,
                self.optimizer,
                self.lr_scheduler,
                get_step=lambda: self.step,
                set_step=lambda step: setattr(self, "step", step),
                quorum_timeout_seconds=cfg.comm.init_timeout_seconds,
                init_sync=t.seed is None,  # unseeded groups drew different weights: the first quorum syncs them
                start_step=self.step,  # the step this group resumed at
                fragments=self.plan.fragments,
            )
        self.skip: NonFiniteSkip | None = None  # training.skip_nonfinite_steps: the guard that skips bad steps
        if t.skip_nonfinite_steps:
            self.skip = NonFiniteSkip(self.device, self.optimizer, self.lr_scheduler, t.steps, t.skip_nonfinite_steps)
        self.nan_guard = self.skip or NonFiniteGuard(self.device)
        self.is_logging_rank, self.metrics = metrics_logger(
            cfg,
            self.device,
            self.flops_per_token,
            self.float8 is not None,
            data_tokens=getattr(self.dataloader, "tokens_by_source", None),  # a token-file mix's per-source tokens
        )
        self.losses: list[float] = []  # losses of logged steps (filled by the metrics hook), for tests and callers

    def _resume_or_start(self, source: InitialSource | None, held_elsewhere: dict, last_step: int) -> int:
        """The step to start after: this run's latest checkpoint (a full one also checks self.settings; a changed lr
        is warned about), else checkpoint.initial_load_path's weights, else freshly initialised weights (0)."""
        step = self.checkpointer.load(last_step=last_step)
        if source is not None and self.checkpointer.loaded is None:  # nothing of this run's to resume
            load_initial(source, self.model, held_elsewhere)
        elif self.checkpointer.loaded is None:
            logger.info("Training from scratch (freshly initialised weights)")
        if step > 0:
            old_lr, new_lr = apply_config_hyperparameters(self.optimizer, self.lr_scheduler)
            if old_lr != new_lr:
                logger.warning(f"lr of step {step + 1}: {new_lr:.4g} (this run's schedule; saved: {old_lr:.4g})")
        return step

    # train_state for checkpoints: the step counter, and the settings a resume is checked against (JSON text).
    def state_dict(self) -> dict[str, int | str]:
        return {"step": self.step, "settings": json.dumps(self.settings, sort_keys=True)}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Restore the step; refuse (CheckpointError) or warn about changed settings (trainer/checkpoint/resume.py)."""
        where = f"checkpoint {step_dir(self.checkpointer.folder, int(state['step']))}"
        saved = json.loads(str(state["settings"]))
        for line in check_resume(saved, self.settings, where, self.cfg.training.allow_data_change):
            logger.warning(line)
        self.step = int(state["step"])

    def local_batch(self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None) -> Batch:
        """What this rank computes of a micro-batch its data-parallel rank reads: all of it (with its document ids,
        when its data records them), or under context parallelism its part of every sequence, the tokens' positions
        and the loss normalizer (document masks are refused with CP: kiln_base/config/checks.py)."""
        if self.cp is None:
            return Batch(inputs, labels, doc_ids=doc_ids)
        assert doc_ids is None, "document masks with context parallelism are refused at config time"
        return Batch(*self.cp.shard_batch(inputs, labels))

    def forward_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward and fp32 cross-entropy of one micro-batch (under context parallelism, of this rank's part)."""
        batch = self.local_batch(inputs, labels, doc_ids)
        with self.amp:
            logits = self.model(batch.inputs, positions=batch.positions, doc_ids=batch.doc_ids)
        return self.loss_fn(logits, batch.labels, batch.normalizer)

    def eval_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The forward and loss of one batch as training computes them, without backward (validation; the caller
        holds torch.no_grad): the mean loss over this rank's tokens (under pipeline parallelism, through every stage:
        on every rank of the pipeline)."""
        if self.pipeline is not None:
            batch = self.local_batch(inputs, labels, doc_ids)
            with self.amp, self.loss_context():
                return self.pipeline.evaluate(batch.inputs, batch.labels, batch.positions, batch.doc_ids)
        with self.loss_context():
            loss = self.forward_loss(inputs, labels, doc_ids)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def eval_log_likelihood(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Downstream evaluation (the caller holds torch.no_grad): per row, the summed log-likelihood of the labels
        that are not -100, (rows,), on every rank of the model replica. The validation forward of the layout:
        under pipeline parallelism through every stage (Pipeline.evaluate_rows), under context parallelism each rank
        its part of the rows, summed over the CP group."""
        batch = self.local_batch(inputs, labels)
        with self.amp, self.loss_context():
            if self.pipeline is not None:
                rows = self.pipeline.evaluate_rows(batch.inputs, batch.labels, row_log_likelihood, batch.positions)
            else:
                rows = row_log_likelihood(self.model(batch.inputs, positions=batch.positions), batch.labels)
        if self.cp is not None:
            dist.all_reduce(rows, group=self.parallel_dims.cp_mesh.get_group())
        return rows

    def _downstream_eval(self, cfg: JobConfig) -> DownstreamEval:
        """[eval]: the tasks (loaded now: a task that cannot run stops the run before its first step) and kiln's
        model behind lm-eval's interface, scoring through eval_log_likelihood."""
        from trainer.evaluation.downstream import Layout, build_downstream_eval  # lm-eval: an optional extra

        dims = self.parallel_dims
        layout = Layout(
            dp_rank=dims.dp_mesh.get_local_rank(),
            dp_degree=dims.dp_degree,
            dp_group=dims.dp_mesh.get_group() if dims.dp_degree > 1 else None,
            quantum=dims.tp * (self.cp.layout.n_chunks if self.cp is not None else 1),
            shapes="fixed" if cfg.training.compile else "divisors" if self.pipeline is not None else "tight",
        )
        return build_downstream_eval(
            cfg.eval, self.tokenizer, self.eval_log_likelihood, layout, cfg.training.seq_len, self.device
        )

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Loss parallel (TP): cross-entropy over vocab-sharded logits; the loss and its backward run inside."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One micro-batch: loss in fp32, scaled for gradient accumulation; returns the unscaled loss."""
        with self.loss_context():
            loss = self.forward_loss(inputs, labels, doc_ids)
            (loss / self.grad_accum_steps).backward()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss parallel: a replicated DTensor
        return loss.detach()

    def report_saved_activations(self) -> SavedActivationReport:
        """One forward+backward on a real batch under the configured setup; log the bytes kept for backward. Under
        training.compile the compiled regions are read from their partitioned graphs (trainer/tools/
        saved_activations.py), the rest is measured eagerly, and the log says which is which."""
        inputs, labels, *docs = (t.to(self.device) for t in next(self.dataloader))  # docs: [doc_ids] of token files
        with self.loss_context():
            report = measure_saved_activations(self.model, lambda: self.forward_loss(inputs, labels, *docs))
        self.optimizer.zero_grad()
        if self.is_logging_rank:
            logger.info(f"Tensors kept for backward by producing op (rank {dist.get_rank()}):\n{report.format()}")
        else:
            logger.info(f"saved_activations_total_bytes: {report.total_bytes}")
        return report

    def write_seed_checkpoint(self) -> None:
        """checkpoint.create_seed_checkpoint: save the initial weights as step-0 (nothing trained) and return."""
        if self.checkpointer.loaded is not None:
            raise CheckpointError(
                f"checkpoint.create_seed_checkpoint: {self.checkpointer.folder} already holds "
                f"{self.checkpointer.loaded}; a seed checkpoint starts a run: use an empty checkpoint.folder"
            )
        path = self.checkpointer.save_seed()
        logger.info(f"Seed checkpoint written: {path} (step 0); runs with this checkpoint folder start from it")

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate gradients over micro-batches, clip, step the optimizer and LR; return (loss, grad norm)."""
        self.optimizer.zero_grad()
        loss_sum = torch.zeros((), device=self.device)
        tokens, data_time = 0, 0.0
        first = self.dataloader.state_dict() if self.skip is not None else {}  # the batch's position, for a skip
        for _ in range(self.grad_accum_steps):
            t0 = time.perf_counter()
            # A token-file batch of a document-masked run adds its tokens' document ids: docs = [doc_ids].
            inputs, labels, *docs = (t.to(self.device, non_blocking=True) for t in next(self.dataloader))
            # Tokens this rank computes: a context-parallel rank, its 1/cp of each sequence.
            tokens, data_time = tokens + inputs.numel() // self.parallel_dims.cp, data_time + time.perf_counter() - t0
            if self.pipeline is not None:  # every micro-batch through every stage; the loss on every stage's rank
                batch = self.local_batch(inputs, labels, *docs)
                with self.amp, self.loss_context():
                    accum, pos = self.grad_accum_steps, batch.positions
                    loss_sum += self.pipeline.step(batch.inputs, batch.labels, accum, pos, batch.doc_ids)
            else:
                loss_sum += self.forward_backward(inputs, labels, *docs)
        loss = loss_sum / self.grad_accum_steps
        if self.ft is not None:  # across replica groups: gradient shards and loss averaged over the live groups
            loss = self.ft.average(self.model.parameters(), loss)
        # Once per step, not per micro-batch (the ETA counts steps). A pipeline's ranks share its tokens: each counts
        # its share, so tps and mfu stay per device (torchtitan divides by the pipeline degree too).
        self.metrics.count_step(tokens // self.parallel_dims.pp, data_time)
        max_norm = self.cfg.training.max_norm
        max_norm = max_norm if max_norm > 0 else float("inf")
        # foreach: batched kernels on CUDA. A CPU has none (torch loops over the tensors either way), and there the
        # first foreach dispatch over DTensors costs ~0.6 s of a 4-rank run's first step (sharding propagation).
        foreach = self.device.type == "cuda"
        if self.parallel_dims.pp_enabled:  # each rank holds some stages: their norms combine over the pipeline
            group = self.parallel_dims.pp_mesh.get_group()
            grad_norm = clip_grad_norm_(self.model.parameters(), max_norm, group, foreach)
        else:
            grad_norm = clip_grad_norm_(self.model.parameters(), max_norm, None, foreach)
        self.last_lr: float | torch.Tensor = float(self.lr_scheduler.get_last_lr()[0])  # this step's, for the log
        if self.ft is not None and not self.ft.should_commit():  # a replica group died during the step
            return loss, grad_norm
        around: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.skip is not None:  # skipped on every rank if any rank's loss or norm is non-finite (no host sync)
            end = self.dataloader.state_dict()
            where = (first.get("sequences", -1), end.get("sequences", -1), end.get("epoch", -1))
            around = self.skip.optimizer_step(self.step, loss_sum, grad_norm, where)
        with around:
            self.optimizer.step()
            if self.float8 is not None:
                self.float8.post_optimizer_hook(self.model)
        if self.skip is not None:
            self.last_lr = self.skip.applied_lr  # the lr the step applied (the schedule skips too), on the device
        self.lr_scheduler.step()
        return loss, grad_norm

    def _global_mean_loss(self, loss: torch.Tensor) -> float:
        """Mean over data- and context-parallel ranks; called on log steps only (.item() syncs with the host)."""
        if self.parallel_dims.dp_enabled or self.parallel_dims.cp_enabled:
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.parallel_dims.loss_mesh.get_group())
        return loss.item()

    def build_hooks(self) -> list[StepHook]:
        """The hooks phase (trainer/hooks.py), for a loop starting after self.step."""
        return build_hooks(
            self.cfg,
            model=self.model,
            float8_on=self.float8 is not None,
            fsdp_enabled=self.parallel_dims.fsdp_enabled,
            device=self.device,
            start_step=self.step,
            metrics=self.metrics,
            checkpointer=self.checkpointer,
            nan_guard=self.nan_guard,
            global_mean=self._global_mean_loss,
            losses=self.losses,
            validator=self.validator,
            pp_group=self.parallel_dims.pp_mesh.get_group() if self.parallel_dims.pp_enabled else None,
            downstream=self.downstream,
        )

    def train(self, extra_hooks: Sequence[StepHook] = ()) -> None:
        """Train to training.steps; `extra_hooks` (benchmarks' timers) run after kiln's own."""
        t = self.cfg.training
        if self.cfg.profiling.saved_activations_report:
            self.report_saved_activations()
            return
        if self.cfg.checkpoint.create_seed_checkpoint:
            self.write_seed_checkpoint()
            return
        logger.info(
            f"Training {t.steps} steps: local batch {t.local_batch_size} x seq {t.seq_len}, "
            f"grad accumulation {self.grad_accum_steps}, world {dist.get_world_size()}"
        )
        hooks = [*self.build_hooks(), *extra_hooks]
        try:
            while self.step < t.steps:
                if self.ft is not None:  # the step's quorum; a restarted group heals here (self.step jumps)
                    self.ft.start_step(t.local_batch_size * self.grad_accum_steps * self.parallel_dims.dp_degree)
                    if self.step >= t.steps:
                        break
                self.step += 1
                for hook in hooks:
                    hook.pre_step(self.step)
                with contextlib.ExitStack() as around:
                    for hook in hooks:
                        around.enter_context(hook.step_context(self.step))
                    loss, grad_norm = self.train_step()
                if self.ft is not None and not self.ft.committed:  # not applied: the step is run again
                    self.step -= 1
                    continue
                out = StepOutput(self.step, self.step == t.steps, loss, grad_norm, self.last_lr)
                for hook in hooks:
                    hook.post_step(out)
        finally:
            for hook in hooks:
                hook.close()
        logger.info("Training completed")

    def close(self) -> None:
        if self.ft is not None:
            self.ft.close()
        if self.peers is not None:
            self.peers.close()
        self.dataloader.close()
        self.checkpointer.close()
        self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()
