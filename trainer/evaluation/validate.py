"""Validation: the loss of the current weights on held-out data, outside training.

torchtitan's [validation] (kiln_base/config/schema.py, `Validation`): every validation reads the validation set
from its start, in the same global order as training data (trainer/data/text.py: every rank streams the whole
set and keeps its slice of each round of dp_degree x local batch windows), for `steps` batches or the whole set.
So the loss at a step depends on the weights only: not on `validation.freq`, not on the layout.

It never touches training. The batches come from a loader of their own, opened per validation; the forward runs
under torch.no_grad (no graph, no gradients); nothing random is drawn (Llama 3 has no dropout), and the model is
not switched to eval mode (nothing in it depends on the mode, and a compiled block would recompile for the flag).
A compiled run compiles one inference graph per block at its first validation.

The loss is averaged over every validation token of every data-parallel rank: each batch's mean cross-entropy (all
batches have local batch x seq_len tokens), summed over batches, averaged over the ranks, divided by the batches.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln_base.errors import DataError
from trainer.data.text import DataLoader
from trainer.data.tokens import TokenFileLoader

logger = logging.getLogger("kiln")


@dataclass(frozen=True)
class ValidationResult:
    loss: float  # mean cross-entropy per validation token, over all data-parallel ranks
    batches: int  # validation batches read (each over all data-parallel ranks)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf  # exp overflows a float past ~709.8


class Validator:
    """Runs a validation: `open_loader()` gives this rank's batches of the set from its start; `loss_of(inputs,
    labels[, doc_ids])` is the training step's forward and loss (autocast, loss parallel) returning the batch's mean
    loss on this rank; `global_mean` averages a scalar over the data-parallel ranks (a collective)."""

    def __init__(
        self,
        open_loader: Callable[[], DataLoader | TokenFileLoader],
        loss_of: Callable[..., torch.Tensor],
        global_mean: Callable[[torch.Tensor], float],
        steps: int,
        device: torch.device,
    ) -> None:
        self.open_loader, self.loss_of, self.global_mean = open_loader, loss_of, global_mean
        self.steps, self.device = steps, device
        self.warned_short = False
        self.losses: dict[int, float] = {}  # training step -> validation loss, for tests and callers

    def run(self, step: int) -> ValidationResult:
        """Validate the weights after training step `step`."""
        loader = self.open_loader()
        total = torch.zeros((), device=self.device)
        batches = 0
        try:
            with torch.no_grad():
                while self.steps == -1 or batches < self.steps:
                    try:
                        batch = next(loader)  # (inputs, labels), and doc_ids of token files under a document mask
                    except StopIteration:  # the set ended (an incomplete last round is dropped on every rank)
                        break
                    total += self.loss_of(*(t.to(self.device, non_blocking=True) for t in batch))
                    batches += 1
        finally:
            loader.close()
        source, window = loader.source, loader.window
        round_size = loader.dp_degree * loader.batch_size
        if batches == 0:
            raise DataError(
                f"{source} is too small for one validation batch: {round_size} sequences of "
                f"validation.seq_len + 1 = {window} tokens (validation.local_batch_size {loader.batch_size} "
                f"x {loader.dp_degree} data-parallel ranks)"
            )
        if batches < self.steps and not self.warned_short:
            self.warned_short = True
            logger.warning(
                f"validation: {source} holds {batches} batches of {round_size} sequences, fewer than "
                f"validation.steps {self.steps}; each validation reads the whole set ({batches} batches)"
            )
        result = ValidationResult(self.global_mean(total / batches), batches)
        self.losses[step] = result.loss
        return result
