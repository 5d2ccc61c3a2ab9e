"""[eval] mistakes through run_train.sh, with one rank and two: one line, exit status 2, before any training step.

The config check (the launcher, before torchrun) refuses evaluation without lm-eval installed and a task file that
does not exist; the eval phase of each rank's build (lm-eval's TaskManager) refuses an unknown task and a task that
is not multiple choice, before the first step.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.common import ROOT, tiny_run_args
from tests.helpers.eval_tasks import cloze_variant
from tests.helpers.kiln_process import assert_one_line_error, run_kiln

pytestmark = pytest.mark.slow
NGPU = [1, pytest.param(2, marks=pytest.mark.distributed)]
EVAL = ("--eval.enable", "--eval.limit", "4", "--training.steps", "2", "--model.n_layers", "2")


def _run(tmp_path: Path, ngpu: int, *extra: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    args = tiny_run_args(*EVAL, "--job.dump_folder", str(tmp_path / "out"), *extra)
    proc = run_kiln(args, ngpu=ngpu, env=env, cwd=tmp_path)
    line = assert_one_line_error(proc)
    assert "step:" not in proc.output  # before any training step
    return line, proc.output


@pytest.mark.parametrize("ngpu", NGPU)
def test_eval_without_lm_eval_installed(tmp_path: Path, ngpu: int) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    # Python imports sitecustomize at start-up: it makes lm_eval "not installed" (find_spec None, import fails).
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['lm_eval'] = None\n")
    line, out = _run(tmp_path, ngpu, env={"PYTHONPATH": f"{hide}:{ROOT}"})
    assert "eval.enable needs lm-eval (lm-evaluation-harness), which is not installed" in line, line
    assert "pip install -e '.[eval]'" in line and "[rank" not in out  # the launcher's check, no rank started


@pytest.mark.parametrize("ngpu", NGPU)
def test_a_missing_task_file(tmp_path: Path, ngpu: int) -> None:
    line, out = _run(tmp_path, ngpu, "--eval.tasks", "my_tasks/hellaswag.yaml")
    assert f"eval.tasks: task file not found: {tmp_path / 'my_tasks' / 'hellaswag.yaml'}" in line, line
    assert "[rank" not in out


@pytest.mark.parametrize("ngpu", NGPU)
def test_an_unknown_task(tmp_path: Path, ngpu: int) -> None:
    line, _ = _run(tmp_path, ngpu, "--eval.tasks", "kiln_cloze,no_such_task")
    assert "eval.tasks: unknown task 'no_such_task': not a task under eval.include_path" in line, line


@pytest.mark.parametrize("ngpu", NGPU)
def test_a_task_that_is_not_multiple_choice(tmp_path: Path, ngpu: int) -> None:
    folder = tmp_path / "tasks"
    folder.mkdir()
    for name in ("utils.py", "kiln_cloze.jsonl"):
        shutil.copy(ROOT / "assets" / "eval" / "kiln_cloze" / name, folder / name)
    (folder / "gen.yaml").write_text(
        "task: kiln_gen\ncustom_dataset: !function utils.load\ntest_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{label}}"\n'
    )
    line, _ = _run(tmp_path, ngpu, "--eval.tasks", "kiln_gen", "--eval.include_path", str(folder))
    assert "eval.tasks: task 'kiln_gen' is generate_until; kiln scores multiple_choice tasks only" in line, line


@pytest.mark.parametrize("ngpu", NGPU)
def test_a_task_that_reports_acc_only_is_scored(tmp_path: Path, ngpu: int) -> None:
    """A task whose metric_list asks for acc alone (lm-eval's MMLU template): its evaluations log acc, and the run
    ends as any other (it stopped with KeyError: 'acc_norm,none' at the first evaluation)."""
    folder = cloze_variant(tmp_path / "tasks", metrics=("acc",))
    args = tiny_run_args(*EVAL, "--job.dump_folder", str(tmp_path / "out"))
    args += ["--eval.tasks", "kiln_variant", "--eval.include_path", str(folder)]
    proc = run_kiln(args, ngpu=ngpu, cwd=tmp_path)
    assert proc.returncode == 0, proc.output[-3000:]
    lines = [line for line in proc.output.splitlines() if "eval step:" in line]
    assert len(lines) == 2 and all(re.search(r"kiln_variant: acc \d\.\d{4}  \(n=4\)  time:", x) for x in lines), lines


@pytest.mark.parametrize("ngpu", NGPU)
def test_a_task_document_without_choices(tmp_path: Path, ngpu: int) -> None:
    folder = cloze_variant(tmp_path / "tasks", empty_choices_at=2)
    line, _ = _run(tmp_path, ngpu, "--eval.tasks", "kiln_variant", "--eval.include_path", str(folder))
    assert "eval.tasks: task 'kiln_variant' document 2 cannot be scored (no choices" in line, line
