"""Document boundaries of token files (trainer/data/documents.py): a Megatron dataset written as Megatron's
preprocess_data.py writes it (text ... EOD, no BOS) is masked at the documents its .idx records, a numpy token file
at its EOS tokens; data without a boundary is refused (nothing recorded) or warned about (none in the first
batches); a packed document's logits equal its logits alone, in fp32."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln_base.config import Training
from kiln_base.errors import DataError
from models import LLAMA3_FLAVORS, Transformer
from models.attention import block_causal_mask, dense_mask, document_ids
from tests.helpers.data import TOKENIZER
from tests.helpers.megatron_data import megatron_write
from trainer.data.documents import WATCHED_BATCHES, DocumentMask
from trainer.data.sample_index import open_mixture
from trainer.data.tokens import TokenFileLoader, build_token_loader

WORDS, BOS, EOS = TOKENIZER.n_words, TOKENIZER.bos_id, TOKENIZER.eos_id
FLEX = DocumentMask("debugmodel_flex_attn", EOS)


def _eod_documents(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Documents as Megatron's preprocessing writes them: text tokens, then EOD (the tokenizer's EOS); no BOS."""
    rng = np.random.default_rng(seed)
    return [[*rng.integers(0, 1900, n - 1).tolist(), EOS] for n in lengths]


def _true_ids(lengths: list[int], start: int, seq_len: int) -> np.ndarray:
    """Each token of [start, start + seq_len)'s document, counted from the window's first: written out from the
    documents' lengths, not from any index."""
    begins = np.cumsum([0, *lengths[:-1]])
    pos = np.arange(start, start + seq_len)
    return (np.searchsorted(begins, pos, side="right") - np.searchsorted(begins, start, side="right")).astype(np.int32)


def _loader(path: Path, seq_len: int, batch: int, shuffle: bool = True) -> TokenFileLoader:
    mixture = open_mixture([(str(path), 1.0, None)], seq_len, WORDS, seed=3, shuffle=shuffle)
    return TokenFileLoader(mixture, batch, WORDS, eos_id=EOS)


@pytest.mark.parametrize("sentence", [None, 5], ids=["one_sequence_per_document", "split_sentences"])
def test_megatron_documents_give_the_mask_of_their_true_boundaries(tmp_path: Path, sentence: int | None) -> None:
    """Every window's document ids are the true ones (from the documents' lengths), also where Megatron writes a
    document as several sequences (--split-sentences: a sequence start inside a document is no boundary); the
    block mask built from them is the block-causal mask of the true documents. A BOS scan (kiln before) finds no
    boundary in this data at all."""
    lengths = np.random.default_rng(1).integers(1, 30, 80).tolist()
    prefix = megatron_write(tmp_path / "m", _eod_documents(lengths), sentence=sentence)
    seq_len, loader = 31, _loader(prefix, 31, 4)
    boundaries = 0
    for _ in range(6):
        first = loader.sequences
        inputs, _, doc_ids = next(loader)
        assert doc_ids.dtype == torch.int32 and doc_ids.shape == inputs.shape
        truth = np.stack([_true_ids(lengths, loader.mixture.sample(first + i)[1], seq_len) for i in range(4)])
        np.testing.assert_array_equal(doc_ids.numpy(), truth)
        boundaries += int(truth[:, -1].sum())
        mask = dense_mask(block_causal_mask(doc_ids), 4, seq_len, torch.device("cpu"))
        t = torch.from_numpy(truth)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        assert torch.equal(mask[:, 0], causal & (t[:, :, None] == t[:, None, :]))
        assert not document_ids(inputs, BOS).any()  # the old rule: no BOS, so no boundary anywhere
    assert boundaries > 40  # windows with several documents each


def test_numpy_token_files_end_documents_at_eos(tmp_path: Path) -> None:
    """A flat numpy file records no documents: the tokenizer's EOS ends one (the next token starts the next)."""
    lengths = [7, 1, 12, 30, 5, 9, 16, 4, 22, 8]
    np.save(tmp_path / "t.npy", np.array(sum(_eod_documents(lengths), []), dtype=np.uint16))
    loader = _loader(tmp_path / "t.npy", 15, 2, shuffle=False)
    for row in range(4):  # windows in file order: window w starts at token 16 w
        if row % 2 == 0:
            _, _, doc_ids = next(loader)
        np.testing.assert_array_equal(doc_ids[row % 2].numpy(), _true_ids(lengths, 16 * row, 15))
    assert loader.boundaries == f"documents ended by EOS (token {EOS}) in the numpy token files (no index)"


def _training(path: Path, seq_len: int = 31) -> Training:
    return Training(dataset_path=str(path), seq_len=seq_len, local_batch_size=2, steps=20, seed=0)


def test_no_boundary_in_the_first_batches_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One huge document (a numpy file without the tokenizer's EOS): one warning, after the first WATCHED_BATCHES
    batches, naming the flavor and why; data with boundaries: none."""
    np.save(tmp_path / "huge.npy", np.random.default_rng(0).integers(0, 1900, 4000).astype(np.uint16))
    loader = build_token_loader(_training(tmp_path / "huge.npy"), WORDS, 0, 1, 2, documents=FLEX)
    caplog.set_level(logging.WARNING, "kiln")
    for _ in range(3 * WATCHED_BATCHES):
        next(loader)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("model.flavor debugmodel_flex_attn: no document boundary in the first 4 batches"), line
    assert f"numpy token files without EOS (token {EOS})" in line and "attends as causal attention does" in line

    caplog.clear()
    megatron_write(tmp_path / "m", _eod_documents([20] * 100))
    loader = build_token_loader(_training(tmp_path / "m"), WORDS, 0, 1, 2, documents=FLEX)
    for _ in range(2 * WATCHED_BATCHES):
        next(loader)
    assert caplog.records == []


def test_an_index_recording_no_boundary_is_refused_naming_model_flavor(tmp_path: Path) -> None:
    """Every .idx of the data holds one document: no window can hold a boundary, so the mask cannot apply."""
    megatron_write(tmp_path / "one", [sum(_eod_documents([20] * 30), [])])
    with pytest.raises(DataError, match=r"^model.flavor debugmodel_flex_attn masks attention by document, but every"):
        build_token_loader(_training(tmp_path / "one"), WORDS, 0, 1, 2, documents=FLEX)
    build_token_loader(_training(tmp_path / "one"), WORDS, 0, 1, 2)  # causal: the same data is fine


def test_a_packed_document_gets_its_logits_alone(tmp_path: Path) -> None:
    """fp32: in a window of Megatron documents, the debug model under the .idx's document ids gives documents 2 and
    3 the logits each gets alone (positions as kiln sets them: not reset, RoPE sees distances only), within 1e-5;
    the BOS rule (this data has none) lets them attend to the documents before, which moves them by far more."""
    lengths = [10, 12, 9, 30]
    prefix = megatron_write(tmp_path / "m", _eod_documents(lengths, seed=4))
    inputs, _, doc_ids = next(_loader(prefix, 40, 1, shuffle=False))
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel_flex_attn"], vocab_size=WORDS, n_layers=2, max_seq_len=64, bos_id=BOS
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        packed, old = model(inputs, doc_ids=doc_ids)[0], model(inputs)[0]
        for begin, end in ((10, 22), (22, 31)):
            alone = model(inputs[:, begin:end])[0]
            assert (packed[begin:end] - alone).abs().max().item() < 1e-5
            assert (old[begin:end] - alone).abs().max().item() > 1e-2
