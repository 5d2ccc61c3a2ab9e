"""Checkpoints: SIGKILL + resume equals a straight run (1 process and FSDP on 2 gloo ranks), atomic saves,
async + keep_latest_k + weights-only export, float8 (FSDP float8 all-gather) weights saved plain, bad input."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import train as train_entry
from kiln_base.config import Checkpoint, parse_args
from models import LLAMA3_FLAVORS, ModelArgs
from tests.helpers.checkpoints import SMALL, TINY, StepCounter, names, snapshot, train_tiny
from tests.helpers.hostile import reseal
from tests.helpers.kiln_process import CKPT_DRIVER, run_kiln
from tests.helpers.s3_server import S3Server
from trainer.checkpoint.manager import CheckpointManager, complete_steps, read_metadata
from trainer.trainer import Trainer


def drive(dump: Path, *args: str, nproc: int = 1, env: dict[str, str] | None = None) -> tuple[int, list[float]]:
    """Run tests/helpers/ckpt_driver.py (under torchrun when nproc > 1); return (exit status, rank 0's losses)."""
    out = dump.with_suffix(".losses.json")
    proc = run_kiln(
        [out, *TINY, "--job.dump_folder", dump, *args],
        launcher="python" if nproc == 1 else "torchrun",
        script=CKPT_DRIVER,
        ngpu=nproc,
        threads=1,
        env=env,
        log=dump.parent / f"{dump.name}.log",  # for debugging failures
    )
    losses = json.loads(out.read_text()) if out.exists() else []
    return proc.returncode, losses


@pytest.fixture(scope="module")
def straight8(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of the 8-step tiny run without checkpoints (the kill tests' reference)."""
    rc, straight = drive(tmp_path_factory.mktemp("straight8") / "straight", "--training.steps", "8")
    assert rc == 0 and len(straight) == 8
    return straight


@pytest.mark.slow
def test_sigkill_mid_save_then_resume_matches_straight_run(tmp_path: Path, straight8: list[float]) -> None:
    """Killed inside step 6's save (all files written, folder not yet renamed): step-4 stays the latest,
    the resumed run loads it and reproduces the straight run's losses for steps 5-8 bitwise."""
    straight = straight8
    ckpt = ["--training.steps", "8", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"]
    rc, _ = drive(tmp_path / "run", *ckpt, env={"KILN_TEST_KILL_IN_SAVE": "6"})
    assert rc == -9
    folder = tmp_path / "run" / "checkpoint"
    assert names(folder) == ["step-2", "step-4", "step-6.tmp"]
    assert {".metadata", "__0_0.distcp", "kiln.json"} <= {p.name for p in (folder / "step-6.tmp").iterdir()}

    rc, resumed = drive(tmp_path / "run", *ckpt)
    assert rc == 0
    log = (tmp_path / "run.log").read_text()
    assert f"Loaded checkpoint {folder / 'step-4'} (full state)" in log
    assert resumed == straight[4:]  # exact floats
    assert names(folder) == ["step-2", "step-4", "step-6", "step-8"]


@pytest.mark.slow
def test_sigkill_during_async_write_then_resume_matches_straight_run(tmp_path: Path, straight8: list[float]) -> None:
    """async_mode async, killed (SIGKILL) in the background thread writing step 6 (its data file written, no
    .metadata) while training goes on: step-4 stays the newest complete checkpoint, step-6.tmp is all of step 6, and
    the next run resumes from step-4 with the straight run's losses for steps 5-8 bitwise."""
    ckpt = [*("--training.steps", "8", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2")]
    ckpt += ["--checkpoint.async_mode", "async"]
    rc, _ = drive(tmp_path / "run", *ckpt, env={"KILN_TEST_KILL_IN_ASYNC_WRITE": "6"})
    assert rc == -9
    log = (tmp_path / "run.log").read_text()
    assert "Checkpoint step-6: staged in " in log and "writing in background" in log
    folder = tmp_path / "run" / "checkpoint"
    assert names(folder) == ["step-2", "step-4", "step-6.tmp"]
    partial = {p.name for p in (folder / "step-6.tmp").iterdir()}
    assert "__0_0.distcp" in partial and ".metadata" not in partial and "kiln.json" not in partial

    rc, resumed = drive(tmp_path / "run", *ckpt)
    assert rc == 0
    log = (tmp_path / "run.log").read_text()
    assert f"Loaded checkpoint {folder / 'step-4'} (full state)" in log and "damaged" not in log
    assert resumed == straight8[4:]  # exact floats
    assert names(folder) == ["step-2", "step-4", "step-6", "step-8"]


@pytest.mark.slow
def test_sigkill_during_async_upload_to_s3_leaves_the_previous_step_newest(
    s3: S3Server, tmp_path: Path, straight8: list[float]
) -> None:
    """async_mode async into s3:// (moto's server), killed (SIGKILL) in the background thread uploading step 6 (its
    data object in the bucket, no .metadata or kiln.json yet) while training goes on: step-4 stays the newest
    complete checkpoint. The killed run's lock object stays (object storage gives kiln no lease: docs/checkpoint.md),
    so the next run stops naming it until it is deleted by hand; then the run removes the killed step-6/ prefix,
    resumes from step-4 and reproduces the straight run's losses for steps 5-8 bitwise."""
    url = s3.url("run/checkpoint")
    ckpt = [*("--training.steps", "8", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2")]
    ckpt += ["--checkpoint.folder", url, "--checkpoint.async_mode", "async"]
    rc, _ = drive(tmp_path / "run", *ckpt, env={"KILN_TEST_KILL_IN_UPLOAD": "6"})
    assert rc == -9
    keys = s3.keys("run/checkpoint")
    assert sorted(k.split("/")[0] for k in keys if k.endswith("/kiln.json")) == ["step-2", "step-4"], keys
    assert "step-6/__0_0.distcp" in keys and "step-6/.metadata" not in keys and ".kiln.lock" in keys, keys
    assert not list(tmp_path.rglob("s3:*"))

    rc, _ = drive(tmp_path / "run", *ckpt)
    assert rc != 0 and f"checkpoint folder {url} is in use by another kiln run" in (tmp_path / "run.log").read_text()
    assert s3.keys("run/checkpoint") == keys  # nothing removed or replaced
    s3.remove("run/checkpoint/.kiln.lock")
    rc, resumed = drive(tmp_path / "run", *ckpt)
    assert rc == 0
    log = (tmp_path / "run.log").read_text()
    assert f"Loaded checkpoint {url}/step-4 (full state)" in log and "damaged" not in log
    assert f"Removing {url}/step-6/: a save that was killed" in log
    assert resumed == straight8[4:]  # exact floats
    keys = s3.keys("run/checkpoint")
    assert sorted(k.split("/")[0] for k in keys if k.endswith("/kiln.json")) == [f"step-{n}" for n in (2, 4, 6, 8)]


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_two_ranks_sigkill_resume_matches_straight_run(tmp_path: Path) -> None:
    """FSDP on 2 gloo ranks: a run killed after its step-2 checkpoint, resumed to 4, equals a straight run;
    the data position is one global item (any DP layout resumes it: tests/e2e/test_sample_order.py)."""
    rc, straight = drive(tmp_path / "straight", "--training.steps", "4", nproc=2)
    assert rc == 0 and len(straight) == 4
    ckpt = ["--training.steps", "4", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"]
    rc, _ = drive(tmp_path / "run", *ckpt, nproc=2, env={"KILN_TEST_KILL_AFTER_SAVE": "2"})
    assert rc != 0
    folder = tmp_path / "run" / "checkpoint"
    assert names(folder) == ["step-2"]
    md = read_metadata(str(folder / "step-2"))
    assert {k for k in md.state_dict_metadata if k.startswith("dataloader.")} == {
        f"dataloader.{k}" for k in ("sequences", "epoch", "shard", "record", "buffer")
    }
    assert md.state_dict_metadata["layers.0.attention.wq.weight"].size == torch.Size([256, 256])  # global shape

    rc, resumed = drive(tmp_path / "run", *ckpt, nproc=2)
    assert rc == 0
    assert resumed == straight[2:]


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_async_keep_latest_k_and_weights_only_export(
    tmp_path: Path, small_model: None, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--training.steps", "6"]
    trainer = train_tiny(
        tmp_path,
        *ckpt,
        "--checkpoint.keep_latest_k",
        "1",
        "--checkpoint.async_mode",
        "async_with_pinned_mem",
        "--checkpoint.last_save_model_weights_only",
        "--checkpoint.export_dtype",
        "bfloat16",
    )
    assert "async_with_pinned_mem needs CUDA; saving with async_mode=async" in caplog.text
    final = full_params(trainer.model)
    folder = tmp_path / "checkpoint"
    # step-2 purged once step-4's background save landed; the weights-only final save is an export, which
    # keep_latest_k counts apart from the full checkpoints.
    assert names(folder) == ["export-step-6", "step-4"]

    export = read_metadata(str(folder / "export-step-6")).state_dict_metadata
    assert set(export) == set(final)  # weights only, torchtitan's top-level model keys
    assert {m.properties.dtype for m in export.values()} == {torch.bfloat16}
    assert json.loads((folder / "export-step-6" / "kiln.json").read_text())["model_weights_only"] is True

    # An export is no resume point: the next run resumes from the newest full checkpoint, step-4.
    resumed = Trainer(parse_args([*TINY, "--job.dump_folder", str(tmp_path), *ckpt]))
    assert resumed.step == 4 and resumed.lr_scheduler.last_epoch == 4
    resumed.close()
    # The export's weights are the final model's, in bfloat16.
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in export.items()}
    dcp.load(sd, checkpoint_id=str(folder / "export-step-6"))
    for k, v in sd.items():
        assert torch.equal(v, final[k].to(torch.bfloat16)), k


def test_bad_checkpoints_are_clear_errors_and_touch_nothing(
    tmp_path: Path, small_model: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    ckpt = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--training.steps", "2"]
    train_tiny(tmp_path / "good", *ckpt)
    good = tmp_path / "good" / "checkpoint" / "step-2"

    def fails(case: str, match: str, *extra: str) -> None:
        folder = tmp_path / case / "checkpoint"
        (folder / "step-3.tmp").mkdir(parents=True, exist_ok=True)  # a stale temp dir: must survive a failed run
        before = snapshot(folder)
        argv = [*TINY, "--job.dump_folder", str(tmp_path / case), *ckpt, *extra]
        assert train_entry.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("kiln: error: checkpoint"), err
        assert match in err, err
        assert snapshot(folder) == before
        if dist.is_initialized():
            dist.destroy_process_group()

    # Another model shape: the checkpoint was written by a dim-64 model, this one has dim 32.
    shutil.copytree(good, tmp_path / "shape" / "checkpoint" / "step-2")
    with monkeypatch.context() as m:
        m.setitem(LLAMA3_FLAVORS, "debugmodel", ModelArgs(dim=32, n_layers=2, n_heads=4, multiple_of=32))
        fails("shape", "holds another model: 'tok_embeddings.weight' has shape (2256, 64) there but (2256, 32)")
    with monkeypatch.context() as m:  # one layer more than the checkpoint has
        m.setitem(LLAMA3_FLAVORS, "debugmodel", ModelArgs(**{**SMALL.__dict__, "n_layers": 3}))
        fails("shape", "holds another model: it has no 'layers.2.attention.wq.weight'")

    # A truncated shard file, a corrupt index, a corrupt object inside a shard of the right size.
    shutil.copytree(good, tmp_path / "trunc" / "checkpoint" / "step-2")
    shard = tmp_path / "trunc" / "checkpoint" / "step-2" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    fails("trunc", f"checkpoint file {shard} is truncated")

    shutil.copytree(good, tmp_path / "meta" / "checkpoint" / "step-2")
    (tmp_path / "meta" / "checkpoint" / "step-2" / ".metadata").write_bytes(b"\x80\x04garbage")
    fails("meta", "/meta/checkpoint/step-2/.metadata is corrupt or truncated")

    shutil.copytree(good, tmp_path / "bytes" / "checkpoint" / "step-2")
    step = tmp_path / "bytes" / "checkpoint" / "step-2"
    md = read_metadata(str(step))
    info = next(v for k, v in md.storage_data.items() if k.fqn == "dataloader.buffer")
    with open(step / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00" * info.length)
    fails("bytes", f"checkpoint file {step / info.relative_path} is damaged: its checksum is crc32:")
    reseal(step)  # checksums made to match: the reader's own check is what stops it then
    fails("bytes", "could not be read (corrupt?)")

    fails("good", "checkpoint.load_step 7: no complete checkpoint", "--checkpoint.load_step", "7")


def test_float8_fsdp_all_gather_weights_saved_plain_and_resume(tmp_path: Path) -> None:
    """FSDP float8 all-gather makes the sharded weights torchao WeightWithDynamicFloat8CastTensor; the saved
    checkpoint holds plain float32 tensors (DCP loads tensors with weights_only=True) and resumes exactly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from float8.converter import prepare_cpu_float8
    from models import Transformer
    from trainer.components.dist import init_distributed

    prepare_cpu_float8()  # torch's CPU float8 matmul, as kiln's build uses
    init_distributed(60)
    args = ModelArgs(**{**SMALL.__dict__, "vocab_size": 256, "max_seq_len": 16})
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        with torch.device("meta"):
            model = Transformer(args)
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "output")
        mesh = init_device_mesh("cpu", (1,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss.item()

    try:
        model, opt = build(seed=0)
        assert type(model.layers["0"].attention.wq.weight._local_tensor) is WeightWithDynamicFloat8CastTensor
        cfg = Checkpoint(enable_checkpoint=True, interval=1)
        counter = StepCounter()
        saver = CheckpointManager(cfg, str(tmp_path), {"model": model, "optimizer": opt, "train_state": counter})
        train_step(model, opt)
        counter.step = 1
        saver.maybe_save(1)
        saver.close()  # lets go of the folder lock: one CheckpointManager per folder at a time
        md = read_metadata(str(tmp_path / "step-1"))
        tensors = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        assert {"layers.0.attention.wq.weight", "optimizer.state.layers.0.attention.wq.weight.exp_avg"} <= set(tensors)
        assert {m.properties.dtype for k, m in tensors.items() if not k.endswith(".step")} == {torch.float32}
        # No torchao class in the files: loading must not need torchao (a bf16 run, convert_hf.py). In-process
        # DCP loading alone would not show it, as importing torchao registers its classes as safe globals.
        assert b"torchao" not in (tmp_path / "step-1" / "__0_0.distcp").read_bytes()
        plain = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in tensors.items()}
        dcp.load(plain, checkpoint_id=str(tmp_path / "step-1"))  # torch.load(weights_only=True) per tensor
        expected = train_step(model, opt)

        model2, opt2 = build(seed=1)  # different init: everything must come from the checkpoint
        state = StepCounter()
        loader = CheckpointManager(cfg, str(tmp_path), {"model": model2, "optimizer": opt2, "train_state": state})
        assert loader.load() == 1 and state.step == 1
        assert type(model2.layers["0"].attention.wq.weight._local_tensor) is WeightWithDynamicFloat8CastTensor
        loaded = model2.layers["0"].attention.wq.weight._local_tensor._tensor
        assert torch.equal(plain["layers.0.attention.wq.weight"], loaded)
        assert train_step(model2, opt2) == expected
    finally:
        dist.destroy_process_group()


def _damage(step: Path, how: str) -> None:
    if how == "no_metadata":  # e.g. a partial copy: the shards are there, DCP's index is not
        (step / ".metadata").unlink()
    elif how == "truncated_metadata":
        meta = step / ".metadata"
        os.truncate(meta, meta.stat().st_size // 2)
    else:  # a shard cut short: the index is fine, a piece it points to is not there
        shard = step / "__0_0.distcp"
        os.truncate(shard, shard.stat().st_size - 8)


@pytest.mark.parametrize("how", ["no_metadata", "truncated_metadata", "truncated_shard"])
def test_incomplete_newest_checkpoint_is_never_latest(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Steps 1-3 saved; step-3 (then also step-2) damaged: the newest complete step loads, a warning names each
    passed-over folder, and kiln leaves it as it is (it may be a user's partial copy: never deleted or renamed)."""
    caplog.set_level(logging.WARNING, logger="kiln")

    def manager() -> tuple[CheckpointManager, torch.nn.Linear, StepCounter]:
        model, counter = torch.nn.Linear(16, 16, bias=False), StepCounter()
        cfg = Checkpoint(enable_checkpoint=True, interval=1)
        return CheckpointManager(cfg, str(tmp_path), {"model": model, "train_state": counter}), model, counter

    saver, model, counter = manager()
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(step)
        counter.step = step
        saver.maybe_save(step)
    saver.close()
    _damage(tmp_path / "step-3", how)
    # The cheap listing (retention, the NaN guard's "last good") already leaves out a folder without an index.
    assert complete_steps(str(tmp_path)) == ([1, 2] if how == "no_metadata" else [1, 2, 3])

    loader, model, counter = manager()
    assert loader.load() == 2 and counter.step == 2 and bool((model.weight == 2).all())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("damaged checkpoint" in w and str(tmp_path / "step-3") in w for w in warnings), warnings
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step-1", "step-2", "step-3"]
    loader.close()

    caplog.clear()
    _damage(tmp_path / "step-2", how)
    loader, model, counter = manager()
    assert loader.load() == 1 and bool((model.weight == 1).all())
    assert any(str(tmp_path / "step-2") in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    loader.close()
