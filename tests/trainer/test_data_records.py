"""Bad data records: a record that is no JSON object with a string 'text' (null, missing, a number, an array, an
object, not JSON), an empty file, a dataset too small for one sequence: a DataError naming file, record and line,
the same on every rank; mid-run, one line and exit 2 after the last good step."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import train as train_entry
from kiln_base.errors import DataError
from tests.helpers.common import tiny_run_args
from tests.helpers.data import GOOD, TOKENIZER, drain, loader

BAD_RECORDS = [  # (lines after the six good ones, the problem at record 7)
    ('{"text": null}', "record 7 (line 7): 'text' is null; every record needs a string 'text' field"),
    ('{"body": "x"}', "record 7 (line 7): no 'text' field (has: body); every record needs a string 'text' field"),
    ('{"text": 42}', "record 7 (line 7): 'text' is a number, not a string; every record needs a string 'text' field"),
    ('{"text": ["a"]}', "record 7 (line 7): 'text' is an array, not a string"),
    ('{"text": {"a": 1}}', "record 7 (line 7): 'text' is an object, not a string"),
    ('"just a string"', "record 7 (line 7): not a JSON object but"),
    ('{"text": "x"', "record 7 (line 7): not valid JSON (Expecting ',' delimiter, column 13)"),
    ('\n\n{"text": null}', "record 7 (line 9): 'text' is null"),  # blank lines are not records
]


@pytest.mark.parametrize("bad,message", BAD_RECORDS, ids=[b[1][:30] for b in BAD_RECORDS])
def test_bad_record_halfway_names_file_record_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([*GOOD, bad]) + "\n")
    with pytest.raises(DataError) as e:
        drain(loader(path))
    assert str(e.value).startswith(f"data file {path}, {message}"), str(e.value)


def test_bad_record_in_second_file_of_a_folder_and_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("\n".join(GOOD) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join([*GOOD[:2], '{"text": null}']) + "\n")
    errors = []
    for rank in range(2):  # every rank streams the whole dataset: all meet the same record
        with pytest.raises(DataError) as e:
            drain(loader(tmp_path, rank=rank, world=2))
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"data file {tmp_path / 'b.jsonl'}, record 3 (line 3): 'text' is null")


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["empty", "blank_lines"])
def test_empty_jsonl(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=f"no records in {path}"):
        drain(loader(path))


def test_dataset_too_small_for_one_sequence(tmp_path: Path) -> None:
    path = tmp_path / "tiny.jsonl"
    path.write_text('{"text": "hi"}\n')
    with pytest.raises(DataError, match="is too small to fill one sequence of training.seq_len \\+ 1 = 33 tokens"):
        drain(loader(path))


def test_bad_record_mid_run_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 1 (2 x 33 tokens) reads record 1 (69 tokens); step 2 needs record 2, which is null: the run stops
    with one line and status 2."""
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([GOOD[0], '{"text": null}', *GOOD[1:]]) + "\n")
    assert len(TOKENIZER.encode(json.loads(GOOD[0])["text"], bos=True, eos=True)) == 69
    caplog.set_level(logging.INFO, logger="kiln")
    argv = [*tiny_run_args("--model.n_layers", "1"), "--job.dump_folder", str(tmp_path), "--training.steps", "3"]
    assert train_entry.main([*argv, "--training.dataset_path", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kiln: error: data file {path}, record 2 (line 2): 'text' is null; every record needs a string 'text' field\n"
    )
    assert "step:  1 " in caplog.text and "step:  2 " not in caplog.text
