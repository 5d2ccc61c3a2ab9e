"""Load balancing of a mixture-of-experts model, as a step wrapper (trainer/step/step.py StepWrapper): built by the
step phase (trainer/build.py `step`) only for a model with MoE layers, so a dense model's step is unchanged.

Two mechanisms, each off at coefficient 0 (docs/moe.md):
- The auxiliary balance loss (model.moe_aux_loss_coeff): after each micro-batch's forward the model's pooled
  Qwen3-MoE loss (models/moe.py load_balance_loss over `Transformer.router_stats`) times the coefficient is added
  to the loss that is backpropagated, scaled for gradient accumulation with the cross-entropy (the step divides
  their sum). The step's loss, the logged `loss`, stays the cross-entropy; the aux loss is logged as `aux_loss`:
  the mean over the step's micro-batches (and, as `loss`, the data-parallel ranks) of the unscaled loss.
- The auxiliary-loss-free expert bias (model.moe_load_balance_coeff; DeepSeek-V3, as torchtitan applies it): after
  the optimizer step each layer's tokens-per-expert counts are summed over the ranks that hold different tokens
  (data and context parallel) and every rank moves the layer's bias by models/moe.py expert_bias_step of the
  summed counts: the same sum on every rank, so the same bias.

`moe_imbalance`, logged whenever the model has MoE layers: over the layers, the largest max/mean of a layer's
summed counts (1.0 is perfect balance, E / top_k the worst: every token on the same k experts); under pipeline
parallelism the largest over every stage's layers.

The counts are reset at the start of every step (dropping those of validation and evaluation forwards and of a
step not applied), after each update, and under pipeline parallelism after the first step's metadata inference
(torch's forward of placeholder inputs: parallelisms/pipeline.py). Eager activation checkpointing replays a
checkpointed layer's count in the recompute (models/moe.py), doubling that layer's counts on every rank alike:
neither its bias step (sign(mean - count)) nor its max/mean changes with the scale, so nothing here does.

Costs: one all-reduce of [layers, E] float32 counts per step (none on a single rank), one scalar all-reduce over
the pipeline under pipeline parallelism; no host sync. Under training.skip_nonfinite_steps a skipped step still
moves the bias: its counts are finite, only its gradients were not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.llama3 import Transformer
from models.moe import MoE, load_balance_loss, update_expert_bias
from trainer.checkpoint.resume import TrainState
from trainer.step.step import StepWrapper


class MoEBalance(StepWrapper):
    def __init__(
        self,
        layers: list[MoE],
        *,
        bias_coeff: float,
        aux_coeff: float,
        device: torch.device,
        model: Transformer | None = None,
        count_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`layers`: this rank's MoE layers; `model`: the Transformer whose `router_stats` the aux loss reads (the
        plain step's; None under pipeline parallelism, which refuses the aux loss: kiln_base/config/checks.py);
        `count_group`: the ranks whose counts are summed (None: this rank's alone); `pp_group`: the pipeline's
        ranks, over which moe_imbalance is the largest (None without pipeline parallelism)."""
        assert not aux_coeff or model is not None, "the aux loss reads the model's router statistics"
        self.layers, self.bias_coeff, self.aux_coeff, self.model = layers, bias_coeff, aux_coeff, model
        self.device, self.count_group, self.pp_group = device, count_group, pp_group
        self.aux_sum: torch.Tensor | None = None  # this step's unscaled aux losses, summed over its micro-batches
        self.micro_batches = 0
        self.imbalance: torch.Tensor | None = None

    def start(self, progress: TrainState) -> None:
        for m in self.layers:
            m.reset_counts()
        self.aux_sum, self.micro_batches = None, 0

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        if not self.aux_coeff:
            return loss
        assert self.model is not None
        aux = load_balance_loss(self.model.router_stats)
        assert aux is not None, "an MoE model's forward records its layers' router statistics"
        detached = aux.detach()
        self.aux_sum = detached if self.aux_sum is None else self.aux_sum + detached
        self.micro_batches += 1
        return loss + self.aux_coeff * aux

    @torch.no_grad()
    def after_update(self, step: int) -> None:
        if not self.layers:  # a pipeline stage without MoE layers: only the pipeline's maximum
            self.imbalance = torch.zeros((), device=self.device)
            dist.all_reduce(self.imbalance, op=dist.ReduceOp.MAX, group=self.pp_group)
            return
        counts = torch.stack([m.tokens_per_expert for m in self.layers])  # [layers, E]
        if self.count_group is not None:
            dist.all_reduce(counts, group=self.count_group)  # SUM: the global batch's tokens per expert
        self.imbalance = (counts.amax(dim=1) / counts.mean(dim=1)).amax()
        if self.pp_group is not None:
            dist.all_reduce(self.imbalance, op=dist.ReduceOp.MAX, group=self.pp_group)
        for m, summed in zip(self.layers, counts, strict=True):
            if self.bias_coeff:
                update_expert_bias(m, self.bias_coeff, summed)  # resets the counts
            else:
                m.reset_counts()

    def scalars(self) -> dict[str, torch.Tensor]:
        out = {} if self.imbalance is None else {"moe_imbalance": self.imbalance}
        if self.aux_sum is not None:
            out["aux_loss"] = self.aux_sum / self.micro_batches
        return out
