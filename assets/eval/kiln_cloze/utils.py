"""Reads kiln_cloze.jsonl (next to this file) for lm-evaluation-harness: local, no network, any working directory."""

import json
from pathlib import Path

import datasets


def load(**kwargs: object) -> datasets.DatasetDict:
    """The task's only split, `test`; lm-eval passes the task's metadata as keyword arguments (unused)."""
    path = Path(__file__).with_name("kiln_cloze.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
