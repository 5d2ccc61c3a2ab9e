"""Variants of the bundled eval task (assets/eval/kiln_cloze) that tests write into a folder of their own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.common import ROOT

CLOZE = ROOT / "assets" / "eval" / "kiln_cloze"


def cloze_variant(folder: Path, metrics: tuple[str, ...] = ("acc", "acc_norm"), empty_choices_at: int = -1) -> Path:
    """kiln_cloze as task `kiln_variant` in `folder`: its metric_list `metrics` (MMLU's template asks for acc
    alone), and document `empty_choices_at` with no choices."""
    folder.mkdir()
    shutil.copy(CLOZE / "utils.py", folder / "utils.py")
    rows = [json.loads(line) for line in (CLOZE / "kiln_cloze.jsonl").read_text().splitlines() if line]
    if empty_choices_at >= 0:
        rows[empty_choices_at]["choices"] = []
    (folder / "kiln_cloze.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = (CLOZE / "kiln_cloze.yaml").read_text().replace("task: kiln_cloze", "task: kiln_variant")
    head, _, _ = text.partition("metric_list:")
    listed = "".join(f"  - metric: {m}\n    aggregation: mean\n    higher_is_better: true\n" for m in metrics)
    (folder / "kiln_variant.yaml").write_text(f"{head}metric_list:\n{listed}")
    return folder
