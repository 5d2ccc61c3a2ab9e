"""The gradient norm agrees across layouts: the logged grad_norm of FSDP 2, TP 2, PP 2, CP 2 and HSDP 2 x 2 against
one process's, from one seed (fp32, deterministic, 3 steps, global batch 4): within 1e-6 relative at step 1 (the
same weights, the same gradients up to reduction order) and 1e-5 after (the clipped updates then differ by that).

Each rank records the norm train_step returns (what the metrics hook logs) at full precision through an extra step
hook; the runs are the Trainer's, built from train.py arguments on gloo ranks.

The same runs check the step line's tps per device (docs/metrics.md) under a clock that moves 1 s per step: the
tokens this device computes, local batch x seq_len / (PP degree x CP degree): a pipeline's ranks share its tokens
and a context-parallel rank computes 1/CP of each sequence, while a tensor-parallel rank computes every token.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import trainer.components.metrics as metrics_module
from tests.helpers.common import run_trainer, tiny_run_args
from tests.helpers.distributed import run_distributed, train_in_group
from tests.helpers.step_metrics import StepClock
from trainer.components.metrics import MetricsLogger
from trainer.hooks import StepHook, StepOutput

P = "--parallelism."
# max_norm 0.5 clips every step (the debug model's norms are ~1-3): the clipping coefficient comes from the norm.
SEED = (
    *("--training.seed", "7", "--training.deterministic", "--training.steps", "3", "--metrics.log_freq", "1"),
    *("--model.n_layers", "2", "--training.max_norm", "0.5"),
)
LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {  # name: (ranks, flags; global batch 4 in each)
    "fsdp2": (2, ("--training.local_batch_size", "2")),
    "tp2": (2, (f"{P}data_parallel_shard_degree", "1", f"{P}tensor_parallel_degree", "2")),
    "pp2": (2, (f"{P}data_parallel_shard_degree", "1", f"{P}pipeline_parallel_degree", "2")),
    "cp2": (2, (f"{P}context_parallel_degree", "2", f"{P}context_parallel_rotate_method", "alltoall")),
    "hsdp2x2": (4, (f"{P}data_parallel_replicate_degree", "2", "--training.local_batch_size", "1")),
}
# tps per device at 1 s per step: local batch x seq_len (32) / (PP x CP); TP ranks each compute all tokens.
TPS = {"one": 4 * 32, "fsdp2": 2 * 32, "tp2": 4 * 32, "pp2": 4 * 32 // 2, "cp2": 4 * 32 // 2, "hsdp2x2": 1 * 32}


class NormRecorder(StepHook):
    """Every step's gradient norm as a Python float (the value the step line logs, read at full precision), and the
    tps each step line shows, the metrics' clock moving 1 s per step."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.tps: list[float] = []
        self.clock = StepClock()
        metrics_module.time = SimpleNamespace(perf_counter=self.clock)  # type: ignore[assignment]
        log = MetricsLogger.log

        def recording(metrics: MetricsLogger, *args: Any, **kwargs: Any) -> dict[str, float]:
            out = log(metrics, *args, **kwargs)
            self.tps.append(out["tps"])
            return out

        MetricsLogger.log = recording  # type: ignore[method-assign]
        self.restore = lambda: setattr(MetricsLogger, "log", log) or setattr(metrics_module, "time", time)

    def pre_step(self, step: int) -> None:
        self.clock.now += 1.0

    def post_step(self, out: StepOutput) -> None:
        self.norms.append(out.grad_norm.item())

    def close(self) -> None:
        self.restore()


def _argv(dump: Path, *flags: str) -> list[str]:
    return tiny_run_args(*SEED, "--training.local_batch_size", "4", *flags, "--job.dump_folder", str(dump))


def _norms_on_rank(names: list[str], folder: str) -> dict[str, tuple[list[float], list[float]]]:
    """On each rank of one gloo group: the norms and tps of each layout's run, one after the other."""
    out = {}
    for i, name in enumerate(names):
        recorder = NormRecorder()
        train_in_group(_argv(Path(folder, name), *LAYOUTS[name][1]), f"{folder}/store_{i}", [recorder])
        out[name] = (recorder.norms, recorder.tps)
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    recorder = NormRecorder()
    try:
        run_trainer(_argv(tmp_path_factory.mktemp("one")), [recorder])
    finally:
        recorder.restore()  # also when the Trainer fails before its hooks run
    assert recorder.tps == [TPS["one"]] * 3, recorder.tps
    return recorder.norms


def _relative(norms: list[float], ref: list[float]) -> list[float]:
    return [abs(a - b) / b for a, b in zip(norms, ref, strict=True)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2, 4])
def test_grad_norm_agrees_with_one_process_in_every_layout(
    ranks: int, one_process: list[float], tmp_path: Path
) -> None:
    names = [name for name, (n, _) in LAYOUTS.items() if n == ranks]
    runs: Any = run_distributed(_norms_on_rank, ranks, names, str(tmp_path))
    assert len(one_process) == 3 and min(one_process) > 0.5, one_process  # every step clips
    for name in names:
        per_rank = [r[name][0] for r in runs]
        assert all(r == per_rank[0] for r in per_rank), (name, per_rank)  # every rank logs the same norm
        assert [r[name][1] for r in runs] == [[TPS[name]] * 3] * ranks, name  # every rank, every step
    rel = {name: _relative(runs[0][name][0], one_process) for name in names}
    shown = {name: ([f"{x:.2e}" for x in r], runs[0][name][0]) for name, r in rel.items()}
    assert all(r[0] < 1e-6 and max(r) < 1e-5 for r in rel.values()), (one_process, shown)
