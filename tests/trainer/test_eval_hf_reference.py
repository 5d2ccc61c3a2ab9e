"""The outside reference for downstream evaluation: kiln's in-loop scores equal lm-eval's own Hugging Face backend.

A tiny fp32 run (2 layers, seq 128) trains 6 steps, saves its checkpoint at step 6 and evaluates the bundled
kiln_cloze there (its first 24 documents, 96 requests, some longer than 128 tokens: left-truncated). The checkpoint
goes to an HF folder through scripts/convert_hf.py (float32); lm-eval's HFLM (transformers' LlamaForCausalLM on the
CPU, float32, max_length 128 = kiln's training.seq_len, so both truncate alike) scores the same task file with
lm-eval's evaluator. Equal: acc and acc_norm exactly; every request's log-likelihood within 1e-4 absolute (fp32
noise: kiln and transformers differ in RoPE's arithmetic and summation order; measured ~1e-5 on sums of ~-300).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kiln_base.config import Eval
from tests.helpers.common import ROOT, open_trainer, tiny_run_args
from tests.helpers.scripts import load_script
from trainer.evaluation.downstream import load_tasks

pytestmark = pytest.mark.slow

EXAMPLES, SEQ, STEPS = 24, 128, 6
LL_TOLERANCE = 1e-4


def _lls_by_doc(samples: list[dict[str, Any]]) -> dict[int, list[float]]:
    """doc_id -> the log-likelihood of each choice, from lm-eval's logged samples."""
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("eval_hf")
    argv = tiny_run_args(
        *("--job.dump_folder", str(root / "run"), "--training.steps", str(STEPS), "--model.n_layers", "2"),
        *("--training.seq_len", str(SEQ), "--training.seed", "0", "--optimizer.lr", "3e-3"),
        *("--checkpoint.enable_checkpoint", "--checkpoint.interval", str(STEPS)),
        *("--eval.enable", "--eval.freq", "100", "--eval.limit", str(EXAMPLES), "--eval.batch_size", "8"),
    )
    with open_trainer(argv) as trainer:
        trainer.train()
        kiln = trainer.downstream.results[STEPS].scores["kiln_cloze"]
        trainer.downstream.run(STEPS, log_samples=True)  # the same weights again, keeping lm-eval's samples
        kiln_again = trainer.downstream.results[STEPS].scores["kiln_cloze"]
        kiln_samples = trainer.downstream.samples["kiln_cloze"]
    hf_dir = root / "hf"
    conv = load_script("convert_hf")
    assert conv.main(["to_hf", str(root / "run" / "checkpoint"), str(hf_dir), "--dtype", "float32"]) == 0

    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # a local folder: nothing to fetch
    try:
        hf = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=8, max_length=SEQ)
        tasks = load_tasks(Eval(enable=True, include_path=[str(ROOT / "assets" / "eval")]))
        out = evaluate(lm=hf, task_dict={"tasks": tasks, "groups": {}}, limit=EXAMPLES, bootstrap_iters=0)
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before
    assert out is not None
    hf_scores = {m: float(out["results"]["kiln_cloze"][f"{m},none"]) for m in ("acc", "acc_norm")}
    return {
        "kiln": kiln,
        "kiln_again": kiln_again,
        "hf": hf_scores,
        "kiln_lls": _lls_by_doc(kiln_samples),
        "hf_lls": _lls_by_doc(out["samples"]["kiln_cloze"]),
    }


def test_same_accuracy_as_lm_evals_hf_backend(scored: dict[str, Any]) -> None:
    kiln, hf = scored["kiln"], scored["hf"]
    print(f"kiln in the loop: {kiln}; lm-eval HFLM on the export: {hf}")
    assert scored["kiln_again"] == kiln  # the logged-samples run is the in-loop one
    assert (kiln["acc"], kiln["acc_norm"]) == (hf["acc"], hf["acc_norm"])
    assert kiln["examples"] == EXAMPLES


def test_same_log_likelihoods_as_lm_evals_hf_backend(scored: dict[str, Any]) -> None:
    ours, theirs = scored["kiln_lls"], scored["hf_lls"]
    assert sorted(ours) == sorted(theirs) == list(range(EXAMPLES))
    worst = max(abs(a - b) for d in ours for a, b in zip(ours[d], theirs[d], strict=True))
    print(f"largest |log-likelihood difference| over {4 * EXAMPLES} requests: {worst:.3g}")
    assert worst < LL_TOLERANCE
    spread = [x for d in ours for x in ours[d]]
    assert max(spread) - min(spread) > 10  # real, varied log-likelihoods (the model is not uniform)
