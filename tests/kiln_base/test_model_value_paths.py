"""Every model-shape check on every path a shape can arrive by: the command line (model.*), the TOML file's [model],
a Hugging Face folder's config.json and a kiln checkpoint's kiln.json (checkpoint.initial_load_path with model.flavor
from_checkpoint). The same bad shape is refused before any rank starts (train.check_config, what run_train.sh runs
before torchrun) with one line, naming the check, whichever way it came. The launcher's one line and exit 2 through
run_train.sh: tests/e2e/test_hostile_run_train.py, tests/e2e/test_launcher.py."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import tomllib

import train as train_entry
from models import LLAMA3_FLAVORS
from tests.helpers.common import DEBUG_CONFIG, tiny_run_args
from trainer.checkpoint.hf import hf_config

VOCAB = 2256  # the debug tokenizer's
# name: (the model fields, ModelArgs' names, that make the shape bad; world size; what the one line must say, a
# regular expression: a config.json's own reader names its keys, as transformers spells them)
BAD_SHAPES: dict[str, tuple[dict[str, int], int, str]] = {
    "n_heads out of range": ({"n_heads": 0}, 1, "n_heads must be"),
    "heads do not split dim": (
        {"n_heads": 5},
        1,
        r"n_heads must divide dim into heads of even size|num_attention_heads = 5: does not divide hidden_size 256",
    ),
    "odd head size": ({"dim": 96, "n_heads": 32}, 1, "heads of even size"),
    "kv heads do not split heads": (
        {"n_kv_heads": 3},
        1,
        r"n_kv_heads must divide n_heads|num_key_value_heads = 3: does not divide num_attention_heads 16",
    ),
    "vocabulary below the tokenizer's": ({"vocab_size": 2000}, 1, f"{VOCAB} tokens"),
    "more than the machine holds": ({"n_layers": 10**6}, 1, r"needs at least"),
    "TP 2 over one kv head": ({"n_kv_heads": 1}, 2, r"tensor_parallel_degree \(2\) must divide the model's n_kv_heads"),
}
HF_KEYS = {"dim": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads"}
HF_KEYS |= {"vocab_size": "vocab_size", "n_layers": "num_hidden_layers"}


def _toml(values: dict) -> str:
    """TOML text of a two-level dict of plain values (JSON's literals are TOML's for these)."""
    return "".join(
        f"[{section}]\n" + "".join(f"{key} = {json.dumps(v)}\n" for key, v in table.items() if v is not None) + "\n"
        for section, table in values.items()
    )


def _source(path: str, bad: dict[str, int], folder: Path) -> list[str]:
    """The arguments that bring the bad shape by `path`."""
    if path == "command line":
        return [arg for field, value in bad.items() for arg in (f"--model.{field}", str(value))]
    if path == "TOML":
        config = tomllib.loads(Path(DEBUG_CONFIG).read_text())
        config["model"] |= bad
        (folder / "bad.toml").write_text(_toml(config))
        return ["--job.config_file", str(folder / "bad.toml")]
    good = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=VOCAB, max_seq_len=2048, context_len=2048)
    stored = folder / "stored"
    stored.mkdir()
    if path == "HF config.json":
        config = hf_config(good, "float32")
        config.pop("head_dim", None)
        config |= {HF_KEYS[field]: value for field, value in bad.items()}
        (stored / "config.json").write_text(json.dumps(config))
    else:  # a kiln step folder: kiln.json's model_args (the weights are not read before the shape is checked)
        (stored / ".metadata").write_bytes(b"")
        (stored / "kiln.json").write_text(json.dumps({"model_args": dataclasses.asdict(good) | bad}))
    return ["--checkpoint.initial_load_path", str(stored), "--model.flavor", "from_checkpoint"]


@pytest.mark.parametrize("path", ["command line", "TOML", "HF config.json", "kiln.json"])
@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_a_bad_shape_is_refused_whichever_way_it_comes(
    case: str, path: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bad, world, needle = BAD_SHAPES[case]
    tp = ["--parallelism.tensor_parallel_degree", "2"] if world == 2 else []
    argv = tiny_run_args("--job.dump_folder", str(tmp_path / "out"), *tp, *_source(path, bad, tmp_path))
    capsys.readouterr()
    cfg = train_entry.check_config(argv, world_size=world)
    err = capsys.readouterr().err.strip()
    print(f"{case} by {path}: {err}")
    assert cfg is None and len(err.splitlines()) == 1 and err.startswith("kiln: error: ") and re.search(needle, err), (
        err
    )
