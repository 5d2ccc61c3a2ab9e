"""`checkpoint.initial_load_path`: start training from weights outside the run's checkpoint folder.

The path is a Hugging Face Llama, Qwen3 or Qwen3-MoE folder (config.json + safetensors, one file or sharded) or a
kiln checkpoint (a DCP step folder, or a checkpoint folder: its newest complete step; a converted weights-only
`step-N` or another run's full checkpoint, of which only the model is read). Its stored model shape (config.json, or the
step's kiln.json) is what `model.flavor = "from_checkpoint"` builds, or what a named flavor is checked
against. The weights load only when the run's own checkpoint folder holds nothing to resume (as torchtitan's
key), so the same command resumes after a stop; the run's saves go to its own folder, never to the source.

The path may be an object-storage URL (`s3://...`, `gs://...`): a Hugging Face folder (config.json there), a kiln step
prefix (its kiln.json there: kiln writes it last) or a checkpoint folder (its newest step kiln.json completes). Its
shape is read from config.json or kiln.json alone; when the weights load, their files (plain names only) are
fetched into a local temporary folder, read there exactly as a local source (checksums, restricted unpickler,
records inside), and the download is deleted; messages name the URL. A kiln step is read once (each rank fetches
what its own load plan reads, as a resume from a URL does); a Hugging Face folder is downloaded whole on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from kiln_base.errors import CheckpointError, ConfigError
from kiln_base.files import loads_json, read_bounded, url_scheme
from kiln_base.internals import shard_offset
from models.args import ModelArgs, stored_model_args
from trainer.checkpoint.checksums import verify
from trainer.checkpoint.folder import MARKER_LIMIT, agree
from trainer.checkpoint.hf import EXPERT_BIAS, is_hf_folder, iter_hf_as_kiln, kiln_shapes, read_hf_args
from trainer.checkpoint.manager import MARKER, read_metadata, resolve_step_dir
from trainer.checkpoint.reader import check_loaded_state

logger = logging.getLogger("kiln")
KEY = "checkpoint.initial_load_path"


@dataclass(frozen=True)
class InitialSource:
    path: str  # the HF folder, or the kiln DCP step folder
    kind: str  # "hf" or "kiln"
    args: ModelArgs  # the stored model shape (max_seq_len as stored: the caller sets its own)


def stored_kiln_args(step_path: str, where: str) -> ModelArgs:
    """The ModelArgs in a kiln step folder's (or step URL's) kiln.json, every field type- and range-checked."""
    marker = f"{step_path}/{MARKER}" if url_scheme(step_path) else os.path.join(step_path, MARKER)
    try:
        if url_scheme(step_path):
            from trainer.checkpoint.objects import ObjectStore

            saved = loads_json(ObjectStore(step_path).read(MARKER, MARKER_LIMIT))
        else:
            saved = loads_json(read_bounded(marker, MARKER_LIMIT, "a kiln.json"))
    except (OSError, ValueError, CheckpointError) as e:
        raise ConfigError(f"{where}: cannot read {marker}: {e} (kiln needs the model shape stored with it)") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model_args"), dict):
        raise ConfigError(f"{where}: {marker} stores no model_args")
    return stored_model_args(saved["model_args"], f"{where}: {marker}")


def open_source(path: str) -> InitialSource:
    """Recognise and read the shape of checkpoint.initial_load_path (ConfigError naming it if unusable)."""
    where = f"{KEY} {path}"
    if url_scheme(path) is not None:
        return _open_url(path.rstrip("/"), where)
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: not a folder (give a Hugging Face model folder or a kiln checkpoint)")
    if is_hf_folder(path):
        try:
            return InitialSource(path, "hf", read_hf_args(path))
        except ConfigError as e:  # config.json's field, named under the key that pointed at it
            raise ConfigError(f"{KEY}: {e}") from None
    try:
        step = resolve_step_dir(path)
    except CheckpointError:
        raise ConfigError(
            f"{where}: neither a Hugging Face folder (no config.json) nor a kiln checkpoint (no .metadata, no "
            "complete step-N folder)"
        ) from None
    return InitialSource(step, "kiln", stored_kiln_args(step, where))


def _open_url(url: str, where: str) -> InitialSource:
    """open_source of an object-storage URL: the shape from config.json or kiln.json alone (nothing else read)."""
    from trainer.checkpoint.hf import CONFIG
    from trainer.checkpoint.objects import ObjectStore, newest_complete, top_names

    try:
        store = ObjectStore(url)
        top = top_names(store)
        if CONFIG in top:
            with tempfile.TemporaryDirectory(prefix="kiln-source-") as tmp:
                store.download(CONFIG, os.path.join(tmp, CONFIG))
                try:
                    return InitialSource(url, "hf", read_hf_args(tmp))
                except ConfigError as e:
                    raise ConfigError(f"{KEY}: {str(e).replace(tmp, url)}") from None
        if MARKER in top and ".metadata" in top:  # a step prefix, complete (kiln.json is written last)
            return InitialSource(url, "kiln", stored_kiln_args(url, where))
        entry = newest_complete(store)
    except CheckpointError as e:  # the store's line (no such bucket, network), under the key
        raise ConfigError(f"{KEY}: {e}") from None
    if entry is None:
        raise ConfigError(
            f"{where}: neither a Hugging Face folder (no config.json) nor a kiln checkpoint (no .metadata and "
            f"{MARKER}, no step-N completed by its {MARKER}) in object storage"
        )
    return InitialSource(entry.path, "kiln", stored_kiln_args(entry.path, where))


def check_not_inside(source: InitialSource, checkpoint_folder: str) -> None:
    """The run's checkpoint folder must be neither the source nor inside it, nor hold it (compared as URLs when
    either is one: a local folder and a URL never overlap)."""
    if (url_scheme(checkpoint_folder) is None) != (url_scheme(source.path) is None):
        return
    if url_scheme(checkpoint_folder) is not None:
        src, own, sep = source.path.rstrip("/"), checkpoint_folder.rstrip("/"), "/"
    else:
        src, own, sep = os.path.realpath(source.path), os.path.realpath(checkpoint_folder), os.sep
    for a, b in ((src, own), (own, src)):
        if a == b or a.startswith(b + sep):
            raise ConfigError(
                f"{KEY} {source.path} and this run's checkpoint folder {checkpoint_folder} overlap: the run would "
                "save into the folder it starts from; set checkpoint.folder (or job.dump_folder) elsewhere"
            )


def _model_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    from trainer.checkpoint.manager import plain_tensor

    return {k: plain_tensor(v) for k, v in get_model_state_dict(model).items()}


def _kept(target: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box of `target`'s global weight this rank keeps, (offset, shape); None for all of it. A DTensor sharded
    by plain Shard/Replicate placements keeps one box (kiln_base.internals.shard_offset); any other placement
    (FSDP's strided shard under TP) reads the whole weight and keeps its shard."""
    if not isinstance(target, DTensor) or not all(type(p) in (Shard, Replicate) for p in target.placements):
        return None
    shape, offset = shard_offset(target)
    return offset, shape


def _fill(target: torch.Tensor, part: torch.Tensor, box: Any) -> None:
    """Copy `part` into `target`: this rank's box of it, or (box None) the whole tensor, of which a DTensor keeps
    its shard; no communication."""
    part = part.to(dtype=target.dtype)
    if box is not None:
        (target.to_local() if isinstance(target, DTensor) else target).copy_(part)
    elif isinstance(target, DTensor):
        local = distribute_tensor(part, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(part)


@torch.no_grad()
def load_initial(
    source: InitialSource, model: nn.Module, held_elsewhere: Mapping[str, tuple[int, ...]] | None = None
) -> None:
    """Load the source's weights into `model` (built with source.args; sharded or not, float8 or not, a pipeline
    rank's stages: `held_elsewhere` names the weights other stages load). A URL's kiln step is read once: each rank
    fetches the bytes its own load plan reads (as a resume from object storage does); a URL's Hugging Face folder
    is downloaded whole on every rank. A download is deleted once loaded."""
    t0 = time.perf_counter()
    if url_scheme(source.path) is not None:
        from trainer.checkpoint.objects import download_prefix

        with tempfile.TemporaryDirectory(prefix="kiln-initial-") as local:
            try:
                if source.kind == "kiln":
                    _load_kiln(source.path, model, held_elsewhere, download=local)
                else:
                    download_prefix(source.path, local, hf=True)
                    _load_hf(dataclasses.replace(source, path=local), model, held_elsewhere)
            except (CheckpointError, ConfigError) as e:  # name the URL, not a download
                # Any rank's download: an agreed refusal names the folder of the rank that found it.
                copies = re.escape(os.path.dirname(local)) + r"/kiln-initial-[^/\s]+"
                if source.kind == "kiln":  # the step's files are in download/<step name>
                    copies += "/" + re.escape(os.path.basename(source.path)) + r"\b"
                raise type(e)(re.sub(copies, lambda _: source.path, str(e))) from None
    elif source.kind == "kiln":
        _load_kiln(source.path, model, held_elsewhere)
    else:
        _load_hf(source, model, held_elsewhere)
    logger.info(
        f"Loaded initial weights from {source.path} ({'Hugging Face' if source.kind == 'hf' else 'kiln'}) "
        f"in {time.perf_counter() - t0:.2f} s; training starts at step 0"
    )


def _load_hf(source: InitialSource, model: nn.Module, held_elsewhere: Mapping[str, tuple[int, ...]] | None) -> None:
    """The model's weights from Hugging Face folder source.path. Read once: each rank reads only the box of each
    weight it keeps (its shard) and none of the weights other stages hold; what each read is checked, and every
    rank raises the first refusal (agree)."""
    elsewhere = dict(held_elsewhere or {})
    targets = _model_targets(model)
    where = f"{KEY} {source.path}"
    tied = source.args.tie_word_embeddings
    error = None
    seen = set()
    # The shapes whole weights have (a box's tensor is smaller): the files' weights and the expert bias, which
    # no file holds (iter_hf_as_kiln yields it as zeros, in its box: empty for another stage's layer).
    args = source.args
    stored = kiln_shapes(args)
    stored |= {f"layers.{i}.{EXPERT_BIAS}": (args.moe_num_experts,) for i in range(args.n_layers if args.moe else 0)}
    boxes = {k: _kept(t) for k, t in targets.items()}
    boxes |= {k: ((0,) * len(s), (0,) * len(s)) for k, s in elsewhere.items() if k not in targets}
    for name, part in iter_hf_as_kiln(source.path, source.args, boxes.get):
        if name == "output.weight" and tied:
            continue  # a tied model's lm_head copy (some exports write it): HF ties it to the embedding
        target = targets.get(name)
        if target is None and name not in elsewhere:
            raise CheckpointError(f"{where} has weight '{name}', which this model lacks")
        shape = tuple(target.shape) if target is not None else elsewhere[name]
        # A box's weight has the shape its file's header declared, checked against config.json's model.
        got = tuple(part.shape) if boxes.get(name) is None else stored.get(name, tuple(part.shape))
        if got != shape:
            raise CheckpointError(f"{where}: '{name}' has shape {got} there but {shape} in this model")
        try:
            check_loaded_state({name: part}, source.path, None, 0)
        except CheckpointError as e:
            error = error or str(e)
        if target is not None and error is None:
            _fill(target, part.to(target.device), boxes[name])
        seen.add(name)
    missing = sorted((set(targets) | set(elsewhere)) - seen - ({"output.weight"} if tied else set()))
    if missing:
        raise CheckpointError(f"{where} has no weight for '{missing[0]}'")
    error = agree(error)
    if error is not None:
        raise CheckpointError(error)
    set_model_state_dict(model, dict(targets))  # a fresh dict[str, Any]: the API's value type is wider


def _load_kiln(
    path: str, model: nn.Module, held_elsewhere: Mapping[str, tuple[int, ...]] | None, download: str | None = None
) -> None:
    """The model's weights from kiln step `path`: a local folder, or (with `download`, an empty local folder) an
    object-storage step of which this rank fetches its planned bytes there."""
    from trainer.checkpoint.manager import check_matches, fetch_checked
    from trainer.checkpoint.reader import load

    targets = _model_targets(model)
    if download is None:
        md = read_metadata(path)
        check_matches(path, targets, md, weights_only=True, held_elsewhere=dict(held_elsewhere or {}))
        verify(path)  # a torchtitan or converted checkpoint (no checksums): one line, unverified
        local = path
    else:
        from trainer.checkpoint.objects import download_step, step_entry

        entry = step_entry(path)
        local = download_step(entry, download)  # its head (.metadata, kiln.json), in download/<step name>
        md = read_metadata(local, entry.sizes)  # the index against the listed objects' sizes
        check_matches(path, targets, md, weights_only=True, held_elsewhere=dict(held_elsewhere or {}))
        fetch_checked(entry, local, targets, md)  # read once, as a resume from a URL
    load(targets, local, md)
    error = None
    try:
        check_loaded_state(targets, path, None, 0)  # this rank's shards; all ranks raise the first refusal
    except CheckpointError as e:
        error = str(e)
    error = agree(error)
    if error is not None:
        raise CheckpointError(error)
    set_model_state_dict(model, dict(targets))
