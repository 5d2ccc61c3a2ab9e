"""What the data tests share: the bundled tokenizer, six good JSONL records, and a data loader built as a rank's.

    dl = loader(path, rank=1, world=2)   # kiln's loader over `path` for rank 1 of 2, batch 2 x seq 32
    drain(dl)                            # read up to 50 batches, then close it (a bad record raises DataError)

Used by the data-record, resume and sample-order suites.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln_base.config import Training
from tests.helpers.common import TOKENIZER_PATH
from trainer.components.tokenizer import Tokenizer
from trainer.data.text import build_dataloader

TOKENIZER = Tokenizer(str(TOKENIZER_PATH))
GOOD = [json.dumps({"text": f"record {i} " + "word " * 30}) for i in range(6)]  # 69 tokens each


def loader(path: Path, rank: int = 0, world: int = 1, batch: int = 2, seq_len: int = 32, prefetch: int = 2):
    cfg = Training(seq_len=seq_len, local_batch_size=batch, dataset_path=str(path), data_prefetch=prefetch)
    return build_dataloader(cfg, TOKENIZER, rank, world)


def drain(dl: Any, n: int = 50) -> None:
    try:
        for _ in range(n):
            next(dl)
    finally:
        dl.close()
