"""Bytes each rank reads from storage when a checkpoint loads, at 1, 2, 4 and 8 gloo ranks (CPU, FSDP2).

    python benchmarks/read_once.py [--ranks 1 2 4 8] [--dim 256] [--layers 4] [--cases dcp hf s3 s3_initial]

Three loads, each of a checkpoint written by the same number of ranks, into a model FSDP-sharded over all ranks:
  dcp  a resume (model, AdamW, step) from a local step folder, through CheckpointManager.load;
  hf   an initial load of a Hugging Face folder (config.json + model.safetensors) through load_initial;
  s3   the resume of `dcp` from an s3:// URL (moto's server in this process, tests/helpers/s3_server.py);
  s3_initial  an initial load (checkpoint.initial_load_path, through load_initial) of that s3:// checkpoint's
       weights (its size: the whole step, weights and AdamW moments; the load reads the weights' records).

What is counted, per rank, is what kiln asks storage for, in kiln's read functions (patched by `counting`):
the bytes each DCP record read covers (SafeFileSystemReader.read_data: every planned item's length), the files
whole-file checksums read (checksums.file_checksum), `.metadata` (reader.load_metadata), the tensor bytes taken
out of a safetensors file (safe_open's get_tensor and get_slice[...]: safetensors maps the file, so a byte not
taken is not read), and for s3 every object downloaded or read and every byte range fetched (ObjectStore.download, read,
read_range). Small
JSON reads (kiln.json, config.json) and safetensors headers are not counted. /proc/self/io is not used: on one
host the page cache serves the second rank's reads of a file (read_bytes 0), and safetensors reads through mmap,
which rchar does not see. Prints one markdown row per case and rank count: the checkpoint's size, the bytes read
from storage per rank (max over the ranks) and in all (s3: the objects fetched; its local copy's reads are in the
per-rank breakdown printed to stderr), and whether every rank count loaded the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models import ModelArgs, Transformer  # noqa: E402

COUNT: dict[str, int] = {}
# What counts as read from storage, by case: s3's local copy is read again (checksums, DCP) from local disk.
STORAGE = {"s3": ("s3",), "s3_initial": ("s3",), "hf": ("safetensors",)}


def _add(what: str, n: int) -> None:
    COUNT[what] = COUNT.get(what, 0) + int(n)


class _CountingSlice:
    def __init__(self, sl: Any) -> None:
        self._sl = sl

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self._sl[index]
        _add("safetensors", t.numel() * t.element_size())
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sl, name)


class _CountingSafeOpen:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import safetensors

        self._f = _REAL["safe_open"](*args, **kwargs)
        self._mod = safetensors

    def __enter__(self) -> _CountingSafeOpen:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.__exit__(*exc)

    def get_tensor(self, key: str) -> torch.Tensor:
        t = self._f.get_tensor(key)
        _add("safetensors", t.numel() * t.element_size())
        return t

    def get_slice(self, key: str) -> _CountingSlice:
        return _CountingSlice(self._f.get_slice(key))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


_REAL: dict[str, Any] = {}


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """COUNT, reset, while kiln's read functions count the bytes they take from storage (module docstring)."""
    import safetensors

    from trainer.checkpoint import checksums, objects, reader

    COUNT.clear()
    real: dict[str, Any] = {}

    def read_data(self: Any, plan: Any, planner: Any) -> Any:
        _add("dcp", sum(self.storage_data[item.storage_index].length for item in plan.items))
        return real["read_data"](self, plan, planner)

    def file_checksum(path: str) -> str:
        _add("checksums", os.path.getsize(path))
        return real["file_checksum"](path)

    def load_metadata(path: Any, rank: Any = None) -> Any:
        _add("metadata", os.path.getsize(os.path.join(path, ".metadata" if rank is None else f"__{rank}.metadata")))
        return real["load_metadata"](path, rank)

    def download(self: Any, name: str, local: str) -> None:
        real["download"](self, name, local)
        _add("s3", os.path.getsize(local))

    def read(self: Any, name: str, limit: int) -> bytes:
        data = real["read"](self, name, limit)
        _add("s3", len(data))
        return data

    def read_range(self: Any, name: str, offset: int, length: int) -> bytes:
        data = real["read_range"](self, name, offset, length)
        _add("s3", len(data))
        return data

    patches: list[tuple[Any, str, Any]] = [
        (reader.SafeFileSystemReader, "read_data", read_data),
        (checksums, "file_checksum", file_checksum),
        (reader, "load_metadata", load_metadata),
        (objects.ObjectStore, "download", download),
        (objects.ObjectStore, "read", read),
        (objects.ObjectStore, "read_range", read_range),
        (safetensors, "safe_open", _CountingSafeOpen),
    ]
    for obj, name, new in patches:
        real[name] = _REAL[name] = getattr(obj, name)
        setattr(obj, name, new)
    try:
        yield COUNT
    finally:
        for obj, name, _ in patches:
            setattr(obj, name, real[name])


def model_args(dim: int, layers: int) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=2048, multiple_of=64, max_seq_len=16)


def sharded_model(args: ModelArgs, seed: int) -> torch.nn.Module:
    """The model with `args`, FSDP2-sharded over every rank (as kiln's dp_shard), its weights drawn from `seed`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(model: torch.nn.Module) -> dict[str, list[float]]:
    """Every weight, whole (gathered), as plain lists: what a load must give whatever the rank count."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        out[k] = v.flatten()[:: max(1, v.numel() // 64)].tolist()  # a sample of every weight: small to send
    return out


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, 2048, (2, 9), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1]).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def save_resume(folder: str, args: ModelArgs) -> dict[str, list[float]]:
    """Every rank: a model, one AdamW step, step-1 saved into `folder` (a local folder or an s3:// URL); the saved
    weights."""
    from kiln_base.config import Checkpoint
    from tests.helpers.checkpoints import StepCounter
    from trainer.checkpoint.manager import CheckpointManager

    model = sharded_model(args, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    counter = StepCounter()
    counter.step = 1
    saver = CheckpointManager(
        Checkpoint(enable_checkpoint=True, interval=1),
        folder,
        {"model": model, "optimizer": opt, "train_state": counter},
    )
    saver.maybe_save(1)
    saver.close()
    return full_state(model)


def load_resume(folder: str, args: ModelArgs) -> tuple[dict[str, int], dict[str, list[float]]]:
    """Every rank: resume from `folder`; (this rank's counted bytes, the loaded weights)."""
    from kiln_base.config import Checkpoint
    from tests.helpers.checkpoints import StepCounter
    from trainer.checkpoint.manager import CheckpointManager

    model = sharded_model(args, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = StepCounter()
    loader = CheckpointManager(
        Checkpoint(enable_checkpoint=True, interval=1),
        folder,
        {"model": model, "optimizer": opt, "train_state": counter},
    )
    with counting() as count:
        assert loader.load() == 1
    loader.close()
    return dict(count), full_state(model)


def write_hf(folder: str, args: ModelArgs) -> None:
    """A Hugging Face folder of the model with `args` (seed 0): config.json + model.safetensors."""
    from safetensors.torch import save_file

    from trainer.checkpoint.hf import CONFIG, hf_config, kiln_to_hf, write_json

    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    os.makedirs(folder, exist_ok=True)
    save_file(kiln_to_hf(model.state_dict(), args), os.path.join(folder, "model.safetensors"))
    write_json(os.path.join(folder, CONFIG), hf_config(args, "float32"))


def load_source(folder: str) -> tuple[dict[str, int], dict[str, list[float]]]:
    """Every rank: checkpoint.initial_load_path `folder` into a fresh sharded model; (counted bytes, its weights)."""
    from trainer.checkpoint.initial_load import load_initial, open_source

    source = open_source(folder)
    model = sharded_model(source.args, seed=1)
    with counting() as count:
        load_initial(source, model)
    return dict(count), full_state(model)


def _rank(
    case: str, folder: str, dim: int, layers: int, env: dict[str, str]
) -> tuple[dict[str, int], dict[str, list[float]], Any]:
    import torch.distributed as dist

    os.environ.update(env)  # the S3 server's: a forkserver started earlier does not pass on the caller's

    args = model_args(dim, layers)
    if case == "hf":
        if dist.get_rank() == 0:
            write_hf(folder, args)
        dist.barrier()
        return (*load_source(folder), None)
    saved = save_resume(folder, args)
    dist.barrier()
    return (*(load_source(folder) if case == "s3_initial" else load_resume(folder, args)), saved)


def size_of(case: str, folder: str, s3: Any) -> int:
    """The bytes of the checkpoint a load of `case` reads: the step's files (hf: the safetensors file)."""
    if case == "hf":
        return os.path.getsize(os.path.join(folder, "model.safetensors"))
    if case in ("s3", "s3_initial"):
        root = folder.removeprefix("s3://")
        return sum(s3.fs.du(f"{root}/step-1", total=False).values())
    return sum(p.stat().st_size for p in Path(folder, "step-1").iterdir())


def measure(case: str, world: int, dim: int, layers: int, work: str, s3: Any = None) -> dict[str, Any]:
    """One load of `case` on `world` ranks: the checkpoint's size, each rank's counted bytes and loaded state."""
    from tests.helpers.distributed import run_distributed

    folder = s3.url(f"{case}-{world}-{os.getpid()}") if case.startswith("s3") else os.path.join(work, f"{case}-{world}")
    results = run_distributed(_rank, world, case, folder, dim, layers, s3.env if s3 is not None else {})
    storage = STORAGE.get(case)
    return {
        "size": size_of(case, folder, s3),
        "per_rank": [sum(n for k, n in count.items() if storage is None or k in storage) for count, _, _ in results],
        "counts": [count for count, _, _ in results],
        "states": [state for _, state, _ in results],
        "saved": results[0][2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    cases = ["dcp", "hf", "s3", "s3_initial"]
    parser.add_argument("--cases", nargs="+", default=cases, choices=cases)
    a = parser.parse_args()
    from tests.helpers.s3_server import S3Server

    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(S3Server()) if any(c.startswith("s3") for c in a.cases) else None
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-read-once-"))
        print(
            "| case | ranks | checkpoint MB | from storage per rank MB (max) | in all MB | in all / size | loaded = "
            "saved |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for case in a.cases:
            first = None
            for world in a.ranks:
                m = measure(case, world, a.dim, a.layers, work, s3)
                total = sum(m["per_rank"])
                # dcp, s3: every rank's weights are those saved; hf: those of the first rank count's load
                want = m["saved"] if m["saved"] is not None else (first or m["states"][0])
                first = first or m["states"][0]
                same = "yes" if all(state == want for state in m["states"]) else "NO"
                print(
                    f"| {case} | {world} | {m['size'] / 1e6:.2f} | {max(m['per_rank']) / 1e6:.2f} | {total / 1e6:.2f} "
                    f"| {total / m['size']:.2f} | {same} |",
                    flush=True,
                )
                print(f"  {case} {world} ranks, per rank: {m['counts']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
