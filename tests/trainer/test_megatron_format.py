"""kiln's Megatron indexed format against Megatron-LM's own code (megatron-core, the dev extra): what kiln's tokenize
command writes Megatron reads document by document, and what Megatron's builder writes kiln reads token by token."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers.data import TOKENIZER
from tests.helpers.megatron_data import CORPUS, corpus_documents, megatron_read, megatron_write
from tests.helpers.scripts import load_script
from trainer.data.token_files import open_token_file, read_index


def test_megatron_reads_what_the_tokenize_command_writes(tmp_path: Path) -> None:
    assert load_script("tokenize_data").main([str(CORPUS), str(tmp_path / "kiln"), "--workers", "2",
                                              "--shard-mb", "0.5"]) == 0  # fmt: skip
    assert megatron_read(tmp_path / "kiln") == corpus_documents()


def test_kiln_reads_what_megatron_writes(tmp_path: Path) -> None:
    docs = corpus_documents(limit=300)
    for dtype in (np.int32, np.uint16):
        prefix = megatron_write(tmp_path / f"m_{np.dtype(dtype).name}", docs, dtype)
        tf = open_token_file(f"{prefix}.bin", TOKENIZER.n_words)
        assert tf.tokens.dtype == dtype and tf.documents == 300 and tf.max_token_id is None
        assert tf.tokens.tolist() == sum(docs, [])
        _, lengths, _, _ = read_index(f"{prefix}.idx", f"{prefix}.bin")
        assert lengths.tolist() == [len(d) for d in docs]
