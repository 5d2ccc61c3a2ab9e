"""Pipeline x context parallelism against one process from the same seed (the same weights in every layout).

One spawned group of 4 gloo ranks (PP 2 x CP 2: the mesh (pp, cp), each pipeline stage on a CP pair) trains through
`parse_args` + `Trainer`, fp32, deterministic, the debug model with 2 blocks, seq 32, global batch 4, 3 steps: under
1F1B with all-gathered keys/values and under Interleaved1F1B with keys/values passed round the ring. The losses must
equal the one-process run's within 1e-5 relative; every parameter's gradient after step 1 (gathered by name from the
stages; both CP ranks of a stage hold the same) the one-process gradient within 1e-5 of its largest entry; the
gradient norms the one-process norms; and a validation through the same layout one process's validation loss.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.common import DEBUG_CONFIG, open_trainer
from tests.helpers.distributed import reopen_group, run_distributed
from tests.helpers.grads import GradsAtStep1
from trainer.hooks import StepHook, StepOutput

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = [
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "32"),
    *("--training.global_batch_size", "4", "--training.local_batch_size", "4", "--training.steps", "3"),
    *("--training.seed", "0", "--training.mixed_precision_param", "float32", "--training.deterministic"),
    *("--metrics.log_freq", "1", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1"),
    *("--activation_checkpoint.mode", "none", "--validation.enable", "--validation.freq", "3"),
    *("--validation.steps", "2"),
    # No clipping: the gradients are compared as computed. The clipping coefficient carries the gradient norm's own
    # fp32 noise (torch's CPU norm of one (1128, 256) shard is 6e-5 off its float64 value), so layouts' norms differ
    # by up to 7.7e-5 relative here, one process against FSDP 2 as much; the norms are compared at that scale.
    *("--training.max_norm", "0"),
]
P = "--parallelism."
CASES = {
    "1F1B-allgather": (f"{P}pipeline_parallel_schedule", "1F1B", f"{P}context_parallel_rotate_method", "allgather"),
    "Interleaved1F1B-alltoall": (
        *(f"{P}pipeline_parallel_schedule", "Interleaved1F1B"),
        *(f"{P}context_parallel_rotate_method", "alltoall"),
    ),
}
PP2_CP2 = (f"{P}pipeline_parallel_degree", "2", f"{P}context_parallel_degree", "2")
_KEEP: list[Any] = []  # closed Trainers: the first one's process group holds the store the later ones' watch uses


class GradNorms(StepHook):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def post_step(self, out: StepOutput) -> None:
        norm = out.grad_norm.full_tensor() if isinstance(out.grad_norm, DTensor) else out.grad_norm
        self.norms.append(float(norm))


def _run(argv: list[str]) -> dict[str, Any]:
    with open_trainer(argv) as trainer:
        _KEEP.append(trainer)
        grads, norms = GradsAtStep1(trainer.model), GradNorms()
        trainer.train(extra_hooks=[grads, norms])
    validated = trainer.validator.losses if trainer.validator is not None else {}
    val = [validated[s] for s in sorted(validated)]
    return {"losses": trainer.losses, "grads": grads.grads, "norms": norms.norms, "val": val}


def _group(folder: str) -> bytes:
    out = {}
    Path(folder).mkdir(parents=True, exist_ok=True)
    for i, (name, args) in enumerate(CASES.items()):
        reopen_group(f"{folder}/store_{i}")
        torch._dynamo.reset()
        out[name] = _run([*COMMON, *PP2_CP2, *args, "--job.dump_folder", f"{folder}/{name}"])
    buffer = io.BytesIO()  # tensors through the result queue would be shared memory of a process about to exit
    torch.save(out, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("pp_cp")
    one = _run([*COMMON, "--job.dump_folder", str(folder / "one")])
    ranks = [torch.load(io.BytesIO(r)) for r in run_distributed(_group, 4, str(folder / "pp_cp"))]
    return {"one": one, "ranks": ranks}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_with_context_parallel_matches_one_process(case: str, runs: dict[str, Any]) -> None:
    one, ranks = runs["one"], [r[case] for r in runs["ranks"]]
    for r in ranks:  # the loss is the global mean on every rank, the norm summed over the stages
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(one["norms"]), rtol=2e-4, atol=0)
    # Ranks 0, 1 (the pipeline's first rank, CP ranks 0 and 1) hold the same stages, ranks 2, 3 the others.
    for a, b in ((0, 1), (2, 3)):
        assert set(ranks[a]["grads"]) == set(ranks[b]["grads"])
        for name, g in ranks[a]["grads"].items():
            torch.testing.assert_close(ranks[b]["grads"][name], g, rtol=0, atol=0)
    assert not set(ranks[0]["grads"]) & set(ranks[2]["grads"]), "each parameter lives on one pipeline rank"
    grads = ranks[0]["grads"] | ranks[2]["grads"]
    assert set(grads) == set(one["grads"])
    # CP merges attention blocks by log-sum-exp, another fp32 order: each gradient within 1e-5 of its largest entry
    # (tests/parallelisms/test_context_parallel.py's bound for CP alone; measured here: 5e-7).
    for name, g in one["grads"].items():
        worst = ((grads[name] - g).abs().max() / g.abs().max()).item()
        assert worst < 1e-5, f"{name} differs by {worst:.2e} of its largest gradient"


def test_validation_with_pipeline_and_context_parallel_matches_one_process(runs: dict[str, Any]) -> None:
    one = runs["one"]["val"]
    assert one, "the one-process run validated"
    for case in CASES:
        for r in runs["ranks"]:
            torch.testing.assert_close(torch.tensor(r[case]["val"]), torch.tensor(one), rtol=1e-5, atol=0)
