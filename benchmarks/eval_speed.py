"""How fast downstream evaluation ([eval], trainer/evaluation/downstream.py) scores, against the model's forward.

    python benchmarks/eval_speed.py [--limit 200] [--batch-size 16] [--repeats 3] [train.py arguments ...]

Builds the Trainer of the debug config (one rank, fp32 unless the arguments say otherwise) with eval on, untrained
weights, and times whole evaluations of the bundled kiln_cloze (`--limit` documents, 4 requests each) through
lm-eval's evaluator: examples/s, requests/s and the requests' tokens/s. Then it times the model's plain forward
(no_grad) over as many tokens in full training-length rows of `--batch-size`, the floor an evaluation could reach,
and prints the ratio: evaluation seconds / forward seconds for the same token count. Each timing is the best of
`--repeats`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln_base.config import parse_args  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    a, rest = p.parse_known_args()
    argv = [
        *("--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--training.steps", "1"),
        *("--training.mixed_precision_param", "float32", "--job.dump_folder", "/tmp/kiln_eval_speed"),
        *("--eval.enable", "--eval.limit", str(a.limit), "--eval.batch_size", str(a.batch_size)),
        *rest,
    ]
    trainer = Trainer(parse_args(argv))
    try:
        assert trainer.downstream is not None
        best = None
        for i in range(a.repeats + 1):  # the first evaluation warms up (and builds lm-eval's requests once)
            result = trainer.downstream.run(i)
            if i and (best is None or result.seconds < best.seconds):
                best = result
        assert best is not None
        examples = sum(int(s["examples"]) for s in best.scores.values())
        tokens = best.tokens
        seq = trainer.cfg.training.seq_len
        rows = max(1, round(tokens / seq))
        batch = torch.randint(0, trainer.tokenizer.n_words, (a.batch_size, seq), device=trainer.device)
        forward = float("inf")
        with torch.no_grad():
            trainer.model(batch)
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                for _ in range(-(-rows // a.batch_size)):
                    trainer.model(batch)
                forward = min(forward, time.perf_counter() - t0)
        forward_tokens = -(-rows // a.batch_size) * a.batch_size * seq
        floor = forward * tokens / forward_tokens
        print(
            f"eval: {examples} examples ({best.requests} requests, {tokens:,} tokens) in {best.seconds:.2f} s: "
            f"{examples / best.seconds:.1f} examples/s, {best.requests / best.seconds:.1f} requests/s, "
            f"{tokens / best.seconds:,.0f} tokens/s; the plain forward: {forward_tokens / forward:,.0f} tokens/s "
            f"(rows of {seq}); eval / forward for the same tokens: {best.seconds / floor:.2f}x"
        )
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
