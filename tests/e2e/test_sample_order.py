"""The global sample order: step N's global batch is the same whatever the data-parallel layout; FSDP on 2 ranks
follows the 1-rank loss curve; a checkpoint resumes 1 -> 2 -> 1 ranks and continues the curve (whole runs through
tests/helpers/loss_runs.py; the straight runs are fixtures of tests/e2e/conftest.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.data import loader
from tests.helpers.loss_runs import drive, with_init


def test_global_batch_is_the_same_for_every_layout(tmp_path: Path) -> None:
    """Step N's global batch (8 sequences) is the same whatever (DP degree, local batch); so is the state."""
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"doc {i} " + "w " * (5 + i % 17)}) for i in range(60)) + "\n")
    batches, states = {}, {}
    for world, batch in [(1, 8), (2, 4), (4, 2), (8, 1)]:
        loaders = [loader(path, rank=r, world=world, batch=batch, prefetch=r % 2 * 2) for r in range(world)]
        batches[world] = [torch.cat([next(dl)[0] for dl in loaders]) for _ in range(3)]
        states[world] = [dl.state_dict() for dl in loaders]
        for dl in loaders:
            dl.close()
    for world in (2, 4, 8):
        assert all(torch.equal(a, b) for a, b in zip(batches[1], batches[world], strict=True)), world
        assert all(s == states[1][0] for s in states[world]), world
    state = states[1][0]
    assert state["sequences"] == 24
    restored = torch.load(io.BytesIO(_saved(state)), weights_only=True)  # plain types only: no pickled objects
    assert restored == state


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_two_ranks_follow_the_one_rank_curve(straight_one: dict, straight_two: dict) -> None:
    assert straight_one["first_step"] == straight_two["first_step"] == 1
    print("1 rank :", straight_one["losses"], "\n2 ranks:", straight_two["losses"])
    assert max_rel_diff(straight_one["losses"], straight_two["losses"]) < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
def test_elastic_resume_one_two_one_continues_the_curve(runs: Path, straight_one: dict) -> None:
    """step-2 of the 1-rank run resumes on 2 ranks (steps 3-6, saving step-4), whose step-4 resumes on 1 rank."""
    two = drive(with_init(runs / "init", runs / "e2", runs / "one" / "checkpoint" / "step-2"),
                "--checkpoint.interval", "2", nproc=2)  # fmt: skip
    one = drive(with_init(runs / "init", runs / "e1", runs / "e2" / "checkpoint" / "step-4"))
    assert two["first_step"] == 3 and one["first_step"] == 5
    print("straight:", straight_one["losses"][2:], "\n2 ranks :", two["losses"], "\n1 rank  :", one["losses"])
    assert max_rel_diff(two["losses"], straight_one["losses"][2:]) < 1e-5
    assert max_rel_diff(one["losses"], straight_one["losses"][4:]) < 1e-5
