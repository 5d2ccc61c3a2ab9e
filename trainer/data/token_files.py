"""Pre-tokenized token files: Megatron's indexed format (`.bin` + `.idx`) and flat numpy token files, read and
written with numpy memory maps (no dependency: the format is a 30-byte header and three arrays).

Megatron's `.idx` (megatron/core/datasets/indexed_dataset.py, version 1), little-endian:

    b"MMIDIDX\\x00\\x00"  version <Q = 1  dtype code <B  sequence count <Q  document count <Q
    sequence lengths int32[sequence count]  sequence pointers int64[sequence count] (byte offsets into .bin)
    document indices int64[document count] (sequence numbers where documents start, then the sequence count)

The `.bin` is the sequences' tokens back to back. kiln trains on a file's tokens as one stream (documents as their
writer left them: `scripts/tokenize_data.py` writes each as BOS ... EOS, the text path's convention), so opening a
file reads only its header and checks its arrays' ends against the `.bin`'s size: nothing proportional to the
corpus. A flat numpy file (OLMo/Dolma) is one stream too: with an `.npy` header (np.save) its dtype is read from
it; without one (OLMo's raw memmaps) the dtype is uint16 when the vocabulary fits in it, else uint32 (OLMo's rule).

Token ids are checked against the vocabulary before any step when a file has a stats sidecar (`<file>.kiln.json`,
the smallest and largest id, the token count and the file's size, written by the tokenize command or
`scripts/tokenize_data.py --stats FILE` for files made elsewhere). The sidecar is checked against its file (size,
token count, and the first and last 64Ki ids inside its range), so a stale or edited one is refused, not
believed. Without a sidecar (or, for signed tokens, with one from before the smallest id was recorded), each window
is checked as it is read (min and max over seq_len+1 ids), and a bad id stops the run naming the file and position.
Torch-free: the launcher checks files with it before any rank starts.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from kiln_base.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's dtype codes (DType in indexed_dataset.py).
DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
NPY_MAGIC = b"\x93NUMPY"
SIDECAR = ".kiln.json"
TOKEN_EXTENSIONS = (".bin", ".idx", ".npy")
TEXT_EXTENSIONS = (".jsonl", ".json", ".parquet", ".txt")  # what the text path reads (trainer/data/sources.py)
SPOT_CHECK = 1 << 16  # ids at each end of a file compared with its sidecar's range: 256 KiB of int32 at most


def token_dtype(n_words: int) -> np.dtype:
    """The dtype kiln writes for a vocabulary: uint16 when it fits (Megatron's choice below 65,500), else int32."""
    return np.dtype(np.uint16 if n_words <= 65536 else np.int32)


@dataclass(frozen=True)
class TokenFile:
    """One memory-mapped token stream. `path` is the token data (`.bin` or `.npy`), named in every error."""

    path: str
    tokens: np.ndarray  # 1-D memmap
    documents: int | None  # from the .idx; None for numpy files
    max_token_id: int | None  # from the stats sidecar, when there is one
    min_token_id: int | None = None  # from the stats sidecar (0 for unsigned tokens), when there is one
    # The .idx's sequence pointers and document indices (memory-mapped), where the documents are recorded.
    index: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def ids_checked(self) -> bool:
        """Every id is known to lie in [min_token_id, max_token_id] (checked at open): windows need no check."""
        return self.min_token_id is not None and self.max_token_id is not None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def document_starts(self, start: int, stop: int, eos_id: int) -> np.ndarray:
        """Where documents begin inside tokens (start, stop) of this file, as offsets from `start` (a document
        beginning at `start` itself is the window's first either way): from the .idx's document index when the file
        has one (a document starts at its first sequence's pointer), else after each `eos_id` token (a flat numpy
        file records no documents; its writer ends each with EOS). O(log documents) with an index: two binary
        searches over memory-mapped arrays, nothing materialised."""
        if self.index is None:
            return np.flatnonzero(self.tokens[start : stop - 1] == eos_id) + 1
        pointers, docs = self.index
        size = self.tokens.dtype.itemsize
        first = np.searchsorted(pointers, start * size, side="right")  # the sequences beginning inside: [first, last)
        last = np.searchsorted(pointers, stop * size, side="left")
        lo, hi = np.searchsorted(docs[:-1], [first, last], side="left")  # the documents whose first sequence is one
        return np.asarray(pointers[docs[lo:hi]]) // size - start


def is_token_path(path: str) -> bool:
    """A Megatron prefix, `.bin`, `.idx`, `.npy`, or a folder holding `.idx`/`.npy` files (and no text)."""
    if os.path.isdir(path):
        return bool(token_file_paths(path, strict=False))
    return path.endswith(TOKEN_EXTENSIONS) or os.path.isfile(path + ".idx")


def token_file_paths(path: str, strict: bool = True) -> list[str]:
    """The token data files (`.bin` or `.npy`) a path names, sorted; a folder is searched recursively."""
    if os.path.isdir(path):
        names = [os.path.join(root, f) for root, _, names in os.walk(path) for f in names]
        found = sorted(f for f in names if f.endswith((".npy", ".idx")))
        text = sorted(f for f in names if f.endswith(TEXT_EXTENSIONS) and not f.endswith(SIDECAR))
        if found and text:  # one would be trained on and the other silently left out
            raise DataError(
                f"{path}: holds token files ({os.path.relpath(found[0], path)}, {len(found)} in all) and text files "
                f"({os.path.relpath(text[0], path)}, {len(text)} in all); a source is one kind: move one kind out"
            )
        files = [f[: -len(".idx")] + ".bin" if f.endswith(".idx") else f for f in found]
        if strict and not files:
            raise DataError(f"{path}: no .idx/.bin or .npy token files in this folder")
        return files
    if path.endswith(".idx"):
        return [path[: -len(".idx")] + ".bin"]
    if path.endswith((".bin", ".npy")):
        return [path]
    return [path + ".bin"]  # a Megatron prefix


def _prefix(path: str) -> str:
    """A source's name on disk: a Megatron pair by its prefix (`d/web`, `d/web.bin` and `d/web.idx` are one)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path) and path.endswith((".bin", ".idx")):
        return path[: -len(".bin")]
    return path


def source_identity(path: str) -> str:
    """What a source is, whatever it is called: its resolved path (links followed), a pair by its prefix."""
    prefix = _prefix(path)
    return os.path.join(os.path.realpath(os.path.dirname(prefix)), os.path.basename(prefix))


def source_names(paths: list[str]) -> list[str]:
    """The sources as logs, metrics and the checkpoint's fingerprint name them: the shortest end of each path that
    no other source's ends in (`train` alone; `wiki/train` and `books/train` together). Moving the data keeps them."""
    parts = [_prefix(p).strip(os.sep).split(os.sep) for p in paths]
    names = []
    for i, mine in enumerate(parts):
        k = next(
            (k for k in range(1, len(mine)) if all(q[-k:] != mine[-k:] for j, q in enumerate(parts) if j != i)),
            len(mine),
        )
        names.append("/".join(mine[-k:]))
    return names


def _sidecar_range(path: str, tokens: np.ndarray, size: int) -> tuple[int | None, int | None]:
    side = path + SIDECAR
    if not os.path.isfile(side):
        return None, None
    rewrite = f"rewrite them with scripts/tokenize_data.py --stats {path}"
    try:
        with open(side) as f:
            stats = json.load(f)
        max_id, n_tokens, recorded = int(stats["max_token_id"]), int(stats["tokens"]), int(stats["bytes"])
        min_id = None if stats.get("min_token_id") is None else int(stats["min_token_id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{side}: not a kiln stats file ({e}); delete it or rewrite it with scripts/tokenize_data.py --stats {path}"
        ) from None
    if recorded != size:
        raise DataError(
            f"{side} describes {recorded} bytes but {path} has {size}: the file changed after its stats were "
            f"written; {rewrite}"
        )
    if n_tokens != tokens.shape[0]:
        raise DataError(f"{side} describes {n_tokens} tokens but {path} holds {tokens.shape[0]}: {rewrite}")
    if tokens.dtype.kind == "u" and min_id is None:
        min_id = 0  # a sidecar from before the smallest id was recorded: unsigned tokens cannot be below 0
    if tokens.shape[0]:
        # What the sidecar says must hold of the data it describes: a cheap look at both ends of the file.
        ends = np.concatenate([tokens[:SPOT_CHECK], tokens[-SPOT_CHECK:]])
        low, high = int(ends.min()), int(ends.max())
        if high > max_id or (min_id is not None and low < min_id):
            raise DataError(
                f"{side} records ids {min_id} to {max_id}, but {path} holds {low if high <= max_id else high}: "
                f"it does not describe this file (edited, or written for another one); {rewrite}"
            )
    return min_id, max_id


def read_index(idx_path: str, bin_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sequence lengths, sequence pointers, document indices) of a Megatron `.idx`, memory-mapped, with
    its header, its length and its agreement with the `.bin` checked (DataError naming the file)."""
    try:
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError as e:
        raise DataError(f"{idx_path}: cannot read: {e.strerror or e}") from None
    if len(head) < _HEADER.size or not head.startswith(MAGIC):
        raise DataError(f"{idx_path}: not a Megatron index (no MMIDIDX header)")
    _, version, code, n_seq, n_doc = _HEADER.unpack(head)
    if version != VERSION:
        raise DataError(f"{idx_path}: index version {version}; kiln reads version {VERSION}")
    if code not in DTYPES:
        raise DataError(f"{idx_path}: unknown token dtype code {code} (Megatron's are 1-8)")
    dtype = np.dtype(DTYPES[code])
    expected = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
    if size < expected:
        raise DataError(
            f"{idx_path}: truncated: {size} bytes, its header announces {n_seq} sequences and "
            f"{n_doc} document indices ({expected} bytes)"
        )
    mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = mm[_HEADER.size : _HEADER.size + 4 * n_seq].view(np.int32)
    pointers = mm[_HEADER.size + 4 * n_seq : _HEADER.size + 12 * n_seq].view(np.int64)
    docs = mm[_HEADER.size + 12 * n_seq : expected].view(np.int64)
    try:
        bin_size = os.path.getsize(bin_path)
    except OSError as e:
        raise DataError(f"{bin_path}: cannot read the token file of {idx_path}: {e.strerror or e}") from None
    end = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if n_seq else 0
    if end != bin_size:
        what = "truncated" if end > bin_size else "longer than its index"
        raise DataError(
            f"{bin_path}: {what}: {bin_size} bytes, but {idx_path} indexes {end} bytes of {dtype.name} tokens"
        )
    # Sequences back to back (every writer does so): the pointers are the lengths' running sum. 12 bytes per
    # sequence, vectorised: ~10 ms for a million documents.
    if n_seq and (
        int(pointers[0]) != 0 or not np.array_equal(np.diff(pointers), lengths[:-1].astype(np.int64) * dtype.itemsize)
    ):
        raise DataError(
            f"{idx_path}: its sequence pointers disagree with its lengths (sequences not back to back in {bin_path})"
        )
    if n_doc and (int(docs[0]) != 0 or int(docs[-1]) != n_seq):
        raise DataError(f"{idx_path}: its document indices do not span its {n_seq} sequences")
    return dtype, lengths, pointers, docs


def _open_npy(path: str, n_words: int) -> tuple[np.ndarray, int]:
    """A flat numpy token file: np.save's format, or a raw memmap (OLMo's) read as token_dtype(n_words) up to
    uint32."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if magic == NPY_MAGIC:
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:  # a truncated body or a bad header
            raise DataError(f"{path}: cannot read as a numpy array: {e}") from None
        if arr.ndim != 1:
            raise DataError(f"{path}: a {arr.ndim}-D array; token files are 1-D (documents back to back)")
        return arr, size
    dtype = np.dtype(np.uint16 if n_words <= 65536 else np.uint32)
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: truncated: {size} bytes is not a whole number of {dtype.name} tokens (a raw "
            f"token file without .npy header is read as {dtype.name} for a {n_words}-word vocabulary)"
        )
    return np.memmap(path, mode="r", dtype=dtype), size


def open_token_file(path: str, n_words: int) -> TokenFile:
    """Memory-map one token file (`.bin` of a Megatron pair, or `.npy`) and check what can be checked without
    reading its tokens: the index against the file, the dtype against the vocabulary, the sidecar's largest id."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such token file")
    documents, index = None, None
    if path.endswith(".npy"):
        tokens, size = _open_npy(path, n_words)
    else:
        dtype, lengths, pointers, docs = read_index(path[: -len(".bin")] + ".idx", path)
        size = os.path.getsize(path)
        tokens = np.memmap(path, mode="r", dtype=dtype) if size else np.zeros(0, dtype)
        documents = max(int(docs.shape[0]) - 1, 0)
        index = (pointers, docs)
    if tokens.dtype.kind not in "iu":
        raise DataError(f"{path}: {tokens.dtype.name} values; token files hold integer ids (uint16, int32, ...)")
    if np.iinfo(tokens.dtype).max < n_words - 1:
        raise DataError(
            f"{path}: its dtype {tokens.dtype.name} holds ids up to {np.iinfo(tokens.dtype).max}, but the "
            f"tokenizer has {n_words} words: tokenize again (uint16 up to 65,536 words, int32 above)"
        )
    min_id, max_id = _sidecar_range(path, tokens, size)
    if max_id is not None and max_id >= n_words:
        raise DataError(
            f"{path}: holds token id {max_id}, outside the tokenizer's vocabulary (0 to {n_words - 1}); "
            f"it was tokenized with another tokenizer"
        )
    if min_id is not None and min_id < 0:
        raise DataError(
            f"{path}: holds token id {min_id}, outside the tokenizer's vocabulary (0 to {n_words - 1}); a negative "
            "id (a padding value?) has no embedding: drop or replace those tokens"
        )
    return TokenFile(
        path=path, tokens=tokens, documents=documents, min_token_id=min_id, max_token_id=max_id, index=index
    )


def write_index(idx_path: str, dtype: np.dtype, lengths: np.ndarray) -> None:
    """A Megatron `.idx` for sequences of `lengths` tokens back to back, one document each."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    docs = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(idx_path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODES[np.dtype(dtype)], len(lengths), len(docs)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(docs.tobytes(order="C"))


def write_stats(path: str, *, min_id: int, max_id: int, tokens: int) -> None:
    """The sidecar that lets a run check every id against its vocabulary before any step, in no time: the ids'
    range, and the token count and size that tie it to this file."""
    stats = {"min_token_id": int(min_id), "max_token_id": int(max_id), "tokens": int(tokens)}
    with open(path + SIDECAR, "w") as f:
        json.dump({**stats, "bytes": os.path.getsize(path)}, f)


def token_id_range(tokens: np.ndarray, chunk: int = 1 << 26) -> tuple[int, int]:
    """The smallest and largest id of a token stream, in chunks (constant memory; ~1 GB/s from the page cache);
    (0, -1) for an empty one."""
    low, high = None, -1
    for start in range(0, tokens.shape[0], chunk):
        part = tokens[start : start + chunk]
        low = int(part.min()) if low is None else min(low, int(part.min()))
        high = max(high, int(part.max()))
    return (0 if low is None else low), high
