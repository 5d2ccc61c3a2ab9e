"""trainer/checkpoint/objects.py against moto's S3 server and fake-gcs-server's GCS on localhost (the `bucket` fixture,
both in turn; `s3` alone where the store's API does not matter): the one-job lock object, retries with backoff then
one line naming the URL, which prefixes count, are removed or are left alone, and a save whose upload fails
(CheckpointManager in-process, one rank)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kiln_base.config import Checkpoint
from kiln_base.errors import CheckpointError
from tests.helpers.checkpoints import StepCounter
from tests.helpers.gcs_server import GCSServer
from tests.helpers.s3_server import S3Server
from trainer.checkpoint import objects
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.objects import ObjectLock, ObjectStore, remove_killed_object_saves, scan_objects


def test_lock_object_refuses_a_second_run_naming_the_holder_until_released(bucket: S3Server | GCSServer) -> None:
    s3 = bucket
    store = ObjectStore(s3.url("run/ckpt"))
    first = ObjectLock(store)
    assert s3.keys("run/ckpt") == [".kiln.lock"]
    with pytest.raises(CheckpointError) as e:
        ObjectLock(ObjectStore(s3.url("run/ckpt")))
    holder = s3.read("run/ckpt/.kiln.lock").decode()
    assert f"checkpoint folder {s3.url('run/ckpt')} is in use by another kiln run ({holder.strip()}" in str(e.value)
    assert "delete the lock object" in str(e.value)
    first.release()
    assert s3.keys("run/ckpt") == []
    ObjectLock(ObjectStore(s3.url("run/ckpt"))).release()  # free again


class _Flaky:
    """An fsspec filesystem stand-in whose `find` fails `failures` times (a dropped connection), then answers."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def find(self, root: str, detail: bool = False) -> dict[str, dict[str, Any]]:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return {f"{root}/step-2/kiln.json": {"size": 12}}


def _store(s3: S3Server, fs: Any, waits: list[float]) -> ObjectStore:
    store = ObjectStore(s3.url("run/ckpt"), sleep=waits.append)
    store.fs = fs
    return store


def test_a_transient_failure_is_retried_with_doubling_waits(s3: S3Server) -> None:
    waits: list[float] = []
    fs = _Flaky(2, ConnectionResetError("connection reset by peer"))
    assert _store(s3, fs, waits).listing() == {"step-2": {"kiln.json": 12}}
    assert fs.calls == 3 and waits == [1.0, 2.0]


def test_a_lasting_failure_is_one_line_naming_the_url_after_the_tries(s3: S3Server) -> None:
    waits: list[float] = []
    fs = _Flaky(99, TimeoutError("read timed out"))
    with pytest.raises(CheckpointError) as e:
        _store(s3, fs, waits).listing()
    assert str(e.value).startswith(
        f"object storage: listing {s3.url('run/ckpt')}/ failed after {objects.TRIES['s3']} tries: TimeoutError: read "
        "timed out (check the network, the credentials and AWS_ENDPOINT_URL)"
    )
    assert fs.calls == objects.TRIES["s3"] and waits == [1.0, 2.0, 4.0, 8.0]


def test_a_refused_permission_is_not_retried(s3: S3Server) -> None:
    waits: list[float] = []
    fs = _Flaky(99, PermissionError("Access Denied"))
    with pytest.raises(CheckpointError, match="failed: PermissionError: Access Denied"):
        _store(s3, fs, waits).listing()
    assert fs.calls == 1 and waits == []


class NoCredentialsError(Exception):  # botocore's, by name: kiln tells it by its name
    pass


def test_a_gcs_refused_permission_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """gcsfs raises a plain OSError('Forbidden: ...') for a 403, not PermissionError."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # no look for credentials (15 s): fs is a fake
    waits: list[float] = []
    fs = _Flaky(99, OSError("Forbidden: https://storage.googleapis.com/b/kiln-test/o"))
    store = ObjectStore("gs://kiln-test/run/ckpt", sleep=waits.append)
    store.fs = fs
    with pytest.raises(CheckpointError, match="failed: OSError: Forbidden: "):
        store.listing()
    assert fs.calls == 1 and waits == []


def test_an_unreachable_gcs_is_one_line_after_two_kiln_tries_of_gcsfs_six(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Real gcsfs against a closed port: gcsfs tries each request 6 times (5 waits), kiln tries that twice (one wait)
    and says it in one line; gcsfs's ERROR record with a traceback per given-up request stays out of the log."""
    import gcsfs.retry

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # nothing listens on port 9 here
    gcsfs_waits: list[float] = []

    async def no_wait(seconds: float) -> None:
        gcsfs_waits.append(seconds)

    monkeypatch.setattr(gcsfs.retry, "asyncio", type("_Asyncio", (), {"sleep": staticmethod(no_wait)}))
    waits: list[float] = []
    with pytest.raises(CheckpointError) as e:
        ObjectStore("gs://kiln-test/run/ckpt", sleep=waits.append).listing()
    assert str(e.value).startswith(
        "object storage: listing gs://kiln-test/run/ckpt/ failed after 2 tries: ClientConnectorError: Cannot connect"
    ), e.value
    assert waits == [1.0] and len(gcsfs_waits) == 2 * 5
    assert not [r for r in caplog.records if r.name.startswith("gcsfs")], caplog.records


def test_missing_credentials_are_not_retried(s3: S3Server) -> None:
    waits: list[float] = []
    fs = _Flaky(99, NoCredentialsError("Unable to locate credentials"))
    with pytest.raises(CheckpointError, match="failed: NoCredentialsError: Unable to locate credentials .check"):
        _store(s3, fs, waits).listing()
    assert fs.calls == 1 and waits == []


def test_only_marked_steps_count_and_only_kilns_killed_saves_are_removed(bucket: S3Server | GCSServer) -> None:
    s3 = bucket
    for key in ("step-2/.kiln-saving", "step-2/.metadata", "step-2/kiln.json"):  # complete
        s3.write(f"run/ckpt/{key}", b"{}")
    for key in ("step-4/.kiln-saving", "step-4/.metadata", "step-4/__0_0.distcp"):  # killed before its marker
        s3.write(f"run/ckpt/{key}", b"x")
    s3.write("run/ckpt/step-6/.metadata", b"x")  # not kiln's: no .kiln-saving, no kiln.json
    store = ObjectStore(s3.url("run/ckpt"))
    entries = {e.name: e for e in scan_objects(store)}
    assert [n for n, e in entries.items() if e.has_metadata and not e.tmp] == ["step-2"]
    assert entries["step-4"].kiln_saving and not entries["step-6"].kiln_saving
    remove_killed_object_saves(store)
    assert s3.keys("run/ckpt") == ["step-2/.kiln-saving", "step-2/.metadata", "step-2/kiln.json", "step-6/.metadata"]


def _manager(url: str, async_mode: str = "disabled") -> tuple[CheckpointManager, torch.nn.Linear, StepCounter]:
    model, counter = torch.nn.Linear(8, 8, bias=False), StepCounter()
    cfg = Checkpoint(enable_checkpoint=True, interval=1, async_mode=async_mode)
    return CheckpointManager(cfg, url, {"model": model, "train_state": counter}), model, counter


def test_async_uploads_run_in_the_background_marker_last_and_the_next_save_waits(
    bucket: S3Server | GCSServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """async_mode async, to S3 and to GCS: maybe_save returns while step 1's upload is held back (not yet a
    checkpoint); the next save waits for it; every object is uploaded off the training thread, step 1's all before
    step 2's, kiln.json last."""
    s3 = bucket
    url = s3.url("run/ckpt")
    saver, model, counter = _manager(url, "async")
    release = threading.Event()
    order: list[tuple[bool, str]] = []  # (on the training thread, object)
    write, upload = ObjectStore.write, ObjectStore.upload

    def held(name: str) -> None:
        if name.startswith("step-1/") and not name.endswith(".kiln-saving"):
            assert release.wait(60)
        order.append((threading.current_thread() is threading.main_thread(), name))

    monkeypatch.setattr(ObjectStore, "write", lambda self, name, data: (held(name), write(self, name, data))[1])
    monkeypatch.setattr(ObjectStore, "upload", lambda self, local, name: (held(name), upload(self, local, name))[1])
    with torch.no_grad():
        model.weight.fill_(1.0)
    counter.step = 1
    saver.maybe_save(1)  # returns with step 1's upload held
    assert "step-1/kiln.json" not in s3.keys("run/ckpt") and saver._pending is not None
    with torch.no_grad():
        model.weight.fill_(2.0)  # training goes on: step 1's staged copy is what is uploaded
    counter.step = 2
    threading.Timer(0.5, release.set).start()
    saver.maybe_save(2)  # waits for step 1's upload, then stages step 2
    assert "step-1/kiln.json" in s3.keys("run/ckpt")
    saver.close()
    step1 = [name for main, name in order if name.startswith("step-1/") and not name.endswith(".kiln-saving")]
    assert step1[-1] == "step-1/kiln.json" and "step-1/.metadata" in step1 and "step-1/__0_0.distcp" in step1
    first_of_2 = next(i for i, (_, n) in enumerate(order) if n.startswith("step-2/") and not n.endswith("saving"))
    assert order.index((False, "step-1/kiln.json")) < first_of_2
    assert [n for main, n in order if main and not n.endswith(".kiln-saving")] == []  # all off the training thread
    assert order[-1] == (False, "step-2/kiln.json")
    loader, model, counter = _manager(url)
    assert loader.load() == 2 and counter.step == 2 and bool((model.weight == 2).all())
    loader.close()
    s3.remove("run/ckpt/step-2/kiln.json")  # step 2 no longer counts: step 1 is the newest
    loader, model, counter = _manager(url)
    assert loader.load() == 1 and bool((model.weight == 1).all())  # the staged copy, not the later weights
    loader.close()


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_failed_upload_is_one_line_removes_its_prefix_and_leaves_the_last_step_loadable(
    bucket: S3Server | GCSServer, monkeypatch: pytest.MonkeyPatch, async_mode: str
) -> None:
    """Under async the failure is raised where the training loop meets the background upload: the next save."""
    s3 = bucket
    url = s3.url("run/ckpt")
    saver, model, counter = _manager(url, async_mode)
    with torch.no_grad():
        model.weight.fill_(1.0)
    counter.step = 1
    saver.maybe_save(1)
    upload = ObjectStore.upload

    def failing(self: ObjectStore, local: str, name: str) -> None:
        if name.startswith("step-2/"):
            raise CheckpointError(f"object storage: uploading to {self.where(name)} failed after 5 tries: boom")
        upload(self, local, name)

    monkeypatch.setattr(ObjectStore, "upload", failing)
    counter.step = 2
    with pytest.raises(CheckpointError) as e:
        saver.maybe_save(2)
        saver.maybe_save(3)  # async: step 2's upload has failed in the background
    assert str(e.value).startswith(f"saving checkpoint step-2 into {url} failed (CheckpointError: object storage: ")
    assert f"{url}/step-1 is the newest complete checkpoint; the partial {url}/step-2/ was removed" in str(e.value)
    saver.close()
    assert [k for k in s3.keys("run/ckpt") if not k.startswith("step-1/")] == []  # no step-2/, no lock
    loader, model, counter = _manager(url)
    assert loader.load() == 1 and counter.step == 1 and bool((model.weight == 1).all())
    loader.close()


def test_an_initial_load_url_that_is_or_holds_the_runs_own_folder_is_refused() -> None:
    from kiln_base.errors import ConfigError
    from models import LLAMA3_FLAVORS
    from trainer.checkpoint.initial_load import InitialSource, check_not_inside

    source = InitialSource("s3://b/run/checkpoint/step-2", "kiln", LLAMA3_FLAVORS["debugmodel"])
    for own in ("s3://b/run/checkpoint", "s3://b/run/checkpoint/step-2/", "s3://b/run/checkpoint/step-2/x"):
        with pytest.raises(ConfigError, match="overlap: the run would save into the folder it starts from"):
            check_not_inside(source, own)
    for own in ("s3://b/run/checkpoint-2", "gs://b/run/checkpoint", "/tmp/run/checkpoint"):
        check_not_inside(source, own)  # another prefix, another store, a local folder
