"""Data: packing into seq_len+1 windows with bos/eos, global sample order over DP ranks, local formats, stateful
resume, re-looping."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kiln_base.config import Training
from kiln_base.errors import ConfigError, DataError
from tests.helpers.common import HANG_TIMEOUT_S, TOKENIZER_PATH
from trainer.components.tokenizer import Tokenizer
from trainer.data.text import DataLoader, build_dataloader

TOKENIZER = Tokenizer(str(TOKENIZER_PATH))


def loader(path: Path | None = None, seq_len: int = 32, batch: int = 2, rank: int = 0, world: int = 1):
    cfg = Training(seq_len=seq_len, local_batch_size=batch, dataset_path=None if path is None else str(path))
    return build_dataloader(cfg, TOKENIZER, rank, world)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_windows_are_packed_with_bos_eos(tmp_path: Path) -> None:
    docs = ["the first document", "a second one"]
    inputs, labels = next(loader(write_jsonl(tmp_path / "d.jsonl", docs * 20), seq_len=16))
    assert inputs.shape == labels.shape == (2, 16) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are inputs shifted by one
    expected = []
    for d in docs * 20:
        expected += TOKENIZER.encode(d, bos=True, eos=True)
    assert inputs[0].tolist() == expected[:16] and labels[0].tolist() == expected[1:17]
    assert inputs[1].tolist() == expected[17:33]  # windows of seq_len+1 tokens, no overlap


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet"])
def test_local_formats(tmp_path: Path, fmt: str) -> None:
    texts = [f"line number {i} of the file" for i in range(50)]
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, texts)
    elif fmt == "txt":
        path.write_text("\n".join(texts) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), path)
    inputs, _ = next(loader(path))
    assert TOKENIZER.decode(inputs[0].tolist()).startswith("<|begin_of_text|>line number 0 of the file")


def test_folder_of_files_and_mixed_formats_rejected(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ["alpha " * 20] * 5)
    write_jsonl(tmp_path / "b.jsonl", ["beta " * 20] * 5)
    assert next(loader(tmp_path))[0].shape == (2, 32)
    (tmp_path / "c.txt").write_text("gamma\n")
    with pytest.raises(ConfigError, match="must hold files of one format"):
        loader(tmp_path)


def test_dp_ranks_take_slices_of_the_global_batch(tmp_path: Path) -> None:
    """Rank r of D with local batch B gets rows r*B..(r+1)*B of the one-rank batch of D*B: the same sequences."""
    path = write_jsonl(tmp_path / "d.jsonl", [f"document {i} " + "word " * 30 for i in range(40)])
    one = loader(path, batch=4)
    ranks = [loader(path, batch=2, rank=r, world=2) for r in range(2)]
    for _ in range(3):
        assert torch.equal(next(one)[0], torch.cat([next(r)[0] for r in ranks]))
    assert one.state_dict() == ranks[0].state_dict() == ranks[1].state_dict()


def test_state_dict_resumes_exactly() -> None:
    dl = loader(seq_len=64)
    for _ in range(3):
        next(dl)
    state = dl.state_dict()
    expected = [next(dl)[0] for _ in range(3)]
    resumed = loader(seq_len=64)
    resumed.load_state_dict(state)
    for want in expected:
        assert torch.equal(next(resumed)[0], want)


def test_relooping_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kiln")
    dl = loader(write_jsonl(tmp_path / "d.jsonl", ["short doc with a few words"] * 4), seq_len=16)
    for _ in range(6):
        next(dl)
    assert any("re-looping" in r.getMessage() for r in caplog.records)


def test_unknown_dataset_name() -> None:
    registered = "kiln_corpus, kiln_corpus_validation, c4, c4_validation"
    with pytest.raises(ConfigError, match=f"unknown dataset 'c5'; registered: {registered}"):
        build_dataloader(Training(dataset="c5"), TOKENIZER, 0, 1)


def test_state_is_global_and_resumes_under_another_layout(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [f"document {i} " + "word " * 30 for i in range(40)])
    rank1 = loader(path, rank=1, world=2)
    next(rank1)
    state = rank1.state_dict()
    assert state["sequences"] == 4 and set(state) == {"sequences", "epoch", "shard", "record", "buffer"}
    expected = next(loader(path, batch=4))  # skip the first global batch of 4 ...
    one = loader(path, batch=4)
    next(one)
    expected = next(one)[0]  # ... and take the second
    resumed = loader(path, batch=4)
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed)[0], expected)


def test_unreadable_dataset_files_are_named(tmp_path: Path) -> None:
    bad_json = tmp_path / "a" / "bad.jsonl"
    bad_json.parent.mkdir()
    bad_json.write_text('{"text": "fine"\n')
    with pytest.raises(DataError, match=f"data file {bad_json}, record 1 \\(line 1\\): not valid JSON"):
        loader(bad_json.parent)
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=f"{no_text}, record 1 \\(line 1\\): no 'text' field \\(has: body\\)"):
        loader(no_text)
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=f"data file {bad_parquet}: cannot read: "):
        loader(bad_parquet)
    # A malformed record further in is found while streaming: a DataError naming the file and line.
    late = tmp_path / "late.jsonl"
    late.write_text('{"text": "good"}\n' * 3 + "{broken\n")
    with pytest.raises(DataError, match=f"data file {late}, record 4 \\(line 4\\): not valid JSON"):
        next(loader(late))


def test_bad_dataset_path_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import train

    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    argv = ["--job.dump_folder", str(tmp_path), "--training.dataset_path", str(bad), "--training.seq_len", "32"]
    assert train.main(argv) == 2  # the Trainer failed in __init__: conftest ends its process group
    err = capsys.readouterr().err.strip()
    assert err == (
        f"kiln: error: data file {bad}, record 1 (line 1): not a JSON object but an array; "
        "every record needs a string 'text' field"
    )


def _wait_until_produced(dl: DataLoader, batches: int) -> None:
    """Block until the prefetch thread has queued `batches` batches in all (no sleeps: the queue's own condition
    is notified on every put; unfinished_tasks counts puts, as nothing calls task_done)."""
    q = dl._queue
    with q.not_empty:
        assert q.not_empty.wait_for(lambda: q.unfinished_tasks >= batches, timeout=HANG_TIMEOUT_S), q.unfinished_tasks


@pytest.mark.parametrize("prefetch", [0, 3])
def test_prefetch_gives_same_batches_and_exact_state(prefetch: int) -> None:
    """Prefetching must not change the batches nor let the saved position run ahead of the consumed batches."""
    reference = loader(seq_len=64)
    reference.prefetch = 0
    want = [next(reference)[0] for _ in range(6)]
    dl = loader(seq_len=64)
    dl.prefetch = prefetch
    got = [next(dl)[0] for _ in range(3)]
    if prefetch:
        _wait_until_produced(dl, 3 + prefetch)  # the producer is `prefetch` batches ahead, every time
    state = dl.state_dict()
    dl.close()
    resumed = loader(seq_len=64)
    resumed.prefetch = prefetch
    resumed.load_state_dict(state)
    got += [next(resumed)[0] for _ in range(3)]
    resumed.close()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_pinned_batches_are_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    """With local batch > 1, inputs and labels are slices of one (batch, seq + 1) tensor: not contiguous. A
    non-contiguous pinned tensor is staged through pageable memory on its way to the GPU, so the trainer's
    non_blocking copy would block. What gets pinned, and what is handed out, must be contiguous. (No GPU here:
    pin_memory is replaced by a recorder that returns the tensor.)"""
    pinned: list[bool] = []

    def fake_pin(t: torch.Tensor) -> torch.Tensor:
        pinned.append(t.is_contiguous())
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    cfg = Training(seq_len=32, local_batch_size=4, data_prefetch=0)
    dl = build_dataloader(cfg, TOKENIZER, 0, 1, pin_memory=True)
    try:
        inputs, labels = next(dl)
    finally:
        dl.close()
    assert inputs.shape == labels.shape == (4, 32)
    assert inputs.is_contiguous() and labels.is_contiguous()
    assert pinned == [True, True]
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # still the same windows, shifted by one
