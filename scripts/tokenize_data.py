"""Tokenize text once into Megatron's indexed format (OUTPUT_PREFIX.bin + .idx), for training.dataset_path or
training.dataset_mix (docs/data.md).

    python scripts/tokenize_data.py INPUT OUTPUT_PREFIX [--workers N] [--tokenizer FILE] [--text-key text]
                                    [--shard-mb 16] [--split train]
    python scripts/tokenize_data.py --stats FILE.bin|FILE.npy     # the vocabulary check's sidecar, for files
                                                                  # tokenized elsewhere

INPUT: a .jsonl/.json/.parquet/.txt file, a folder of them (recursively, sorted), a Hugging Face dataset saved
with save_to_disk (a folder holding state.json or dataset_dict.json), or any other name `datasets.load_dataset`
opens (a local loading script or data folder, or a hub id with network). Every document is encoded with kiln's
tokenizer as training's text path does, BOS ... EOS; uint16 tokens when the vocabulary fits, else int32.

The input is cut into shards (line-aligned byte ranges of --shard-mb of a .jsonl/.txt file; a whole .json or
.parquet file; 100,000 rows of a HF dataset), tokenized by min(--workers, shards to do) processes into the
scratch folder OUTPUT_PREFIX.shards/, each shard's .bin/.idx renamed into place when complete. A re-run (after
Ctrl-C, a crash or a killed worker) keeps the finished shards and does the rest; the shards are concatenated into
OUTPUT_PREFIX.bin/.idx at the end, with the smallest and largest token id recorded in OUTPUT_PREFIX.bin.kiln.json
(checked against the vocabulary at start of every run), and the files the script wrote in the scratch folder
removed, then the folder. A record that is not a JSON object with a string text field stops it with one line
naming the file and record (exit 2).

The scratch folder is the script's only if it holds the marker (kiln-tokenize-scratch.json) it wrote when it made
it: a folder of that name without it (the input itself, say) is refused, never written to or deleted. An output
inside the input folder, or a scratch folder that is, holds or lies inside the input, is refused up front: a re-run
would read the output as input, and the end of a run would delete input.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from kiln_base.errors import ConfigError, DataError, KilnExit, UserError, say  # noqa: E402
from trainer.components.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from trainer.data.sources import record_problem  # noqa: E402
from trainer.data.token_files import (  # noqa: E402
    SIDECAR,
    open_token_file,
    read_index,
    token_dtype,
    token_id_range,
    write_index,
    write_stats,
)

FORMATS = (".jsonl", ".json", ".parquet", ".txt")
HF_ROWS = 100_000  # rows per shard of a HF dataset
MAX_WORKERS = 256  # each worker is a process holding the tokenizer: more only cost memory and start-up
# The scratch folder's proof of identity: written into it first, when the script makes it; a folder without it is
# not the script's, whatever its name.
MARKER = "kiln-tokenize-scratch.json"
MARKER_CONTENT = {"made_by": "kiln scripts/tokenize_data.py", "holds": "shards of OUTPUT_PREFIX, until merged"}


@dataclass(frozen=True)
class Shard:
    source: str  # a file, or the HF dataset's name
    start: int  # byte offset (jsonl/txt) or row (HF); 0 for a whole file
    end: int  # -1: to the end


def _input_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(r, f) for r, _, names in os.walk(path) for f in names if f.endswith(FORMATS))
        if not files:
            raise DataError(f"{path}: no {'/'.join(FORMATS)} files in this folder")
        return files
    if not path.endswith(FORMATS):
        raise DataError(f"{path}: not a {'/'.join(FORMATS)} file")
    return [path]


def _is_saved_hf(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")
    )


def _open_hf(path: str, split: str):  # noqa: ANN202 (a datasets.Dataset)
    import datasets

    try:
        ds = datasets.load_from_disk(path) if _is_saved_hf(path) else datasets.load_dataset(path, split=split)
    except Exception as e:  # whatever datasets says: the input is not readable as a dataset
        raise DataError(f"{path}: cannot open as a Hugging Face dataset ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split '{split}' (has: {', '.join(ds)}); pass --split")
        ds = ds[split]
    return ds


def plan_shards(path: str, shard_bytes: int, split: str) -> list[Shard]:
    """The shards of the input, the same for any --workers (so a re-run with other workers keeps them)."""
    if _is_saved_hf(path) or not os.path.exists(path):
        n = len(_open_hf(path, split))
        return [Shard(path, s, min(s + HF_ROWS, n)) for s in range(0, n, HF_ROWS)]
    shards = []
    for f in _input_files(path):
        if not f.endswith((".jsonl", ".txt")):
            shards.append(Shard(f, 0, -1))
            continue
        size, cuts = os.path.getsize(f), [0]
        with open(f, "rb") as fh:
            while cuts[-1] + shard_bytes < size:
                fh.seek(cuts[-1] + shard_bytes)
                fh.readline()  # to the end of the line the cut falls in
                if fh.tell() >= size:
                    break
                cuts.append(fh.tell())
        shards += [Shard(f, a, b) for a, b in zip(cuts, [*cuts[1:], -1], strict=True)]
    return shards


def _line_records(shard: Shard, text_key: str) -> Iterator[tuple[str, int]]:
    """(text, 1-based line) of each record of a .jsonl/.txt byte range; DataError naming file, record and line."""
    with open(shard.source, "rb") as fh:
        before = fh.read(shard.start)
        line, record = before.count(b"\n"), sum(1 for x in before.split(b"\n")[:-1] if x.strip())
        end = shard.end if shard.end >= 0 else os.path.getsize(shard.source)
        while fh.tell() < end:
            raw = fh.readline()
            line += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{shard.source}, record {record + 1} (line {line}): not UTF-8 (byte 0x{raw[e.start]:02x})"
                ) from None
            if shard.source.endswith(".txt"):
                record += 1
                yield text.rstrip("\r\n"), record
                continue
            if not text.strip():
                continue
            record += 1
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{shard.source}, record {record} (line {line}): not valid JSON ({e.msg}, column {e.colno})"
                ) from None
            problem = record_problem(value, text_key)
            if problem is not None:
                raise DataError(
                    f"{shard.source}, record {record} (line {line}): {problem}; "
                    f"every record needs a string '{text_key}' field"
                )
            yield value[text_key], record


def _records(shard: Shard, text_key: str, split: str) -> Iterator[str]:
    if shard.source.endswith((".jsonl", ".txt")) and os.path.isfile(shard.source):
        for text, _ in _line_records(shard, text_key):
            yield text
        return
    if shard.source.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(shard.source).to_pylist()
        except (OSError, ValueError) as e:
            raise DataError(f"{shard.source}: cannot read as parquet: {e}") from None
    elif shard.source.endswith(".json") and os.path.isfile(shard.source):
        try:
            with open(shard.source, encoding="utf-8") as fh:
                rows = json.load(fh)
        except (OSError, ValueError) as e:
            raise DataError(f"{shard.source}: cannot read as JSON: {e}") from None
        if not isinstance(rows, list):
            raise DataError(f"{shard.source}: a JSON file must hold an array of records (or use .jsonl)")
    else:
        rows = _open_hf(shard.source, split).select(range(shard.start, shard.end))
    for i, row in enumerate(rows):
        problem = record_problem(row, text_key)
        if problem is not None:
            raise DataError(
                f"{shard.source}, record {shard.start + i + 1}: {problem}; "
                f"every record needs a string '{text_key}' field"
            )
        yield row[text_key]


_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(tokenizer_path)


def tokenize_shard(job: tuple[int, Shard, str, str, str]) -> tuple[int, int, int, int, str | None]:
    """Tokenize one shard into work/NNNNNN.bin/.idx; (shard, documents, tokens, largest id, error line or None)."""
    n, shard, work, text_key, split = job
    assert _TOKENIZER is not None
    dtype = token_dtype(_TOKENIZER.n_words)
    prefix = os.path.join(work, f"{n:06d}")
    lengths, low, high = [], None, -1
    try:
        with open(prefix + ".bin.tmp", "wb") as out:
            for text in _records(shard, text_key, split):
                ids = np.array(_TOKENIZER.encode(text, bos=True, eos=True), dtype=dtype)
                out.write(ids.tobytes())
                lengths.append(len(ids))
                low = int(ids.min()) if low is None else min(low, int(ids.min()))
                high = max(high, int(ids.max()))
    except UserError as e:
        return n, 0, 0, -1, e.line()
    write_index(prefix + ".idx.tmp", dtype, np.array(lengths, dtype=np.int32))
    with open(prefix + ".json", "w") as f:
        json.dump({"min_token_id": low, "max_token_id": high}, f)
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")  # last: a shard is done when its .idx exists
    return n, len(lengths), int(sum(lengths)), high, None


def merge(work: str, n_shards: int, output: str, dtype: np.dtype) -> tuple[int, int, int]:
    """Concatenate the shards into output.bin/.idx (+ the stats sidecar); (documents, tokens, largest id)."""
    lengths, lows, high = [], [], -1
    with open(output + ".bin.tmp", "wb") as out:
        for n in range(n_shards):
            prefix = os.path.join(work, f"{n:06d}")
            _, shard_lengths, _, _ = read_index(prefix + ".idx", prefix + ".bin")  # checks the pair agrees
            lengths.append(np.array(shard_lengths))
            with open(prefix + ".bin", "rb") as src:
                shutil.copyfileobj(src, out, 1 << 24)
            with open(prefix + ".json") as f:
                shard = json.load(f)
            high = max(high, int(shard["max_token_id"]))
            # A shard an older kiln finished records no smallest id; a tokenizer's ids are never below 0.
            lows.append(0 if shard.get("min_token_id") is None else int(shard["min_token_id"]))
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    write_index(output + ".idx", dtype, all_lengths)
    os.replace(output + ".bin.tmp", output + ".bin")
    write_stats(output + ".bin", min_id=min(lows, default=0), max_id=high, tokens=int(all_lengths.sum()))
    return len(all_lengths), int(all_lengths.sum()), high


def _inside(path: str, folder: str) -> bool:
    """`path` is `folder` or under it (both resolved)."""
    return os.path.commonpath([path, folder]) == folder


def check_places(input_path: str, output: str) -> None:
    """Refuse an output a re-run would read as input, and a scratch folder whose removal would touch the input."""
    if not os.path.exists(input_path):
        return  # a dataset name for `datasets.load_dataset`: nothing on disk to protect
    source = os.path.realpath(input_path)
    out = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(output))), os.path.basename(output))
    work = os.path.realpath(output + ".shards")  # resolved: a link to the input is the input
    if os.path.isdir(source) and _inside(out, source):
        raise DataError(
            f"{output}: the output is inside the input folder {input_path}, where a re-run would read it as input; "
            "write it outside that folder"
        )
    if _inside(source, work) or _inside(work, source):
        relation = "is" if source == work else "holds" if _inside(source, work) else "is inside"
        raise DataError(
            f"{output}.shards, the scratch folder of OUTPUT_PREFIX {output}, {relation} the input {input_path}; "
            "choose another OUTPUT_PREFIX"
        )


def open_scratch(work: str) -> None:
    """Make the scratch folder `work`, marker first, or accept an existing one only if it holds the marker."""
    if os.path.lexists(work):
        try:
            with open(os.path.join(work, MARKER)) as f:
                mine = json.load(f) == MARKER_CONTENT
        except (OSError, ValueError):
            mine = False
        if not mine:
            raise DataError(
                f"{work}: exists but is not a scratch folder tokenize_data.py made (no {MARKER} in it); move it "
                "away or choose another OUTPUT_PREFIX"
            )
        return
    # Made under a fresh name and renamed into place with its marker: `work` never exists without it.
    tmp = tempfile.mkdtemp(prefix=os.path.basename(work) + ".", dir=os.path.dirname(os.path.abspath(work)))
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(MARKER_CONTENT, f)
    os.rename(tmp, work)


def remove_scratch(work: str, n_shards: int) -> None:
    """Delete the files this script writes into `work` (marker last), then the folder if nothing else is left."""
    names = ["plan.json"] + [
        f"{n:06d}{e}" for n in range(n_shards) for e in (".bin", ".idx", ".json", ".bin.tmp", ".idx.tmp")
    ]
    for name in [*names, MARKER]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(work, name))
    try:
        os.rmdir(work)
    except OSError:
        print(f"left {work}: it holds files tokenize_data.py did not write", file=sys.stderr)


def _hms(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


def tokenize(
    input_path: str, output: str, workers: int, tokenizer_path: str, text_key: str, shard_mb: float, split: str
) -> None:
    check_places(input_path, output)  # before anything is written
    make_folder(output)
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.n_words)
    shards = plan_shards(input_path, int(shard_mb * 2**20), split)
    work = output + ".shards"
    open_scratch(work)
    with open(tokenizer_path, "rb") as f:
        tok_sha = hashlib.sha256(f.read()).hexdigest()
    plan = {"shards": [asdict(s) for s in shards], "tokenizer_sha256": tok_sha, "text_key": text_key}
    plan_path = os.path.join(work, "plan.json")
    if os.path.isfile(plan_path):
        with open(plan_path) as f:
            if json.load(f) != plan:
                raise DataError(
                    f"{work} holds shards of another input, tokenizer or --shard-mb; delete it to "
                    "start over, or re-run with the options it was started with"
                )
    else:
        with open(plan_path, "w") as f:
            json.dump(plan, f)
    todo = [n for n in range(len(shards)) if not os.path.isfile(os.path.join(work, f"{n:06d}.idx"))]
    sizes = [os.path.getsize(s.source) if os.path.isfile(s.source) else 1 for s in shards]
    weight = [(s.end if s.end >= 0 else sz) - s.start for s, sz in zip(shards, sizes, strict=True)]
    total, done = sum(weight), sum(weight[n] for n in range(len(shards)) if n not in todo)
    workers = min(workers, len(todo))  # no more processes than shards to do
    print(
        f"{input_path}: {len(shards)} shards, {len(shards) - len(todo)} already done; {workers} worker(s), "
        f"tokenizer {tokenizer_path} ({tokenizer.n_words} words, {dtype.name} tokens)",
        file=sys.stderr,
    )
    jobs = [(n, shards[n], work, text_key, split) for n in todo]
    t0, docs, tokens, last = time.perf_counter(), 0, 0, 0.0
    if jobs:
        # Spawned, not forked: a worker forked from a process with threads (torch's, a test runner's) segfaulted in
        # its first garbage collection, and a pool replaced it with another that did the same, for ever (a full test
        # run hung so, 2026-11-29). An executor, not a Pool: a worker that dies (killed, out of memory) breaks the
        # executor, where a Pool waits for its shard for ever.
        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(tokenizer_path,)) as pool:
            try:
                for future in as_completed([pool.submit(tokenize_shard, job) for job in jobs]):
                    n, d, t, _, error = future.result()
                    if error is not None:
                        raise DataError(error.removeprefix("kiln: error: "))
                    docs, tokens, done = docs + d, tokens + t, done + weight[n]
                    now = time.perf_counter()
                    if now - last > 1.0 or done == total:
                        rate = tokens / max(now - t0, 1e-9)
                        frac = done / max(total, 1)
                        todo_frac = sum(weight[m] for m in todo) / max(total, 1)
                        eta = (now - t0) / max(frac - (1 - todo_frac), 1e-9) * (1 - frac)
                        print(
                            f"  {100 * frac:5.1f}%  {docs:,} documents  {tokens:,} tokens  {rate:,.0f} tokens/s  "
                            f"ETA {_hms(eta)}",
                            file=sys.stderr,
                        )
                        last = now
            except BrokenProcessPool:
                raise KilnExit(
                    "a tokenizing worker process died (killed, or out of memory?); the finished shards are kept "
                    f"in {work}: re-run the same command to go on"
                ) from None
            except BaseException:
                pool.shutdown(cancel_futures=True)  # the shards being tokenized finish (and are kept); no others
                raise
    n_docs, n_tokens, high = merge(work, len(shards), output, dtype)
    remove_scratch(work, len(shards))
    elapsed = time.perf_counter() - t0
    print(
        f"wrote {output}.bin/.idx: {n_docs:,} documents, {n_tokens:,} tokens ({dtype.name}), largest id {high}; "
        f"{tokens:,} tokens tokenized in {elapsed:.1f} s ({tokens / max(elapsed, 1e-9):,.0f} tokens/s, {workers} "
        f"worker(s))"
    )


def stats(path: str) -> None:
    """The sidecar of a token file made elsewhere: its smallest and largest id, read in chunks."""
    if os.path.isfile(path + SIDECAR):
        os.remove(path + SIDECAR)  # the one being replaced is not believed while the file is opened
    tf = open_token_file(path, n_words=1)
    t0 = time.perf_counter()
    low, high = token_id_range(tf.tokens)
    write_stats(path, min_id=low, max_id=high, tokens=tf.n_tokens)
    print(f"wrote {path}.kiln.json: {tf.n_tokens:,} tokens, ids {low} to {high} ({time.perf_counter() - t0:.1f} s)")


def make_folder(output: str) -> None:
    """The folder OUTPUT_PREFIX names a file in, made if missing; one line if a file stands in its way."""
    folder = os.path.dirname(os.path.abspath(output))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise DataError(f"{output}: {existing} is a file, not a folder; OUTPUT_PREFIX must name a file in a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise DataError(f"{output}: cannot make its folder {folder} ({e.strerror})") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", help="text file, folder, or Hugging Face dataset")
    p.add_argument("output_prefix", nargs="?", help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model"))
    p.add_argument("--text-key", default="text", help="the field holding each record's text")
    p.add_argument("--shard-mb", type=float, default=16.0, help="MB of a .jsonl/.txt file per shard")
    p.add_argument("--split", default="train", help="the split of a Hugging Face dataset")
    p.add_argument(
        "--stats", metavar="FILE", help="write FILE.kiln.json (smallest and largest id) for a token file and exit"
    )
    a = p.parse_args(argv)
    try:
        if a.stats:
            stats(a.stats)
        elif a.input is None or a.output_prefix is None:
            p.error("INPUT and OUTPUT_PREFIX are required (or --stats FILE)")
        else:
            if not 1 <= a.workers <= MAX_WORKERS:
                raise ConfigError(f"--workers must be 1 to {MAX_WORKERS}, got {a.workers}")
            tokenize(a.input, a.output_prefix, a.workers, a.tokenizer, a.text_key, a.shard_mb, a.split)
    except KilnExit as e:
        say(e.line())
        return e.status
    except KeyboardInterrupt:
        print("interrupted: finished shards are kept; re-run the same command to go on", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
