"""Runs that more than one end-to-end suite compares with, computed once for the package (test_sample_order.py and
test_preemption.py both read them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.loss_runs import drive, save_initial_weights, with_init


@pytest.fixture(scope="package")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding init/step-0, the initial weights of every loss_runs run; the runs go beside it."""
    root = tmp_path_factory.mktemp("runs")
    save_initial_weights(root)
    return root


@pytest.fixture(scope="package")
def straight_one(runs: Path) -> dict[str, Any]:
    """1 rank, local batch 4, checkpoints at steps 2, 4, 6."""
    return drive(with_init(runs / "init", runs / "one"), "--checkpoint.interval", "2")


@pytest.fixture(scope="package")
def straight_two(runs: Path) -> dict[str, Any]:
    """FSDP on 2 ranks, local batch 2: the same global batches."""
    return drive(with_init(runs / "init", runs / "two"), "--checkpoint.interval", "100", nproc=2)
