"""Downstream evaluation in every layout: the same weights give the same accuracy counts (fp32) and the same
per-request log-likelihoods (within fp32 noise) on 1 rank, FSDP 2, data-parallel replicate 2 (HSDP's replicate
dimension), TP 2, PP 2 and CP 2; every rank of a layout holds the same result, and the logging rank prints it.

As in test_validation_layouts.py, every run starts from one set of weights: a one-process run saves a checkpoint,
each layout loads it through `checkpoint.initial_load_path`, trains one step at lr 1e-12 and evaluates after it, at
step 1, on the bundled kiln_cloze (its first 16 documents: 64 requests, batches of 4 sequences of up to 64 tokens,
the longer requests left-truncated as lm-eval's HF backend does).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.helpers.common import DEBUG_CONFIG, LogLines, run_trainer
from tests.helpers.distributed import run_distributed, train_in_group

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

P = "--parallelism."
EXAMPLES = 16
COMMON = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "64"),
    *("--training.global_batch_size", "4", "--training.seed", "0", "--training.mixed_precision_param", "float32"),
    *("--metrics.log_freq", "1", "--activation_checkpoint.mode", "none", "--lr_scheduler.warmup_steps", "0"),
)
EVAL = ("--eval.enable", "--eval.limit", str(EXAMPLES), "--eval.batch_size", "4", "--training.steps", "1")
LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {  # name -> (world size, arguments); global batch 4 in each
    "1rank": (1, ("--training.local_batch_size", "4")),
    "fsdp2": (2, (f"{P}data_parallel_shard_degree", "2", "--training.local_batch_size", "2")),
    "replicate2": (2, (f"{P}data_parallel_replicate_degree", "2", f"{P}data_parallel_shard_degree", "1",
                       "--training.local_batch_size", "2")),
    "tp2": (2, (f"{P}data_parallel_shard_degree", "1", f"{P}tensor_parallel_degree", "2",
                "--training.local_batch_size", "4")),
    "pp2": (2, (f"{P}data_parallel_shard_degree", "1", f"{P}pipeline_parallel_degree", "2",
                "--training.local_batch_size", "4")),
    "cp2": (2, (f"{P}data_parallel_shard_degree", "1", f"{P}context_parallel_degree", "2",
                "--training.local_batch_size", "4")),
}  # fmt: skip


def _run_layouts(layouts: list[str], weights: str, folder: str) -> dict[str, dict[str, Any]]:
    """On each rank of one group: evaluate from `weights` in each layout; this rank's view."""
    logger = logging.getLogger("kiln")
    logger.setLevel(logging.INFO)
    lines = LogLines()
    logger.addHandler(lines)
    out = {}
    for i, layout in enumerate(layouts):
        lines.lines.clear()
        dump = f"{folder}/{layout}"
        source = ("--checkpoint.initial_load_path", weights, "--job.dump_folder", dump)
        argv = [*COMMON, *EVAL, *LAYOUTS[layout][1], *source]
        trainer = train_in_group(argv, f"{folder}/store_{i}")
        result = trainer.downstream.results[1]
        out[layout] = {
            "scores": result.scores["kiln_cloze"],
            "lls": trainer.downstream.log_likelihoods[1],
            "lines": [line for line in lines.lines if line.startswith("eval step:")],
        }
    logger.removeHandler(lines)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """layout -> every rank's view, rank 0 first."""
    root = tmp_path_factory.mktemp("eval_layouts")
    saver = [*COMMON, *LAYOUTS["1rank"][1], "--training.steps", "8", "--optimizer.lr", "3e-3"]
    run_trainer([*saver, "--checkpoint.enable_checkpoint", "--job.dump_folder", str(root / "saved")])
    weights = str(root / "saved" / "checkpoint" / "step-8")
    out: dict[str, list[dict[str, Any]]] = {}
    for world in (1, 2):
        group = [name for name, (size, _) in LAYOUTS.items() if size == world]
        ranks = run_distributed(_run_layouts, world, group, weights, str(tmp_path_factory.mktemp(f"world{world}")))
        for name in group:
            out[name] = [r[name] for r in ranks]
    return out


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "1rank"])
def test_same_weights_same_accuracy_in_every_layout(layout: str, results: dict[str, list[dict[str, Any]]]) -> None:
    one = results["1rank"][0]
    for rank_view in results[layout]:
        assert rank_view["scores"] == one["scores"], (layout, rank_view["scores"], one["scores"])  # counts: exact
        assert len(rank_view["lls"]) == len(one["lls"]) == 4 * EXAMPLES
        # fp32 sums in another order (TP's sharded matmuls, CP's split attention): ~1e-6 measured
        assert rank_view["lls"] == pytest.approx(one["lls"], abs=1e-4), layout


def test_the_model_has_learned_something_to_compare(results: dict[str, list[dict[str, Any]]]) -> None:
    lls = results["1rank"][0]["lls"]
    assert len({round(x, 3) for x in lls}) > 50  # distinct log-likelihoods, not a constant
    scores = results["1rank"][0]["scores"]
    assert 0 < scores["acc"] < 1 and 0 < scores["acc_norm"] < 1  # counts that a wrong score could change


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_logs_the_eval_line_from_the_logging_rank(
    layout: str, results: dict[str, list[dict[str, Any]]]
) -> None:
    views = results[layout]
    (line,) = views[0]["lines"]
    s = views[0]["scores"]
    assert line.startswith(f"eval step:  1  kiln_cloze: acc {s['acc']:.4f}  acc_norm {s['acc_norm']:.4f}"), line
    assert all(not v["lines"] for v in views[1:])  # LOG_RANK 0 only
