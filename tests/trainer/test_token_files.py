"""Token files (trainer/data/token_files.py), the sample index and mix (sample_index.py), the loader
(token_data.py): formats read and written, every bad file named in one error, the global sample order the same in
every data-parallel layout, the mix exact to two samples, the loader state one integer; scripts/tokenize_data.py,
in-process and as users run it (its scratch folder, a dead worker, bad places and options)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln_base.config import DatasetSource, Training, parse_args
from kiln_base.errors import CheckpointError, ConfigError, DataError
from tests.helpers.common import ROOT
from tests.helpers.data import TOKENIZER, loader
from tests.helpers.kiln_process import KilnResult, KilnRun, assert_one_line_error, children, run_kiln, start_kiln
from tests.helpers.scripts import load_script
from trainer.checkpoint.resume import OPTIMIZER, REFUSED, SCHEDULE, WARNED, check_resume
from trainer.data.sample_index import BLOCK, Mixture, Source, open_mixture
from trainer.data.token_files import (
    TokenFile,
    open_token_file,
    read_index,
    write_index,
    write_stats,
)
from trainer.data.tokens import TokenFileLoader, build_token_loader, token_fingerprint

V = TOKENIZER.n_words


def write_megatron(prefix: Path, docs: list[list[int]], dtype: type = np.uint16, stats: bool = True) -> Path:
    tokens = np.concatenate([np.array(d, dtype=dtype) for d in docs])
    tokens.tofile(f"{prefix}.bin")
    write_index(f"{prefix}.idx", np.dtype(dtype), np.array([len(d) for d in docs]))
    if stats:
        write_stats(f"{prefix}.bin", min_id=int(tokens.min()), max_id=int(tokens.max()), tokens=len(tokens))
    return Path(f"{prefix}.bin")


def random_docs(n: int, seed: int = 0, high: int = V) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(5, 200))).tolist() for _ in range(n)]


def token_loader(path: Path | str, rank: int = 0, world: int = 1, batch: int = 2, seq_len: int = 32, **kw):
    cfg = Training(seq_len=seq_len, local_batch_size=batch, dataset_path=str(path), seed=1, steps=10, **kw)
    return build_token_loader(cfg, V, rank, world, global_batch=batch * world)


def test_megatron_pair_round_trips(tmp_path: Path) -> None:
    docs = random_docs(50)
    write_megatron(tmp_path / "d", docs)
    dtype, lengths, pointers, doc_idx = read_index(str(tmp_path / "d.idx"), str(tmp_path / "d.bin"))
    assert dtype == np.uint16 and lengths.tolist() == [len(d) for d in docs]
    assert pointers[1] == 2 * len(docs[0]) and doc_idx.tolist() == list(range(51))
    tf = open_token_file(str(tmp_path / "d.bin"), V)
    assert tf.tokens.tolist() == sum(docs, []) and tf.documents == 50 and tf.max_token_id == max(map(max, docs))


def test_numpy_files_with_and_without_header(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint32) % V
    np.save(tmp_path / "a.npy", tokens)
    tokens.astype(np.uint16).tofile(tmp_path / "raw.npy")  # OLMo's raw memmap: uint16 for a small vocabulary
    assert open_token_file(str(tmp_path / "a.npy"), V).tokens.tolist() == tokens.tolist()
    raw = open_token_file(str(tmp_path / "raw.npy"), V)
    assert raw.tokens.dtype == np.uint16 and raw.tokens.tolist() == tokens.tolist() and raw.documents is None


BAD = {
    "truncated .bin": ("truncated", lambda p: _cut(p / "d.bin", 2)),
    "truncated .idx": ("truncated", lambda p: _cut(p / "d.idx", 8)),
    "longer .bin": ("longer than its index", lambda p: _append(p / "d.bin", b"\x00\x00")),
    "no header": ("no MMIDIDX header", lambda p: _overwrite(p / "d.idx", 0, b"XXXX")),
    "pointers disagree": ("pointers disagree", lambda p: _overwrite(p / "d.idx", 34 + 4 * 50 + 8, b"\x07")),
    "stale stats": ("the file changed", lambda p: _replace_bin_same_index(p)),
    "id past vocabulary": (f"token id {V + 5}, outside", lambda p: _stats_of(p / "d.bin", 0, V + 5)),
    "negative id": ("token id -3, outside", lambda p: _stats_of(p / "d.bin", -3, V - 1)),
}


def _stats_of(path: Path, min_id: int, max_id: int) -> None:
    """A sidecar claiming [min_id, max_id] (wider than the file's ids: consistent with what it holds)."""
    write_stats(str(path), min_id=min_id, max_id=max_id, tokens=path.stat().st_size // 2)


def _cut(path: Path, n: int) -> None:
    path.write_bytes(path.read_bytes()[:-n])


def _append(path: Path, data: bytes) -> None:
    path.write_bytes(path.read_bytes() + data)


def _overwrite(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


def _replace_bin_same_index(p: Path) -> None:
    """The pair re-written (one more token in the last document) after its stats were."""
    docs = random_docs(50)
    docs[-1].append(0)
    write_megatron(p / "d", docs, stats=False)


@pytest.mark.parametrize("case", list(BAD))
def test_every_bad_megatron_file_is_one_error_naming_it(tmp_path: Path, case: str) -> None:
    write_megatron(tmp_path / "d", random_docs(50))
    needle, damage = BAD[case]
    damage(tmp_path)
    with pytest.raises(DataError, match=needle) as e:
        open_token_file(str(tmp_path / "d.bin"), V)
    assert str(tmp_path / "d.") in str(e.value) and "\n" not in str(e.value)


def test_a_dtype_that_cannot_hold_the_vocabulary_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "u8.npy", np.arange(100, dtype=np.uint8))
    np.save(tmp_path / "f.npy", np.arange(100, dtype=np.float32))
    with pytest.raises(DataError, match=r"u8.npy: its dtype uint8 holds ids up to 255, but the tokenizer has 2256"):
        open_token_file(str(tmp_path / "u8.npy"), V)
    with pytest.raises(DataError, match=r"f.npy: float32 values"):
        open_token_file(str(tmp_path / "f.npy"), V)
    (tmp_path / "odd.npy").write_bytes(b"\x00" * 7)  # raw, 3.5 uint16 tokens
    with pytest.raises(DataError, match="odd.npy: truncated: 7 bytes"):
        open_token_file(str(tmp_path / "odd.npy"), V)


def test_without_stats_a_bad_id_is_named_when_its_window_is_read(tmp_path: Path) -> None:
    tokens = np.arange(4000, dtype=np.uint16) % 100
    tokens[3000] = V + 1
    np.save(tmp_path / "t.npy", tokens)
    dl = token_loader(tmp_path / "t.npy", batch=4)
    with pytest.raises(DataError, match=rf"t.npy: token 3,000 is id {V + 1}, outside the tokenizer's vocabulary"):
        for _ in range(40):
            next(dl)


def mix_loader(folder: Path, rank: int, world: int, batch: int) -> TokenFileLoader:
    mix = [DatasetSource(str(folder / "d"), 0.7), DatasetSource(str(folder / "e.npy"), 0.3)]
    cfg = Training(seq_len=32, local_batch_size=batch, dataset_mix=mix, seed=1, steps=10)
    return build_token_loader(cfg, V, rank, world, global_batch=batch * world)


def test_global_batch_is_the_same_for_every_layout_and_resumes_by_sample_number(tmp_path: Path) -> None:
    """A 2-source mix (a Megatron pair and a .npy file): step N's global batch is the same in every DP layout."""
    write_megatron(tmp_path / "d", random_docs(300))
    np.save(tmp_path / "e.npy", np.concatenate([np.array(d, np.uint16) for d in random_docs(100, seed=1)]))
    batches: dict[int, list[torch.Tensor]] = {}
    for world, batch in [(1, 8), (2, 4), (4, 2), (8, 1)]:
        loaders = [mix_loader(tmp_path, r, world, batch) for r in range(world)]
        batches[world] = [torch.cat([next(dl)[0] for dl in loaders]) for _ in range(4)]
        assert all(dl.state_dict() == {"sequences": 32} for dl in loaders)
    for world in (2, 4, 8):
        assert all(torch.equal(a, b) for a, b in zip(batches[1], batches[world], strict=True)), world
    resumed = [mix_loader(tmp_path, r, 2, 4) for r in range(2)]
    for dl in resumed:
        dl.load_state_dict({"sequences": 16})  # saved on 1 rank after 2 steps of 8
    assert torch.equal(torch.cat([next(dl)[0] for dl in resumed]), batches[1][2])


def test_windows_are_the_text_paths_windows_shuffled(tmp_path: Path) -> None:
    """The tokenize command's file of a JSONL file, cut into seq_len+1 windows, holds exactly the windows the text
    path packs from the JSONL itself (same BOS/EOS convention), in a seeded order."""
    text = tmp_path / "t.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"doc {i} " + "w " * (5 + i % 17)}) for i in range(200)) + "\n")
    assert load_script("tokenize_data").main([str(text), str(tmp_path / "t"), "--workers", "2"]) == 0
    text_windows = []
    dl = loader(text, batch=1, seq_len=16)
    for _ in range(10_000):
        inputs, labels = next(dl)
        if dl.state_dict()["epoch"] > 0:
            break
        text_windows.append(tuple(inputs[0].tolist() + labels[0, -1:].tolist()))
    dl.close()
    tl = token_loader(tmp_path / "t", batch=1, seq_len=16)
    token_windows = []
    for _ in range(len(text_windows)):
        inputs, labels = next(tl)
        token_windows.append(tuple(inputs[0].tolist() + labels[0, -1:].tolist()))
    assert sorted(token_windows) == sorted(text_windows) and token_windows != text_windows


def _tf(n_tokens: int, name: str = "f") -> TokenFile:
    return TokenFile(name, np.zeros(n_tokens, np.uint16), None, 0)


def test_mix_shares_hold_to_two_samples_at_every_prefix_and_locate_agrees_with_counts() -> None:
    sources = [Source("a", [_tf(6500)], 65, 0.5), Source("b", [_tf(3000)], 65, 0.3), Source("c", [_tf(9000)], 65, 0.2)]
    mix = Mixture(sources, seed=3)
    seen = np.zeros(3, dtype=np.int64)
    for g in range(2 * BLOCK + 300):
        k, j = mix.locate(g)
        assert j == seen[k]  # each source's samples in order: j is its count so far
        seen[k] += 1
        assert np.abs(seen - (g + 1) * mix.weights).max() <= 2
    assert mix.counts(2 * BLOCK + 300).tolist() == seen.tolist()
    assert Mixture(sources, seed=4).locate(17) != mix.locate(17) or Mixture(sources, seed=4).locate(18) != mix.locate(
        18
    )


def test_a_source_past_its_max_epochs_is_refused_with_the_realised_mix() -> None:
    sources = [Source("web", [_tf(65 * 100)], 65, 0.5), Source("code", [_tf(65 * 10)], 65, 0.5, max_epochs=2)]
    mix = Mixture(sources, seed=0)
    mix.check_epochs(40, "training.dataset_mix")  # 20 samples of 10 windows: 2 epochs
    with pytest.raises(DataError, match=r"source code would be read 2\.10 times .* above its max_epochs = 2"):
        mix.check_epochs(42, "training.dataset_mix")
    table = mix.format_table(40)
    assert "code" in table and "2.00 (max 2)" in table


def test_each_epoch_reads_every_window_once(tmp_path: Path) -> None:
    write_megatron(tmp_path / "d", random_docs(40))
    mix = open_mixture([(str(tmp_path / "d"), 1.0, None)], 31, V, seed=5)
    n = mix.sources[0].n_windows
    starts = [mix.sample(g)[1] for g in range(2 * n)]
    assert sorted(starts[:n]) == sorted(starts[n:]) == [32 * w for w in range(n)] and starts[:n] != starts[n:]


def test_mix_config_from_toml_and_the_command_line(tmp_path: Path) -> None:
    for name in ("web", "code"):
        write_megatron(tmp_path / name, random_docs(10))
    toml = tmp_path / "c.toml"
    toml.write_text(
        f'[[training.dataset_mix]]\npath = "{tmp_path / "web"}"\nweight = 0.7\n'
        f'[[training.dataset_mix]]\npath = "{tmp_path / "code"}"\nweight = 0.3\nmax_epochs = 2\n'
    )
    cfg = parse_args(["--job.config_file", str(toml)])
    assert cfg.training.dataset_mix == [
        DatasetSource(str(tmp_path / "web"), 0.7),
        DatasetSource(str(tmp_path / "code"), 0.3, 2.0),
    ]
    cli = parse_args(["--training.dataset_mix", f"{tmp_path / 'web'}:0.7,{tmp_path / 'code'}:0.3:2"])
    assert cli.training.dataset_mix == cfg.training.dataset_mix
    toml.write_text(f'[[training.dataset_mix]]\npath = "{tmp_path / "web"}"\nwieght = 0.7\n')
    with pytest.raises(ConfigError, match="unknown key 'wieght'; did you mean 'weight'"):
        parse_args(["--job.config_file", str(toml)])
    # A source's ranges hold whichever way it comes: the same line from the file (named) and the command line.
    bad = (("-1", "1", "weight", "-1.0"), ("nan", "1", "weight", "nan"), ("1", "-1", "max_epochs", "-1.0"))
    for weight, epochs, key, got in bad:
        line = f"training.dataset_mix.{key} must be a finite number > 0, got {got}"
        source = f'path = "{tmp_path / "web"}"\nweight = {weight}\nmax_epochs = {epochs}\n'
        toml.write_text(f"[[training.dataset_mix]]\n{source}")
        with pytest.raises(ConfigError, match=re.escape(f"{toml}: {line}")):
            parse_args(["--job.config_file", str(toml)])
        with pytest.raises(ConfigError, match=re.escape(f"--{line}")):
            parse_args(["--training.dataset_mix", f"{tmp_path / 'web'}:{weight}:{epochs}"])
    with pytest.raises(ConfigError, match="expected PATH:WEIGHT or PATH:WEIGHT:MAX_EPOCHS"):
        parse_args(["--training.dataset_mix", f"{tmp_path / 'web'}"])


def test_fingerprint_names_what_changed_unless_the_change_is_allowed(tmp_path: Path) -> None:
    for name in ("web", "code"):
        write_megatron(tmp_path / name, random_docs(10))
    mix = [DatasetSource(str(tmp_path / "web"), 0.7), DatasetSource(str(tmp_path / "code"), 0.3)]
    others = {k: 0 for k in (*REFUSED, *SCHEDULE, *OPTIMIZER, *WARNED)}
    others["model"] = {}

    def settings(mix: list[DatasetSource], seed: int = 1) -> dict:
        return {**others, "data": token_fingerprint(Training(dataset_mix=mix, seed=seed))}

    saved = settings(mix)
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in ("web.bin", "web.idx", "code.bin", "code.idx"):
        shutil.copy(tmp_path / f, moved / f)
    same = [DatasetSource(str(moved / "web"), 0.7), DatasetSource(str(moved / "code"), 0.3)]
    assert check_resume(saved, settings(same), "ckpt") == []
    reweighted = [DatasetSource(str(tmp_path / "web"), 0.6), DatasetSource(str(tmp_path / "code"), 0.4)]
    current = settings(reweighted)
    with pytest.raises(CheckpointError, match=r"other data \(token_sources: code: weight: 0.3 there, 0.4 in this run"):
        check_resume(saved, current, "ckpt")
    (line,) = check_resume(saved, current, "ckpt", allow_data_change=True)
    assert "continues from the checkpoint's sample number" in line
    with pytest.raises(CheckpointError, match=r"other data \(seed: 1 there, 2 in this run"):
        check_resume(saved, settings(mix, seed=2), "ckpt")


def test_tokenize_gives_the_same_file_with_any_workers_and_names_a_bad_record(tmp_path: Path, capsys) -> None:
    tokenize = load_script("tokenize_data")
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.jsonl").write_text("\n".join(json.dumps({"text": f"file {i} doc {j}"}) for j in range(20)))
    assert tokenize.main([str(folder), str(tmp_path / "a"), "--workers", "2"]) == 0
    assert tokenize.main([str(folder), str(tmp_path / "b")]) == 0
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()
    assert not (tmp_path / "b.shards").exists()
    assert open_token_file(str(tmp_path / "a.bin"), V).documents == 60
    (folder / "1.jsonl").write_text('{"text": "ok"}\n\n{"txt": "oops"}\n')
    capsys.readouterr()
    assert tokenize.main([str(folder), str(tmp_path / "c"), "--workers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"kiln: error: {folder / '1.jsonl'}, record 2 (line 3): no 'text' field (has: txt); every record needs a "
        "string 'text' field"
    )


def test_tokenize_skips_the_shards_an_interrupted_run_finished(tmp_path: Path, capsys) -> None:
    tokenize = load_script("tokenize_data")
    text = tmp_path / "t.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"doc {j} " + "x " * 50}) for j in range(400)) + "\n")
    args = [str(text), str(tmp_path / "o"), "--shard-mb", "0.01"]
    assert tokenize.main(args) == 0
    whole = (tmp_path / "o.bin").read_bytes()
    capsys.readouterr()
    # Re-create the state after an interruption: the plan and the first shard done, a bad shard 2 that a re-run
    # must not read (it would fail) if it were redone.
    work = tmp_path / "o.shards"
    tokenize.open_scratch(str(work))  # the folder as the script makes it, with its marker
    shards = tokenize.plan_shards(str(text), int(0.01 * 2**20), "train")
    tokenize._init_worker(tokenize.os.path.join(tokenize.ROOT, "assets", "tokenizer", "tokenizer.model"))
    tokenize.tokenize_shard((0, shards[0], str(work), "text", "train"))
    from dataclasses import asdict

    with open(tokenize.os.path.join(tokenize.ROOT, "assets", "tokenizer", "tokenizer.model"), "rb") as f:
        sha = tokenize.hashlib.sha256(f.read()).hexdigest()
    (work / "plan.json").write_text(
        json.dumps({"shards": [asdict(s) for s in shards], "tokenizer_sha256": sha, "text_key": "text"})
    )
    assert tokenize.main(args) == 0
    assert f"{len(shards)} shards, 1 already done" in capsys.readouterr().err
    assert (tmp_path / "o.bin").read_bytes() == whole


def test_loader_state_is_one_integer_and_validation_ends_with_the_set(tmp_path: Path) -> None:
    write_megatron(tmp_path / "d", random_docs(20))
    mix = open_mixture([(str(tmp_path / "d"), 1.0, None)], 31, V, seed=0, shuffle=False)
    n = mix.sources[0].n_windows
    dl = TokenFileLoader(mix, 2, V, dp_rank=1, dp_degree=2, samples=n)
    rounds = sum(1 for _ in dl)
    assert rounds == n // 4 and dl.state_dict() == {"sequences": 4 * rounds}


def test_validation_from_token_files_reads_the_text_paths_batches_in_order(tmp_path: Path) -> None:
    """Validation windows are not shuffled: the tokenized validation split gives the text path's batches, in order."""
    from kiln_base.config import Validation
    from tests.helpers.megatron_data import ROOT
    from trainer.data.text import build_validation_loader
    from trainer.data.tokens import build_token_validation_loader

    text = ROOT / "assets" / "corpus" / "kiln_corpus_validation.jsonl"
    assert load_script("tokenize_data").main([str(text), str(tmp_path / "val")]) == 0
    t = Training(seq_len=64, local_batch_size=2)
    for rank in (0, 1):
        by_text = build_validation_loader(Validation(enable=True, dataset_path=str(text)), t, TOKENIZER, rank, 2)
        by_tokens = build_token_validation_loader(Validation(enable=True, dataset_path=str(tmp_path / "val")), t, V,
                                                  rank, 2)  # fmt: skip
        pairs = list(zip(by_text, by_tokens, strict=True))  # both end with the set, after the same batches
        by_text.close()
        assert len(pairs) > 100 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in pairs)


def test_tokenize_reads_parquet_and_a_saved_hugging_face_dataset(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"record {i} " + "word " * (i % 13) for i in range(50)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    pq.write_table(pa.table({"text": texts, "id": list(range(50))}), tmp_path / "t.parquet")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    tokenize = load_script("tokenize_data")
    for name in ("t.jsonl", "t.parquet", "hf"):
        assert tokenize.main([str(tmp_path / name), str(tmp_path / f"out_{name}")]) == 0
    expected = sum((TOKENIZER.encode(t, bos=True, eos=True) for t in texts), [])
    for name in ("t.jsonl", "t.parquet", "hf"):
        assert open_token_file(str(tmp_path / f"out_{name}.bin"), V).tokens.tolist() == expected, name


# ------------------------------------------------------------------- scripts/tokenize_data.py as users run it

TOKENIZE = ROOT / "scripts" / "tokenize_data.py"


def _tokenize(*args: str | Path, cwd: Path) -> KilnResult:
    return run_kiln([str(a) for a in args], launcher="python", script=TOKENIZE, cwd=cwd, timeout=300)


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (its bytes, None for a folder): a snapshot to compare after a run."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


PLACES = {
    "scratch folder is the input": (("data/web.shards", "data/web"), "data/web.shards, the scratch folder of "
        "OUTPUT_PREFIX data/web, is the input data/web.shards; choose another OUTPUT_PREFIX"),
    "scratch folder holds the input": (("data/web.shards/0.jsonl", "data/web"), "data/web.shards, the scratch "
        "folder of OUTPUT_PREFIX data/web, holds the input data/web.shards/0.jsonl; choose another OUTPUT_PREFIX"),
    "a folder of the scratch name": (("data/web.shards", "mine"), "mine.shards: exists but is not a scratch folder "
        "tokenize_data.py made (no kiln-tokenize-scratch.json in it); move it away or choose another OUTPUT_PREFIX"),
    "output inside the input": (("data", "data/new/web"), "data/new/web: the output is inside the input folder "
        "data, where a re-run would read it as input; write it outside that folder"),
    "output under a file": (("data/web.shards", "somefile.txt/web"), "somefile.txt/web: {tmp}/somefile.txt is a "
        "file, not a folder; OUTPUT_PREFIX must name a file in a folder"),
    "workers 0": (("data/web.shards", "out", "--workers", "0"), "--workers must be 1 to 256, got 0"),
    "workers 10**6": (("data/web.shards", "out", "--workers", "1000000"), "--workers must be 1 to 256, got 1000000"),
}  # fmt: skip


@pytest.mark.parametrize("case", PLACES)
def test_tokenize_refuses_a_scratch_folder_or_output_that_is_not_its_own_and_touches_nothing(
    case: str, tmp_path: Path
) -> None:
    """The scratch folder OUTPUT_PREFIX.shards is the script's only if it holds the marker the script wrote: raw
    shards at data/web.shards given as input with output data/web (once deleted at the end), a folder of that name
    holding a user's file, a scratch folder holding the input, an output inside the input folder (a re-run read it
    as input), an output under a file, nonsense --workers: each one line, exit 2, and every file as it was."""
    shards = tmp_path / "data" / "web.shards"
    shards.mkdir(parents=True)
    for i in range(2):
        (shards / f"{i}.jsonl").write_text("".join(json.dumps({"text": f"shard {i} doc {j}"}) + "\n" for j in range(5)))
    (tmp_path / "mine.shards").mkdir()
    (tmp_path / "mine.shards" / "notes.txt").write_text("keep me")
    (tmp_path / "somefile.txt").write_text("a file")
    before = _tree(tmp_path)
    args, line = PLACES[case]
    assert assert_one_line_error(_tokenize(*args, cwd=tmp_path)) == f"kiln: error: {line.format(tmp=tmp_path)}"
    assert _tree(tmp_path) == before


def test_tokenize_starts_no_more_workers_than_shards(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": f"doc {j}"}) + "\n" for j in range(5)))
    result = _tokenize("t.jsonl", "t", "--workers", "8", cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "1 shards, 0 already done; 1 worker(s)" in result.stderr
    assert result.stdout.splitlines()[-1].endswith(", 1 worker(s))")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.bin.kiln.json", "t.idx", "t.jsonl"]


def test_tokenize_ends_when_a_worker_dies_and_a_rerun_resumes(tmp_path: Path) -> None:
    """A worker killed mid-shard (SIGKILL: the OOM killer) ends the run with one line and exit 1 (a Pool waited for
    its shard for ever); the re-run keeps the finished shard, and at its end deletes only the files it wrote."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"text": "a small first shard"}) + "\n")
    (src / "b.jsonl").write_text(
        (json.dumps({"text": "the quick brown fox jumps over the lazy dog " * 20}) + "\n") * 800
    )
    before = _tree(src)
    work = tmp_path / "out.shards"
    with KilnRun(start_kiln(["in", "out", "--workers", "1"], launcher="python", script=TOKENIZE, cwd=tmp_path)) as run:
        deadline = time.monotonic() + 120
        while not (work / "000000.idx").exists():  # shard 0 done: the worker is on the big shard 1
            assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr
            time.sleep(0.005)
        (worker,) = [p for p in children(run.proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        os.kill(worker, signal.SIGKILL)
        assert run.finish(timeout=120) == 1, run.stderr
    err = "".join(run.stderr)
    died = "kiln: error: a tokenizing worker process died (killed, or out of memory?); the finished shards are kept"
    assert err.splitlines()[-1] == f"{died} in out.shards: re-run the same command to go on", err
    assert "Traceback" not in err
    (work / "notes.txt").write_text("not the script's")
    rerun = _tokenize("in", "out", cwd=tmp_path)
    assert rerun.returncode == 0, rerun.output
    assert "2 shards, 1 already done" in rerun.stderr and "left out.shards: it holds files" in rerun.stderr
    assert rerun.stdout.splitlines()[-1].startswith("wrote out.bin/.idx: 801 documents")
    assert open_token_file(str(tmp_path / "out.bin"), V).documents == 801
    assert _tree(work) == {"notes.txt": b"not the script's"} and _tree(src) == before
