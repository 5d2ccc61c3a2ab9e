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

from float8.converter import build_float8_converter
from models import LLAMA3_FLAVORS, Transformer, flops_per_token, num_params
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_llama
from trainer.checkpoint import CheckpointManager
from trainer.config import ConfigError, JobConfig
from trainer.data import build_dataloader
from trainer.dist import init_distributed, set_collective_timeout, set_determinism
from trainer.metrics import MetricsLogger
from trainer.optim import build_lr_scheduler, build_optimizer
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
        self.parallel_dims.build_mesh(self.device.type)
        dp_degree, dp_rank = self.parallel_dims.dp_degree, self.parallel_dims.dp_mesh.get_local_rank()
        self.grad_accum_steps = self._grad_accum_steps(dp_degree)
        set_determinism(t.seed, t.deterministic)

        try:
            self.tokenizer = Tokenizer(cfg.model.tokenizer_path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.tokenizer_path: {e}") from None
        self.dataloader = build_dataloader(t, self.tokenizer, dp_rank, dp_degree)

        model_args = dataclasses.replace(
            LLAMA3_FLAVORS[cfg.model.flavor], vocab_size=self.tokenizer.n_words, max_seq_len=t.seq_len
        )
        with torch.device("meta"):
            model = Transformer(model_args)
        if self.float8 is not None:
            self.float8.convert(model)
        self.flops_per_token = flops_per_token(model_args, model, t.seq_len)
        logger.info(
            f"Model llama3 {cfg.model.flavor}: {num_params(model):,} params, "
            f"{self.flops_per_token / 1e9:.3f} GFLOPs/token, vocab {model_args.vocab_size}"
        )

        parallelize_llama(model, self.parallel_dims, t, p, cfg.activation_checkpoint)
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

        self.is_logging_rank = str(dist.get_rank()) in os.environ.get("LOG_RANK", "0").split(",")
        tb_dir = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder, f"rank_{dist.get_rank()}")
        self.metrics = MetricsLogger(
            cfg.metrics, self.device, self.flops_per_token, tb_dir, self.is_logging_rank, self.float8 is not None
        )
        self.losses: list[float] = []  # losses of logged steps, for tests and callers

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

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch: loss in fp32, scaled for gradient accumulation; returns the unscaled loss."""
        with self.amp:
            logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        (loss / self.grad_accum_steps).backward()
        return loss.detach()

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
        gc.disable()  # collect at a fixed cadence instead of at random points mid-step
        logger.info(
            f"Training {t.steps} steps: local batch {t.local_batch_size} x seq {t.seq_len}, "
            f"grad accumulation {self.grad_accum_steps}, world {dist.get_world_size()}"
        )
        try:
            while self.step < t.steps:
                self.step += 1
                if self.step % t.gc_freq == 0:
                    gc.collect(1)
                loss, grad_norm = self.train_step()
                if self.metrics.should_log(self.step) or self.step == t.steps:
                    # clip_grad_norm_ already returns the global norm (a DTensor when params are sharded).
                    norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                    loss_f, norm_f = self._global_mean_loss(loss), norm.item()
                    self.losses.append(loss_f)
                    self.metrics.log(self.step, t.steps, loss_f, norm_f, self.last_lr)
                self.checkpointer.maybe_save(self.step, last=self.step == t.steps)
                if self.step == 1:
                    set_collective_timeout(self.cfg.comm.train_timeout_seconds)
        finally:
            gc.enable()
        logger.info("Training completed")

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()
