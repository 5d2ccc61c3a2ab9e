"""kiln_base/files.py: the rules for files someone else may have made, one function each (issue 36's holes 1-3),
and the config parser that uses them (a TOML file that is a FIFO, too large or nested too deep)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kiln_base.config import parse_args
from kiln_base.errors import ConfigError
from kiln_base.files import (
    FileRefused,
    inside,
    loads_json,
    open_no_follow,
    read_bounded,
    remove_tree,
    require_regular,
    writable_dir_problem,
    write_atomic,
)


@pytest.mark.parametrize("name", ["a.distcp", "sub/a.distcp", "./a", "sub/../a"])
def test_inside_accepts_names_inside_the_folder(tmp_path: Path, name: str) -> None:
    assert inside(str(tmp_path), name, "record") == os.path.join(tmp_path, name)


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "sub/../../x", "..", "", "a\0b", 3, None])
def test_inside_refuses_names_leading_out(tmp_path: Path, name: object) -> None:
    with pytest.raises(FileRefused, match="record"):
        inside(str(tmp_path), name, "record")


def test_read_bounded_reads_regular_files_up_to_the_limit(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 100)
    assert read_bounded(str(f), 100, "a test file") == b"x" * 100
    with pytest.raises(FileRefused, match=r"is 100 bytes, more than kiln reads for a test file"):
        read_bounded(str(f), 99, "a test file")
    with pytest.raises(FileRefused, match="is a folder, not a regular file"):
        read_bounded(str(tmp_path), 100, "a test file")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done: list[BaseException] = []

    def read() -> None:
        try:
            read_bounded(str(fifo), 100, "a test file")
        except BaseException as e:
            done.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=10)
    assert done and isinstance(done[0], FileRefused) and "is a FIFO (named pipe)" in str(done[0])
    with pytest.raises(FileRefused, match="is a FIFO"):
        require_regular(str(fifo))


def test_loads_json_turns_deep_nesting_into_a_value_error() -> None:
    assert loads_json("[[1]]") == [[1]]
    with pytest.raises(ValueError, match="nested deeper than kiln parses"):
        loads_json("[" * 100_000 + "]" * 100_000)


def test_writes_never_follow_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "link"
    link.symlink_to(victim)
    with pytest.raises(FileRefused, match="is a symbolic link"):
        open_no_follow(str(link), os.O_RDWR | os.O_CREAT)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(FileRefused, match="is a symbolic link"):
        open_no_follow(str(dangling), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert victim.read_text() == "precious" and not (tmp_path / "would-be-created").exists()

    hard = tmp_path / "hard"
    os.link(victim, hard)  # the same file under a second name: writing it writes the victim
    with pytest.raises(FileRefused, match="has 1 other hard link"):
        open_no_follow(str(hard), os.O_RDWR | os.O_CREAT)
    (tmp_path / "f.json.part").symlink_to(victim)  # a planted temp name
    with pytest.raises(FileRefused):
        write_atomic(str(tmp_path / "f.json"), b"{}")
    write_atomic(str(link), b"new")  # renamed over the link itself, never written through it
    assert victim.read_text() == "precious" and not link.is_symlink() and link.read_text() == "new"


def test_remove_tree_refuses_a_link_and_never_follows_one(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "file").write_text("x")
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "inner-link").symlink_to(kept)
    (tmp_path / "link").symlink_to(kept)
    with pytest.raises(FileRefused):
        remove_tree(str(tmp_path / "link"))
    remove_tree(str(ours))
    assert not ours.exists() and (kept / "file").read_text() == "x"


def test_writable_dir_problem(tmp_path: Path) -> None:
    assert writable_dir_problem(str(tmp_path / "new" / "folder")) is None
    assert (tmp_path / "new" / "folder").is_dir() and not list((tmp_path / "new" / "folder").iterdir())
    (tmp_path / "file").write_text("x")
    assert writable_dir_problem(str(tmp_path / "file")) == "exists and is not a directory"
    assert "is not usable" in (writable_dir_problem(str(tmp_path / "file" / "sub")) or "")


# ----------------------------------------------------------------------------- the config file


def test_a_toml_config_that_is_a_fifo_too_large_or_too_deep_is_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is a FIFO"):
        parse_args(["--job.config_file", str(fifo)])
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match="more than kiln reads for a TOML config"):
        parse_args(["--job.config_file", str(big)])
    deep = tmp_path / "deep.toml"
    deep.write_text("[training]\nsteps = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="malformed TOML: arrays or tables nested deeper than kiln parses"):
        parse_args(["--job.config_file", str(deep)])
