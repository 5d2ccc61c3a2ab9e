"""The sample index over token files: global sample number -> source, window, token range, computed for any sample
without reading what comes before it (torch-free, numpy only).

Packing. Each source (a weighted entry of training.dataset_mix, or training.dataset_path alone) is its token files'
streams cut into windows of seq_len+1 tokens: window w of a file is tokens [w (L+1), (w+1)(L+1)), documents
crossing window boundaries as in the text path (its documents are BOS ... EOS back to back too), the last
partial window of each file dropped (at most seq_len tokens per file). The windows of one pass over a source are
shuffled by a permutation drawn from (seed, source, epoch): sample j of a source is window perm_e[j mod n] of
epoch e = j // n. OLMo-core's numpy datasets pack and shuffle the same way.

Mixing. Source k has weight w_k (shares of tokens, normalised; every sample has L+1 tokens, so shares of samples).
The global samples are cut into blocks of BLOCK; after b blocks source k has had c_k(b) = floor(w_k b BLOCK)
samples, except the heaviest source, which has the rest (b BLOCK - sum of the others). Every c_k grows with b
(the heaviest's step is at least w_max BLOCK - K + 1 > 0), and each share is exact to a sample per block
boundary. Inside block b the block's c_k(b+1) - c_k(b) samples of each source are spread evenly, from offsets
drawn from (seed, b), so every prefix of the run holds each source's share to within two samples. So sample g's
source and its number within that source take O(K + BLOCK) numpy work, whatever g is:
a rank reads only its own samples, its cost does not grow with the data-parallel degree, and a resumed run
starts at its saved sample number under any layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln_base.errors import ConfigError, DataError
from trainer.data.token_files import (
    TokenFile,
    open_token_file,
    source_identity,
    source_names,
    token_file_paths,
)

BLOCK = 4096  # samples per mixing block: the mix is exact to one sample per source at every multiple of it


@dataclass
class Source:
    """One weighted source: its token files, cut into windows of `window` tokens."""

    name: str
    files: list[TokenFile]
    window: int
    weight: float = 1.0
    max_epochs: float | None = None

    def __post_init__(self) -> None:
        counts = np.array([f.n_tokens // self.window for f in self.files], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])  # first window number of each file
        self.n_windows = int(self.starts[-1])
        self.n_tokens = sum(f.n_tokens for f in self.files)
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation), the last one used

    def order(self, epoch: int, seed: int, index: int) -> np.ndarray:
        """The windows of one pass, shuffled from (seed, source index, epoch); the last pass used is kept (8 bytes
        per window: 1 MB for a 1 B-token source at seq 8192)."""
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([seed, index, epoch])
            self._order = (epoch, rng.permutation(self.n_windows))
        return self._order[1]

    def window_at(self, w: int) -> tuple[TokenFile, int]:
        """(file, first token) of window `w` of this source."""
        f = int(np.searchsorted(self.starts, w, side="right")) - 1
        return self.files[f], (w - int(self.starts[f])) * self.window


class Mixture:
    """Sample numbers of a weighted mix of sources (module docstring); `shuffle=False` reads each source's windows
    in file order (validation)."""

    def __init__(self, sources: list[Source], seed: int, shuffle: bool = True) -> None:
        for s in sources:
            if s.n_windows == 0:
                files = ", ".join(f.path for f in s.files)
                raise DataError(f"{files}: fewer than seq_len + 1 = {s.window} tokens, not one training sequence")
        self.sources, self.seed, self.shuffle = sources, seed, shuffle
        self.weights = normalised([s.weight for s in sources])
        self.heaviest = int(np.argmax(self.weights))
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None  # (block, source of each, number within)

    def counts(self, samples: int) -> np.ndarray:
        """Samples of each source among global samples [0, samples)."""
        if len(self.sources) == 1:
            return np.array([samples], dtype=np.int64)
        b, r = divmod(samples, BLOCK)
        out = self._cumulative(b)
        if r:
            kinds, _ = self._block_plan(b)
            out += np.bincount(kinds[:r], minlength=len(self.sources))
        return out

    def _cumulative(self, blocks: int) -> np.ndarray:
        c = np.floor(self.weights * (blocks * BLOCK)).astype(np.int64)
        c[self.heaviest] = 0
        c[self.heaviest] = blocks * BLOCK - int(c.sum())
        return c

    def _block_plan(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's samples: the source of each and its number within that source."""
        if self._block is None or self._block[0] != b:
            start, quota = self._cumulative(b), self._cumulative(b + 1) - self._cumulative(b)
            # Evenly spread: source k's i-th sample of the block sits at (i + u_k) / quota_k, u_k drawn from (seed,
            # b); so every prefix of the block holds each source's share to within one sample.
            offsets = np.random.default_rng([self.seed, 1 << 20, b]).random(len(self.sources))
            kinds = np.repeat(np.arange(len(self.sources)), quota)
            nth = np.arange(BLOCK) - np.repeat(np.cumsum(quota) - quota, quota)  # i of source k's i-th sample
            order = np.argsort((nth + offsets[kinds]) / quota[kinds], kind="stable")  # keeps each source's i order
            self._block = (b, kinds[order], start[kinds[order]] + nth[order])
        return self._block[1], self._block[2]

    def locate(self, g: int) -> tuple[int, int]:
        """(source, sample number within the source) of global sample g."""
        if len(self.sources) == 1:  # no mixing: the source's sample g
            return 0, g
        b, r = divmod(g, BLOCK)
        kinds, within = self._block_plan(b)
        return int(kinds[r]), int(within[r])

    def sample(self, g: int) -> tuple[TokenFile, int, int]:
        """(file, first token, source) of global sample g; its window is the next source.window tokens."""
        k, j = self.locate(g)
        s = self.sources[k]
        epoch, w = divmod(j, s.n_windows)
        if self.shuffle:
            w = int(s.order(epoch, self.seed, k)[w])
        f, start = s.window_at(w)
        return f, start, k

    def epochs(self, samples: int) -> list[float]:
        """Passes over each source that `samples` global samples make."""
        return [int(c) / s.n_windows for c, s in zip(self.counts(samples), self.sources, strict=True)]

    def check_epochs(self, samples: int, where: str) -> None:
        """A source repeated more than its max_epochs over the run is a DataError naming it (before any step)."""
        for s, e in zip(self.sources, self.epochs(samples), strict=True):
            if s.max_epochs is not None and e > s.max_epochs:
                raise DataError(
                    f"{where}: source {s.name} would be read {e:.2f} times over the run ({s.n_tokens:,} tokens, "
                    f"weight {s.weight:g}), above its max_epochs = {s.max_epochs:g}; lower its weight or "
                    f"training.steps, raise max_epochs, or add data"
                )

    def format_table(self, samples: int) -> str:
        """The realised mix of `samples` global samples: one row per source."""
        counts, window = self.counts(samples), self.sources[0].window
        rows = [f"{'source':<24} {'weight':>7} {'share':>7} {'tokens':>15} {'in source':>15} {'epochs':>7}"]
        for s, w, c in zip(self.sources, self.weights, counts, strict=True):
            share = c / max(samples, 1)
            epochs = int(c) / s.n_windows
            rows.append(
                f"{s.name:<24} {w:>7.3f} {share:>7.3f} {int(c) * window:>15,} {s.n_tokens:>15,} "
                f"{epochs:>7.2f}" + ("" if s.max_epochs is None else f" (max {s.max_epochs:g})")
            )
        return "\n".join(rows)


def normalised(weights: list[float]) -> np.ndarray:
    """Weights as shares summing to 1. Divided by the largest first: any positive finite weights are valid, and
    the sum of two near the float maximum (1e308 + 1e308) is inf, which would make every share 0."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.max()
    return w / w.sum()


def open_mixture(
    paths: list[tuple[str, float, float | None]], seq_len: int, n_words: int, seed: int, shuffle: bool = True
) -> Mixture:
    """The mixture of (path, weight, max_epochs) sources, each path a token file, Megatron prefix or folder of
    them; every file opened and checked (token_files.open_token_file) before any step. A source given twice (by
    any of its names: `d/web` and `d/web.bin` are one) is a ConfigError naming both entries."""
    seen: dict[str, int] = {}
    for i, (path, _, _) in enumerate(paths):
        j = seen.setdefault(source_identity(path), i)
        if j != i:
            raise ConfigError(
                f"training.dataset_mix[{i}].path: {path} is the source of training.dataset_mix[{j}] "
                f"({paths[j][0]}) again; give each source once, with the sum of the weights"
            )
    sources = []
    for (path, weight, max_epochs), name in zip(paths, source_names([p for p, _, _ in paths]), strict=True):
        files = [open_token_file(f, n_words) for f in token_file_paths(path)]
        sources.append(Source(name, files, seq_len + 1, weight, max_epochs))
    return Mixture(sources, seed, shuffle)
