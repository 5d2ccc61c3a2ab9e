"""Tests for the bundled tokenizer, trainer.components.tokenizer.Tokenizer and scripts/train_tokenizer.py."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from tests.helpers.common import ROOT, TOKENIZER_PATH
from tests.helpers.scripts import load_script
from trainer.components.tokenizer import SPECIAL_TOKENS, Tokenizer

CORPUS_PATH = ROOT / "assets" / "corpus" / "kiln_corpus.jsonl"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(TOKENIZER_PATH))


def test_vocab_and_special_ids(tok: Tokenizer) -> None:
    assert len(SPECIAL_TOKENS) == 256 == len(set(SPECIAL_TOKENS))
    assert SPECIAL_TOKENS[-1] == "<|reserved_special_token_246|>"
    assert tok.n_words == 2256
    assert tok.bos_id == 2000
    assert tok.eos_id == 2001
    assert tok.pad_id == -1
    assert tok.special_tokens["<|eot_id|>"] == 2009


@pytest.mark.parametrize(
    "text",
    [
        "Seven plus five is twelve. 7 + 5 = 12.",
        "Brindale lies on the Amber River; population 4,200.",
        "héllo wörld — 日本語 🙂 ñ",
        "digits 1234567890 and 00042",
        "tabs\t\tand   spaces\n\n\n   newlines  \r\n end  ",
        "<|end_of_text|> <|begin_of_text|>",
        "",
    ],
)
def test_roundtrip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, bos=False, eos=False)
    assert all(0 <= i < tok.n_words for i in ids)
    assert tok.decode(ids) == text


def test_special_text_is_plain_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|end_of_text|>", bos=False, eos=False)
    assert tok.eos_id not in ids
    assert all(i < 2000 for i in ids)


def test_bos_eos_flags(tok: Tokenizer) -> None:
    plain = tok.encode("hello there", bos=False, eos=False)
    assert tok.encode("hello there", bos=True, eos=False) == [tok.bos_id, *plain]
    assert tok.encode("hello there", bos=False, eos=True) == [*plain, tok.eos_id]
    assert tok.encode("", bos=True, eos=True) == [tok.bos_id, tok.eos_id]
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"


def test_long_runs_roundtrip(tok: Tokenizer) -> None:
    text = "a" * 30_000 + " " * 30_000 + "seven plus five"
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_compression_on_corpus(tok: Tokenizer) -> None:
    with open(CORPUS_PATH, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, 300)]
    n_chars = sum(len(t) for t in texts)
    n_tokens = sum(len(tok.encode(t, bos=False, eos=False)) for t in texts)
    assert n_chars / n_tokens > 2.5


def test_missing_file_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match="nope") as info:
        Tokenizer(str(missing))
    assert str(missing) in str(info.value)
    assert "tiktoken" in str(info.value)


@pytest.mark.parametrize("content", [b"this is not a tokenizer\n", b"", b"\x00\xff\x10garbage", b"QQ== 5\n"])
def test_garbage_file_raises_value_error(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "garbage.model"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        Tokenizer(str(bad))


def test_directory_path_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        Tokenizer(str(tmp_path))


def test_train_is_deterministic(tmp_path: Path) -> None:
    train_tokenizer = load_script("train_tokenizer")
    texts = [
        "the cat sat on the mat. the cat said meow.",
        "seven plus five is twelve. 7 + 5 = 12.",
        "Ana found a red ball in the garden, and Tom found a blue kite.",
    ] * 5
    first = train_tokenizer.train(texts, 300)
    second = train_tokenizer.train(list(reversed(texts)), 300)
    assert first == second
    assert sorted(first.values()) == list(range(300))
    assert all(first[bytes([b])] == b for b in range(256))
    assert train_tokenizer.unreachable_tokens(first) == []

    # The written file loads with the Tokenizer and encodes the training text compactly.
    path = tmp_path / "tiny.model"
    train_tokenizer.write_tiktoken_bpe(first, path)
    tiny = Tokenizer(str(path))
    assert tiny.n_words == 300 + 256
    ids = tiny.encode(texts[0], bos=False, eos=False)
    assert tiny.decode(ids) == texts[0]
    assert len(ids) < 0.6 * len(texts[0])  # merges were learned and are used


def test_train_rejects_too_small_corpus() -> None:
    train_tokenizer = load_script("train_tokenizer")
    with pytest.raises(ValueError, match="corpus too small"):
        train_tokenizer.train(["ab"], 300)
