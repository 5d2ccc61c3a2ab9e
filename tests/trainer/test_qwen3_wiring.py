"""`model.name qwen3` wired through the config, the build, the dry run and the initial load.

The family table (kiln_base.config.MODEL_FAMILIES, models.args.FAMILIES) against itself; model.flavor checked
against model.name's family; a stored shape of the other family refused; the Llama FFN overrides refused where the
flavor gives its width; MoE with TP refused; the plan's parameter count against the built model; the seeded init of
an expert weight sharded on the experts; the dry run's total and active parameters and the q/k norms' TP style; and
a run started from a Qwen3-MoE folder saved by transformers, whose first step's loss is transformers' on the batch,
and the same folder through scripts/convert_hf.py from_hf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln_base.config import MODEL_FAMILIES, check_parallel_plan, parse_args
from kiln_base.config.plan import model_params
from kiln_base.errors import ConfigError
from models import LLAMA3_FLAVORS, QWEN3_FLAVORS, Transformer, num_params
from models.args import FAMILIES
from models.init import trunc
from parallelisms.seeded_init import draw_shard
from tests.helpers.common import DEBUG_CONFIG, open_trainer, tiny_run_args
from tests.helpers.scripts import load_script
from trainer import build
from trainer.checkpoint.initial_load import InitialSource
from trainer.hooks import StepHook, StepOutput
from trainer.tools.dry_run import dry_run

VOCAB = 2256  # the bundled tokenizer's


def test_family_table_names_each_flavor_once() -> None:
    assert list(FAMILIES) == list(MODEL_FAMILIES) == ["llama3", "qwen3"]
    for name, flavors in FAMILIES.items():
        assert set(flavors) == set(MODEL_FAMILIES[name]) and len(flavors) == len(MODEL_FAMILIES[name]), name
    assert FAMILIES["llama3"] is LLAMA3_FLAVORS and FAMILIES["qwen3"] is QWEN3_FLAVORS  # one dict: tests patch it


@pytest.mark.parametrize(
    ("name", "flavor", "error"),
    [
        ("qwen3", "debugmodel_moe", None),
        ("qwen3", "30B-A3B", None),
        ("llama3", "debugmodel_flex_attn", None),
        ("qwen3", "3.2-1B", "model.flavor '3.2-1B' is not a model.name qwen3 flavor; choose from debugmodel, "),
        ("llama3", "debugmodel_moe", "model.flavor 'debugmodel_moe' is not a model.name llama3 flavor; choose from"),
        ("qwen4", "debugmodel", "'qwen4' is not a valid choice; choose from llama3, qwen3"),
    ],
)
def test_flavor_checked_against_the_family(name: str, flavor: str, error: str | None) -> None:
    argv = ["--model.name", name, "--model.flavor", flavor, "--job.dry_run"]
    if error is None:
        assert parse_args(argv).model.flavor == flavor
        return
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert error in str(e.value) and "\n" not in str(e.value), str(e.value)
    if "is not a model.name" in error:
        assert str(e.value).endswith(", from_checkpoint")


def _cfg(*args: str) -> Any:
    return parse_args(["--job.config_file", DEBUG_CONFIG, "--job.dry_run", *args])


def test_stored_shape_of_the_other_family_refused() -> None:
    llama = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=VOCAB)
    qwen = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], vocab_size=VOCAB)
    stored = ("--model.flavor", "from_checkpoint", "--checkpoint.initial_load_path", "/tmp")
    for name, args, other in (("qwen3", llama, "llama3"), ("llama3", qwen, "qwen3")):
        m = _cfg("--model.name", name, *stored).model
        with pytest.raises(
            ConfigError, match=f"holds a {other} model but model.name is {name}; set model.name {other}"
        ):
            build.model_args(m, 32, VOCAB, InitialSource("/src", "hf", args))
    got = build.model_args(_cfg("--model.name", "qwen3", *stored).model, 32, VOCAB, InitialSource("/src", "hf", qwen))
    assert got.moe_num_experts == 8 and got.max_seq_len == 32


def test_llama_ffn_overrides_refused_where_the_flavor_gives_the_width() -> None:
    m = _cfg("--model.name", "qwen3", "--model.multiple_of", "512").model
    with pytest.raises(
        ConfigError, match="model.multiple_of is set, but model.name qwen3 flavor debugmodel has its FFN"
    ):
        build.model_args(m, 32, VOCAB)
    args = build.model_args(_cfg("--model.name", "qwen3", "--model.dim", "128").model, 32, VOCAB)
    assert (args.dim, args.ffn_dim, args.head_dim) == (128, 768, 32)  # the other overrides apply
    assert build.model_args(_cfg("--model.multiple_of", "512").model, 32, VOCAB).multiple_of == 512  # llama3's rule


def test_moe_with_tensor_parallel_refused() -> None:
    cfg = _cfg("--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.tensor_parallel_degree", "2")
    shape = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], vocab_size=VOCAB).shape()
    with pytest.raises(ConfigError, match="parallelism.tensor_parallel_degree 2 with a mixture-of-experts model"):
        check_parallel_plan(cfg, shape, "cpu")
    dense = dataclasses.replace(QWEN3_FLAVORS["debugmodel"], vocab_size=VOCAB).shape()
    check_parallel_plan(cfg, dense, "cpu")


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe", "0.6B", "30B-A3B"])
def test_plan_counts_the_parameters_the_model_builds(flavor: str) -> None:
    """The launcher's memory check counts from the shape (kiln_base.config.plan.model_params): the built model's."""
    args = QWEN3_FLAVORS[flavor]
    args = dataclasses.replace(args, vocab_size=VOCAB) if args.vocab_size < 0 else args
    with torch.device("meta"):
        model = Transformer(args)
    assert model_params(args.shape()) == num_params(model)


def test_expert_weights_drawn_by_expert_shard_are_the_whole_tensors() -> None:
    """FSDP shards an expert weight [E, out, in] on dim 0, unevenly too: each shard holds the whole tensor's values."""
    full_shape, gen = (5, 6, 4), torch.Generator()
    whole = draw_shard(
        trunc(0.02), 7, "layers.0.moe.experts.w1", full_shape, full_shape, (0, 0, 0), torch.device("cpu"), gen
    )
    parts = [
        draw_shard(
            trunc(0.02), 7, "layers.0.moe.experts.w1", full_shape, (n, 6, 4), (e0, 0, 0), torch.device("cpu"), gen
        )
        for e0, n in ((0, 3), (3, 2))
    ]
    assert torch.equal(torch.cat(parts), whole) and whole.std() > 0.01
    assert not torch.equal(whole[0], whole[1])  # each expert its own values


def test_expert_weights_drawn_by_part_of_each_expert_are_the_whole_tensors() -> None:
    """Fewer experts than the ranks sharding them (EP 2 x efsdp 2 with 2 experts): FSDP shards dim 1, each rank
    holding part of an expert's rows; each part holds the whole tensor's values (it used to fail an assertion)."""
    full_shape, gen = (2, 6, 4), torch.Generator()
    fqn, init = "layers.0.moe.experts.w1", trunc(0.02)
    whole = draw_shard(init, 7, fqn, full_shape, full_shape, (0, 0, 0), torch.device("cpu"), gen)
    for e0, o0, n in ((0, 0, 3), (0, 3, 3), (1, 0, 3), (1, 2, 4), (0, 1, 2)):
        part = draw_shard(init, 7, fqn, full_shape, (1, n, 4), (e0, o0, 0), torch.device("cpu"), gen)
        assert torch.equal(part, whole[e0 : e0 + 1, o0 : o0 + n]), (e0, o0, n)
    both = draw_shard(init, 7, fqn, full_shape, (2, 3, 2), (0, 3, 2), torch.device("cpu"), gen)
    assert torch.equal(both, whole[:, 3:, 2:])


def test_dry_run_prints_total_and_active_params_and_the_qk_norm_tp_style() -> None:
    moe = dry_run(_cfg("--model.name", "qwen3", "--model.flavor", "debugmodel_moe"))
    assert "kiln dry run: qwen3 debugmodel_moe, 4 layers, MoE 8 experts (top 2)" in moe
    assert "parameters: 5,097,984 total, 2,738,688 active per token (53.7%)" in moe, moe
    assert "an MoE's FLOPs count its active parameters" in moe
    dense = dry_run(_cfg("--model.name", "qwen3", "--parallelism.tensor_parallel_degree", "2"))
    norm = next(line for line in dense.splitlines() if line.split()[0] == "layers.*.attention.q_norm")
    assert "SequenceParallel" in norm and "replicated" in norm, norm
    assert "active per token" not in dense
    # Without the tokenizer file the plan takes the flavor's published vocabulary (Qwen's 151,936 tokens).
    published = dry_run(_cfg("--model.name", "qwen3", "--model.flavor", "30B-A3B", "--model.tokenizer_path", "/none"))
    assert "parameters: 30,532,122,624 total, 3,353,032,704 active per token" in published, published.splitlines()[:2]


class FirstBatch:
    """Stands in for the step's data loader (trainer.train_step.dataloader = FirstBatch(...)), keeping the batches."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.batches = loader, list[tuple[torch.Tensor, ...]]()

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        self.batches.append(next(self.loader))
        return self.batches[-1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class Losses(StepHook):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def post_step(self, out: StepOutput) -> None:
        self.losses.append(float(out.loss))


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny Qwen3-MoE saved by transformers' save_pretrained (per-expert safetensors names), and the model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hf_config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    )  # fmt: skip
    hf = Qwen3MoeForCausalLM(hf_config).eval()
    with torch.no_grad():  # a decisive router and random norms, so that routing and the norms' layout show
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    hf.save_pretrained(folder)
    return folder, hf


def test_run_from_a_transformers_qwen3_moe_folder_starts_at_its_loss(moe_folder: tuple, tmp_path: Path) -> None:
    """checkpoint.initial_load_path at a Qwen3-MoE folder written by transformers' save_pretrained, model.flavor
    from_checkpoint: step 1's loss (before any update) is transformers' cross-entropy on step 1's batch."""
    folder, hf = moe_folder
    argv = tiny_run_args(
        *("--model.name", "qwen3", "--model.flavor", "from_checkpoint", "--training.steps", "1"),
        *("--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(tmp_path / "run")),
    )
    hook = Losses()
    with open_trainer(argv) as trainer:
        assert trainer.model.model_args.moe_num_experts == 4
        trainer.train_step.dataloader = data = FirstBatch(trainer.train_step.dataloader)
        trainer.train([hook])
    inputs, labels = data.batches[0][:2]
    with torch.no_grad():
        logits = hf(inputs).logits
    expected = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).item()
    assert len(hook.losses) == 1 and abs(hook.losses[0] - expected) <= 1e-5 * expected, (hook.losses, expected)
    other = F.cross_entropy(logits.flatten(0, 1), labels.roll(1, dims=1).flatten()).item()
    assert abs(other - expected) > 1e-2  # the comparison can tell another batch's loss


def test_convert_from_hf_computes_the_transformers_logits(moe_folder: tuple, tmp_path: Path) -> None:
    """scripts/convert_hf.py from_hf on the same folder: a kiln step whose model computes transformers' logits."""
    folder, hf = moe_folder
    conv = load_script("convert_hf")
    assert conv.main(["from_hf", str(folder), str(tmp_path / "kiln")]) == 0
    sd, args = conv.load_kiln_weights(str(tmp_path / "kiln" / "step-0"))
    assert (args.moe_num_experts, args.moe_top_k, args.head_dim, args.qk_norm) == (4, 2, 16, True)
    model = Transformer(args)
    model.load_state_dict(sd)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
