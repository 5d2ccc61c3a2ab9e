"""Peak memory of one forward+backward with the loss eager vs compiled (trainer/components/loss.py).

    python benchmarks/loss_memory.py --job.config_file train_configs/debug_model.toml --model.vocab_size 128256 \
        --training.seq_len 256 --training.local_batch_size 2 --training.mixed_precision_param float32

Each mode runs in a fresh process: the real Trainer from the same flags as train.py, the model eager in both
(only the loss differs), one warm-up forward+backward (compiles the loss), then one measured forward+backward.
Peak = high-water mark during the measured pass minus memory in use before it: on CUDA the allocator's peak
(`max_memory_allocated`); on CPU the process's peak RSS (`VmHWM`, reset through /proc/self/clear_refs; tensors
this large are mmap'ed by malloc, so RSS follows them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(argv: list[str], compiled: bool) -> dict[str, float | str]:
    import torch

    from kiln_base.config import parse_args
    from trainer.components.loss import build_loss_fn
    from trainer.trainer import Trainer

    cfg = parse_args([*argv, "--training.compile=false", "--metrics.enable_tensorboard=false"])
    trainer = Trainer(cfg)
    trainer.train_step.loss_fn = build_loss_fn(compiled)
    try:
        inputs, labels = (t.to(trainer.device) for t in next(trainer.dataloader))
        trainer.train_step.forward_backward(inputs, labels)  # warm-up: compiles the loss, allocates the gradients
        cuda = trainer.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            before = _proc_kib("VmRSS") * 1024
        loss = trainer.train_step.forward_backward(inputs, labels)
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _proc_kib("VmHWM") * 1024
        output = trainer.model.get_submodule("output")
        assert isinstance(output, torch.nn.Linear)
        logits_numel = inputs.numel() * output.out_features
        return {
            "loss": "compiled" if compiled else "eager",
            "peak_mib": (peak - before) / 2**20,
            "logits_fp32_mib": 4 * logits_numel / 2**20,
            "loss_value": round(loss.item(), 4),
        }
    finally:
        trainer.close()


def main(argv: list[str]) -> None:
    if os.environ.get("KILN_LOSS_MEMORY_MODE"):
        print(json.dumps(measure(argv, os.environ["KILN_LOSS_MEMORY_MODE"] == "compiled")))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # every large tensor mmap'ed: RSS tracks frees
    results = []
    for mode in ("eager", "compiled"):
        out = subprocess.run(
            [sys.executable, __file__, *argv],
            env=dict(env, KILN_LOSS_MEMORY_MODE=mode),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    unit = results[0]["logits_fp32_mib"]
    print(f"one (tokens x vocab) fp32 tensor: {unit:.0f} MiB")
    for r in results:
        print(
            f"loss {r['loss']:8}: peak over the pass {r['peak_mib']:8.0f} MiB ({r['peak_mib'] / unit:.2f} fp32 logits)"
            f"  loss {r['loss_value']}"
        )
    print(f"saved by compiling the loss: {results[0]['peak_mib'] - results[1]['peak_mib']:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
