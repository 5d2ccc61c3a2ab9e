"""The Trainer: builds everything from the config (trainer/build.py's phases), then runs the loop until
training.steps: each step is the step object's (trainer/step/step.py), the loop's other concerns are hooks
(trainer/hooks.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from kiln_base.config import JobConfig, RunPlan, check_memory_budget, memory_estimate, validation_shape
from parallelisms.parallel_dims import ParallelDims
from trainer import build
from trainer.checkpoint.folder import FolderClaim
from trainer.checkpoint.initial_load import InitialSource, load_initial, open_source
from trainer.checkpoint.resume import TrainState, apply_config_hyperparameters
from trainer.components.dist import PeerWatch, set_determinism
from trainer.components.metrics import MetricsLogger
from trainer.components.optim import build_lr_scheduler, build_optimizer
from trainer.components.scalar_writers import open_scalar_writers
from trainer.components.tokenizer import load_tokenizer
from trainer.hooks import StepHook, StepOutput, build_hooks
from trainer.step.step import StepResult
from trainer.tools.saved_activations import SavedActivationReport, measure_saved_activations

logger = logging.getLogger("kiln")


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
    flops = build.flops_line(built.flops_per_token_by_convention, cfg.metrics.attention_flops, args.moe)
    moe = f", MoE {args.moe_num_experts} experts (top {args.moe_top_k})" if args.moe else ""
    params = f"{built.n_params:,} params{build.active_text(built)}"
    logger.info(
        f"Model {cfg.model.name} {cfg.model.flavor}: {args.n_layers} layers{moe}, {params}, vocab {args.vocab_size}, "
        f"seq {cfg.training.seq_len}; {flops}"
    )
    log_attention(args.attn_type, args.attn_mask_type, args.bos_id, device_type, boundaries)


def check_budget(cfg: JobConfig, plan: RunPlan, built: build.BuiltModel, dims: ParallelDims, device_type: str) -> None:
    """training.memory_budget_gib against the plan's estimate of this rank's part (kiln_base.config.memory_estimate;
    a pipeline rank: its stages' blocks and the micro-batches its schedule keeps in flight), before any weight is
    allocated."""
    estimate = memory_estimate(cfg, plan, build.local_params(built.model), device_type, dims.pp_rank)
    check_memory_budget(cfg, estimate)


def metrics_logger(
    cfg: JobConfig,
    device: torch.device,
    flops_per_token: float,
    float8: bool,
    data_tokens: Callable[[], dict[str, int]] | None,
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
        self.parallel_dims = dims = build.parallel_dims(self.plan, self.device.type)
        local_ranks = 1 if self.device.type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        build.check_fits(cfg, self.plan, local_ranks, self.device)
        set_determinism(t.seed, t.deterministic)
        documents = build.document_mask(cfg.model.flavor, args, self.tokenizer)  # None: causal
        self.dataloader = build.data(cfg, self.tokenizer, self.plan, dims, self.device, documents)

        built = build.build_model(cfg, args, dims, self.float8, pipeline=self.plan.pipeline)
        self.model, self.flops_per_token, self.n_params = built.model, built.flops_per_token, built.n_params
        check_budget(cfg, self.plan, built, dims, self.device.type)
        log_model(cfg, built, self.device.type, self.dataloader.boundaries)
        build.materialize(built.parts, self.device, build.init_seed(t.seed))
        self.optimizer = build_optimizer(list(self.model.parameters()), cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.train_step = build.step(
            cfg, self.plan, built, dims, self.device, self.optimizer, self.lr_scheduler, self.dataloader, self.float8
        )
        self.validator = build.validator(cfg, self.tokenizer, dims, self.device, self.train_step, documents)
        self.downstream = build.downstream_eval(cfg, self.tokenizer, self.device, self.train_step)  # tasks load now

        settings = build.run_settings(cfg, args, self.plan.global_batch, self.dataloader)
        self.state = TrainState(settings, build.checkpoint_folder(cfg), t.allow_data_change)
        states = {
            "model": self.model,
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "dataloader": self.dataloader,
            "train_state": self.state,
        }
        self.checkpointer = build.checkpointer(cfg, self.checkpoint_claim, source, states, built.held_elsewhere)
        self.state.step = self._resume_or_start(source, built.held_elsewhere, t.steps)
        # After the resume: fault tolerance's first quorum compares the resumed step.
        self.nan_guard = build.wrap_step(cfg, self.plan, self.train_step, self.state)
        self.is_logging_rank, self.metrics = metrics_logger(
            cfg, self.device, self.flops_per_token, self.float8 is not None, self.dataloader.tokens_by_source
        )
        self.losses: list[float] = []  # losses of logged steps (filled by the metrics hook), for tests and callers

    @property
    def step(self) -> int:
        """The last step applied (resumed or trained)."""
        return self.state.step

    def _resume_or_start(self, source: InitialSource | None, held_elsewhere: dict, last_step: int) -> int:
        """The step to start after: this run's latest checkpoint (a full one also checks the saved settings; a
        changed lr is warned about), else checkpoint.initial_load_path's weights, else freshly initialised weights
        (0)."""
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

    def report_saved_activations(self) -> SavedActivationReport:
        """One forward+backward on a real batch under the configured setup; log the bytes kept for backward. Under
        training.compile the compiled regions are read from their partitioned graphs (trainer/tools/
        saved_activations.py), the rest is measured eagerly, and the log says which is which."""
        inputs, labels, *docs = (t.to(self.device) for t in next(self.dataloader))  # docs: [doc_ids] of token files
        step = self.train_step
        with step.loss_context():
            report = measure_saved_activations(self.model, lambda: step.forward_loss(inputs, labels, *docs))
        self.optimizer.zero_grad()
        if self.is_logging_rank:
            logger.info(f"Tensors kept for backward by producing op (rank {dist.get_rank()}):\n{report.format()}")
        else:
            logger.info(f"saved_activations_total_bytes: {report.total_bytes}")
        return report

    def build_hooks(self) -> list[StepHook]:
        """The hooks phase (trainer/hooks.py), for a loop starting after the current step."""
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
            global_mean=self.train_step.global_mean,
            losses=self.losses,
            validator=self.validator,
            pp_group=self.parallel_dims.pp_group,
            downstream=self.downstream,
        )

    def train(self, extra_hooks: Sequence[StepHook] = ()) -> None:
        """Train to training.steps; `extra_hooks` (benchmarks' timers) run after kiln's own."""
        t = self.cfg.training
        if self.cfg.profiling.saved_activations_report:
            self.report_saved_activations()
            return
        if self.cfg.checkpoint.create_seed_checkpoint:
            path = self.checkpointer.save_seed()
            logger.info(f"Seed checkpoint written: {path} (step 0); runs with this checkpoint folder start from it")
            return
        logger.info(
            f"Training {t.steps} steps: local batch {t.local_batch_size} x seq {t.seq_len}, "
            f"grad accumulation {self.plan.grad_accum_steps}, world {dist.get_world_size()}"
        )
        hooks = [*self.build_hooks(), *extra_hooks]
        try:
            while self.state.step < t.steps:
                self.train_step.start(self.state)  # the wrappers' (a healing replica group moves the step)
                if self.state.step >= t.steps:
                    break
                step = self.state.step = self.state.step + 1
                for hook in hooks:
                    hook.pre_step(step)
                with contextlib.ExitStack() as around:
                    for hook in hooks:
                        around.enter_context(hook.step_context(step))
                    result: StepResult = self.train_step(step)
                self.metrics.count_step(self.plan.batch.rank_tokens, result.data_time)
                if not result.applied:  # on no rank: the step is run again
                    self.state.step -= 1
                    continue
                step = self.state.step  # a semi-synchronous sync in the update may have healed it to the live step
                out = StepOutput(step, step == t.steps, result.loss, result.grad_norm, result.lr, result.scalars)
                for hook in hooks:
                    hook.post_step(out)
        finally:
            for hook in hooks:
                hook.close()
        logger.info("Training completed")

    def close(self) -> None:
        self.train_step.close()
        if self.peers is not None:
            self.peers.close()
        self.dataloader.close()
        self.checkpointer.close()
        self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()
