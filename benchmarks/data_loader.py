"""What feeding a data-parallel job costs one rank: token files (trainer/data/tokens.py) against the text
path (trainer/data/text.py), numbers for docs/performance.md (not a timed test).

    python benchmarks/data_loader.py loader   [--seq-len 2048] [--batch 2] [--degrees 1,2,4,8,64] [--token-data P]
    python benchmarks/data_loader.py read     [--seq-len 8192] [--batch 4]   # tokens/s of one rank, page cache
    python benchmarks/data_loader.py tokenize [--copies 5]                   # the tokenize command, 1 and 2 workers
    python benchmarks/data_loader.py startup  [--tokens 1e9] [--documents 1e6] [--keep]

loader: a rank's loader is a function of (rank, degree, step), so the ranks of DP N are simulated in one process:
the last rank of each degree is built and timed over batches from step 0, per batch, with no prefetch thread
(data_prefetch 0: the time the step would wait without one). Both paths read the bundled corpus (the token path
from its tokenized copy). read: one rank's batches of a synthetic 1 B-token file written just before (so in the
page cache). startup: a 1 B-token, 1 M-document Megatron pair of uint16 tokens (2 GB, in --dir, deleted after
unless --keep), then a fresh process opens it and reads its first batch: seconds and peak RSS above the imports.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from kiln_base.config import Training  # noqa: E402
from trainer.components.tokenizer import load_tokenizer  # noqa: E402
from trainer.data.text import build_dataloader  # noqa: E402
from trainer.data.token_files import write_index, write_stats  # noqa: E402
from trainer.data.tokens import build_token_loader  # noqa: E402

CORPUS = ROOT / "assets" / "corpus" / "kiln_corpus.jsonl"
TOKENIZER = ROOT / "assets" / "tokenizer" / "tokenizer.model"
TOKENIZE = ROOT / "scripts" / "tokenize_data.py"


def _per_batch(loader: object, batches: int, repeats: int = 1) -> float:
    """Seconds per batch: the best of `repeats` runs of `batches` batches (the box is shared: the best run is the
    one least disturbed by other processes)."""
    next(loader)  # type: ignore[call-overload]  # opening costs are not per batch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batches):
            next(loader)  # type: ignore[call-overload]
        best = min(best, (time.perf_counter() - t0) / batches)
    return best


def loader_times(seq_len: int, batch: int, degrees: list[int], work: Path, token_data: str | None) -> list[dict]:
    """Per-batch time of the last rank of each DP degree; token files: the tokenized corpus, or `token_data`."""
    tokenizer = load_tokenizer(str(TOKENIZER))
    prefix = work / "corpus"
    if not Path(f"{prefix}.bin").exists():
        subprocess.run([sys.executable, str(TOKENIZE), str(CORPUS), str(prefix)], check=True, capture_output=True)
    data = token_data or str(prefix)
    loaders = {}
    for dp in degrees:
        t = Training(seq_len=seq_len, local_batch_size=batch, dataset_path=data, seed=0, steps=1000)
        loaders[dp] = build_token_loader(t, tokenizer.n_words, dp - 1, dp, global_batch=batch * dp)
        next(loaders[dp])
    # Degrees interleaved, best of 7 rounds of 200 batches each: a disturbance (another process, a page-cache
    # miss) lands on one round of one degree, not on a whole degree.
    token = {dp: float("inf") for dp in degrees}
    for _ in range(7):
        for dp in degrees:
            token[dp] = min(token[dp], _per_batch(loaders[dp], 200))
    rows = []
    for dp in degrees:
        text_cfg = Training(seq_len=seq_len, local_batch_size=batch, dataset_path=str(CORPUS), data_prefetch=0)
        text_loader = build_dataloader(text_cfg, tokenizer, dp - 1, dp)
        text = _per_batch(text_loader, max(2, 40 // dp), repeats=2)
        text_loader.close()
        rows.append({"dp": dp, "token_ms": 1e3 * token[dp], "text_ms": 1e3 * text})
        print(f"DP {dp:>3}: token files {1e3 * token[dp]:8.3f} ms/batch   text path {1e3 * text:9.1f} ms/batch",
              flush=True)  # fmt: skip
    return rows


def synthetic_pair(prefix: Path, tokens: int, documents: int, vocab: int, seed: int = 0) -> None:
    """prefix.bin/.idx (+ stats) of `tokens` uint16 ids in `documents` documents, written in 64 M-token chunks."""
    rng = np.random.default_rng(seed)
    cuts = np.unique(rng.integers(1, tokens, size=documents - 1))  # ~documents documents, without 8 GB of arange
    lengths = np.diff(np.concatenate([[0], cuts, [tokens]])).astype(np.int32)
    with open(f"{prefix}.bin", "wb") as f:
        for start in range(0, tokens, 1 << 26):
            f.write(rng.integers(0, vocab, size=min(1 << 26, tokens - start), dtype=np.uint16).tobytes())
    write_index(f"{prefix}.idx", np.dtype(np.uint16), lengths)
    write_stats(f"{prefix}.bin", min_id=0, max_id=vocab - 1, tokens=tokens)


def read_rate(seq_len: int, batch: int, prefix: Path) -> float:
    """Tokens/s one rank (rank 3 of DP 8) copies out of the page cache into its batches."""
    vocab = load_tokenizer(str(TOKENIZER)).n_words
    t = Training(seq_len=seq_len, local_batch_size=batch, dataset_path=str(prefix), seed=0, steps=1000)
    loader = build_token_loader(t, vocab, 3, 8, global_batch=batch * 8)
    seconds = _per_batch(loader, 200)
    return batch * seq_len / seconds


STARTUP = """
import resource, sys, time
sys.path.insert(0, {root!r})
from kiln_base.config import Training
from trainer.data.tokens import build_token_loader
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
t = Training(seq_len=8192, local_batch_size=4, dataset_path={prefix!r}, seed=0, steps=10000)
loader = build_token_loader(t, 2256, 7, 64, global_batch=4 * 64)
opened = time.perf_counter() - t0
next(loader)
first = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print({{"open_s": opened, "first_batch_s": first, "rss_mib_above_imports": (peak - base) / 1024,
       "rss_mib": peak / 1024}})
"""


def startup(prefix: Path) -> dict:
    code = STARTUP.format(root=str(ROOT), prefix=str(prefix))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return eval(out.strip().splitlines()[-1])  # a dict of floats printed by the child


def tokenize_rates(copies: int, work: Path) -> list[tuple[int, float]]:
    text = work / "corpus_x.jsonl"
    with open(text, "wb") as out:
        for _ in range(copies):
            out.write(CORPUS.read_bytes())
    rates = []
    for workers in (1, 2):
        prefix = work / f"tok{workers}"
        t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, str(TOKENIZE), str(text), str(prefix), "--workers", str(workers),
                        "--shard-mb", "1"], check=True, capture_output=True)  # fmt: skip
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
        n = json.loads(Path(f"{prefix}.bin.kiln.json").read_text())["tokens"]
        rates.append((workers, n / (time.perf_counter() - t0)))
        print(f"tokenize {text.stat().st_size / 2**20:.0f} MB, {workers} worker(s): {rates[-1][1]:,.0f} tokens/s "
              f"(wall clock of the whole command: start-up, tokenizing, merge); {n / cpu:,.0f} tokens per CPU-second "
              f"over all its processes; load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("loader", "read", "tokenize", "startup"))
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--degrees", default="1,2,4,8,64")
    p.add_argument("--token-data", help="loader: time the token path on this prefix instead of the corpus")
    p.add_argument("--copies", type=int, default=5)
    p.add_argument("--tokens", type=float, default=1e9)
    p.add_argument("--documents", type=float, default=1e6)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    work = Path(a.dir) / "kiln_data_bench"
    work.mkdir(parents=True, exist_ok=True)
    if a.what == "loader":
        loader_times(a.seq_len or 2048, a.batch or 2, [int(d) for d in a.degrees.split(",")], work, a.token_data)
    elif a.what == "tokenize":
        tokenize_rates(a.copies, work)
    else:
        prefix = work / "synthetic"
        if not Path(f"{prefix}.idx").exists():
            t0 = time.perf_counter()
            synthetic_pair(prefix, int(a.tokens), int(a.documents), load_tokenizer(str(TOKENIZER)).n_words)
            seconds = time.perf_counter() - t0
            print(f"wrote {int(a.tokens):,} tokens in {int(a.documents):,} documents in {seconds:.0f} s")
        if a.what == "read":
            rate = read_rate(a.seq_len or 8192, a.batch or 4, prefix)
            print(f"read rate, one rank, seq {a.seq_len or 8192} x batch {a.batch or 4}: {rate:,.0f} tokens/s")
        else:
            print("startup (fresh process, seq 8192, rank 7 of DP 64):", startup(prefix))
        if not a.keep:
            for suffix in (".bin", ".idx", ".bin.kiln.json"):
                os.remove(f"{prefix}{suffix}")
    if not a.keep and a.what != "loader":
        shutil.rmtree(work, ignore_errors=True)
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
