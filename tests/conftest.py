"""Shared fixtures: process-group and determinism cleanup after every test, the repo root, tiny-run arguments,
the small debug model, Trainers that are always closed, and local S3 (moto) and GCS (fake-gcs-server) servers. The same
helpers are importable from tests/helpers/ (common.py, checkpoints.py, s3_server.py, gcs_server.py) for module-level
use."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch._inductor.config
import torch.distributed as dist

from models import LLAMA3_FLAVORS
from tests.helpers.checkpoints import SMALL
from tests.helpers.common import DEBUG_CONFIG, ROOT, open_trainer, tiny_run_args
from tests.helpers.gcs_server import GCSServer
from tests.helpers.s3_server import S3Server

if TYPE_CHECKING:
    from trainer.trainer import Trainer

# A suite started in the background by a script (`pytest ... &` in a non-interactive shell, nohup) inherits SIGINT
# ignored, and so would every kiln process it starts: the Ctrl-C test waited out its 600 s timeout. Start them as a
# terminal would (an exec'd child gets the default action for a signal caught here, but keeps an ignored one).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Inductor compiles in-process: its default pool of compile workers (one per core) starts at each compiling process's
# first compile, which on 2 shared cores costs more than it overlaps (a compiled float8 test, cold cache: 76-86 s
# in-process against 117-140 s with the pool, 2026-12-02). Spawned kiln processes inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])  # decided at its import

# Under pytest-xdist each worker is one of several test processes sharing the cores: one intra-op thread each, as
# the spawned ranks have (tests/helpers/distributed.py), so idle OpenMP threads do not spin against the other worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _onednn_restored() -> Iterator[None]:
    """A CPU float8 build turns oneDNN off process-wide (float8/converter.py): each test starts as it found it."""
    enabled = torch.backends.mkldnn.enabled
    yield
    torch.backends.mkldnn.enabled = enabled


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    """A test that fails half-way through building a Trainer must not leave its process group (or the global
    deterministic-algorithms switch that training.deterministic sets) to the next."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def debug_config() -> str:
    """Path of train_configs/debug_model.toml."""
    return DEBUG_CONFIG


@pytest.fixture
def tiny_args(tmp_path: Path) -> Callable[..., list[str]]:
    """tiny_args(*extra) -> train.py arguments for the tiny fp32 debug run, dumping under this test's tmp_path."""

    def make(*extra: str, ac: str = "none") -> list[str]:
        return tiny_run_args("--job.dump_folder", str(tmp_path), *extra, ac=ac)

    return make


@pytest.fixture
def small_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process runs use a 2-layer, dim-64 debugmodel (tests.helpers.checkpoints.SMALL): the saves are about 1 MB
    instead of 76 MB."""
    monkeypatch.setitem(LLAMA3_FLAVORS, "debugmodel", SMALL)


@pytest.fixture
def make_trainer() -> Iterator[Callable[[list[str]], Trainer]]:
    """make_trainer(argv) -> a Trainer that is closed when the test ends, pass or fail."""
    with contextlib.ExitStack() as stack:
        yield lambda argv: stack.enter_context(open_trainer(argv))


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """moto's S3 server on a free localhost port with one bucket (tests/helpers/s3_server.py); this process's
    environment, and so every kiln process the test starts, points at it (AWS_ENDPOINT_URL, test credentials)."""
    with S3Server() as server:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        yield server


@pytest.fixture(params=["s3", "gs"])
def bucket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server | GCSServer]:
    """One bucket on a local server of each object store kiln supports, in turn: moto's S3 (`s3`) and
    fake-gcs-server's GCS (`gs`, tests/helpers/gcs_server.py); the environment points kiln's processes at it."""
    with S3Server() if request.param == "s3" else GCSServer() as server:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        yield server
