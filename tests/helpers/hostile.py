"""Hostile inputs, made as a stranger's checkpoint, a careless config or a broken machine would make them: the
shared crafting tools of the tests of kiln's refusals (tests/trainer/test_hostile_checkpoints.py,
tests/e2e/test_hostile_run_train.py) and of scratch attack scripts.

Every function edits files of a checkpoint kiln itself wrote (so only the named part is hostile) and reads kiln's
own `.metadata` with plain pickle: these are the test's files, not a stranger's. An edit reseals the checkpoint
(its kiln.json's checksums made those of the edited files, as anyone who can edit the files can): what is tested
then is what the reader does with hostile content, not the checksums (tests/trainer/test_checkpoint_checksums.py).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import torch

from models.args import ModelArgs

# A 2-layer, dim-64 debugmodel: 1 MB full checkpoints, ~1 s builds.
SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, rope_theta=500000)
SMALL_ARGS = ("--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2")
SMALL_ARGS += ("--model.multiple_of", "32")


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file, folder and link under `folder` (links not followed), except the folder lock (each run takes it
    and writes its pid@host there): relative path -> (size, mtime in ns)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            st = p.lstat()
            if name != ".kiln.lock":
                out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def read_md(step: Path) -> Any:
    with open(step / ".metadata", "rb") as f:
        return pickle.load(f)  # kiln's own, good file


def reseal(step: Path) -> None:
    """Make the checksums in `step`'s kiln.json those of its files as they are now (no-op without a kiln.json)."""
    from trainer.checkpoint.checksums import file_checksum

    marker = step / "kiln.json"
    if not marker.is_file():
        return
    saved = json.loads(marker.read_text())
    names = set(saved.get("checksums", {})) | {p.name for p in step.iterdir() if p.name.endswith(".distcp")}
    saved["checksums"] = {name: file_checksum(str(step / name)) for name in sorted(names) if (step / name).is_file()}
    marker.write_text(json.dumps(saved))


def write_md(step: Path, md: Any) -> None:
    (step / ".metadata").write_bytes(pickle.dumps(md))
    reseal(step)


def torch_saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def record_index(md: Any, fqn: str) -> Any:
    return next(i for i in md.storage_data if i.fqn == fqn)


def read_item(step: Path, fqn: str) -> bytes:
    """The bytes of checkpoint item `fqn`'s record."""
    md = read_md(step)
    info = md.storage_data[record_index(md, fqn)]
    with open(step / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def rewrite_item(step: Path, fqn: str, data: bytes, **changes: Any) -> None:
    """Point checkpoint item `fqn` at `data` (appended to its shard file), as someone editing the files would;
    `changes` replace other fields of its record (relative_path, transform_descriptors)."""
    md = read_md(step)
    index = record_index(md, fqn)
    info = md.storage_data[index]
    shard = step / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(data)
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(data), **changes)
    write_md(step, md)


def deflated(record: bytes, pad_member: str | None = None, pad_bytes: int = 0) -> bytes:
    """torch.save's zip `record` rewritten with every member deflate-compressed, `pad_member` (a storage, e.g.
    'data/0') first grown by `pad_bytes` zeros: a small record that inflates to any size."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(record)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            with src.open(info) as member:
                member._expected_crc = None  # type: ignore[attr-defined]  # kiln saves records without torch's CRC
                data = member.read()
            if pad_member is not None and info.filename.endswith(pad_member):
                data += bytes(pad_bytes)
            dst.writestr(info.filename, data)
    return out.getvalue()


def storage_member(record: bytes) -> str:
    """The name of the (first) tensor storage member of torch.save's zip `record` (`<archive>/data/0`)."""
    with zipfile.ZipFile(io.BytesIO(record)) as z:
        return next(n for n in z.namelist() if "/data/" in n and not n.endswith("serialization_id"))


# ---------------------------------------------------------------------------------------------- run_train.sh

RUN_TRAIN = str(Path(__file__).resolve().parents[2] / "run_train.sh")


def run_train_sh(
    *args: str, cwd: Path, ngpu: int | str = 1, env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess:
    """`NGPU=ngpu run_train.sh args` from `cwd`, `env` on top of this process's environment; `kwargs` go to
    subprocess.run (preexec_fn, timeout)."""
    kwargs.setdefault("timeout", 600)
    full_env = {**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(["bash", RUN_TRAIN, *args], cwd=cwd, env=full_env, capture_output=True, text=True, **kwargs)
