"""Megatron-LM's own indexed-dataset writer (megatron-core, kiln's dev extra), for the tests that check kiln reads
what Megatron, NeMo and GPT-NeoX write: the bundled corpus, tokenized with kiln's tokenizer as Megatron's
preprocess_data.py does (one document per record, BOS ... EOS), into a `.bin`/`.idx` pair of int32 tokens."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch

from tests.helpers.common import ROOT
from tests.helpers.data import TOKENIZER

CORPUS = ROOT / "assets" / "corpus" / "kiln_corpus.jsonl"


def corpus_documents(limit: int | None = None, bos: bool = True) -> list[list[int]]:
    """The corpus's records encoded BOS ... EOS (kiln's convention), or with `bos=False` text ... EOD as Megatron's
    preprocess_data.py writes them with --append-eod (the EOD is the tokenizer's EOS; no BOS)."""
    docs = []
    with open(CORPUS) as f:
        for line in f:
            if line.strip() and (limit is None or len(docs) < limit):
                docs.append(TOKENIZER.encode(json.loads(line)["text"], bos=bos, eos=True))
    return docs


def megatron_write(prefix: Path, docs: list[list[int]], dtype: type = np.int32, sentence: int | None = None) -> Path:
    """prefix.bin/.idx written by megatron.core's IndexedDatasetBuilder; returns the prefix. With `sentence`, each
    document is written as sequences of up to that many tokens (preprocess_data.py --split-sentences: several
    sequences, one document)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its import warns about optional packages (apex, transformer-engine)
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        if sentence is not None:
            lengths = [min(sentence, len(doc) - i) for i in range(0, len(doc), sentence)]
            builder.add_document(np.asarray(doc, dtype=np.int64), lengths)  # type: ignore[arg-type]
            continue
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def megatron_read(prefix: Path) -> list[list[int]]:
    """Every document of prefix.bin/.idx as megatron.core's IndexedDataset reads it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))]
