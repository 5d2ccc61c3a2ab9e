"""Training from token files through the paths users run: the same losses on 1 rank, FSDP 2, TP 2 and PP 2 from a
Megatron dataset written by Megatron-LM's own builder (fp32, deterministic, within 1e-5; FSDP 2 and TP 2 as a
chain of resumes: 1 rank to step 2, FSDP 2 to step 4, TP 2 to step 6, which is the 1-rank curve); a 3-source
mix's logged shares hold its weights within 1%; every bad token file is one line naming it, before any step
(exit 2, run_train.sh)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.common import tiny_run_args
from tests.helpers.data import TOKENIZER
from tests.helpers.kiln_process import assert_one_line_error, run_kiln
from tests.helpers.loss_runs import drive, save_initial_weights, with_init
from tests.helpers.megatron_data import corpus_documents, megatron_write
from tests.helpers.run_files import tensorboard_scalars
from tests.helpers.scripts import load_script
from trainer.data.token_files import write_index, write_stats

P = "--parallelism."
ONE_DP = (f"{P}data_parallel_shard_degree", "1", "--training.local_batch_size", "4")
TP2 = (*ONE_DP, f"{P}tensor_parallel_degree", "2")
PP2 = (*ONE_DP, f"{P}pipeline_parallel_degree", "2")


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def token_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """init/step-0 (the weights every run starts from) and megatron.bin/.idx: the first 2,000 documents of the bundled
    corpus written by megatron.core's IndexedDatasetBuilder (int32 tokens, no kiln stats sidecar)."""
    root = tmp_path_factory.mktemp("token_runs")
    save_initial_weights(root)
    megatron_write(root / "megatron", corpus_documents(limit=2000))
    return root


@pytest.fixture(scope="module")
def one_rank(token_runs: Path) -> dict[str, Any]:
    data = ("--training.dataset_path", str(token_runs / "megatron"), "--checkpoint.interval", "2")
    return drive(with_init(token_runs / "init", token_runs / "one"), *data)


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_follows_the_one_rank_curve_from_megatron_files(token_runs: Path, one_rank: dict) -> None:
    data = ("--training.dataset_path", str(token_runs / "megatron"), "--checkpoint.interval", "100")
    run = drive(with_init(token_runs / "init", token_runs / "pp2"), *data, *PP2, nproc=2)
    print("1 rank:", one_rank["losses"], "\npp2:", run["losses"])
    assert run["first_step"] == 1 and len(run["losses"]) == 6
    assert max_rel_diff(one_rank["losses"], run["losses"]) < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_saved_on_one_rank_resumes_on_fsdp2_then_tp2(token_runs: Path, one_rank: dict) -> None:
    """step-2 of the 1-rank run resumes on FSDP 2 (saving step 4), whose step-4 resumes on TP 2: each layout reads
    its share of the Megatron files and continues the 1-rank curve (the data position is one sample number, so
    neither reads what came before). FSDP 2 and TP 2 from step 1 read the same way; PP 2 runs from step 1 above."""
    data = ("--training.dataset_path", str(token_runs / "megatron"), "--checkpoint.interval", "2")
    fsdp = drive(with_init(token_runs / "init", token_runs / "r_fsdp", token_runs / "one" / "checkpoint" / "step-2"),
                 *data, nproc=2)  # fmt: skip
    tp = drive(with_init(token_runs / "init", token_runs / "r_tp", token_runs / "r_fsdp" / "checkpoint" / "step-4"),
               *data, *TP2, nproc=2)  # fmt: skip
    assert fsdp["first_step"] == 3 and tp["first_step"] == 5
    assert max_rel_diff(fsdp["losses"], one_rank["losses"][2:]) < 1e-5
    assert max_rel_diff(tp["losses"], one_rank["losses"][4:]) < 1e-5


@pytest.mark.slow
def test_a_three_source_mix_logs_its_weights_and_refuses_changed_data(tmp_path: Path) -> None:
    """web/code/math at 0.5/0.3/0.2 (tokenized by the tokenize command from three slices of the corpus): the table
    at start, then every log line's shares within 1% of the weights, the tokens per source in TensorBoard;
    resuming with other weights is one line, and with training.allow_data_change it goes on from the saved
    sample number."""
    corpus = [json.dumps({"text": TOKENIZER.decode(d[1:-1])}) for d in corpus_documents(limit=1500)]
    for name, part in (("web", corpus[:700]), ("code", corpus[700:1100]), ("math", corpus[1100:])):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(part) + "\n")
        assert load_script("tokenize_data").main([str(tmp_path / f"{name}.jsonl"), str(tmp_path / name)]) == 0
    mix = f"{tmp_path / 'web'}:0.5,{tmp_path / 'code'}:0.3,{tmp_path / 'math'}:0.2"
    args = tiny_run_args("--model.n_layers", "1", "--training.steps", "40", "--training.local_batch_size", "8",
                         "--metrics.log_freq", "10", "--job.dump_folder", str(tmp_path / "run"),
                         "--checkpoint.enable_checkpoint", "--checkpoint.interval", "20")  # fmt: skip
    proc = run_kiln([*args, "--training.dataset_mix", mix, "--metrics.enable_tensorboard"], ngpu=1, check=True)
    print(proc.stdout[-4000:])
    assert re.search(r"web\s+0\.500\s+0\.500\s+5,280\s+102,368\s+0\.05", proc.stdout)  # 160 x 33 tokens
    shares = re.findall(r"step:\s+(\d+) .* mix: web ([\d.]+)% code ([\d.]+)% math ([\d.]+)%", proc.stdout)
    assert [s[0] for s in shares] == ["1", "10", "20", "30", "40"]
    for step, *got in shares[1:]:
        assert all(abs(float(g) - w) < 1.0 for g, w in zip(got, (50, 30, 20), strict=True)), (step, got)
    tb = tensorboard_scalars(tmp_path / "run" / "tb" / "rank_0")  # tokens read per source, all ranks, as metrics
    assert [tb[40][f"kiln/data_tokens/{name}"] for name in ("web", "code", "math")] == [160 * 33, 96 * 33, 64 * 33]
    changed = f"{tmp_path / 'web'}:0.4,{tmp_path / 'code'}:0.4,{tmp_path / 'math'}:0.2"
    longer = ("--training.steps", "60")
    refused = run_kiln([*args, *longer, "--training.dataset_mix", changed], ngpu=1)
    assert_one_line_error(refused, "other data (token_sources: code: weight: 0.3 there, 0.4 in this run)",
                          "training.allow_data_change")  # fmt: skip
    allowed = run_kiln([*args, *longer, "--training.dataset_mix", changed, "--training.allow_data_change"], ngpu=1,
                       check=True)  # fmt: skip
    assert "training.allow_data_change: this run's data continues from the checkpoint's sample number" in (
        allowed.stdout + allowed.stderr
    )
    assert "step: 50" in allowed.stdout and "step: 10 " not in allowed.stdout  # resumed at step 40


def _pair(folder: Path, dtype: type = np.uint16, stats: bool = True) -> Path:
    docs = corpus_documents(limit=200)
    tokens = np.concatenate([np.array(d, dtype=dtype) for d in docs])
    tokens.tofile(folder / "d.bin")
    write_index(str(folder / "d.idx"), np.dtype(dtype), np.array([len(d) for d in docs]))
    if stats:
        write_stats(str(folder / "d.bin"), min_id=int(tokens.min()), max_id=int(tokens.max()), tokens=len(tokens))
    return folder / "d"


def _truncate(path: Path, n: int) -> None:
    path.write_bytes(path.read_bytes()[:-n])


BAD_FILES = {
    "truncated_bin": (lambda d: _truncate(_pair(d).with_suffix(".bin"), 2), "d.bin: truncated"),
    "truncated_idx": (lambda d: _truncate(_pair(d).with_suffix(".idx"), 8), "d.idx: truncated"),
    "index_disagrees": (
        lambda d: (_pair(d), write_index(str(d / "d.idx"), np.dtype(np.uint16), np.array([10, 20]))),
        "d.bin: longer than its index",
    ),
    "dtype_too_small": (lambda d: np.save(d / "d.npy", np.arange(300, dtype=np.uint8)), "its dtype uint8 holds ids"),
    "id_outside_vocabulary": (
        lambda d: write_stats(
            str(_pair(d, stats=False).with_suffix(".bin")),
            min_id=0,
            max_id=TOKENIZER.n_words + 7,
            tokens=(d / "d.bin").stat().st_size // 2,
        ),
        f"holds token id {TOKENIZER.n_words + 7}, outside the tokenizer's vocabulary",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_every_bad_token_file_is_one_line_before_any_step(tmp_path: Path, case: str) -> None:
    make, needle = BAD_FILES[case]
    make(tmp_path)
    path = tmp_path / ("d.npy" if case == "dtype_too_small" else "d")
    proc = run_kiln([*tiny_run_args("--training.steps", "1"), "--training.dataset_path", path], ngpu=1)
    line = assert_one_line_error(proc, needle, str(tmp_path))
    assert "step:" not in proc.stdout, line


@pytest.mark.slow  # starts a rank
def test_a_bad_id_in_a_file_without_stats_is_one_line_naming_it(tmp_path: Path) -> None:
    """A file made elsewhere has no stats sidecar: its ids are checked window by window as read (docs/data.md)."""
    bad = TOKENIZER.n_words + 3
    docs = [[bad] * 40 for _ in range(20)]
    megatron_write(tmp_path / "d", docs, np.int32)
    proc = run_kiln([*tiny_run_args("--training.steps", "1"), "--training.dataset_path", tmp_path / "d"], ngpu=1)
    assert_one_line_error(proc, f"{tmp_path / 'd.bin'}: token ", f"is id {bad}, outside the tokenizer's vocabulary")
