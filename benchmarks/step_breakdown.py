"""Where a training step's time goes: data, forward+backward, grad clip, optimizer, and everything else.

    python benchmarks/step_breakdown.py --job.config_file train_configs/debug_model.toml --training.steps 8 ...

Builds the real Trainer from the same flags as train.py and wraps its phases with timers (synchronising the
device around each phase on CUDA, so the figures are wall time per phase; this adds syncs, so use train.py's
own tps for throughput). Prints each phase's median time and share of the step over the steps after the first.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import trainer.step.step as step_module  # noqa: E402
from kiln_base.config import parse_args  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    trainer = Trainer(cfg)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    times: dict[str, float] = defaultdict(float)

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            times[name] += time.perf_counter() - t0
            return out

        return wrapper

    class TimedLoader:
        """The trainer's loader with next() timed; everything else (close, state_dict) passes through."""

        def __init__(self, loader) -> None:
            self.loader = loader
            self.next = timed("data", loader.__next__)

        def __next__(self):
            return self.next()

        def __getattr__(self, name: str):
            return getattr(self.loader, name)

    # A benchmark's instrumentation: the trainer's loader and forward_backward are swapped for timed ones.
    trainer.train_step.dataloader = TimedLoader(trainer.dataloader)
    step_fn = trainer.train_step
    step_fn.forward_backward = timed("forward+backward", step_fn.forward_backward)  # type: ignore[method-assign]
    # Hooks rather than wrapping optimizer.step: LambdaLR checks that step is the optimizer's own method.
    opt_t0 = [0.0]

    def opt_pre(*_) -> None:
        sync()
        opt_t0[0] = time.perf_counter()

    def opt_post(*_) -> None:
        sync()
        times["optimizer"] += time.perf_counter() - opt_t0[0]

    trainer.optimizer.register_step_pre_hook(opt_pre)
    trainer.optimizer.register_step_post_hook(opt_post)
    clip = step_module.clip_grad_norm_  # the gradient norm (float64 squares) and the clip
    step_module.clip_grad_norm_ = timed("grad clip", clip)

    per_step: list[dict[str, float]] = []
    gc.disable()
    for step in range(1, cfg.training.steps + 1):
        trainer.state.step = step
        if step % cfg.training.gc_freq == 0:
            gc.collect(1)
        times.clear()
        sync()
        t0 = time.perf_counter()
        loss = step_fn(step).loss
        sync()
        times["step"] = time.perf_counter() - t0
        per_step.append(dict(times))
    gc.enable()
    step_module.clip_grad_norm_ = clip
    trainer.close()

    measured = per_step[1:] or per_step  # the first step pays one-off costs (allocator, compile)
    step_med = statistics.median(s["step"] for s in measured)
    print(f"median step {step_med * 1e3:.1f} ms over {len(measured)} steps (loss {loss.item():.4f})")
    inside = 0.0
    for name in ("data", "forward+backward", "grad clip", "optimizer"):
        med = statistics.median(s.get(name, 0.0) for s in measured)
        inside += med
        print(f"  {name:17} {med * 1e3:9.2f} ms  {100 * med / step_med:5.1f}%")
    other = max(step_med - inside, 0.0)
    print(f"  {'other':17} {other * 1e3:9.2f} ms  {100 * other / step_med:5.1f}%   (zero_grad, H2D copy, LR, hooks)")


if __name__ == "__main__":
    main(sys.argv[1:])
