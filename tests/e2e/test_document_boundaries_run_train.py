"""Document-masked training on a Megatron dataset written as Megatron's preprocess_data.py writes it (text ... EOD,
no BOS), through run_train.sh: the start-up line says the documents come from the .idx and the loss falls; PP 2
(every stage handed the batch's document ids) follows the 1-rank curve; an index that records no boundary is one
line naming model.flavor before any step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.common import tiny_run_args
from tests.helpers.kiln_process import assert_one_line_error, run_kiln
from tests.helpers.loss_runs import drive, save_initial_weights, with_init
from tests.helpers.megatron_data import corpus_documents, megatron_write

FLEX = ("--model.flavor", "debugmodel_flex_attn")
LINE = "Attention: block_causal: causal within each document, documents from the .idx document index; "


@pytest.fixture(scope="module")
def eod_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """megatron.bin/.idx: 1,000 corpus documents as text ... EOD (no BOS), by megatron.core's own builder."""
    root = tmp_path_factory.mktemp("eod")
    megatron_write(root / "megatron", corpus_documents(limit=1000, bos=False))
    return root


@pytest.mark.slow
def test_flex_attention_on_eod_megatron_data_masks_at_the_index_and_trains(eod_data: Path, tmp_path: Path) -> None:
    data = ("--training.dataset_path", str(eod_data / "megatron"), "--job.dump_folder", str(tmp_path))
    proc = run_kiln([*tiny_run_args("--training.steps", "16", *FLEX), *data, "--metrics.log_freq", "1"], ngpu=1)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert LINE in proc.stdout, proc.stdout[-3000:]
    assert "no document boundary" not in proc.stdout
    losses = [float(x) for x in re.findall(r"\[rank0\]:.*step: +\d+  loss: +([\d.]+)", proc.stdout)]
    assert len(losses) == 16 and all(x == x and x < 20 for x in losses), losses  # finite
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses  # falling


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_gets_the_document_ids_and_follows_the_one_rank_curve(eod_data: Path) -> None:
    save_initial_weights(eod_data)
    data = ("--training.dataset_path", str(eod_data / "megatron"), "--checkpoint.interval", "100", *FLEX)
    one = drive(with_init(eod_data / "init", eod_data / "one"), *data)
    pp2 = ("--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "4")
    pp = drive(with_init(eod_data / "init", eod_data / "pp2"), *data, *pp2, "--parallelism.pipeline_parallel_degree",
               "2", nproc=2)  # fmt: skip
    assert len(pp["losses"]) == len(one["losses"]) == 6
    assert max(abs(a - b) / a for a, b in zip(one["losses"], pp["losses"], strict=True)) < 1e-5


@pytest.mark.parametrize("ngpu", [1, 2])
def test_an_index_recording_no_boundary_is_one_line_naming_model_flavor(tmp_path: Path, ngpu: int) -> None:
    """Every document in one: the .idx records no boundary, so the document mask cannot apply (exit 2)."""
    megatron_write(tmp_path / "one", [sum(corpus_documents(limit=40, bos=False), [])])
    argv = [*tiny_run_args("--training.steps", "1", *FLEX), "--training.dataset_path", tmp_path / "one"]
    proc = run_kiln(argv, ngpu=ngpu)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert_one_line_error(proc, "model.flavor debugmodel_flex_attn masks attention by document", "one document")
