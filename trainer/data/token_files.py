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
the largest id, written by the tokenize command or `scripts/tokenize_data.py --stats FILE` for files made
elsewhere); without one, each window is checked as it is read (a max over seq_len+1 ids), and a bad id stops the
run naming the file and position. Torch-free: the launcher checks files with it before any rank starts.
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
    # The .idx's sequence pointers and document indices (memory-mapped), where the documents are recorded.
    index: tuple[np.ndarray, np.ndarray] | None = None

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
        found = sorted(
            os.path.join(root, f)
            for root, _, names in os.walk(path)
            for f in names
            if f.endswith(".npy") or (f.endswith(".idx") and not f.endswith(SIDECAR))
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


def _sidecar_max(path: str, size: int) -> int | None:
    side = path + SIDECAR
    if not os.path.isfile(side):
        return None
    try:
        with open(side) as f:
            stats = json.load(f)
        max_id, recorded = int(stats["max_token_id"]), int(stats["bytes"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{side}: not a kiln stats file ({e}); delete it or rewrite it with scripts/tokenize_data.py --stats {path}"
        ) from None
    if recorded != size:
        raise DataError(
            f"{side} describes {recorded} bytes but {path} has {size}: the file changed after its stats were "
            f"written; rewrite them with scripts/tokenize_data.py --stats {path}"
        )
    return max_id


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
    max_id = _sidecar_max(path, size)
    if max_id is not None and max_id >= n_words:
        raise DataError(
            f"{path}: holds token id {max_id}, outside the tokenizer's vocabulary (0 to {n_words - 1}); "
            f"it was tokenized with another tokenizer"
        )
    return TokenFile(path=path, tokens=tokens, documents=documents, max_token_id=max_id, index=index)


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


def write_stats(path: str, max_token_id: int, n_tokens: int) -> None:
    """The sidecar that lets a run check every id against its vocabulary before any step, in no time."""
    stats = {"max_token_id": int(max_token_id), "tokens": int(n_tokens), "bytes": os.path.getsize(path)}
    with open(path + SIDECAR, "w") as f:
        json.dump(stats, f)


def max_token_id(tokens: np.ndarray, chunk: int = 1 << 26) -> int:
    """The largest id of a token stream, in chunks (constant memory; ~1 GB/s from the page cache)."""
    best = -1
    for start in range(0, tokens.shape[0], chunk):
        best = max(best, int(tokens[start : start + chunk].max()))
    return best
