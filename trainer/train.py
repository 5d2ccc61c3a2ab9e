"""The Trainer: builds everything from the config, then runs train_step until training.steps.

Build order (DESIGN.md): model on meta -> float8 conversion -> parallelize (TP, AC, compile, FSDP) ->
materialise on the device + init_weights -> optimizer/LR -> checkpoint load -> train loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from float8.converter import build_float8_converter
from float8.validation import check_cpu_float8
from parallelisms.parallel_dims import ParallelDims, validate_parallelism
from parallelisms.parallelize import loss_parallel_enabled
from trainer.build import base_args, build_model
from trainer.components.checkpoint import CheckpointManager, step_dir
from trainer.components.checkpoint_folder import FolderClaim
from trainer.components.data import build_dataloader, dataset_fingerprint
from trainer.components.dist import PeerWatch, init_distributed, set_determinism
from trainer.components.initial_load import check_not_inside, load_initial, open_source
from trainer.components.loss import build_loss_fn
from trainer.components.metrics import MetricsLogger
from trainer.components.optim import build_lr_scheduler, build_optimizer
from trainer.components.resume import apply_config_hyperparameters, check_resume, file_sha256, training_settings
from trainer.components.tokenizer import load_tokenizer
from trainer.config import CPU_BF16_COST, JobConfig, grad_accum_steps, resolve_mixed_precision
from trainer.hooks import (
    CheckpointHook,
    CollectiveTimeoutHook,
    Float8CheckHook,
    Float8ScheduleHook,
    GCHook,
    MetricsHook,
    NonFiniteHook,
    NumericsHook,
    ProfilingHook,
    StepHook,
    StepOutput,
    StopHook,
    StopRequestHook,
    compiling_steps,
)
from trainer.tools.guards import NonFiniteGuard
from trainer.tools.saved_activations import SavedActivationReport, measure_saved_activations

logger = logging.getLogger("kiln")


def log_precision(param: str, precision: str, device_type: str) -> None:
    """One start-up line with the compute dtype chosen, and one warning when bf16 is forced on a CPU."""
    how = f"training.mixed_precision_param = {param}" + (f" on {device_type}" if param == "auto" else "")
    logger.info(f"Mixed precision: {precision} compute, float32 master weights and optimizer state ({how})")
    if precision == "bfloat16" and device_type == "cpu":
        logger.warning(f"bfloat16 compute on a CPU, as asked: {CPU_BF16_COST}; auto (float32) is faster there")


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
        t = cfg.training
        # float8's environment checks (torchao version, GPU capability) fail fast, before any process group.
        self.float8 = build_float8_converter(cfg.float8, cfg.parallelism.tensor_parallel_degree)
        self.device = init_distributed(cfg.comm.init_timeout_seconds)
        self.peers = PeerWatch.maybe_start()  # names the lost ranks when a collective fails (train.py)
        if self.device.type == "cpu":
            check_cpu_float8(cfg.float8)
        checkpoint_folder = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
        if cfg.checkpoint.enable_checkpoint:  # a busy, read-only or non-directory folder fails now, not hours in
            self.checkpoint_claim = FolderClaim(checkpoint_folder)
        # checkpoint.initial_load_path: its stored shape is read now (and checked against the flavor at build).
        source = open_source(cfg.checkpoint.initial_load_path) if cfg.checkpoint.initial_load_path else None
        if source is not None and cfg.checkpoint.enable_checkpoint:
            check_not_inside(source, checkpoint_folder)
        p = cfg.parallelism
        self.parallel_dims = ParallelDims(
            p.data_parallel_replicate_degree,
            p.data_parallel_shard_degree,
            p.tensor_parallel_degree,
            dist.get_world_size(),
        )
        validate_parallelism(
            self.parallel_dims,
            base_args(cfg.model, source.args if source else None),
            t,
            p,
            self.device.type,
            cfg.activation_checkpoint,
        )
        self.parallel_dims.build_mesh(self.device.type)
        dp_degree, dp_rank = self.parallel_dims.dp_degree, self.parallel_dims.dp_mesh.get_local_rank()
        self.grad_accum_steps = self._grad_accum_steps(dp_degree)
        set_determinism(t.seed, t.deterministic)

        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path)
        self.dataloader = build_dataloader(t, self.tokenizer, dp_rank, dp_degree, pin_memory=self.device.type == "cuda")

        built = build_model(
            cfg,
            self.parallel_dims,
            self.tokenizer.n_words,
            self.float8,
            source.args if source else None,
            source.path if source else "",
        )
        model, self.flops_per_token, self.n_params = built.model, built.flops_per_token, built.n_params
        logger.info(
            f"Model llama3 {cfg.model.flavor}: {built.args.n_layers} layers, {built.n_params:,} params, "
            f"{self.flops_per_token / 1e9:.3f} GFLOPs/token, vocab {built.args.vocab_size}"
        )
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=self.device)
        model.train()
        self.model = model
        # Without FSDP's MixedPrecisionPolicy, autocast gives bf16 compute over fp32 master weights.
        self.precision = resolve_mixed_precision(t.mixed_precision_param, self.device.type)
        log_precision(t.mixed_precision_param, self.precision, self.device.type)
        self.amp = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if not self.parallel_dims.dp_enabled and self.precision == "bfloat16"
            else contextlib.nullcontext()
        )
        self.loss_parallel = loss_parallel_enabled(self.parallel_dims, p)  # logits stay vocab-sharded under TP
        self.loss_fn = build_loss_fn(t.compile and not self.loss_parallel)

        self.optimizer = build_optimizer(list(model.parameters()), cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.step = 0
        global_batch = self.grad_accum_steps * t.local_batch_size * dp_degree
        self.settings = training_settings(
            cfg,
            built.args,
            global_batch,
            dataset_fingerprint(t, self.dataloader.windows.shard_files),
            file_sha256(cfg.model.tokenizer_path),
        )
        self.checkpointer = CheckpointManager(
            cfg.checkpoint,
            checkpoint_folder,
            {
                "model": model,
                "optimizer": self.optimizer,
                "lr_scheduler": self.lr_scheduler,
                "dataloader": self.dataloader,
                "train_state": self,
            },
            claim=self.checkpoint_claim,
        )
        self.step = self.checkpointer.load(last_step=t.steps)  # a full checkpoint also checks self.settings
        if source is not None and self.checkpointer.loaded is None:  # nothing of this run's to resume
            load_initial(source, model)
        elif self.checkpointer.loaded is None:
            logger.info("Training from scratch (freshly initialised weights)")
        if self.step > 0:
            old_lr, new_lr = apply_config_hyperparameters(self.optimizer, self.lr_scheduler)
            if old_lr != new_lr:
                logger.warning(f"lr of step {self.step + 1}: {new_lr:.4g} (this run's schedule; saved: {old_lr:.4g})")
        self.nan_guard = NonFiniteGuard(self.device)

        self.is_logging_rank = str(dist.get_rank()) in os.environ.get("LOG_RANK", "0").split(",")
        tb_dir = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder, f"rank_{dist.get_rank()}")
        self.metrics = MetricsLogger(
            cfg.metrics, self.device, self.flops_per_token, tb_dir, self.is_logging_rank, self.float8 is not None
        )
        self.losses: list[float] = []  # losses of logged steps (filled by the metrics hook), for tests and callers

    def _grad_accum_steps(self, dp_degree: int) -> int:
        return grad_accum_steps(self.cfg.training, dp_degree)

    # train_state for checkpoints: the step counter, and the settings a resume is checked against (JSON text).
    def state_dict(self) -> dict[str, int | str]:
        return {"step": self.step, "settings": json.dumps(self.settings, sort_keys=True)}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Restore the step; refuse (CheckpointError) or warn about changed settings (trainer/components/resume.py)."""
        where = f"checkpoint {step_dir(self.checkpointer.folder, int(state['step']))}"
        for line in check_resume(json.loads(str(state["settings"])), self.settings, where):
            logger.warning(line)
        self.step = int(state["step"])

    def forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and fp32 cross-entropy of one micro-batch."""
        with self.amp:
            logits = self.model(inputs)
        return self.loss_fn(logits, labels)

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
        tokens, data_time = 0, 0.0
        for _ in range(self.grad_accum_steps):
            t0 = time.perf_counter()
            inputs, labels = next(self.dataloader)
            inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            tokens, data_time = tokens + inputs.numel(), data_time + time.perf_counter() - t0
            loss_sum += self.forward_backward(inputs, labels)
        self.metrics.count_step(tokens, data_time)  # once per step, not per micro-batch: the ETA counts steps
        max_norm = self.cfg.training.max_norm
        # foreach: batched kernels on CUDA. A CPU has none (torch loops over the tensors either way), and there the
        # first foreach dispatch over DTensors costs ~0.6 s of a 4-rank run's first step (sharding propagation).
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), max_norm if max_norm > 0 else float("inf"), foreach=self.device.type == "cuda"
        )
        self.last_lr = float(self.lr_scheduler.get_last_lr()[0])  # the lr this step used, for the log line
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

    def build_hooks(self) -> list[StepHook]:
        """The loop's non-training concerns, in the order they run (see trainer/hooks.py)."""
        cfg, rank = self.cfg, dist.get_rank()
        hooks: list[StepHook] = [
            GCHook(cfg.training.gc_freq),
            ProfilingHook(cfg.profiling, cfg.job.dump_folder, rank, self.device, self.step),
        ]
        after = cfg.float8.disable_after_step
        if self.float8 is not None and after:
            hooks.append(Float8ScheduleHook(self.model, after, cfg.training.steps))
        if self.float8 is not None and not (after and self.step >= after):  # resumed past the switch: nothing to check
            hooks.append(Float8CheckHook(self.model, cfg.float8, self.parallel_dims.fsdp_enabled))
        if self.float8 is not None and cfg.float8.numerics_log_freq:
            folder = os.path.join(cfg.job.dump_folder, "float8_numerics")
            hooks.append(NumericsHook(self.model, cfg.float8, folder, rank, self.is_logging_rank, self.metrics.writer))
        stop = StopRequestHook()  # first in post_step: every later hook knows whether this is the last step run

        def must_check(out: StepOutput) -> bool:
            return stop.stopping or self.metrics.should_log(out.step) or self.checkpointer.due(out.step, out.last)

        metrics = MetricsHook(self.metrics, cfg.training.steps, self._global_mean_loss, force=lambda: stop.stopping)
        metrics.losses = self.losses
        hooks.insert(0, stop)
        long_steps = compiling_steps(self.step, cfg.training.compile, False, cfg.float8.numerics_log_freq)
        if cfg.training.compile and after:
            long_steps.add(max(after, self.step) + 1)  # the blocks recompile at the switch
        hooks += [
            NonFiniteHook(self.nan_guard, must_check, self.checkpointer.folder),  # before metrics and saves
            metrics,
            CheckpointHook(self.checkpointer),
            CollectiveTimeoutHook(
                long_steps,
                cfg.comm.init_timeout_seconds,
                cfg.comm.train_timeout_seconds,
            ),
            StopHook(stop, self.checkpointer, cfg.training.steps),  # last: saves and raises TrainingStopped
        ]
        return hooks

    def train(self) -> None:
        t = self.cfg.training
        if self.cfg.profiling.saved_activations_report:
            self.report_saved_activations()
            return
        logger.info(
            f"Training {t.steps} steps: local batch {t.local_batch_size} x seq {t.seq_len}, "
            f"grad accumulation {self.grad_accum_steps}, world {dist.get_world_size()}"
        )
        hooks = self.build_hooks()
        try:
            while self.step < t.steps:
                self.step += 1
                for hook in hooks:
                    hook.pre_step(self.step)
                with contextlib.ExitStack() as around:
                    for hook in hooks:
                        around.enter_context(hook.step_context(self.step))
                    loss, grad_norm = self.train_step()
                out = StepOutput(self.step, self.step == t.steps, loss, grad_norm, self.last_lr)
                for hook in hooks:
                    hook.post_step(out)
        finally:
            for hook in hooks:
                hook.close()
        logger.info("Training completed")

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        self.dataloader.close()
        self.checkpointer.close()
        self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()
