"""A URL in checkpoint.folder or checkpoint.initial_load_path names object storage, never a folder under
job.dump_folder (issue 57): an unknown scheme, a missing bucket or s3:// without s3fs is one ConfigError line
naming the key and the URL, at parse time (the launcher parses before any rank starts); the path resolution leaves a
URL as it is, and job.dump_folder (local outputs) takes none."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from kiln_base.config import parse_args
from kiln_base.errors import ConfigError
from kiln_base.files import object_store_problem, output_location, url_scheme
from tests.helpers.common import tiny_run_args


def _refusal(*args: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse_args(tiny_run_args(*args))
    return str(e.value)


@pytest.mark.parametrize(
    ("path", "scheme"),
    [("s3://b/run", "s3"), ("S3://b", "s3"), ("gs://b/x", "gs"), ("hdfs://n/x", "hdfs"), ("checkpoint", None)],
)
def test_url_scheme(path: str, scheme: str | None) -> None:
    assert url_scheme(path) == scheme


@pytest.mark.parametrize("path", ["checkpoint", "/abs/checkpoint", "./s3:x", "run:v1"])
def test_local_paths_are_no_urls(path: str) -> None:
    assert url_scheme(path) is None
    assert object_store_problem(path) is None


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("hdfs://namenode/run", "hdfs:// is not an object store kiln supports; use s3://BUCKET/PREFIX"),
        ("gs:///run", "names no bucket; write gs://BUCKET/PREFIX"),
        ("s3:///run", "names no bucket; write s3://BUCKET/PREFIX"),
        ("S3://bucket/run", "write the scheme in lower case: s3://bucket/run"),  # fsspec knows no 'S3'
        ("s3:/bucket/run", "is not a URL (a slash short?)"),  # else a local folder named `s3:`
        ("s3:bucket", "is not a URL (a slash short?)"),
    ],
)
def test_unusable_checkpoint_folder_url_is_one_line_naming_key_and_url(url: str, needle: str) -> None:
    line = _refusal("--checkpoint.enable_checkpoint", "--checkpoint.folder", url)
    assert line.startswith(f"checkpoint.folder {url}: ") and needle in line, line


def test_s3_without_s3fs_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # find_spec answers None for a module blocked so
    assert importlib.util.find_spec("s3fs") is None
    line = _refusal("--checkpoint.enable_checkpoint", "--checkpoint.folder", "s3://bucket/run/checkpoint")
    assert line == (
        "checkpoint.folder s3://bucket/run/checkpoint: s3:// needs the s3fs package, which is not installed "
        "(pip install s3fs, or kiln's extra: pip install -e '.[s3]')"
    )


def test_a_url_folder_is_not_checked_with_checkpoints_off() -> None:
    parse_args(tiny_run_args("--checkpoint.folder", "hdfs://n/x"))  # nothing is saved, nothing is refused


def test_initial_load_path_url_is_checked_as_a_folder_url_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    line = _refusal("--checkpoint.initial_load_path", "hdfs://n/hf/llama")
    assert line.startswith("checkpoint.initial_load_path hdfs://n/hf/llama: hdfs:// is not an object store kiln")
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    line = _refusal("--checkpoint.initial_load_path", "gs://bucket/hf/llama")
    assert line == (
        "checkpoint.initial_load_path gs://bucket/hf/llama: gs:// needs the gcsfs package, which is not installed "
        "(pip install gcsfs, or kiln's extra: pip install -e '.[gcs]')"
    )


def test_dump_folder_url_is_refused_naming_it() -> None:
    line = _refusal("--job.dump_folder", "s3://bucket/run")
    assert line.startswith("job.dump_folder s3://bucket/run: a local folder (logs, traces, TensorBoard)")


def test_an_s3_folder_with_s3fs_parses_and_stays_a_url() -> None:
    pytest.importorskip("s3fs")
    args = ("--checkpoint.enable_checkpoint", "--checkpoint.folder", "s3://b/run/", "--checkpoint.async_mode", "async")
    cfg = parse_args(tiny_run_args(*args))  # async uploads are allowed (tests/trainer/test_checkpoint_objects.py)
    assert cfg.checkpoint.folder == "s3://b/run/" and cfg.checkpoint.async_mode == "async"
    assert output_location(cfg.job.dump_folder, cfg.checkpoint.folder) == "s3://b/run"
