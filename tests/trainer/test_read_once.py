"""Read once: a load on N ranks reads about one checkpoint from storage in all, not N (docs/checkpoint.md, "Read
once"). Measured as benchmarks/read_once.py measures it: the bytes kiln's read functions take from storage."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from benchmarks import read_once
from tests.helpers.s3_server import S3Server
from trainer.checkpoint.hf import iter_hf_as_kiln, kiln_shapes

ARGS = dataclasses.replace(read_once.model_args(64, 1), n_heads=4, n_kv_heads=2)  # 16-row heads


def test_a_box_of_each_hf_weight_is_that_box_of_the_whole_weight(tmp_path: Path) -> None:
    """Boxes that cut q/k heads in two (their rows are permuted per head), columns, a 1-D norm, an empty box: each
    is the same box of the whole weight, and only about its bytes are read."""
    read_once.write_hf(str(tmp_path), ARGS)
    whole = dict(iter_hf_as_kiln(str(tmp_path), ARGS))
    shapes = kiln_shapes(ARGS)

    def box(name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = shapes[name]
        if name == "norm.weight":
            return (0,), (0,)  # nothing kept here
        lo = shape[0] // 3 + 5  # inside a head, not at its start
        return (lo, *([3] * (len(shape) - 1))), (shape[0] // 2, *([s - 3 for s in shape[1:]]))

    with read_once.counting() as count:
        parts = dict(iter_hf_as_kiln(str(tmp_path), ARGS, box))
    assert set(parts) == set(whole)
    for name, part in parts.items():
        (off, shape), w = box(name), whole[name]
        assert torch.equal(part, w[tuple(slice(o, o + n) for o, n in zip(off, shape))]), name
    kept = sum(p.numel() * p.element_size() for p in parts.values())
    # q/k are read by whole heads: at most two 16-row heads more per weight
    assert kept <= count["safetensors"] <= kept + 2 * 2 * 16 * ARGS.dim * 4


@pytest.mark.distributed
def test_two_ranks_each_read_half_the_checkpoint_and_load_what_was_saved(tmp_path: Path, s3: S3Server) -> None:
    """2 FSDP ranks: a Hugging Face initial load takes about half the safetensors bytes per rank, an s3:// resume
    and an initial load from the same s3:// checkpoint fetch about half the step's objects per rank; each loads the
    weights one rank loads, or that were saved."""
    hf = read_once.measure("hf", 2, 64, 1, str(tmp_path))
    torch.manual_seed(0)
    model = read_once.Transformer(read_once.model_args(64, 1))
    model.init_weights()
    assert hf["states"] == [read_once.full_state(model)] * 2
    assert all(0.4 * hf["size"] < n < 0.6 * hf["size"] for n in hf["per_rank"]), (hf["per_rank"], hf["size"])
    s3_load = read_once.measure("s3", 2, 64, 1, str(tmp_path), s3)
    assert s3_load["states"] == [s3_load["saved"]] * 2
    assert all(0.4 * s3_load["size"] < n < 0.65 * s3_load["size"] for n in s3_load["per_rank"]), s3_load
    # checkpoint.initial_load_path of that s3:// checkpoint: its weights, each rank fetching about half the step
    # (its own file whole, for the checksum; every rank downloaded the whole step before)
    initial = read_once.measure("s3_initial", 2, 64, 1, str(tmp_path), s3)
    assert initial["states"] == [initial["saved"]] * 2
    assert all(0.4 * initial["size"] < n < 0.65 * initial["size"] for n in initial["per_rank"]), initial


def test_a_range_one_rank_fetched_is_checked_against_the_owners_copy(tmp_path: Path) -> None:
    """The owner of a file (it has it whole, its checksum checked) refuses a range another rank fetched whose bytes
    differ from its copy's; ranges of files it does not hold are the other owners' to check."""
    import zlib

    from trainer.checkpoint.objects import range_mismatch

    (tmp_path / "__1_0.distcp").write_bytes(bytes(range(200)))
    good = ("__1_0.distcp", 10, 50, zlib.crc32(bytes(range(10, 60))))
    bad = ("__1_0.distcp", 10, 50, zlib.crc32(bytes(range(11, 61))))
    assert range_mismatch(str(tmp_path), {"__1_0.distcp"}, [good], "s3://b/step-1") is None
    assert range_mismatch(str(tmp_path), set(), [bad], "s3://b/step-1") is None
    error = range_mismatch(str(tmp_path), {"__1_0.distcp"}, [good, bad], "s3://b/step-1")
    assert error is not None and error.startswith("checkpoint file s3://b/step-1/__1_0.distcp is damaged: bytes 10-60")


def test_a_nan_in_the_part_a_rank_reads_is_refused(tmp_path: Path) -> None:
    """The finiteness check runs on what was read (each rank its box; every rank raises the first refusal)."""
    from safetensors.torch import load_file, save_file

    from kiln_base.errors import CheckpointError
    from trainer.checkpoint.initial_load import load_initial, open_source

    read_once.write_hf(str(tmp_path), ARGS)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, str(tmp_path / "model.safetensors"))
    source = open_source(str(tmp_path))
    with pytest.raises(CheckpointError, match="'norm.weight' holds NaN or infinite values"):
        load_initial(source, read_once.Transformer(source.args))


def test_an_hf_moe_loads_into_one_pipeline_stage(tmp_path: Path) -> None:
    """A Qwen3-MoE folder into a stage holding layer 0 only (PP 2's first stage): the expert bias of layer 1, in no
    HF file and held by the other stage, is not refused for the empty box this stage reads of it; layer 0 gets the
    weights a whole-model load gives."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from models import Transformer
    from trainer.checkpoint.initial_load import load_initial, open_source

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    source = open_source(str(tmp_path))
    whole = Transformer(source.args)
    load_initial(source, whole)
    stage = Transformer(source.args)
    del stage.layers["1"]
    stage.norm, stage.output = None, None  # type: ignore[assignment]
    kept = stage.state_dict()
    elsewhere = {k: tuple(v.shape) for k, v in whole.state_dict().items() if k not in kept}
    assert "layers.1.moe.expert_bias" in elsewhere
    load_initial(source, stage, elsewhere)
    assert kept and all(torch.equal(v, whole.state_dict()[k]) for k, v in stage.state_dict().items())


def _initial_load_outcome(url: str, env: dict[str, str], failing_rank: int | None = None) -> str:
    """On a rank: checkpoint.initial_load_path `url` into a fresh sharded model; the refusal, or "loaded". On
    `failing_rank` every download of a `.distcp` object fails (as after the store's retries)."""
    import torch.distributed as dist

    from kiln_base.errors import CheckpointError
    from trainer.checkpoint import objects
    from trainer.checkpoint.initial_load import load_initial, open_source

    os.environ.update(env)
    if dist.get_rank() == failing_rank:
        real = objects.ObjectStore.download

        def download(store: objects.ObjectStore, name: str, local: str) -> None:
            if name.endswith(".distcp"):
                raise CheckpointError(f"object storage: downloading {store.where(name)} failed: injected")
            real(store, name, local)

        objects.ObjectStore.download = download  # type: ignore[method-assign]
    source = open_source(url)
    try:
        load_initial(source, read_once.sharded_model(source.args, seed=1))
    except CheckpointError as e:
        return str(e)
    return "loaded"


@pytest.mark.distributed
def test_a_damaged_or_missing_file_of_a_url_initial_load_stops_both_ranks_naming_the_object(
    tmp_path: Path, s3: S3Server
) -> None:
    """2 FSDP ranks, an initial load from an s3:// step: a flipped bit in rank 0's file (which rank 0 fetches whole
    and checks) and a file deleted from the bucket (rank 1 downloads it) each stop both ranks with the same line
    naming the object, never a rank's download folder (the other rank's, in the agreed line, was left before), and
    so does a download failing on one rank; a step at the top of a bucket loads."""
    from tests.helpers.distributed import run_distributed

    read_once.measure("s3_initial", 2, 64, 1, str(tmp_path), s3)  # a step saved on 2 ranks, loaded as is
    folder = f"s3_initial-2-{os.getpid()}"
    keys = [k for k in s3.keys(folder) if k.startswith("step-1/")]
    s3.fs.mkdir("top")
    for key in keys:  # a copy at the top of its own bucket
        s3.fs.pipe_file(f"top/{key.removeprefix('step-1/')}", s3.read(f"{folder}/{key}"))
    assert run_distributed(_initial_load_outcome, 2, "s3://top", s3.env) == ["loaded", "loaded"]
    good = s3.read(f"{folder}/step-1/__0_0.distcp")
    data = bytearray(good)
    data[len(data) // 2] ^= 0x01
    s3.write(f"{folder}/step-1/__0_0.distcp", bytes(data))
    url = s3.url(folder)
    flipped = run_distributed(_initial_load_outcome, 2, url, s3.env)
    assert flipped[0] == flipped[1] and flipped[0].startswith(f"checkpoint file {url}/step-1/__0_0.distcp is damaged")
    s3.write(f"{folder}/step-1/__0_0.distcp", good)
    # A download that fails on rank 1 alone (rank 1 fetches __1_0.distcp whole): rank 0 learns it, not left waiting
    # in the next collective until the launcher ends it (its download left behind)
    failed = run_distributed(_initial_load_outcome, 2, url, s3.env, 1)
    assert failed[0] == failed[1] and failed[0].endswith("__1_0.distcp failed: injected"), failed
    s3.remove(f"{folder}/step-1/__1_0.distcp")
    missing = run_distributed(_initial_load_outcome, 2, url, s3.env)
    assert missing[0] == missing[1] and f"{url}/step-1/__1_0.distcp" in missing[0], missing
    assert "kiln-initial-" not in missing[0] + flipped[0]
