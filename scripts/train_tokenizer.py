"""Train kiln's bundled byte-level BPE tokenizer and write it in Llama3's tiktoken format.

Text is pre-tokenized with Llama3's regex, BPE merges are learned on the table of unique
pre-tokens ("words") starting from the 256 single bytes, and the result is written as
`base64(token_bytes) rank` lines, which is what `tiktoken.load.load_tiktoken_bpe` reads.

    python scripts/train_tokenizer.py [--corpus PATH] [--vocab-size N] [--output PATH]
"""

from __future__ import annotations

import argparse
import base64
import heapq
import itertools
import json
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import regex  # a tiktoken dependency; the stdlib `re` has no \p{L} classes

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT / "assets" / "corpus" / "kiln_corpus.jsonl"
DEFAULT_OUTPUT = ROOT / "assets" / "tokenizer" / "tokenizer.model"
DEFAULT_VOCAB_SIZE = 2000

# Llama3's pre-tokenization pattern (same string as trainer/components/tokenizer.py uses for encoding).
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

Pair = tuple[bytes, bytes]


def read_corpus(path: Path) -> Iterator[str]:
    """Yield the "text" field of every line of a JSONL corpus."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


def count_words(texts: Iterable[str]) -> Counter[bytes]:
    """Frequency of every pre-token (as UTF-8 bytes) under Llama3's split pattern."""
    pattern = regex.compile(PAT_STR)
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(pattern.findall(text))
    return Counter({w.encode("utf-8"): c for w, c in counts.items()})


def _merge_word(word: list[bytes], pair: Pair) -> list[bytes]:
    """Replace every non-overlapping occurrence of `pair` in `word`, left to right."""
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(word_counts: dict[bytes, int], vocab_size: int) -> dict[bytes, int]:
    """Learn BPE merges; return {token_bytes: rank} with ranks 0..vocab_size-1.

    Ranks are the order of creation (the 256 bytes first), so every token is made from two
    lower-ranked tokens, as tiktoken's rank-order merging expects. The most frequent pair wins;
    ties go to the lexicographically smallest (left, right) bytes, so the result is deterministic.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256 (the single bytes), got {vocab_size}")
    ranks = {bytes([b]): b for b in range(256)}
    # Symbols are byte strings rather than ids, so a token reached by two different merge paths
    # is still one token.
    words = [[bytes([b]) for b in w] for w in word_counts]
    freqs = list(word_counts.values())

    pair_counts: dict[Pair, int] = defaultdict(int)
    where: dict[Pair, set[int]] = defaultdict(set)  # pair -> indices of words that (may) hold it
    for i, (word, freq) in enumerate(zip(words, freqs, strict=True)):
        for pair in itertools.pairwise(word):
            pair_counts[pair] += freq
            where[pair].add(i)

    # Max-heap with lazy deletion: an entry is live only if its count is still the current one.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    while len(ranks) < vocab_size and heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue
        merged = pair[0] + pair[1]
        if merged not in ranks:
            ranks[merged] = len(ranks)
        changed: set[Pair] = set()
        for i in where.pop(pair):
            word = words[i]
            new = _merge_word(word, pair)
            if len(new) == len(word):  # stale index: the pair left this word earlier
                continue
            freq = freqs[i]
            # Incremental update: only the words holding the pair are re-counted.
            for p in itertools.pairwise(word):
                pair_counts[p] -= freq
                changed.add(p)
            for p in itertools.pairwise(new):
                pair_counts[p] += freq
                where[p].add(i)
                changed.add(p)
            words[i] = new
        for p in changed:
            count = pair_counts[p]
            if count > 0:
                heapq.heappush(heap, (-count, p))
            else:
                del pair_counts[p]
    if len(ranks) < vocab_size:
        raise ValueError(f"corpus too small: only {len(ranks)} tokens could be learned, wanted {vocab_size}")
    return ranks


def train(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> dict[bytes, int]:
    """Pre-tokenize `texts` and learn a `vocab_size`-token byte-level BPE."""
    return train_bpe(count_words(texts), vocab_size)


def unreachable_tokens(ranks: dict[bytes, int]) -> list[bytes]:
    """Tokens that tiktoken's lowest-rank-first merging would not build from their own bytes."""
    bad = []
    for token in ranks:
        parts = [bytes([b]) for b in token]
        while len(parts) > 1:
            best = min(
                range(len(parts) - 1),
                key=lambda j: ranks.get(parts[j] + parts[j + 1], len(ranks)),
            )
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        if parts != [token]:
            bad.append(token)
    return bad


def write_tiktoken_bpe(ranks: dict[bytes, int], path: Path) -> None:
    """Write `base64(token) rank` lines in rank order (Llama3's tokenizer.model format)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    with open(path, "w", encoding="ascii", newline="\n") as f:
        f.writelines(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="JSONL file with a 'text' field")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="total ranks including the 256 single bytes (special tokens not counted)",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    start = time.perf_counter()
    word_counts = count_words(read_corpus(args.corpus))
    ranks = train_bpe(word_counts, args.vocab_size)
    elapsed = time.perf_counter() - start
    write_tiktoken_bpe(ranks, args.output)
    bad = unreachable_tokens(ranks)
    print(f"{len(word_counts):,} unique pre-tokens; {len(ranks)} ranks learned in {elapsed:.1f}s")
    print(f"wrote {args.output} ({args.output.stat().st_size:,} bytes)")
    if bad:
        print(f"warning: {len(bad)} tokens are unreachable by rank-order merging: {bad[:5]}")


if __name__ == "__main__":
    main()
