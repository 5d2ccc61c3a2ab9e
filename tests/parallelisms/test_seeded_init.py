"""One seed, one model (parallelisms/seeded_init.py): with the same training.seed every layout holds the weights one
process holds, value for value, and so logs the same losses.

The layouts are built by the Trainer from train.py arguments (the path users take) on gloo ranks: FSDP 2, TP 2,
FSDP 2 x TP 2, HSDP 2 x 2, and float8 tensorwise with FSDP float8 all-gather. Each rank gathers its parameters'
full tensors before training and the logged losses after; both are compared with one process's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from kiln_base.internals import unwrapped_fqn
from models.llama3 import ParamInit
from parallelisms.seeded_init import CHUNK_ELEMS, draw_shard
from tests.helpers.common import open_trainer, tiny_run_args
from tests.helpers.distributed import reopen_group, run_distributed

SEED = ("--training.seed", "7", "--training.deterministic", "--training.steps", "3", "--metrics.log_freq", "1")
GLOBAL_BATCH = 4  # sequences per step in every layout


def _weights_and_losses(argv: list[str]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The full initial weights (gathered from every shard) and the logged losses of a Trainer run."""
    with open_trainer(argv) as trainer:
        weights = {
            unwrapped_fqn(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.model.named_parameters()
        }
        trainer.train()
        return weights, list(trainer.losses)


def _layout_rank(argv: list[str], store: str) -> tuple[dict[str, Any], list[float]]:
    """On each rank of a gloo group: the run's full weights (as numpy arrays: tensors would travel back to the test
    as shared-memory handles of a process that has exited) and its losses."""
    reopen_group(store)
    weights, losses = _weights_and_losses(argv)
    return {k: v.float().numpy() for k, v in weights.items()}, losses


LAYOUTS = {  # name: (ranks, local batch, flags)
    "fsdp2": (2, 2, ()),
    "tp2": (2, 4, ("--parallelism.tensor_parallel_degree", "2")),
    "fsdp2_tp2": (4, 2, ("--parallelism.tensor_parallel_degree", "2")),
    "hsdp2x2": (4, 1, ("--parallelism.data_parallel_replicate_degree", "2")),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list[float]]:
    dump = str(tmp_path_factory.mktemp("one"))
    return _weights_and_losses(tiny_run_args(*SEED, "--training.local_batch_size", "4", "--job.dump_folder", dump))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_same_seed_same_weights_and_losses_in_every_layout(
    layout: str, one_process: tuple[dict[str, torch.Tensor], list[float]], tmp_path: Path
) -> None:
    ranks, batch, flags = LAYOUTS[layout]
    assert ranks * batch // (2 if "--parallelism.tensor_parallel_degree" in flags else 1) == GLOBAL_BATCH
    argv = tiny_run_args(*SEED, "--training.local_batch_size", str(batch), "--job.dump_folder", str(tmp_path), *flags)
    weights, losses = run_distributed(_layout_rank, ranks, argv, str(tmp_path / "store"))[0]
    ref_weights, ref_losses = one_process
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        assert torch.equal(torch.from_numpy(weights[name]), ref), f"{layout}: initial {name} differs from one process's"
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
    assert rel[0] < 1e-5 and max(rel) < 1e-5, (layout, losses, ref_losses)


@pytest.mark.slow
@pytest.mark.distributed
def test_float8_all_gather_layout_starts_from_the_same_weights(
    one_process: tuple[dict[str, torch.Tensor], list[float]], tmp_path: Path
) -> None:
    """The layout-independent values reach float8 weights too (FSDP float8 all-gather wraps each weight shard in
    torchao's subclass): the initial weights equal the float8-off single process's."""
    f8 = ("--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather", "--training.steps", "1")
    argv = tiny_run_args(*SEED, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path), *f8)
    weights, _ = run_distributed(_layout_rank, 2, argv, str(tmp_path / "store"))[0]
    for name, ref in one_process[0].items():
        assert torch.equal(torch.from_numpy(weights[name]), ref), name


def test_a_shard_holds_the_whole_tensors_values() -> None:
    """draw_shard of any slice equals that slice of the whole tensor, across chunk boundaries and uneven splits."""
    init = ParamInit("trunc_normal", 0.02, cut=3.0)
    g = torch.Generator()
    cols = 256
    rows = 3 * (CHUNK_ELEMS // cols) + 5  # three whole chunks and a short one
    full = draw_shard(init, 7, "x", (rows, cols), (rows, cols), (0, 0), torch.device("cpu"), g)
    for shape, offset in [((rows // 3, cols), (rows // 3, 0)), ((7, 100), (CHUNK_ELEMS // cols - 3, 128))]:
        part = draw_shard(init, 7, "x", (rows, cols), shape, offset, torch.device("cpu"), g)
        assert torch.equal(part, full[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]])
    other = draw_shard(init, 8, "x", (rows, cols), (rows, cols), (0, 0), torch.device("cpu"), g)
    assert not torch.equal(other, full)  # another seed, another tensor


def test_unset_seed_draws_one_and_says_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """training.seed unset: the weights come from a seed drawn at random, logged so the model can be repeated."""
    import logging
    import re

    caplog.set_level(logging.INFO, logger="kiln")
    argv = tiny_run_args("--training.steps", "1", "--training.seed", "none", "--job.dump_folder", str(tmp_path))
    with open_trainer(argv) as a:
        first = a.model.output.weight.detach().clone()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Initial weights from seed")]
    seed = re.search(r"seed (\d+)", line).group(1)  # type: ignore[union-attr]
    with open_trainer(argv) as b:
        assert not torch.equal(b.model.output.weight, first)  # a fresh draw
    with open_trainer(tiny_run_args("--training.seed", seed, "--job.dump_folder", str(tmp_path))) as c:
        assert torch.equal(c.model.output.weight, first)  # the logged seed repeats the model
