"""What a token source is (trainer/data/token_files.py, sample_index.py, tokens.py): a source is its files'
content, whatever path names it (two `train` folders are two sources, `d/web` and `d/web.bin` one); a stats
sidecar is believed only where it agrees with its file, for both ends of the ids; mix weights of any magnitude
give their shares."""

from __future__ import annotations

import json
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from kiln_base.config import DatasetSource, Training, parse_args
from kiln_base.errors import CheckpointError, ConfigError, DataError
from tests.helpers.data import TOKENIZER
from tests.helpers.scripts import load_script
from trainer.checkpoint.resume import OPTIMIZER, REFUSED, SCHEDULE, WARNED, check_resume
from trainer.data.sample_index import BLOCK, Mixture, Source, open_mixture
from trainer.data.token_files import SIDECAR, TokenFile, is_token_path, open_token_file, write_index, write_stats
from trainer.data.tokens import build_token_loader, token_fingerprint

V = TOKENIZER.n_words


def pair(prefix: Path, seed: int, dtype: type = np.uint16, stats: bool = True) -> np.ndarray:
    """prefix.bin/.idx of random ids in 20 documents (+ the sidecar); returns the tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 200, size=20)
    tokens = rng.integers(0, V, size=int(lengths.sum())).astype(dtype)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(f"{prefix}.bin")
    write_index(f"{prefix}.idx", np.dtype(dtype), lengths)
    if stats:
        write_stats(f"{prefix}.bin", min_id=int(tokens.min()), max_id=int(tokens.max()), tokens=len(tokens))
    return tokens


def settings(mix: list[DatasetSource]) -> dict:
    others = {k: 0 for k in (*REFUSED, *SCHEDULE, *OPTIMIZER, *WARNED)}
    return {**others, "model": {}, "data": token_fingerprint(Training(dataset_mix=mix, seed=1))}


def test_two_sources_of_one_name_are_two_sources_and_a_replaced_one_is_refused(tmp_path: Path) -> None:
    """wiki/train and books/train: replacing wiki/train's files is a change of data, named."""
    pair(tmp_path / "wiki" / "train", seed=1)
    pair(tmp_path / "books" / "train", seed=2)
    mix = [DatasetSource(str(tmp_path / "wiki" / "train"), 0.5), DatasetSource(str(tmp_path / "books" / "train"), 0.5)]
    saved = settings(mix)
    assert sorted(saved["data"]["token_sources"]) == ["books/train", "wiki/train"]
    pair(tmp_path / "wiki" / "train", seed=3)  # other documents in the same place
    with pytest.raises(CheckpointError, match=r"other data \(token_sources: wiki/train: files: train\.bin: "):
        check_resume(saved, settings(mix), "ckpt")
    (line,) = check_resume(saved, settings(mix), "ckpt", allow_data_change=True)
    assert "changed data (token_sources: wiki/train: files: train.bin" in line
    # The logs and metrics name them the same way.
    mixture = open_mixture([(s.path, s.weight, None) for s in mix], 32, V, seed=0)
    assert [s.name for s in mixture.sources] == ["wiki/train", "books/train"]


def test_a_pair_is_one_source_by_any_of_its_names_and_is_given_once(tmp_path: Path) -> None:
    pair(tmp_path / "d" / "web", seed=1)
    pair(tmp_path / "d" / "code", seed=2)
    code = DatasetSource(str(tmp_path / "d" / "code"), 0.5)
    saved = settings([DatasetSource(str(tmp_path / "d" / "web"), 0.5), code])
    for name in ("web.bin", "web.idx"):
        assert check_resume(saved, settings([DatasetSource(str(tmp_path / "d" / name), 0.5), code]), "ckpt") == []
    os.symlink(tmp_path / "d", tmp_path / "link")
    for again in (tmp_path / "d" / "web.bin", tmp_path / "link" / "web"):
        paths = [
            (str(tmp_path / "d" / "web"), 1.0, None),
            (str(tmp_path / "d" / "code"), 1.0, None),
            (str(again), 1.0, None),
        ]
        with pytest.raises(
            ConfigError, match=r"training.dataset_mix\[2\].path: .* is the source of training.dataset_mix\[0\]"
        ):
            open_mixture(paths, 32, V, seed=0)


def test_a_folder_of_token_files_and_text_is_refused_naming_both(tmp_path: Path) -> None:
    pair(tmp_path / "data" / "d", seed=1)  # with its .kiln.json sidecar, which is not text
    assert is_token_path(str(tmp_path / "data"))
    (tmp_path / "data" / "more.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(
        DataError, match=r"data: holds token files \(d\.idx, 1 in all\) and text files \(more\.jsonl, 1 in all\)"
    ):
        is_token_path(str(tmp_path / "data"))


def _signed_with_padding(path: Path) -> np.ndarray:
    tokens = np.random.default_rng(0).integers(0, V, size=5000).astype(np.int32)
    tokens[2500:2600] = -1  # padding, mid-file: beyond the sidecar's spot check of the ends
    np.save(path, tokens)
    return tokens


def test_negative_ids_are_refused_with_the_stats_sidecar(tmp_path: Path, capsys) -> None:
    path = tmp_path / "pad.npy"
    _signed_with_padding(path)
    assert load_script("tokenize_data").main(["--stats", str(path)]) == 0
    assert json.loads(Path(f"{path}{SIDECAR}").read_text())["min_token_id"] == -1
    with pytest.raises(DataError, match=r"pad\.npy: holds token id -1, outside the tokenizer's vocabulary"):
        open_token_file(str(path), V)


def test_a_sidecar_without_the_smallest_id_is_not_trusted_for_it(tmp_path: Path) -> None:
    """A sidecar written before the minimum was recorded: signed ids are checked window by window as read."""
    path = tmp_path / "pad.npy"
    tokens = _signed_with_padding(path)
    old = {"max_token_id": int(tokens.max()), "tokens": len(tokens), "bytes": path.stat().st_size}
    Path(f"{path}{SIDECAR}").write_text(json.dumps(old))
    assert not open_token_file(str(path), V).ids_checked
    cfg = Training(seq_len=31, local_batch_size=4, dataset_path=str(path), seed=1, steps=10)
    dl = build_token_loader(cfg, V, 0, 1, global_batch=4)
    with pytest.raises(DataError, match=r"pad\.npy: token 2,5\d\d is id -1, outside the tokenizer's vocabulary"):
        for _ in range(50):
            next(dl)
    pair(tmp_path / "u", seed=1)  # unsigned tokens: an old sidecar is enough, they cannot be negative
    side = Path(f"{tmp_path / 'u.bin'}{SIDECAR}")
    side.write_text(json.dumps({k: v for k, v in json.loads(side.read_text()).items() if k != "min_token_id"}))
    assert open_token_file(str(tmp_path / "u.bin"), V).ids_checked


def test_a_sidecar_that_does_not_describe_its_file_is_refused(tmp_path: Path) -> None:
    tokens = pair(tmp_path / "d", seed=1)
    side = Path(f"{tmp_path / 'd.bin'}{SIDECAR}")
    good = json.loads(side.read_text())
    ends_max = int(max(tokens[:100].max(), tokens[-100:].max()))
    edits = {
        "tokens": (
            {"tokens": good["tokens"] + 1},
            rf"describes {good['tokens'] + 1} tokens but .*d\.bin holds {len(tokens)}",
        ),
        "max lowered": ({"max_token_id": ends_max - 1}, r"records ids .* but .*d\.bin holds .*: it does not describe"),
        "min raised": ({"min_token_id": int(tokens[:100].min()) + 1}, r"it does not describe this file"),
    }
    for change, needle in edits.values():
        side.write_text(json.dumps({**good, **change}))
        with pytest.raises(DataError, match=needle) as e:
            open_token_file(str(tmp_path / "d.bin"), V)
        assert "scripts/tokenize_data.py --stats" in str(e.value) and "\n" not in str(e.value)
    # --stats rewrites a sidecar that no longer describes its file (it used to refuse to open the file).
    assert load_script("tokenize_data").main(["--stats", str(tmp_path / "d.bin")]) == 0
    assert json.loads(side.read_text()) == good


def _source(weight: float, k: int) -> Source:
    return Source(f"s{k}", [TokenFile(f"s{k}", np.zeros(100_000, np.uint16), None, 0)], 33, weight)


WEIGHTS = {
    "easy": [1.0, 2.0, 3.0],
    "both near the float maximum": [1e308, 1e308],
    "huge and mixed": [1.7e308, 1e308, 3e307],
    "subnormal": [5e-324, 1.5e-323],
    "tiny": [1e-310, 3e-310, 2e-310],
    "mixed magnitudes": [1e-300, 1e300, 3e300],
}


@pytest.mark.parametrize("case", list(WEIGHTS))
def test_mix_weights_of_any_magnitude_give_their_shares(case: str) -> None:
    """Shares against exact fractions of the weights as given (no float arithmetic in the reference)."""
    weights = WEIGHTS[case]
    mixture = Mixture([_source(w, k) for k, w in enumerate(weights)], seed=0)
    total = sum(Fraction(w) for w in weights)
    n = 3 * BLOCK
    counts = mixture.counts(n)
    for w, c in zip(weights, counts, strict=True):
        assert abs(int(c) - Fraction(w) / total * n) <= len(weights), (case, counts.tolist())
    shares = [float(Fraction(w) / total) for w in weights]
    assert np.allclose(mixture.weights, shares, rtol=1e-12, atol=0)


def test_the_fingerprint_keeps_the_shares_of_huge_weights(tmp_path: Path) -> None:
    pair(tmp_path / "a", seed=1)
    pair(tmp_path / "b", seed=2)

    def shares(wa: float, wb: float) -> list[float]:
        mix = [DatasetSource(str(tmp_path / "a"), wa), DatasetSource(str(tmp_path / "b"), wb)]
        return [s["weight"] for s in settings(mix)["data"]["token_sources"].values()]

    assert shares(1e308, 1e308) == [0.5, 0.5] == shares(1.0, 1.0)
    assert shares(1.5e308, 5e307) == [0.75, 0.25]


def test_an_empty_dataset_path_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--training.dataset_path is empty: give a file or folder, or none"):
        parse_args(["--training.dataset_path", ""])
    toml = tmp_path / "c.toml"
    toml.write_text('[validation]\ndataset_path = ""\n')
    with pytest.raises(ConfigError, match=r"c.toml: validation.dataset_path is empty"):
        parse_args(["--job.config_file", str(toml)])
    assert parse_args(["--training.dataset_path", "none"]).training.dataset_path is None
