"""The Trainer: builds everything from the config, then runs train_step until training.steps.

Build order (DESIGN.md): model on meta -> float8 conversion -> parallelize (TP, AC, compile, FSDP) ->
materialise on the device + init_weights -> optimizer/LR -> checkpoint load -> train loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from float8.converter import build_float8_converter
from models import LLAMA3_FLAVORS, ModelArgs, Transformer, flops_per_token, num_params
from parallelisms.parallel_dims import ParallelDims, validate_parallelism
from parallelisms.parallelize import loss_parallel_enabled, parallelize_llama
from trainer.checkpoint import CheckpointManager
from trainer.config import ConfigError, JobConfig
from trainer.data import build_dataloader
from trainer.dist import init_distributed, set_collective_timeout, set_determinism
from trainer.float8_checks import Float8UsageProbe
from trainer.guards import NonFiniteGuard
from trainer.metrics import MetricsLogger
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from trainer.saved_activations import SavedActivationReport, measure_saved_activations
from trainer.sqnr import Float8SQNRMonitor
from trainer.tokenizer import Tokenizer

logger = logging.getLogger("kiln")


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        t = cfg.training
        # float8's environment checks (torchao version, GPU capability) fail fast, before any process group.
        self.float8 = build_float8_converter(cfg.float8)
        self.device = init_distributed(cfg.comm.init_timeout_seconds)
        p = cfg.parallelism
        self.parallel_dims = ParallelDims(
            p.data_parallel_replicate_degree,
            p.data_parallel_shard_degree,
            p.tensor_parallel_degree,
            dist.get_world_size(),
        )
        validate_parallelism(
            self.parallel_dims, LLAMA3_FLAVORS[cfg.model.flavor], t, p, self.device.type, cfg.activation_checkpoint
        )
        self.parallel_dims.build_mesh(self.device.type)
        dp_degree, dp_rank = self.parallel_dims.dp_degree, self.parallel_dims.dp_mesh.get_local_rank()
        self.grad_accum_steps = self._grad_accum_steps(dp_degree)
        set_determinism(t.seed, t.deterministic)

        try:
            self.tokenizer = Tokenizer(cfg.model.tokenizer_path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.tokenizer_path: {e}") from None
        self.dataloader = build_dataloader(t, self.tokenizer, dp_rank, dp_degree, pin_memory=self.device.type == "cuda")

        model_args = self._model_args(self.tokenizer.n_words)
        with torch.device("meta"):
            model = Transformer(model_args)
        if self.float8 is not None:
            self.float8.convert(model)
        self.flops_per_token = flops_per_token(model_args, model, t.seq_len)
        logger.info(
            f"Model llama3 {cfg.model.flavor}: {num_params(model):,} params, "
            f"{self.flops_per_token / 1e9:.3f} GFLOPs/token, vocab {model_args.vocab_size}"
        )

        parallelize_llama(model, self.parallel_dims, t, p, cfg.activation_checkpoint, cfg.float8)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=self.device)
        model.train()
        self.model = model
        # Without FSDP's MixedPrecisionPolicy, autocast gives bf16 compute over fp32 master weights.
        self.amp = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if not self.parallel_dims.dp_enabled and t.mixed_precision_param == "bfloat16"
            else contextlib.nullcontext()
        )
        self.loss_parallel = loss_parallel_enabled(self.parallel_dims, p)  # logits stay vocab-sharded under TP

        self.optimizer = build_optimizer(list(model.parameters()), cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.step = 0
        self.checkpointer = CheckpointManager(
            cfg.checkpoint,
            os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder),
            {
                "model": model,
                "optimizer": self.optimizer,
                "lr_scheduler": self.lr_scheduler,
                "dataloader": self.dataloader,
                "train_state": self,
            },
        )
        self.step = self.checkpointer.load()
        self.nan_guard = NonFiniteGuard(self.device)

        self.is_logging_rank = str(dist.get_rank()) in os.environ.get("LOG_RANK", "0").split(",")
        tb_dir = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder, f"rank_{dist.get_rank()}")
        self.metrics = MetricsLogger(
            cfg.metrics, self.device, self.flops_per_token, tb_dir, self.is_logging_rank, self.float8 is not None
        )
        self.losses: list[float] = []  # losses of logged steps, for tests and callers
        self._float8_verified = False  # float8 flags are checked once, at the first step

    def _model_args(self, tokenizer_words: int) -> ModelArgs:
        """The flavor's shape with the vocabulary (and optional layer count) from tokenizer and config."""
        m, vocab = self.cfg.model, self.cfg.model.vocab_size
        if vocab is not None and vocab < tokenizer_words:
            raise ConfigError(f"model.vocab_size ({vocab}) is smaller than the tokenizer's {tokenizer_words} tokens")
        args = LLAMA3_FLAVORS[m.flavor]
        return dataclasses.replace(
            args,
            vocab_size=vocab or tokenizer_words,
            n_layers=m.n_layers or args.n_layers,
            max_seq_len=self.cfg.training.seq_len,
        )

    def _grad_accum_steps(self, dp_degree: int) -> int:
        t = self.cfg.training
        per_step = t.local_batch_size * dp_degree
        global_bs = per_step if t.global_batch_size == -1 else t.global_batch_size
        if global_bs % per_step:
            raise ConfigError(
                f"training.global_batch_size ({global_bs}) must be a multiple of local_batch_size x "
                f"data-parallel degree ({t.local_batch_size} x {dp_degree} = {per_step})"
            )
        return global_bs // per_step

    # train_state for checkpoints: the step counter is the only trainer state besides the components.
    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])

    def forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and fp32 cross-entropy of one micro-batch."""
        with self.amp:
            logits = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Loss parallel (TP): cross-entropy over vocab-sharded logits; the loss and its backward run inside."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch: loss in fp32, scaled for gradient accumulation; returns the unscaled loss."""
        with self.loss_context():
            loss = self.forward_loss(inputs, labels)
            (loss / self.grad_accum_steps).backward()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss parallel: a replicated DTensor
        return loss.detach()

    def report_saved_activations(self) -> SavedActivationReport:
        """One eager forward+backward on a real batch under the configured setup; log the bytes kept for backward."""
        inputs, labels = next(self.dataloader)
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        with torch.compiler.set_stance("force_eager"), self.loss_context():  # compiled code hides saved tensors
            report = measure_saved_activations(self.model, lambda: self.forward_loss(inputs, labels))
        self.optimizer.zero_grad()
        if self.is_logging_rank:
            logger.info(f"Tensors kept for backward by producing op (rank {dist.get_rank()}):\n{report.format()}")
        else:
            logger.info(f"saved_activations_total_bytes: {report.total_bytes}")
        return report

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate gradients over micro-batches, clip, step the optimizer and LR; return (loss, grad norm)."""
        self.optimizer.zero_grad()
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.grad_accum_steps):
            t0 = time.perf_counter()
            inputs, labels = next(self.dataloader)
            inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            self.metrics.count_step(inputs.numel(), time.perf_counter() - t0)
            loss_sum += self.forward_backward(inputs, labels)
        max_norm = self.cfg.training.max_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), max_norm if max_norm > 0 else float("inf"), foreach=True
        )
        self.nan_guard.observe(self.step, loss_sum, grad_norm)
        self.last_lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step used, for the log line
        self.optimizer.step()
        if self.float8 is not None:
            self.float8.post_optimizer_hook(self.model)
        self.lr_scheduler.step()
        return loss_sum / self.grad_accum_steps, grad_norm

    def _global_mean_loss(self, loss: torch.Tensor) -> float:
        """Mean over data-parallel ranks; called on log steps only (.item() syncs with the host)."""
        if self.parallel_dims.dp_enabled:
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.parallel_dims.dp_mesh.get_group())
        return loss.item()

    def train(self) -> None:
        t = self.cfg.training
        if self.cfg.profiling.saved_activations_report:
            self.report_saved_activations()
            return
        gc.disable()  # collect at a fixed cadence instead of at random points mid-step
        logger.info(
            f"Training {t.steps} steps: local batch {t.local_batch_size} x seq {t.seq_len}, "
            f"grad accumulation {self.grad_accum_steps}, world {dist.get_world_size()}"
        )
        prof_cfg, dump, rank = self.cfg.profiling, self.cfg.job.dump_folder, dist.get_rank()
        sqnr_freq = self.cfg.float8.sqnr_log_freq
        sqnr = Float8SQNRMonitor(self.model) if self.float8 is not None and sqnr_freq else None
        try:
            with (
                maybe_enable_profiling(prof_cfg, dump, rank, self.step) as profiler,
                maybe_enable_memory_snapshot(prof_cfg, dump, rank, self.device, self.step) as snapshot,
            ):
                while self.step < t.steps:
                    self._train_one(sqnr, sqnr_freq)
                    if profiler is not None:
                        profiler.step()
                    if snapshot is not None:
                        snapshot.step()
        finally:
            gc.enable()
            if sqnr is not None:
                sqnr.remove()
        logger.info("Training completed")

    def _train_one(self, sqnr: Float8SQNRMonitor | None, sqnr_freq: int) -> None:
        """One step of the loop: train_step, first-step float8 checks, SQNR, metrics, checkpoint."""
        t = self.cfg.training
        self.step += 1
        if self.step % t.gc_freq == 0:
            gc.collect(1)
        if sqnr is not None:
            sqnr.active = self.step % sqnr_freq == 0
        if self.float8 is not None and not self._float8_verified:
            probe = Float8UsageProbe(self.model, self.cfg.float8, self.parallel_dims.fsdp_enabled)
            with probe.during_first_step():  # counts torchao's float8 matmuls; the step itself is unchanged
                loss, grad_norm = self.train_step()
            probe.verify()
            self._float8_verified = True
        else:
            loss, grad_norm = self.train_step()
        last = self.step == t.steps
        log_step = self.metrics.should_log(self.step) or last
        if log_step or self.checkpointer.due(self.step, last):
            self.nan_guard.check(self.checkpointer.folder)
        if log_step:
            # clip_grad_norm_ already returns the global norm (a DTensor when params are sharded).
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            loss_f, norm_f = self._global_mean_loss(loss), norm.item()
            self.losses.append(loss_f)
            self.metrics.log(self.step, t.steps, loss_f, norm_f, self.last_lr)
        if sqnr is not None and sqnr.active and self.is_logging_rank:
            sqnr.log(self.step)
        self.checkpointer.maybe_save(self.step, last=last)
        if self.step == 1:
            set_collective_timeout(self.cfg.comm.train_timeout_seconds)

    def close(self) -> None:
        self.dataloader.close()
        self.checkpointer.close()
        self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()
