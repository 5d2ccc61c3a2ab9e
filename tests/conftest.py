"""Shared fixtures: process-group cleanup after every test, and the tiny-run helpers of tests/common.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    """A test that fails half-way through building a Trainer must not leave its process group to the next."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
