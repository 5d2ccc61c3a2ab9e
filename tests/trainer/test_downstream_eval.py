"""Downstream evaluation ([eval], trainer/evaluation/downstream.py) on one rank, through the Trainer: when it
runs, what it logs (the line, TensorBoard), that it leaves training alone, that each request's log-likelihood is the
model's (whatever the batch it was padded into), the bundled task (and scripts/make_eval_task.py's errors) and the
task checks.

The layouts: tests/e2e/test_eval_layouts.py; the outside reference (lm-eval's HF backend): test_eval_hf_reference.py;
errors through run_train.sh: tests/e2e/test_eval_run_train.py.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln_base.config import Eval
from kiln_base.errors import ConfigError
from tests.helpers.common import ROOT, kiln_log_lines, open_trainer, tiny_run_args
from tests.helpers.eval_tasks import cloze_variant
from tests.helpers.kiln_process import assert_one_line_error, run_kiln
from tests.helpers.run_files import tensorboard_scalars
from tests.helpers.scripts import load_script
from trainer.evaluation.downstream import IGNORE, load_tasks, padded_length, reported_metrics

TASK_DIR = ROOT / "assets" / "eval" / "kiln_cloze"
MAKE_EVAL_TASK = ROOT / "scripts" / "make_eval_task.py"
STEPS = 4
EVAL = ("--eval.enable", "--eval.freq", "3", "--eval.limit", "6", "--eval.batch_size", "8")


def _run(dump: Path, *extra: str) -> dict[str, Any]:
    argv = tiny_run_args(
        *("--job.dump_folder", str(dump), "--training.steps", str(STEPS), "--metrics.log_freq", "1"),
        *("--training.seed", "0", "--training.data_prefetch", "0", "--model.n_layers", "2"),
        *("--training.seq_len", "64", "--metrics.enable_tensorboard"),
        *extra,
    )
    with kiln_log_lines() as lines:
        with open_trainer(argv) as trainer:
            trainer.train()
            out: dict[str, Any] = {"losses": list(trainer.losses), "lines": list(lines.lines)}
            if trainer.downstream is not None:
                out["results"] = dict(trainer.downstream.results)
                out["check"] = _check_scoring(trainer)
    out["tb"] = tensorboard_scalars(dump / "tb" / "rank_0")
    return out


def _check_scoring(trainer: Any) -> dict[str, Any]:
    """Score a few requests of several lengths through KilnLM, in batches of 3 (padded, sorted), and each one alone
    through the model's plain forward: log_softmax over the whole vocabulary, the continuation's tokens gathered."""
    lm = trainer.downstream.lm
    tok = trainer.tokenizer
    texts = [
        ("A cat sat", " on the mat."),
        ("Once upon a time, there was", " a quiet child named Tom."),
        ("Eight minus six is two.", "\n8 - 6 = 2."),
        ("x", " y"),
        ("Hello there, Ana. How are", " you?"),
    ]
    requests = []
    for context, continuation in texts:
        whole = tok.encode(context + continuation, bos=True, eos=False)
        ctx = tok.encode(context, bos=True, eos=False)
        requests.append(((context, continuation), ctx, whole[len(ctx) :]))
    lm.batch_size = 3
    got = [ll for ll, _ in lm._loglikelihood_tokens(requests)]
    want = []
    with torch.no_grad():
        for _, ctx, cont in requests:
            tokens = torch.tensor([ctx + cont])
            logp = torch.log_softmax(trainer.model(tokens[:, :-1]).float(), dim=-1)[0]
            n = len(cont)
            want.append(float(logp[-n:].gather(1, tokens[0, -n:, None]).sum()))
    return {"got": got, "want": want, "lengths": [len(c) + len(d) for _, c, d in requests]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("downstream_eval")
    return {"off": _run(root / "off"), "on": _run(root / "on", *EVAL)}


def test_eval_runs_at_step_1_every_freq_and_the_last_step(runs: dict[str, dict[str, Any]]) -> None:
    results = runs["on"]["results"]
    assert sorted(results) == [1, 3, 4]
    for r in results.values():
        assert set(r.scores) == {"kiln_cloze"}
        s = r.scores["kiln_cloze"]
        assert s["examples"] == 6 and r.requests == 24  # 6 documents x 4 choices
        for metric in ("acc", "acc_norm"):
            assert s[metric] * 6 == pytest.approx(round(s[metric] * 6)), s  # a count of 6 examples


def test_eval_leaves_training_alone(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["on"]["losses"] == runs["off"]["losses"]  # bitwise: nothing drawn, no gradient, same data


def test_eval_goes_to_the_log_and_tensorboard(runs: dict[str, dict[str, Any]]) -> None:
    results, tb = runs["on"]["results"], runs["on"]["tb"]
    eval_lines = [line for line in runs["on"]["lines"] if line.startswith("eval step:")]
    assert len(eval_lines) == 3
    for line, (step, r) in zip(eval_lines, sorted(results.items()), strict=True):
        s = r.scores["kiln_cloze"]
        assert line.startswith(f"eval step: {step:2}  kiln_cloze: acc {s['acc']:.4f}  acc_norm {s['acc_norm']:.4f}")
        assert "(n=6)" in line and line.endswith("s")
        assert tb[step]["kiln/eval/kiln_cloze/acc"] == pytest.approx(s["acc"])
        assert tb[step]["kiln/eval/kiln_cloze/acc_norm"] == pytest.approx(s["acc_norm"])
        assert tb[step]["kiln/eval_seconds"] == pytest.approx(r.seconds)
    assert not any("kiln/eval" in k for step in runs["off"]["tb"].values() for k in step)


def test_each_request_scores_its_own_log_likelihood_in_any_batch(runs: dict[str, dict[str, Any]]) -> None:
    check = runs["on"]["check"]
    assert len(set(check["lengths"])) > 3  # batches of 3 padded rows of different lengths
    assert check["got"] == pytest.approx(check["want"], abs=1e-4), check  # fp32, padded vs alone


def test_padded_length_holds_the_batch_and_splits_over_the_layout() -> None:
    assert padded_length(40, 128, 1, "tight") == 40
    assert padded_length(41, 128, 1, "tight") == 48
    assert padded_length(41, 128, 4, "tight") == 48  # a multiple of tp x cp chunks (and of 8)
    assert padded_length(41, 128, 6, "tight") == 42
    assert padded_length(127, 128, 1, "tight") == 128
    assert padded_length(40, 128, 1, "divisors") == 64  # a pipeline: few shapes (stages per shape)
    assert padded_length(5, 96, 4, "divisors") == 8  # 96's divisors that are multiples of 4: 4, 8, 12, ...
    assert padded_length(3, 128, 1, "fixed") == 128  # compiled: one shape
    assert IGNORE == -100  # torch.nn.functional.cross_entropy's ignore_index


def test_the_bundled_task_is_what_the_script_makes(tmp_path: Path) -> None:
    make = load_script("make_eval_task")
    out = tmp_path / "kiln_cloze.jsonl"
    texts_path = ROOT / "assets" / "corpus" / "kiln_corpus_validation.jsonl"
    texts = [json.loads(line)["text"] for line in texts_path.read_text().splitlines() if line]
    items = make.make_items(texts, make.DEFAULT_SEED)
    out.write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items))
    assert out.read_bytes() == (TASK_DIR / "kiln_cloze.jsonl").read_bytes()
    for item in items:
        assert len(set(item["choices"])) == 4 and 0 <= item["label"] < 4
        answer = item["choices"][item["label"]]
        sep = answer[: len(answer) - len(answer.lstrip())]
        assert all(c.startswith(sep) for c in item["choices"])  # one separator: no choice stands out by it
        assert sep and texts[item["doc"]].startswith(item["context"] + answer)


BAD_CORPORA = {
    "too few distractors": ('{"text": "A. B. C."}\n{"text": "D. E."}\n', "record 1: 2 distinct candidate "
        "distractors (segments of the other documents, unlike its answer); 3 are needed: give a corpus with more "
        "documents"),
    "no text": ('{"text": "A. B. C."}\n\n{"txt": "D. E."}\n', "line 3: no 'text' field (has: txt); every record "
        "needs a string 'text' field"),
    "no item": ('{"text": "one sentence"}\n{"text": "another one"}\n', "no record of its 2 has two or more "
        "segments (sentences or lines): no item to make; give documents of several sentences"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_CORPORA)
def test_make_eval_task_refuses_too_few_distractors_and_a_record_without_text(case: str, tmp_path: Path) -> None:
    """Run as users run it: two documents give the first only two distinct distractors (its draws once looped for
    ever), a record without `text` was a KeyError traceback; each is one line naming the file, exit 2, no output."""
    corpus, line = BAD_CORPORA[case]
    (tmp_path / "c.jsonl").write_text(corpus)
    args = ["--corpus", "c.jsonl", "--output", "task/t.jsonl"]
    result = run_kiln(args, launcher="python", script=MAKE_EVAL_TASK, cwd=tmp_path, timeout=60)
    assert assert_one_line_error(result) == f"kiln: error: c.jsonl, {line}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_make_eval_task_draws_rare_distractors_from_the_list_of_them() -> None:
    """Distractors that random draws rarely hit (three segments among 60,000 copies of one) are drawn from the list
    of all candidates after MAX_DRAWS draws: every item still has four different choices, its answer among them."""
    make = load_script("make_eval_task")
    texts = ["X. Y.", "a. " * 30_000 + "b. c. d.", "a. " * 30_000 + "P. Q."]
    items = make.make_items(texts, seed=0)
    assert [i["doc"] for i in items] == [0, 1, 2]
    for item in items:
        assert len(set(item["choices"])) == 4 and 0 <= item["label"] < 4
    assert items[0]["choices"][items[0]["label"]] == " Y."


def test_the_bundled_task_loads_as_multiple_choice() -> None:
    tasks = load_tasks(Eval(enable=True, include_path=[str(TASK_DIR.parent)]))
    (task,) = tasks.values()
    assert task.OUTPUT_TYPE == "multiple_choice" and len(task.test_docs()) == 496


def _generate_task(folder: Path) -> Path:
    folder.mkdir()
    shutil.copy(TASK_DIR / "utils.py", folder / "utils.py")
    shutil.copy(TASK_DIR / "kiln_cloze.jsonl", folder / "kiln_cloze.jsonl")
    path = folder / "gen.yaml"
    path.write_text(
        "task: kiln_gen\ncustom_dataset: !function utils.load\ntest_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{label}}"\n'
    )
    return path


def test_a_task_that_is_not_multiple_choice_is_refused(tmp_path: Path) -> None:
    path = _generate_task(tmp_path / "gen")
    with pytest.raises(ConfigError, match=r"eval.tasks: task 'kiln_gen' is generate_until; kiln scores "):
        load_tasks(Eval(enable=True, tasks=[str(path)], include_path=[]))


def test_a_task_whose_data_does_not_load_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(
        "task: broken\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: /nonexistent/data.jsonl\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\n'
        "doc_to_target: 0\n"
    )
    with pytest.raises(ConfigError, match=r"eval.tasks: task '.*broken.yaml' does not load \("):
        load_tasks(Eval(enable=True, tasks=[str(path)], include_path=[]))


def test_a_document_without_choices_is_one_line_naming_the_task_and_document(tmp_path: Path) -> None:
    folder = cloze_variant(tmp_path / "t", empty_choices_at=3)
    with pytest.raises(ConfigError) as e:
        load_tasks(Eval(enable=True, tasks=["kiln_variant"], include_path=[str(folder)], limit=8))
    assert str(e.value).startswith(
        "eval.tasks: task 'kiln_variant' document 3 cannot be scored (no choices (doc_to_choice gave []))"
    ), e.value
    load_tasks(Eval(enable=True, tasks=["kiln_variant"], include_path=[str(folder)], limit=3))  # documents 0-2


def test_the_metrics_are_those_lm_eval_reports() -> None:
    """lm-eval's results of one task: whatever metrics its metric_list asks for, no stderr, no alias."""
    mmlu = {"alias": "mmlu_x", "acc,none": 0.25, "acc_stderr,none": "N/A"}
    assert reported_metrics(mmlu) == {"acc": 0.25}
    both = {"acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.75, "mcc,none": 0.0, "acc,strict": 1}
    assert reported_metrics(both) == {"acc": 0.5, "acc_norm": 0.75, "mcc": 0.0, "acc,strict": 1.0}


def test_eval_time_is_left_out_of_tokens_per_second() -> None:
    """The hook hands the evaluation's seconds to MetricsLogger.discount (the next line's tps and mfu leave them
    out, as validation's do), on step 1, every freq steps and the last step only."""
    from trainer.evaluation.downstream import EvalResult
    from trainer.hooks import DownstreamEvalHook, StepOutput

    class Slow:
        def run(self, step: int) -> EvalResult:
            time.sleep(0.2)
            return EvalResult({"t": {"acc": 0.5, "acc_norm": 0.25, "examples": 4}}, 0.2, 16, 100)

    class Metrics:
        is_logging_rank, writer = True, None
        discounted: list[float] = []

        def discount(self, seconds: float) -> None:
            self.discounted.append(seconds)

    metrics = Metrics()
    hook = DownstreamEvalHook(Slow(), 5, metrics)  # type: ignore[arg-type]
    for step in (1, 2, 5, 6, 7):
        hook.post_step(StepOutput(step, step == 7, torch.zeros(()), torch.zeros(()), 0.0))
    assert len(metrics.discounted) == 3 and min(metrics.discounted) >= 0.2  # steps 1, 5 and 7 (the last)
