"""Two kinds of bug the rest of the suite would not catch (issue 36):

- HSDP replicas reading the same samples: every data-parallel rank, replicate and shard coordinates together, must
  read its own slice of the global batch (the data phase of trainer/build.py, on gloo ranks, against one process
  reading the whole global batch).
- rollback protection that depends on keep_latest_k: `checkpoint.load_step` older than a full checkpoint in the
  folder is refused whatever keep_latest_k is, and whoever published the later checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import train as train_entry
from tests.helpers.common import tiny_run_args
from tests.helpers.distributed import run_distributed
from tests.helpers.hostile import SMALL_ARGS, snapshot

# ---------------------------------------------------------------------------------------------- HSDP data


def _rank_batches(replicate: int, shard: int, tp: int, steps: int) -> list[list[list[int]]]:
    """On a gloo rank: the inputs of this rank's first `steps` batches, through the Trainer's data phase."""
    from kiln_base.config import parse_args
    from trainer import build
    from trainer.components.tokenizer import load_tokenizer

    degrees = ("--parallelism.data_parallel_replicate_degree", str(replicate))
    degrees += ("--parallelism.data_parallel_shard_degree", str(shard), "--parallelism.tensor_parallel_degree", str(tp))
    cfg = parse_args(tiny_run_args("--training.local_batch_size", "2", "--training.data_prefetch", "0", *degrees))
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    args = build.model_args(cfg.model, cfg.training.seq_len, tokenizer.n_words)
    plan = build.run_plan(cfg, args, dist.get_world_size(), "cpu")  # the Trainer's plan and mesh
    dims = build.parallel_dims(plan, "cpu")
    loader = build.data(cfg, tokenizer, plan, dims, torch.device("cpu"))
    try:
        return [next(loader)[0].tolist() for _ in range(steps)]
    finally:
        loader.close()


def _global_batches(dp_degree: int, steps: int) -> list[list[list[int]]]:
    """One process reading the whole global batch (dp_degree x local batch 2) of each step."""
    from kiln_base.config import parse_args
    from trainer.components.tokenizer import load_tokenizer
    from trainer.data.text import build_dataloader

    cfg = parse_args(tiny_run_args("--training.local_batch_size", str(2 * dp_degree), "--training.data_prefetch", "0"))
    loader = build_dataloader(cfg.training, load_tokenizer(cfg.model.tokenizer_path), 0, 1)
    try:
        return [next(loader)[0].tolist() for _ in range(steps)]
    finally:
        loader.close()


@pytest.mark.distributed
@pytest.mark.parametrize(("replicate", "shard", "tp"), [(2, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_every_data_parallel_rank_reads_its_own_slice_under_hsdp(replicate: int, shard: int, tp: int) -> None:
    steps, dp = 2, replicate * shard
    per_rank = run_distributed(_rank_batches, replicate * shard * tp, replicate, shard, tp, steps)
    reference = _global_batches(dp, steps)
    for step in range(steps):
        # global rank = (replicate index x shard + shard index) x tp + tp index; the DP rank is the first factor
        by_dp = [[per_rank[d * tp + t][step] for t in range(tp)] for d in range(dp)]
        assert all(peers == [peers[0]] * tp for peers in by_dp), "ranks of one TP group read different batches"
        slices = [peers[0] for peers in by_dp]
        assert [row for s in slices for row in s] == reference[step], f"step {step + 1}: not the global batch"
        assert len({json.dumps(s) for s in slices}) == dp, f"step {step + 1}: two DP ranks read the same samples"


# ---------------------------------------------------------------------------------------------- rollback

ARGS = tiny_run_args(*SMALL_ARGS, "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2")


def _main(dump: Path, *args: str) -> int:
    rc = train_entry.main([*ARGS, "--job.dump_folder", str(dump), *args])
    if dist.is_initialized():
        dist.destroy_process_group()
    return rc


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dump folder whose checkpoint folder holds step-2 and step-4 (full, published there, keep_latest_k 0)."""
    dump = tmp_path_factory.mktemp("rollback")
    assert _main(dump, "--training.steps", "4") == 0
    return dump


@pytest.mark.parametrize("keep", [0, 1, 2, 5])
@pytest.mark.parametrize("later", ["published here", "copied in"])
def test_rollback_is_refused_whatever_keep_latest_k(
    four_steps: Path, tmp_path: Path, capsys: pytest.CaptureFixture, keep: int, later: str
) -> None:
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    folder = run / "checkpoint"
    # As if published in this folder (keep_latest_k counts those); a step-4 copied in from elsewhere keeps the
    # place its kiln.json names, so keep_latest_k never counts it.
    for step in ("step-2", "step-4") if later == "published here" else ("step-2",):
        marker = json.loads((folder / step / "kiln.json").read_text())
        (folder / step / "kiln.json").write_text(json.dumps({**marker, "written_to": str((folder / step).resolve())}))
    before = snapshot(folder)
    capsys.readouterr()
    rc = _main(run, "--training.steps", "6", "--checkpoint.load_step", "2", "--checkpoint.keep_latest_k", str(keep))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"checkpoint.load_step 2 is older than step-4 in {folder}" in err, err
    assert snapshot(folder) == before
