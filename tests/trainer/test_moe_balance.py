"""MoE load balancing in the step (trainer/step/moe_balance.py), on a tiny Qwen3 MoE built in-process: the logged
loss is the cross-entropy while the gradient is that of CE + coeff x aux; the expert bias moves by expert_bias_step
of the step's counts (summed over 2 gloo ranks); the counts reset; moe_imbalance is max/mean. Each against an
autograd reference computed here from the model's own forward, not against constants."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.optim.lr_scheduler import LambdaLR

from kiln_base.config import JobConfig, Model, check_moe_balance, parse_args
from kiln_base.config.plan import Degrees
from kiln_base.errors import ConfigError
from models import QWEN3_FLAVORS, Transformer, load_balance_loss, moe_layers
from models.moe import expert_bias_step
from parallelisms.parallel_dims import ParallelDims
from tests.helpers.distributed import run_distributed
from trainer import build
from trainer.components.loss import cross_entropy_loss
from trainer.components.metrics import MetricsLogger
from trainer.hooks import MetricsHook, StepOutput
from trainer.step.step import TrainStep

VOCAB, SEQ, BATCH, ACCUM = 64, 8, 2, 2
ARGS = dataclasses.replace(
    QWEN3_FLAVORS["debugmodel_moe"],
    dim=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    ffn_dim=64,
    moe_num_experts=4,
    moe_hidden_dim=16,
    vocab_size=VOCAB,
    max_seq_len=SEQ,
)


def _model(checkpointed: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    if checkpointed:  # eager activation checkpointing: the recompute replays the layers' counts
        for name, block in list(model.layers.items()):
            model.layers[name] = checkpoint_wrapper(block)
    return model


def _batches(seed: int, words: tuple[int, int] = (0, VOCAB)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step's micro-batches of random token ids from `words` [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(*words, (BATCH, SEQ + 1), generator=g) for _ in range(ACCUM)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _step(model: Transformer, batches: list, bias: float, aux: float, dims: ParallelDims | None = None) -> TrainStep:
    """The plain step over `batches` (one step's micro-batches), wrapped as the build wraps it."""
    dims = dims or ParallelDims(Degrees(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    built = build.BuiltModel(
        model=model, parts=[model], args=ARGS, n_params=0, n_active_params=0, flops_per_token=0.0,
        flops_per_token_by_convention={},
        linear_fqns=[], tp_plan={},
    )  # fmt: skip
    cfg = Model(moe_load_balance_coeff=bias, moe_aux_loss_coeff=aux)
    step = TrainStep(
        model=model, optimizer=optimizer, lr_scheduler=LambdaLR(optimizer, lambda _: 1.0),
        dataloader=iter(batches * 4), dims=dims, grad_accum_steps=ACCUM, loss_fn=cross_entropy_loss,
        amp=contextlib.nullcontext(), loss_parallel=False, cp=None, max_norm=0.0, device=torch.device("cpu"),
        wrappers=[build.moe_balance(cfg, built, dims, torch.device("cpu"))],
    )  # fmt: skip
    build.wrap_step(JobConfig(), None, step, None)  # type: ignore[arg-type]  # the resume's wrappers: none here
    return step


def _reference(batches: list, aux_coeff: float) -> tuple[Transformer, torch.Tensor, torch.Tensor]:
    """The step's math by hand on a fresh copy of the model: per micro-batch CE + coeff x aux, backward / ACCUM.
    Returns the model (its grads, its layers' counts) and the mean CE and mean aux."""
    model = _model()
    ce_sum, aux_sum = torch.zeros(()), torch.zeros(())
    for inputs, labels in batches:
        ce = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        aux = load_balance_loss(model.router_stats)
        assert aux is not None
        ((ce + aux_coeff * aux) / ACCUM).backward()
        ce_sum, aux_sum = ce_sum + ce.detach(), aux_sum + aux.detach()
    return model, ce_sum / ACCUM, aux_sum / ACCUM


def _counts(model: Transformer) -> list[torch.Tensor]:
    return [m.tokens_per_expert.clone() for m in moe_layers(model)]


def _imbalance(counts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([c.max() / c.mean() for c in counts]).max()


def test_logged_loss_is_the_cross_entropy_and_the_gradient_carries_the_aux_loss() -> None:
    coeff, batches = 0.5, _batches(0)
    model = _model()
    result = _step(model, batches, bias=0.0, aux=coeff)(1)
    ref, ce, aux = _reference(batches, coeff)
    torch.testing.assert_close(result.loss, ce)  # the logged loss: the cross-entropy alone
    torch.testing.assert_close(result.scalars["aux_loss"], aux)  # the mean over the micro-batches, unscaled
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, msg=name)
    # The aux term is there: the router's gradient of CE alone differs from the step's.
    ce_only, _, _ = _reference(batches, 0.0)
    gate = "layers.0.moe.router.gate.weight"
    assert not torch.allclose(dict(ce_only.named_parameters())[gate].grad, grads[gate], atol=1e-6)


def test_no_aux_loss_at_coefficient_0() -> None:
    batches = _batches(0)
    model = _model()
    result = _step(model, batches, bias=0.0, aux=0.0)(1)
    ref, ce, _ = _reference(batches, 0.0)
    torch.testing.assert_close(result.loss, ce)
    assert "aux_loss" not in result.scalars and "moe_imbalance" in result.scalars
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "activation_checkpointing"])
def test_bias_moves_by_the_step_of_this_steps_counts_then_they_reset(checkpointed: bool) -> None:
    """Counts left over from before the step (a validation forward) are dropped at its start; the bias moves by
    expert_bias_step of the step's own counts, the same under eager activation checkpointing (which counts a
    recomputed layer twice); moe_imbalance is the largest max/mean over the layers; the counts are zero after."""
    coeff, batches = 1e-3, _batches(1)
    model = _model(checkpointed)
    step = _step(model, batches, bias=coeff, aux=0.0)
    for m in moe_layers(model):
        m.tokens_per_expert[0] += 1e6  # would flip the step's sign for every other expert
    ref, _, _ = _reference(batches, 0.0)
    want = _counts(ref)
    step.start(None)  # type: ignore[arg-type]  # the loop's call before each step
    result = step(1)
    for m, counts in zip(moe_layers(model), want, strict=True):
        torch.testing.assert_close(m.expert_bias, expert_bias_step(counts, coeff))
        assert m.expert_bias.abs().sum() > 0
        assert m.tokens_per_expert.sum() == 0
    torch.testing.assert_close(result.scalars["moe_imbalance"], _imbalance(want))
    assert result.scalars["moe_imbalance"] > 1  # tiny random routing is not balanced


def test_coefficient_0_leaves_the_bias_and_resets_the_counts() -> None:
    batches = _batches(1)
    model = _model()
    step = _step(model, batches, bias=0.0, aux=0.0)
    step.start(None)  # type: ignore[arg-type]
    result = step(1)
    ref, _, _ = _reference(batches, 0.0)
    for m in moe_layers(model):
        assert m.expert_bias.abs().sum() == 0 and m.tokens_per_expert.sum() == 0
    torch.testing.assert_close(result.scalars["moe_imbalance"], _imbalance(_counts(ref)))


def _two_ranks(coeff: float) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    dims = ParallelDims.for_world(1, 2, 1, 2)
    dims.build_mesh("cpu")
    batches = _batches(3, (16 * rank, 16 * rank + 16))  # each rank its own words: other experts are busy
    ref, _, _ = _reference(batches, 0.0)
    model = _model()
    step = _step(model, batches, bias=coeff, aux=0.0, dims=dims)
    step.start(None)  # type: ignore[arg-type]
    result = step(1)
    return {  # plain lists: a tensor crosses the process boundary as shared memory the rank frees on exit
        "bias": [m.expert_bias.tolist() for m in moe_layers(model)],
        "counts": [c.tolist() for c in _counts(ref)],
        "imbalance": result.scalars["moe_imbalance"].item(),
    }


@pytest.mark.distributed
def test_two_ranks_update_the_same_bias_from_the_summed_counts() -> None:
    coeff = 1e-3
    r0, r1 = run_distributed(_two_ranks, 2, coeff)
    own = [torch.tensor(c) for c in r0["counts"]]
    summed = [a + torch.tensor(b) for a, b in zip(own, r1["counts"], strict=True)]
    assert r0["bias"] == r1["bias"]  # bitwise: every rank applies the same step
    for layer, total in enumerate(summed):
        torch.testing.assert_close(torch.tensor(r0["bias"][layer]), expert_bias_step(total, coeff))
    # The sum matters: rank 0's own counts would move some layer's bias otherwise.
    assert any(
        not torch.allclose(expert_bias_step(mine, coeff), expert_bias_step(total, coeff))
        for mine, total in zip(own, summed, strict=True)
    )
    assert r0["imbalance"] == r1["imbalance"] == pytest.approx(_imbalance(summed).item())


def test_the_step_line_shows_the_step_scalars_averaged_as_the_loss(caplog: pytest.LogCaptureFixture) -> None:
    """The metrics hook reduces each of the step's scalars as it reduces the loss (`global_mean`: here a stand-in
    that adds 1, to see it applied) and the line and the scalar writers get them under their names."""
    written: dict[str, float] = {}
    writer = SimpleNamespace(add_scalar=lambda tag, value, step: written.update({tag: value}), flush=lambda: None)
    cfg, cpu = JobConfig().metrics, torch.device("cpu")
    logger = MetricsLogger(cfg, cpu, 1.0, writer, is_logging_rank=True)  # type: ignore[arg-type]
    hook = MetricsHook(logger, 10, lambda t: t.item() + 1, [])
    scalars = {"aux_loss": torch.tensor(0.25), "moe_imbalance": torch.tensor(0.5)}
    with caplog.at_level(logging.INFO, logger="kiln"):
        hook.post_step(StepOutput(1, False, torch.tensor(1.5), torch.tensor(1.0), 1e-3, scalars))
    assert (written["kiln/loss"], written["kiln/aux_loss"], written["kiln/moe_imbalance"]) == (2.5, 1.25, 1.5)
    line = caplog.records[-1].getMessage()
    assert "loss:  2.5000" in line and "aux_loss: 1.2500  moe_imbalance: 1.5000" in line


def _argv(*extra: str) -> list[str]:
    return ["--model.tokenizer_path", __file__, *extra]  # any existing file: not read here


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("--model.moe_aux_loss_coeff", "0.001", "--parallelism.pipeline_parallel_degree", "2"),
            "model.moe_aux_loss_coeff 0.001 with parallelism.pipeline_parallel_degree 2",
        ),
        (
            ("--model.moe_aux_loss_coeff", "0.001", "--parallelism.context_parallel_degree", "2"),
            "model.moe_aux_loss_coeff 0.001 with parallelism.context_parallel_degree 2",
        ),
        (
            ("--model.moe_load_balance_coeff", "-1"),
            "model.moe_load_balance_coeff must be a finite number >= 0, got -1.0",
        ),
        (("--model.moe_aux_loss_coeff", "-0.5"), "model.moe_aux_loss_coeff must be a finite number >= 0, got -0.5"),
    ],
)
def test_config_refuses(extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_args(_argv(*extra))


def test_fault_tolerance_refuses_the_bias() -> None:
    ft = ("--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--job.dry_run")
    with pytest.raises(ConfigError, match="model.moe_load_balance_coeff 0.001 with fault_tolerance.enable"):
        parse_args(_argv(*ft, "--model.moe_load_balance_coeff", "0.001"))
    parse_args(_argv(*ft, "--model.moe_aux_loss_coeff", "0.001"))  # the aux loss goes through the gradients


def test_a_dense_model_refuses_the_coefficients() -> None:
    with pytest.raises(ConfigError, match="model.moe_aux_loss_coeff 0.001 balances a mixture of experts, but"):
        build.model_args(Model(flavor="debugmodel", moe_aux_loss_coeff=1e-3), SEQ, VOCAB)
    with pytest.raises(ConfigError, match="model.moe_load_balance_coeff 0.01 balances"):
        check_moe_balance(Model(moe_load_balance_coeff=0.01), 0, "flavor debugmodel")
    check_moe_balance(Model(moe_load_balance_coeff=0.01, moe_aux_loss_coeff=1e-3), 4, "an MoE")
