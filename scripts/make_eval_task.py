"""Build kiln's bundled multiple-choice task, kiln_cloze, from the corpus's held-out split.

    python scripts/make_eval_task.py [--corpus assets/corpus/kiln_corpus_validation.jsonl]
                                     [--output assets/eval/kiln_cloze/kiln_cloze.jsonl] [--seed 1234]

Each validation document is cut into segments (a sentence, or a line of a dialogue or a list). One item per document
with at least two segments: the context is the document up to a segment (its first 1 to 6 segments), and the four
choices are the separator that follows the context plus the true next segment, or plus a segment drawn from another
document (three distractors, all different). Which position holds the true segment is drawn too. A model that read
the context knows what comes next; one that knows only which segments are frequent does not (chance is 25%).

The task definition (lm-evaluation-harness's format: kiln_cloze.yaml, and utils.py which reads this file next to
it) is in the same folder and written by hand. Standard library only (and kiln_base's errors) and a fixed seed:
re-running gives a byte-identical file. A record without a string `text` field, or a corpus with fewer than three
distinct segments to draw a document's distractors from, stops it with one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln_base.errors import DataError, say  # noqa: E402
from trainer.data.sources import record_problem  # noqa: E402 (torch-free, as kiln_base)

DEFAULT_CORPUS = ROOT / "assets" / "corpus" / "kiln_corpus_validation.jsonl"
DEFAULT_OUTPUT = ROOT / "assets" / "eval" / "kiln_cloze" / "kiln_cloze.jsonl"
DEFAULT_SEED = 1234
MAX_CONTEXT_SEGMENTS = 6
N_CHOICES = 4
MAX_DRAWS = 1000  # random draws of a document's distractors before drawing from the full list of candidates
# A segment ends at a sentence's end (the spaces after it are the separator) or at a line's end (the newlines).
SEPARATOR = re.compile(r"((?<=[.!?]) +|\n+)")


def segments(text: str) -> tuple[list[str], list[str]]:
    """(segments, separators): text == seg[0] + sep[0] + seg[1] + ... + seg[-1]; empty segments dropped."""
    parts = SEPARATOR.split(text)
    segs, seps = parts[0::2], parts[1::2]
    out_segs, out_seps = [segs[0]], []
    for sep, seg in zip(seps, segs[1:], strict=True):
        if seg:
            out_seps.append(sep)
            out_segs.append(seg)
    return out_segs, out_seps


def make_items(texts: list[str], seed: int) -> list[dict]:
    rng = random.Random(seed)
    split = [segments(t) for t in texts]
    items = []
    for doc, (segs, seps) in enumerate(split):
        if len(segs) < 2:
            continue
        cut = rng.randint(1, min(len(segs) - 1, MAX_CONTEXT_SEGMENTS))  # the context: segments [0, cut)
        context = "".join(s + sep for s, sep in zip(segs[: cut - 1], seps[: cut - 1], strict=True)) + segs[cut - 1]
        sep, answer = seps[cut - 1], segs[cut]
        chosen = {answer}
        for _ in range(MAX_DRAWS):  # drawn as before, so the bundled task stays byte-identical; bounded
            if len(chosen) == N_CHOICES:
                break
            other = rng.randrange(len(split))
            if other != doc:
                chosen.add(rng.choice(split[other][0]))
        else:  # rare candidates (or too few): draw from the list of all of them, or refuse
            candidates = {s for other, (ss, _) in enumerate(split) if other != doc for s in ss} - {answer}
            if len(candidates) < N_CHOICES - 1:
                raise DataError(
                    f"record {doc + 1}: {len(candidates)} distinct candidate distractors (segments of the other "
                    f"documents, unlike its answer); {N_CHOICES - 1} are needed: give a corpus with more documents"
                )
            chosen |= set(rng.sample(sorted(candidates - chosen), N_CHOICES - len(chosen)))
        distractors = sorted(chosen - {answer})
        rng.shuffle(distractors)
        label = rng.randrange(N_CHOICES)
        choices = [sep + s for s in distractors[:label] + [answer] + distractors[label:]]
        items.append({"id": len(items), "doc": doc, "context": context, "choices": choices, "label": label})
    if not items:  # an empty task file would fail at the run's first evaluation, not here
        raise DataError(
            f"no record of its {len(texts)} has two or more segments (sentences or lines): no item to make; give "
            "documents of several sentences"
        )
    return items


def read_texts(corpus: Path) -> list[str]:
    """The `text` of each record of a .jsonl file; DataError naming the line of a bad one."""
    try:
        lines = corpus.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DataError(f"cannot read it ({e.strerror})") from None
    texts = []
    for n, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"line {n}: not valid JSON ({e.msg}, column {e.colno})") from None
        problem = record_problem(record, "text")
        if problem is not None:
            raise DataError(f"line {n}: {problem}; every record needs a string 'text' field")
        texts.append(record["text"])
    return texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    a = ap.parse_args()
    try:
        texts = read_texts(a.corpus)
        items = make_items(texts, a.seed)
    except DataError as e:  # a bad line, or too few distractors for a record: one line naming the file
        say(DataError(f"{a.corpus}, {e}").line())
        return 2
    a.output.parent.mkdir(parents=True, exist_ok=True)
    with open(a.output, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(f"{a.output}: {len(items)} items from {len(texts)} documents of {a.corpus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
