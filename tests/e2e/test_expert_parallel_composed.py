"""Expert parallelism composed with pipeline, context and tensor parallelism, against one process from the same seed.

One spawned group of 4 gloo ranks trains `debugmodel_moe` (2 blocks, seq 32, global batch 4, 4 steps, fp32,
deterministic) through `parse_args` + `Trainer` three times: EP 2 x PP 2 (each stage's MoE layer dispatches over
the stage's 2 data-parallel ranks), the same with the expert bias on (model.moe_load_balance_coeff 1e-2, which
changes the routing from step 2 on), and EP 2 x CP 2 with the bias (each EP group is a CP pair, torchtitan's rule;
the experts are FSDP-sharded over the 2 shard ranks), and EP 2 x TP 2 with it under per-op selective activation
checkpointing (each EP group is a TP pair, each TP rank routing its half of every sequence; the bias needs the
counts summed over the TP ranks too). Every step's logged loss, gradient norm and moe_imbalance must
equal the one-process run's within 1e-5 relative, every gradient after step 1 (gathered by name; each pipeline
stage's from its ranks) within 1e-5 of its largest entry, and each layer's expert bias after step 4 the one-process
bias within 1e-6.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln_base.internals import unwrapped_fqn
from tests.helpers.common import DEBUG_CONFIG, open_trainer
from tests.helpers.distributed import forget_dtensor_plans, reopen_group, run_distributed
from tests.helpers.grads import GradsAtStep1
from tests.helpers.step_metrics import logged_metrics

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

COMMON = [
    *("--job.config_file", DEBUG_CONFIG, "--model.name", "qwen3", "--model.flavor", "debugmodel_moe"),
    *("--model.n_layers", "2", "--training.seq_len", "32", "--training.steps", "4", "--training.seed", "0"),
    *("--training.global_batch_size", "4", "--training.mixed_precision_param", "float32", "--training.deterministic"),
    *("--metrics.log_freq", "1", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1"),
    *("--activation_checkpoint.mode", "none"),
]
P = "--parallelism."
BIAS = ("--model.moe_load_balance_coeff", "1e-2")
EP2 = (f"{P}expert_parallel_degree", "2", "--training.local_batch_size", "2")  # 2 data-parallel ranks
CASES = {
    "pp": (*EP2, f"{P}pipeline_parallel_degree", "2"),
    "pp_bias": (*EP2, f"{P}pipeline_parallel_degree", "2", *BIAS),
    "cp_bias": (*EP2, f"{P}context_parallel_degree", "2", *BIAS),
    # Each EP group a TP pair (each TP rank routes its half of every sequence), per-op selective AC.
    "tp_bias": (*EP2, f"{P}tensor_parallel_degree", "2", *BIAS, "--activation_checkpoint.mode", "selective"),
}
REFERENCE = {"pp": (), "pp_bias": BIAS, "cp_bias": BIAS, "tp_bias": BIAS}
METRICS = ("loss", "grad_norm", "moe_imbalance")
_KEEP: list[Any] = []  # closed Trainers: the first one's process group holds the store the later ones' watch uses


def _run(argv: list[str]) -> dict[str, Any]:
    with open_trainer(argv) as trainer:
        _KEEP.append(trainer)
        grads, records = GradsAtStep1(trainer.model), logged_metrics(trainer)
        trainer.train(extra_hooks=[grads])
    bias = {n: b.detach().clone() for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")}
    metrics = {k: [r[k] for r in records] for k in METRICS}
    named = {unwrapped_fqn(n): g for n, g in grads.grads.items()}  # without the AC wrappers' prefixes
    return {"metrics": metrics, "grads": named, "bias": {unwrapped_fqn(n): b for n, b in bias.items()}}


def _group(folder: str) -> bytes:
    out = {}
    Path(folder).mkdir(parents=True, exist_ok=True)
    for i, (name, args) in enumerate(CASES.items()):
        reopen_group(f"{folder}/store_{i}")
        forget_dtensor_plans()  # the previous run's meshes' cached plans name its dead groups
        out[name] = _run([*COMMON, *args, "--job.dump_folder", f"{folder}/{name}"])
    buffer = io.BytesIO()  # tensors through the result queue would be shared memory of a process about to exit
    torch.save(out, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("ep_composed")
    one = {
        name: _run([*COMMON, "--training.local_batch_size", "4", *args, "--job.dump_folder", str(folder / name)])
        for name, args in {"plain": (), "bias": BIAS}.items()
    }
    ranks = [torch.load(io.BytesIO(r)) for r in run_distributed(_group, 4, str(folder / "ep"), timeout_s=900)]
    return {"one": one, "ranks": ranks}


def _merged(ranks: list[dict[str, Any]], key: str, same: tuple[tuple[int, int], ...]) -> dict[str, torch.Tensor]:
    """`key` (grads or bias, by name) from every rank: ranks `same` pairs hold the same names with the same values
    (both ranks of a pipeline stage, or of an EP x CP layout, gather the whole tensor)."""
    merged: dict[str, torch.Tensor] = {}
    for a, b in same:
        assert set(ranks[a][key]) == set(ranks[b][key])
        for name, t in ranks[a][key].items():
            torch.testing.assert_close(ranks[b][key][name], t, rtol=0, atol=0)
        merged |= ranks[a][key]
    return merged


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_composed_matches_one_process(case: str, runs: dict[str, Any]) -> None:
    one = runs["one"]["bias" if REFERENCE[case] else "plain"]
    ranks = [r[case] for r in runs["ranks"]]
    for r in ranks:  # every rank logs the global figures
        for k in METRICS:
            got, want = torch.tensor(r["metrics"][k]), torch.tensor(one["metrics"][k])
            assert len(got) == 4, r["metrics"]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    # PP: ranks 0, 1 (stage 0's data-parallel, and EP, ranks) and 2, 3 (stage 1's); CP, TP: every rank holds all.
    same = ((0, 1), (2, 3)) if case.startswith("pp") else ((0, 1), (0, 2), (0, 3))
    if case.startswith("pp"):
        assert not set(ranks[0]["grads"]) & set(ranks[2]["grads"]), "each parameter lives on one pipeline stage"
    grads = _merged(ranks, "grads", same)
    assert set(grads) == set(one["grads"])
    for name, g in one["grads"].items():
        worst = ((grads[name] - g).abs().max() / g.abs().max()).item()
        assert worst < 1e-5, f"{name} differs by {worst:.2e} of its largest gradient"
    bias = _merged(ranks, "bias", same)
    assert set(bias) == set(one["bias"]) and len(bias) == 2
    for name, b in one["bias"].items():
        assert bool(b.any()) == bool(REFERENCE[case]), (name, b)  # moved only with the coefficient
        torch.testing.assert_close(bias[name], b, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_the_bias_changes_the_run(runs: dict[str, Any]) -> None:
    """The bias cases test the bias: it changes the routing, hence the losses, from step 2 on."""
    plain, bias = (runs["one"][k]["metrics"]["loss"] for k in ("plain", "bias"))
    assert plain[0] == bias[0] and all(abs(a - b) > 1e-4 for a, b in zip(plain[1:], bias[1:], strict=True))
