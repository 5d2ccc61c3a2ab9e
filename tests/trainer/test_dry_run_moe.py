"""The dry run's MoE plan against what a run holds: the parameters, gradients and AdamW state of each rank with the
routed experts over EP x efsdp (each EP rank E / ep experts, FSDP-sharded over efsdp = dp_shard / ep) and the rest
over dp_shard, as the ranks of a real EP 2 x efsdp 2 run hold them after a step; the activations an MoE block keeps
(its tokens' dispatched copies) against the saved-activation report; and the published 235B-A22B under EP 8 on 64
ranks plans on a CPU."""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from kiln_base.config import (
    ActivationCheckpoint,
    Degrees,
    JobConfig,
    RunPlan,
    SequenceSplit,
    Training,
    memory_estimate,
    parse_args,
    training_bytes,
)
from kiln_base.config.plan import BatchPlan, model_params
from kiln_base.internals import checkpoint_wrapper
from models import QWEN3_FLAVORS, Transformer, moe_layers
from parallelisms.activation_checkpoint import SAC_SAVE_LIST, sac_context_fn
from tests.helpers.common import tiny_run_args
from tests.helpers.distributed import run_distributed, train_in_group
from trainer.build import local_params
from trainer.tools.dry_run import dry_run
from trainer.tools.saved_activations import measure_saved_activations

# debugmodel_moe at 2 layers (dim 256, 8 heads of 32, 4 KV heads, 8 experts of width 128, top 2, vocab 2256): on
# 4 ranks every sharded dim divides (vocab 564, dim 64, q/k norms 8 a rank; EP 2 x efsdp 2: 2 experts a rank).
MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.n_layers", "2")
EP = ("--parallelism.expert_parallel_degree", "2")


def _argv(dump: str) -> list[str]:
    return tiny_run_args(*MOE, *EP, "--training.steps", "1", "--job.dump_folder", dump)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _held_after_a_step(folder: str) -> dict[str, Any]:
    """On each rank: one training step of the EP 2 x efsdp 2 run, then the bytes this rank holds (its shards)."""
    trainer = train_in_group(_argv(f"{folder}/run"), f"{folder}/store")
    params = list(trainer.model.parameters())
    experts = [p for moe in moe_layers(trainer.model) for p in moe.experts.parameters()]
    state = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return {
        "params": sum(_local(p).numel() for p in params),
        "experts": sum(_local(p).numel() for p in experts),
        "param_bytes": _bytes(params),
        "grad_bytes": _bytes([p.grad for p in params if p.grad is not None]),
        "adam_bytes": _bytes(state),
        "w1": tuple(_local(moe_layers(trainer.model)[0].experts.w1).shape),
    }


def _mib(plan: str, name: str) -> str:
    match = re.search(rf"^  {re.escape(name)} +([\d.]+) MiB$", plan, re.M)
    assert match, plan
    return match.group(1)


@pytest.mark.distributed
def test_the_dry_run_gives_each_rank_the_shards_an_ep_run_holds(tmp_path: Path) -> None:
    ranks = run_distributed(_held_after_a_step, 4, str(tmp_path))
    cfg = parse_args([*_argv(str(tmp_path / "dry")), "--job.dry_run"])
    plan = dry_run(cfg, 4)
    assert "expert parallel: dp_shard 4 = efsdp 2 x ep 2; each EP rank holds 4 of every MoE layer's 8 experts" in plan
    assert "(a rank's w1: [2, 128, 256] of [8, 128, 256])" in plan, plan
    held = re.search(r"a rank holds: ([\d,]+) of the experts' .* \+ ([\d,]+) of the other .* = ([\d,]+)", plan)
    assert held, plan
    experts, rest, total = (int(g.replace(",", "")) for g in held.groups())
    shape = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], vocab_size=2256, n_layers=2).shape()
    for r in ranks:  # every rank alike: all of the model's dims divide over 4
        assert r["w1"] == (2, 128, 256)
        assert (r["experts"], r["params"] - r["experts"], r["params"]) == (experts, rest, total)
        assert r["param_bytes"] == r["grad_bytes"] == 4 * total and r["adam_bytes"] == 8 * total
        mib = {k: f"{v / 2**20:.2f}" for k, v in (("p", r["param_bytes"]), ("a", r["adam_bytes"]))}
        assert (_mib(plan, "params (fp32)"), _mib(plan, "grads (fp32)")) == (mib["p"], mib["p"])
        assert _mib(plan, "optimizer (AdamW m+v fp32)") == mib["a"]
        # The plan's own count (the launcher's start-up check), from the shape alone: experts over ep x efsdp and
        # the rest over dp_shard come to one division by dp_shard.
        assert training_bytes(shape, Degrees(1, 1, 4, 1, 1, ep=2).param_shards) == 16 * total
    assert total * 4 == model_params(shape)  # nothing held twice, nothing missing


def test_235b_a22b_with_ep_8_plans_on_64_ranks() -> None:
    argv = ["--model.name", "qwen3", "--model.flavor", "235B-A22B", "--model.tokenizer_path", "/none", "--job.dry_run"]
    argv += ["--parallelism.data_parallel_shard_degree", "64", "--parallelism.expert_parallel_degree", "8"]
    plan = dry_run(parse_args(argv))
    assert "kiln dry run: qwen3 235B-A22B, 94 layers, MoE 128 experts (top 8)" in plan, plan
    assert "parameters: 235,093,634,560 total, 22,190,763,520 active per token (9.4%)" in plan, plan
    assert "simulated world: 64 = dp_replicate 1 x dp_shard 64 x tp 1" in plan
    assert "dp_shard 64 = efsdp 8 x ep 8; each EP rank holds 16 of every MoE layer's 128 experts" in plan
    assert "(a rank's w1: [2, 1536, 4096] of [128, 1536, 4096])" in plan
    assert re.search(r"^  total +[\d.]+ GiB$", plan, re.M), plan


# ----------------------------------------------------------------------------- activations

SEQ, LAYERS = 64, 2


ARGS = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], vocab_size=2256, max_seq_len=SEQ, n_layers=LAYERS)


def _moe_model(save_list: frozenset | None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    if save_list is not None:
        for name, block in model.layers.named_children():
            wrapped = checkpoint_wrapper(block, context_fn=partial(sac_context_fn, None, save_list))
            model.layers.register_module(name, wrapped)
    return model


# Measured (torch 2.13, CPU, float32), the blocks' estimate / report: no AC 0.82 (0.65 without the dispatched
# copies, 2 x top_k x dim a token), per-op SAC 0.98 (1.53 with the dense FFN's w1 and w2 outputs counted as saved).
TOLERANCE = {True: 0.25, False: 0.05}  # no AC: RMSNorm's and RoPE's intermediates are not all counted


@pytest.mark.parametrize("save_list", [None, SAC_SAVE_LIST], ids=["no_ac", "per_op_sac"])
def test_moe_activation_estimate_matches_report(save_list: frozenset | None) -> None:
    """The estimate of what an MoE block keeps (with its 2 x top_k x dim dispatched copies per token) against the
    bytes the saved-activation report measures, float32 on a CPU."""
    model = _moe_model(save_list)
    tokens = torch.randint(0, 2256, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def loss() -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    measured = measure_saved_activations(model, loss)
    ac = ActivationCheckpoint(mode="none") if save_list is None else ActivationCheckpoint("selective", "op")
    cfg = JobConfig(training=Training(local_batch_size=2, seq_len=SEQ), activation_checkpoint=ac)
    degrees = Degrees(1, 1, 1, 1, 1)
    plan = RunPlan(degrees, SequenceSplit(1, False), BatchPlan.of(cfg, degrees), pipeline=None, shape=ARGS.shape())
    est = memory_estimate(cfg, plan, local_params(model), "cpu")
    tokens_in = 2 * SEQ
    # The blocks' part of both: the estimate without its logits term (float32 logits + log-softmax, 8 bytes x vocab
    # a token), the report without the log-softmax and the final RMSNorm's input, normalised input and output.
    blocks = est["activations (one micro-batch)"] - tokens_in * 8 * ARGS.vocab_size
    kept = measured.total_bytes - measured.bytes_of("aten._log_softmax") - 3 * tokens_in * ARGS.dim * 4
    assert abs(blocks / kept - 1) < TOLERANCE[save_list is None], (blocks, kept, measured.format())
