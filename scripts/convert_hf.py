"""Convert kiln checkpoints to Hugging Face format (model.safetensors + config.json) and back: Llama 3
(LlamaForCausalLM), Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM).

    python scripts/convert_hf.py to_hf   CHECKPOINT HF_DIR [--dtype bfloat16] [--name llama3 --flavor debugmodel]
                                         [--tokenizer assets/tokenizer/tokenizer.model] [--max_shard_size 5GB]
    python scripts/convert_hf.py from_hf HF_DIR CHECKPOINT_FOLDER [--step 0]

to_hf writes config.json (transformers 4 and 5 keys, the model's true context length, bos/eos from the
tokenizer), generation_config.json, tokenizer.json + tokenizer_config.json and the weights (shards with
model.safetensors.index.json past --max_shard_size, one shard in memory at a time). from_hf refuses (exit 2,
the field named) any config kiln cannot compute exactly. The Trainer can also start from an HF folder directly:
--checkpoint.initial_load_path HF_DIR (docs/checkpoint.md).

CHECKPOINT is a DCP step folder (`outputs/checkpoint/step-100`, full, or an export `export-step-100`) or a
checkpoint folder (its highest complete step is used; an export wins a tie). Checkpoints are read through
kiln's SafeFileSystemReader: a file that needs code to load is refused (exit 2), nothing of it run. The model
shape comes from the step's kiln.json (or --name's --flavor, with the vocabulary read off the embedding). `from_hf`
writes a weights-only DCP checkpoint `CHECKPOINT_FOLDER/step-N` that
kiln loads at start (`--checkpoint.enable_checkpoint --checkpoint.folder CHECKPOINT_FOLDER`) as its initial
weights. Names map as in Hugging Face's convert_llama_weights_to_hf.py, including the q/k row permutation:
kiln (like Meta's Llama) rotates interleaved pairs (x0,x1),(x2,x3)...; HF's Llama rotates the two halves of
each head, so wq and wk rows are reordered per head (trainer/checkpoint/hf.py). Only model weights convert.

Any of the folders may be an object-storage URL (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX): an input is downloaded
into a temporary folder and read as a local one; an output is written there and uploaded (a kiln step as a run
publishes a save, an HF folder with config.json last); docs/checkpoint.md "Object storage".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kiln_base.errors import ConfigError, UserError  # noqa: E402
from kiln_base.files import FileRefused, object_store_problem, url_scheme  # noqa: E402
from models.args import FAMILIES, ModelArgs  # noqa: E402
from trainer.checkpoint import hf  # noqa: E402
from trainer.checkpoint import manager as checkpoint  # noqa: E402
from trainer.checkpoint.checksums import ChecksummingWriter, collect  # noqa: E402
from trainer.checkpoint.folder import write_json  # noqa: E402
from trainer.checkpoint.initial_load import stored_kiln_args  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")  # torch attribute names
DEFAULT_TOKENIZER = os.path.join(ROOT, "assets", "tokenizer", "tokenizer.model")

# The conversion itself lives in trainer/checkpoint/hf.py (the Trainer's checkpoint.initial_load_path uses it).
permute_to_hf, permute_from_hf = hf.permute_to_hf, hf.permute_from_hf
kiln_to_hf, hf_to_kiln = hf.kiln_to_hf, hf.hf_to_kiln
hf_config, args_from_hf_config = hf.hf_config, hf.args_from_hf_config
resolve_step_dir = checkpoint.resolve_step_dir


def _model_tensors(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """kiln name -> (shape, dtype) of every model weight in DCP checkpoint `path` (from its index only)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = checkpoint.read_metadata(path)
    return {
        k: (tuple(m.size), m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if checkpoint.is_model_key(k) and isinstance(m, TensorStorageMetadata)
    }


def _read(path: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """These model weights of DCP checkpoint `path` (no process group needed; only their bytes are read)."""
    from trainer.checkpoint.reader import load

    md = checkpoint.read_metadata(path)
    meta = md.state_dict_metadata
    sd = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
    load(sd, path, md, no_dist=True)
    return sd


def checkpoint_args(path: str, flavor: str | None, vocab: int, name: str = "llama3") -> ModelArgs:
    """The model shape of kiln step folder `path`: family `name`'s --flavor (with the checkpoint's vocabulary),
    else kiln.json's."""
    if flavor is not None:
        if flavor not in FAMILIES[name]:
            raise ConfigError(
                f"--flavor {flavor} is not a --name {name} flavor; choose from {', '.join(FAMILIES[name])}"
            )
        return dataclasses.replace(FAMILIES[name][flavor], vocab_size=vocab)
    if not os.path.isfile(os.path.join(path, checkpoint.MARKER)):
        raise ConfigError(f"{path} has no {checkpoint.MARKER} (not written by kiln?); pass --flavor to give the shape")
    try:
        return stored_kiln_args(path, path)
    except ConfigError as e:
        raise ConfigError(f"{e}; pass --flavor") from None


def load_kiln_weights(
    path: str, flavor: str | None = None, name: str = "llama3"
) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """The model weights of a kiln DCP checkpoint (no process group needed) and the model's ModelArgs."""
    tensors = _model_tensors(path)
    if "tok_embeddings.weight" not in tensors:
        raise ConfigError(f"{path}: no tok_embeddings.weight: not a kiln checkpoint")
    emb = tensors["tok_embeddings.weight"][0]
    args = checkpoint_args(path, flavor, emb[0], name)
    if emb != (args.vocab_size, args.dim):
        raise ConfigError(
            f"{path}: tok_embeddings.weight {emb} does not match the model shape "
            f"(vocab {args.vocab_size}, dim {args.dim})"
        )
    return _read(path, list(tensors)), args


def save_kiln_weights(sd: dict[str, torch.Tensor], args: ModelArgs, folder: str, step: int) -> str:
    """Write a weights-only kiln checkpoint folder/step-N (atomically: .tmp, marker, rename)."""
    import torch.distributed.checkpoint as dcp

    final = checkpoint.step_dir(folder, step)
    tmp = final + ".tmp"
    for path in (final, tmp):  # DCP would write into (or through) whatever is there
        if os.path.lexists(path):
            raise ConfigError(f"{path} already exists; not overwriting it (move it out of {folder})")
    dcp.save(sd, checkpoint_id=tmp, storage_writer=ChecksummingWriter(tmp), no_dist=True)
    dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    marker = {"step": step, "model_weights_only": True, "dtype": dtype, "model_args": dataclasses.asdict(args)}
    marker["checksums"] = collect(tmp)  # verified when a run loads it
    write_json(os.path.join(tmp, checkpoint.MARKER), marker)
    os.rename(tmp, final)
    return final


def to_hf(
    ckpt: str,
    out_dir: str,
    dtype: str | None,
    flavor: str | None,
    tokenizer_path: str = DEFAULT_TOKENIZER,
    max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES,
    name: str = "llama3",
) -> None:
    """kiln checkpoint -> HF folder: weights (sharded past max_shard_bytes, one shard in memory at a time),
    config.json, generation_config.json and the tokenizer files."""
    from trainer.components.tokenizer import Tokenizer

    path = resolve_step_dir(ckpt)
    tensors = _model_tensors(path)
    if "tok_embeddings.weight" not in tensors:
        raise ConfigError(f"{path}: no tok_embeddings.weight: not a kiln checkpoint")
    args = checkpoint_args(path, flavor, tensors["tok_embeddings.weight"][0][0], name)
    try:
        tok = Tokenizer(tokenizer_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer: {e}") from None
    if tok.n_words > args.vocab_size:
        raise ConfigError(
            f"--tokenizer {tokenizer_path} has {tok.n_words} tokens, more than the model's vocabulary "
            f"{args.vocab_size}: not this model's tokenizer"
        )
    os.makedirs(out_dir, exist_ok=True)
    torch_dtype = getattr(torch, dtype) if dtype is not None else None
    files = hf.save_hf_weights(tensors, lambda keys: _read(path, keys), args, out_dir, torch_dtype, max_shard_bytes)
    saved_dtype = dtype or str(next(iter(tensors.values()))[1]).removeprefix("torch.")
    hf.write_json(os.path.join(out_dir, hf.CONFIG), hf.hf_config(args, saved_dtype, tok.bos_id, tok.eos_id))
    hf.write_json(os.path.join(out_dir, "generation_config.json"), hf.generation_config(tok.bos_id, tok.eos_id))
    hf.write_tokenizer(tok, out_dir, args.context_len)
    print(f"{path} -> {out_dir}: {len(files)} safetensors file(s), {saved_dtype}, tokenizer {tokenizer_path}")


def from_hf(hf_dir: str, folder: str, step: int) -> str:
    """HF folder -> weights-only kiln checkpoint folder/step-N (kiln.json holds the model's ModelArgs)."""
    if not hf.is_hf_folder(hf_dir):
        raise ConfigError(f"{os.path.join(hf_dir, hf.CONFIG)}: not found")
    args = hf.read_hf_args(hf_dir)
    sd = dict(hf.iter_hf_as_kiln(hf_dir, args))
    if args.tie_word_embeddings or "output.weight" not in sd:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    final = save_kiln_weights(sd, args, folder, step)
    print(f"{hf_dir} -> {final}: weights-only kiln checkpoint")
    return final


def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)B?", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"a size such as 5GB, 200MB or 1000000, got {text!r}")
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)]


class _Urls:
    """convert_hf's object-storage arguments (s3://, gs://): an input is downloaded into a local temporary folder
    first (plain names only, then read exactly as a local one), an output written there and uploaded after
    (trainer/checkpoint/objects.py): a kiln step as a run saves one (the folder's lock held, `.kiln-saving` first,
    kiln.json last), a Hugging Face folder with config.json last. Messages name the URL, not the temporary folder."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="kiln-convert-")
        self.names: dict[str, str] = {}  # local temporary folder -> the URL it stands for

    def local(self, key: str, url: str) -> str:
        problem = object_store_problem(url)
        if problem is not None:
            raise ConfigError(f"{key} {url}: {problem}")
        path = os.path.join(self.tmp, key)
        os.makedirs(path)
        self.names[path] = url.rstrip("/")
        return path

    def kiln_input(self, url: str) -> str:
        """A kiln step prefix, or a checkpoint folder's newest step kiln.json completes, downloaded."""
        from trainer.checkpoint.objects import ObjectStore, download_prefix, newest_complete, top_names

        local = self.local("checkpoint", url)
        store = ObjectStore(url)
        if not {checkpoint.MARKER, ".metadata"} <= top_names(store):
            entry = newest_complete(store)
            if entry is None:
                raise ConfigError(f"{url}: no kiln checkpoint there (no step-N completed by its {checkpoint.MARKER})")
            local, self.names[local] = os.path.join(local, entry.name), entry.path
            os.makedirs(local)
            url = entry.path
        download_prefix(url, local, hf=False)
        return local

    def hf_input(self, url: str) -> str:
        from trainer.checkpoint.objects import download_prefix

        local = self.local("hf_dir", url)
        download_prefix(url, local, hf=True)
        return local

    def upload_hf(self, local: str) -> None:
        """A Hugging Face folder written into `local`, under its URL: config.json last (the folder is one from then)."""
        from trainer.checkpoint.objects import ObjectStore, top_names

        store = ObjectStore(self.names[local])
        if top_names(store):
            raise ConfigError(f"out_dir {store.url} holds objects already; convert_hf writes only into an empty prefix")
        files = sorted(os.listdir(local), key=lambda n: (n == hf.CONFIG, n))
        for name in files:
            store.upload(os.path.join(local, name), name)

    def upload_step(self, folder: str, step_path: str) -> None:
        """A weights-only kiln step written under local `folder`, into its URL as a run publishes a save."""
        from trainer.checkpoint.objects import (
            ObjectLock,
            ObjectStore,
            prepare_object_save,
            publish_object,
            upload_step,
        )

        store = ObjectStore(self.names[folder])
        name = os.path.basename(step_path)
        marker = json.loads(open(os.path.join(step_path, checkpoint.MARKER), "rb").read())
        lock = ObjectLock(store)  # no run may save into the folder meanwhile (and none holds it now)
        try:
            prepare_object_save(store, name)
            upload_step(store, step_path, name, [f for f in marker["checksums"] if f != ".metadata"])
            store.upload(os.path.join(step_path, ".metadata"), f"{name}/.metadata")
            publish_object(store, name, marker)
        finally:
            lock.release()

    def named(self, message: str) -> str:
        for local, url in sorted(self.names.items(), key=lambda x: -len(x[0])):
            message = message.replace(local, url)
        return message


def _convert(a: argparse.Namespace, urls: _Urls) -> None:
    if a.command == "to_hf":
        ckpt = urls.kiln_input(a.checkpoint) if url_scheme(a.checkpoint) else a.checkpoint
        out = urls.local("out_dir", a.out_dir) if url_scheme(a.out_dir) else a.out_dir
        to_hf(ckpt, out, a.dtype, a.flavor, a.tokenizer, a.max_shard_size, a.name)
        if url_scheme(a.out_dir):
            urls.upload_hf(out)
            print(f"uploaded to {a.out_dir}")
    else:
        hf_dir = urls.hf_input(a.hf_dir) if url_scheme(a.hf_dir) else a.hf_dir
        folder = urls.local("folder", a.folder) if url_scheme(a.folder) else a.folder
        final = from_hf(hf_dir, folder, a.step)
        if url_scheme(a.folder):
            urls.upload_step(folder, final)
            print(f"uploaded to {urls.names[folder]}/{os.path.basename(final)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to_hf", help="kiln DCP checkpoint -> HF model.safetensors + config.json")
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="cast weights (default: as saved)")
    p.add_argument("--name", choices=list(FAMILIES), default="llama3", help="--flavor's model family")
    p.add_argument("--flavor", default=None, help="model shape if no kiln.json: a flavor of --name")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="the model's tiktoken file (default: bundled)")
    p.add_argument("--max_shard_size", type=_size, default=hf.DEFAULT_MAX_SHARD_BYTES, help="e.g. 5GB (default)")
    p = sub.add_parser("from_hf", help="HF Llama / Qwen3 folder -> weights-only kiln checkpoint FOLDER/step-N")
    p.add_argument("hf_dir")
    p.add_argument("folder")
    p.add_argument("--step", type=int, default=0)
    a = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # offline use is the intent
    urls = _Urls()
    try:
        _convert(a, urls)
    except UserError as e:  # config, checkpoint (damaged, refused as unsafe) mistakes; object storage's lines
        print(f"convert_hf: error: {urls.named(' '.join(str(e).splitlines()))}", file=sys.stderr)
        return 2
    except FileRefused as e:  # an output file that is a link (kiln_base/files.py)
        print(f"convert_hf: error: {urls.named(str(e))}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(urls.tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
