"""tiktoken-based tokenizer with Llama3's pre-tokenizer and special tokens.

Works with the bundled `assets/tokenizer/tokenizer.model` (2000 ranks + 256 specials) and with a
real Llama3 `tokenizer.model` (128000 ranks + 256 specials).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from pathlib import Path

import tiktoken

from kiln_base.errors import ConfigError
from kiln_base.files import MiB, read_bounded

# tiktoken's Rust encoder can overflow its stack on huge inputs; Llama3 splits before encoding.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000

# Llama3's pre-tokenization pattern.
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3's tokenizer.model is 2.2 MB (128,000 tokens); a 256k vocabulary ~5 MB. A larger file is refused before
# tiktoken builds its tables from it (a 40 MB file once ran a 2-rank job into the OOM killer, without a word).
MAX_TOKENIZER_BYTES = 32 * MiB
NUM_SPECIAL_TOKENS = 256
# Llama 3.1's named special tokens; the rest of the 256 are reserved placeholders.
NAMED_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
]
SPECIAL_TOKENS = NAMED_SPECIAL_TOKENS + [
    f"<|reserved_special_token_{i}|>" for i in range(2, 2 + NUM_SPECIAL_TOKENS - len(NAMED_SPECIAL_TOKENS))
]


def _load_ranks(model_path: str) -> dict[bytes, int]:
    """Read a tiktoken BPE file, turning every failure into an error that names the path."""
    hint = "it must be a tiktoken BPE file like Llama3's tokenizer.model ('base64(token) rank' per line)"
    path = Path(model_path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found (or not a regular file): {model_path}; {hint}")
    try:
        data = read_bounded(model_path, MAX_TOKENIZER_BYTES, "a tokenizer file")
    except OSError as e:
        raise ValueError(f"cannot read tokenizer file {model_path}: {e}; {hint}") from e
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("not two fields")
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error) as e:
            shown = line[:40].decode(errors="replace") + ("..." if len(line) > 40 else "")
            raise ValueError(
                f"cannot parse tokenizer file {model_path} (line {line_no} {shown!r}: {e}); {hint}"
            ) from None
    if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"tokenizer file {model_path} has no tokens or non-contiguous ranks; {hint}")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"tokenizer file {model_path} lacks some single-byte tokens; {hint}")
    return ranks


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at `model.tokenizer_path`; a missing or malformed file is a ConfigError naming the key."""
    try:
        return Tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None


class Tokenizer:
    """Byte-level BPE tokenizer (tiktoken) with Llama3's regex split and 256 special tokens."""

    def __init__(self, model_path: str) -> None:
        """Load the BPE ranks at `model_path`; specials get ids right after the base vocab."""
        self.model_path = model_path
        mergeable_ranks = _load_ranks(model_path)
        self.mergeable_ranks: dict[bytes, int] = mergeable_ranks  # token bytes -> rank (id); exported to HF
        num_base_tokens = len(mergeable_ranks)
        self.special_tokens: dict[str, int] = {token: num_base_tokens + i for i, token in enumerate(SPECIAL_TOKENS)}
        try:
            self.model = tiktoken.Encoding(
                name=Path(model_path).name,
                pat_str=PAT_STR,
                mergeable_ranks=mergeable_ranks,
                special_tokens=self.special_tokens,
            )
        except Exception as e:  # e.g. duplicate tokens collapsing ranks
            raise ValueError(f"tokenizer file {model_path} is not a valid tiktoken BPE file: {e}") from e
        self._n_words: int = num_base_tokens + len(self.special_tokens)
        self._bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self._eos_id: int = self.special_tokens["<|end_of_text|>"]

    @property
    def n_words(self) -> int:
        """Vocabulary size including special tokens (the model's embedding rows)."""
        return self._n_words

    @property
    def bos_id(self) -> int:
        """Id of `<|begin_of_text|>`."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """Id of `<|end_of_text|>`."""
        return self._eos_id

    @property
    def pad_id(self) -> int:
        """No padding token, as in Llama3."""
        return -1

    def encode(self, s: str, *, bos: bool, eos: bool) -> list[int]:
        """Encode `s`; special-token text in `s` is encoded as ordinary text, never as specials."""
        ids: list[int] = []
        for i in range(0, len(s), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_long_runs(s[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS):
                ids.extend(self.model.encode(piece, allowed_special=set(), disallowed_special=()))
        if bos:
            ids.insert(0, self._bos_id)
        if eos:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        """Decode ids to text (invalid UTF-8 byte sequences become U+FFFD)."""
        return self.model.decode(ids)


def _split_long_runs(s: str, max_len: int) -> Iterator[str]:
    """Split `s` so no piece holds more than `max_len` consecutive whitespace or non-whitespace chars."""
    run_len = 0
    run_is_space = s[0].isspace() if s else False
    start = 0
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if is_space != run_is_space:
            run_len = 1
            run_is_space = is_space
        else:
            run_len += 1
            if run_len > max_len:
                yield s[start:i]
                start = i
                run_len = 1
    yield s[start:]
