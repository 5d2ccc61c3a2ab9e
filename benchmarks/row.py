"""One benchmark row in one process: train.py's training run, plus the time spent in the transformer blocks.

    python benchmarks/row.py --bench.warmup 3 [train.py flags]        (or under torchrun for several processes)

Trains exactly as train.py does (same Trainer, same step lines) and, on every step after `--bench.warmup`,
times the transformer blocks' forward and backward inside the real step: events at the first block's input and
the last block's output going forward, and at the gradients of the last block's output and of the first
block's input coming back (CUDA events on a GPU, a clock on a CPU). Embedding, final norm, output layer, loss,
optimizer and data are outside that window, so float8's gain (it only changes the blocks' matmuls) shows
without their fixed cost. Ends with one line that benchmarks/run.py parses:

    blocks: 123.45 ms per step (forward 41.20, backward 82.25; median of 10 steps)
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from trainer.hooks import StepHook, StepOutput  # noqa: E402


class _Clock:
    """A point in time on the device's stream (CUDA event) or on the host clock (CPU: ops run synchronously)."""

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        if self.event is not None:
            self.event.record()
        self.t = time.perf_counter()

    def ms_since(self, start: _Clock) -> float:
        if self.event is not None and start.event is not None:
            return start.event.elapsed_time(self.event)
        return 1e3 * (self.t - start.t)


class BlockTimer(StepHook):
    """Forward and backward time of `model.layers` inside each measured training step (all micro-batches)."""

    def __init__(self, model: nn.Module, warmup: int, cuda: bool) -> None:
        blocks = list(model.get_submodule("layers").children())
        self.warmup, self.cuda, self.active = warmup, cuda, False
        self.marks: list[dict[str, _Clock]] = []  # one per micro-batch
        self.per_step: list[tuple[float, float]] = []  # (forward ms, backward ms)
        self.handles = [
            blocks[0].register_forward_pre_hook(self._first_block_input),
            blocks[-1].register_forward_hook(self._last_block_output),
        ]

    def _mark(self, name: str) -> None:
        self.marks[-1][name] = _Clock(self.cuda)

    def _first_block_input(self, module: nn.Module, args: tuple) -> None:
        if not self.active or not torch.is_grad_enabled():
            return
        self.marks.append({})
        self._mark("fwd_start")
        x = args[0]
        if x.requires_grad:  # its gradient is the last thing the blocks' backward computes
            x.register_hook(lambda g: self._mark("bwd_end"))

    def _last_block_output(self, module: nn.Module, args: tuple, out: Any) -> None:
        if not self.active or not self.marks or "fwd_end" in self.marks[-1]:
            return
        self._mark("fwd_end")
        if isinstance(out, torch.Tensor) and out.requires_grad:  # its gradient starts the blocks' backward
            out.register_hook(lambda g: self._mark("bwd_start"))

    def pre_step(self, step: int) -> None:
        self.active = step > self.warmup
        self.marks = []

    def post_step(self, out: StepOutput) -> None:
        if not self.active:
            return
        if self.cuda:
            torch.cuda.synchronize()
        fwd = sum(m["fwd_end"].ms_since(m["fwd_start"]) for m in self.marks if "fwd_end" in m)
        bwd = sum(m["bwd_end"].ms_since(m["bwd_start"]) for m in self.marks if "bwd_end" in m and "bwd_start" in m)
        self.per_step.append((fwd, bwd))

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def summary(self) -> str:
        if not self.per_step:
            return "blocks: n/a (no measured step)"
        fwd = statistics.median(f for f, _ in self.per_step)
        bwd = statistics.median(b for _, b in self.per_step)
        total = statistics.median(f + b for f, b in self.per_step)
        return (
            f"blocks: {total:.2f} ms per step (forward {fwd:.2f}, backward {bwd:.2f}; "
            f"median of {len(self.per_step)} steps)"
        )


def main(argv: list[str]) -> int:
    from kiln_base.config import parse_args
    from kiln_base.errors import UserError
    from trainer.trainer import Trainer

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout
    )
    warmup = 0
    if "--bench.warmup" in argv:
        i = argv.index("--bench.warmup")
        warmup = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    try:
        trainer = Trainer(parse_args(argv))
    except UserError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    timer = BlockTimer(trainer.model, warmup, trainer.device.type == "cuda")
    try:
        trainer.train(extra_hooks=[timer])
    except UserError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
    print(timer.summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
