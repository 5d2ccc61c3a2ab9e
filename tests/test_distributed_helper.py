"""tests/helpers/distributed.py itself: its forkserver preloads modules that exist (the forkserver silently skips a
preload it cannot import), and its ranks meet at the end through the store rank 0 hosts."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tests.helpers.distributed import _PRELOAD, check_preload, run_distributed


def test_forkserver_preloads_modules_that_exist() -> None:
    check_preload(_PRELOAD)
    with pytest.raises(ModuleNotFoundError, match="no module named trainer.train$"):
        check_preload(["torch", "trainer.train"])  # the module's name before the refactor


def _rank0_leaves_first() -> int:
    """Rank 0 returns (and ends its group) at once; the other rank then still creates a group through the store
    rank 0 hosts (as DeviceMesh does, one group after another): what reset its connection when rank 0's store went
    with rank 0's group."""
    if dist.get_rank() != 0:
        time.sleep(2)
        dist.new_group([1], use_local_synchronization=True)  # a group of its own: only the store, no peer
    return dist.get_rank()


@pytest.mark.distributed
def test_store_outlives_every_rank_that_still_uses_it() -> None:
    assert run_distributed(_rank0_leaves_first, 2) == [0, 1]
