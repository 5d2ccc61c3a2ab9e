"""Expert parallelism (parallelisms/expert_parallel.py) against one process, and its config rules.

The distributed tests build the same small Qwen3-style MoE model (every block an MoE FFN with shared experts) with
the same weights on one process and on gloo ranks (float32, deterministic), and compare the forward, every
gradient (the experts' gathered from their shards) and the tokens-per-expert counts. The routing is made uneven on
purpose: in block 0 no token picks expert 3 (an EP rank's local expert receives no rows), in block 1 every token
picks expert 0 (one rank's experts receive every row).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from float8.converter import Float8Converter
from float8.experts import counting_grouped_gemms
from kiln_base.config import ActivationCheckpoint, Float8, JobConfig, Parallelism, Training, check_world
from kiln_base.config.checks import check_config_alone, check_parallel_plan
from kiln_base.errors import ConfigError
from kiln_base.internals import shard_offset, unwrapped_fqn
from models import ModelArgs, Transformer
from models.moe import GroupedExperts, moe_layers
from parallelisms.expert_parallel import ExpertParallelExperts, apply_ep
from parallelisms.grad_norm import total_norm
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_llama
from tests.helpers.distributed import run_distributed

VOCAB, BATCH, SEQ = 64, 8, 8
ARGS = ModelArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    vocab_size=VOCAB,
    max_seq_len=SEQ,
    qk_norm=True,
    moe_num_experts=4,
    moe_top_k=2,
    moe_hidden_dim=16,
    moe_route_norm=True,
    moe_shared_hidden_dim=8,
)
# Measured (torch 2.13, CPU): loss within 4.8e-7 of one process's (4.54: one float32 ulp, the mean of the ranks'
# means), gradients within 2.3e-8, the gradient norm within 9e-9, in every case below; 1e-6 leaves room for other
# CPUs' kernels. The counts are equal exactly.
ATOL = 1e-6


# float8 on the experts alone (the Linears kept high precision), emulated float8 rowwise grouped GEMMs.
EXPERTS_F8 = Float8(
    enable_float8_linear=True,
    recipe_name="rowwise",
    emulate=True,
    moe_fqns=["experts"],
    filter_fqns=["output", "attention", "router", "shared_experts"],
)
# Measured (torch 2.13, torchao 0.18, CPU), EP 2 x FSDP and FSDP 2 alone with float8 experts against one process's
# float8 experts: the same loss, gradients within 1.5e-8, the norm within 8.2e-9 (the same casts of the same rows:
# an expert's rows are gathered whole on its rank; FSDP all-gathers the whole weight). float8 against high precision
# there: block 0's w1 gradient differs by 1.4e-5.
ATOL_F8 = 1e-6


def reference_model(float8: bool = False) -> Transformer:
    """The model and weights every layout starts from, with the uneven routing of the module docstring; `float8`:
    its experts converted (EXPERTS_F8)."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    if float8:
        Float8Converter(EXPERTS_F8).convert(model)
    first, second = moe_layers(model)
    with torch.no_grad():
        for moe in (first, second):
            moe.router.gate.weight.normal_(0, 0.5)  # decisive routing: top-k ties would be layout noise
        first.expert_bias[3] = -100.0  # nobody picks expert 3
        second.expert_bias[0] = 100.0  # everybody picks expert 0
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def reference_run(float8: bool = False) -> dict[str, Any]:
    model = reference_model(float8)
    loss = loss_of(model, batch())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = [m.tokens_per_expert.clone() for m in moe_layers(model)]
    return {"loss": loss.item(), "grads": grads, "counts": counts, "norm": total_norm(list(grads.values())).item()}


def full_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    assert g is not None
    return g.full_tensor() if isinstance(g, DTensor) else g


# ----------------------------------------------------------------------------- on the ranks


def _layer_case(grouped_mm: bool, float8: bool = False) -> dict[str, Any]:
    """One MoE layer, its experts split over all ranks (no FSDP): each rank feeds its share of the tokens; the local
    experts run as a grouped GEMM or as the loop over experts (`float8`: their float8 grouped GEMMs, counted)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = reference_model(float8)
    moe_layers(ref)[0].experts.use_grouped_mm = grouped_mm
    moe = moe_layers(ref)[0]
    x = torch.randn(world * 6, ARGS.dim, generator=torch.Generator().manual_seed(2))
    mine = x.chunk(world)[rank].clone().requires_grad_(True)
    dims = ParallelDims.for_world(1, -1, 1, world, ep=world)
    dims.build_mesh("cpu")
    apply_ep(moe, dims.ep_mesh, dims.degrees.ep_data_ranks)
    assert isinstance(moe.experts, ExpertParallelExperts)
    moe.reset_counts()
    gemms: list[bool] = []
    with counting_grouped_gemms(gemms.append):
        y, _ = moe(mine.view(1, -1, ARGS.dim))
        # Each rank's loss: its rows' output against fixed weights; summed over the ranks, one process's loss.
        probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).chunk(world)[rank]
        (y.view_as(probe) * probe).sum().backward()
    router = moe.router.gate.weight.grad
    assert router is not None
    dist.all_reduce(router)  # replicated weight: every rank's share of the gradient
    experts = {n: full_grad(getattr(moe.experts, n)) for n in ("w1", "w2", "w3")}
    counts = moe.tokens_per_expert.clone()
    dist.all_reduce(counts)
    local = moe.experts.w1.to_local().shape[0]
    return dict(
        y=y.detach(), x_grad=mine.grad, router=router, experts=experts, counts=counts, local=local, gemms=len(gemms)
    )


def _model_case(
    dp_replicate: int,
    ep: int,
    ac: str,
    ckpt: str | None,
    load: str | None = None,
    float8: bool = False,
    tp: int = 1,
) -> dict[str, Any]:
    """The whole model through parallelize_llama (EP, TP, AC, FSDP) with the reference weights (copied in, or loaded
    from the DCP checkpoint `load` saved under another layout); one forward and backward on this rank's share of the
    batch (the data-parallel rank's rows; a TP group's ranks share it); saved to `ckpt` if given. `float8`: the
    experts converted first, as the build converts (EXPERTS_F8)."""
    import torch.distributed.checkpoint as dcp

    world = dist.get_world_size()
    dims = ParallelDims.for_world(dp_replicate, -1, tp, world, ep=ep)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(ARGS)
    if float8:
        Float8Converter(EXPERTS_F8).convert(model)
    # The logits whole on every TP rank (no loss parallel): loss_of is the plain cross-entropy.
    parallelism = Parallelism(disable_loss_parallel=True)
    parallelize_llama(model, dims, Training(), parallelism, ActivationCheckpoint(ac), Float8())
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    ref = reference_model().state_dict()
    if load is not None:
        dcp.load(model.state_dict(), checkpoint_id=load)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            full = ref.get(unwrapped_fqn(name))
            if full is None:
                continue  # freqs_cis: computed by init_buffers
            if load is None and isinstance(t, DTensor):
                t.to_local().copy_(distribute_tensor(full, t.device_mesh, t.placements).to_local())
            elif load is None:
                t.copy_(full)
            if isinstance(t, DTensor):
                assert torch.equal(t.full_tensor(), full), name  # the shard is the right slice of the whole
                # What the layout-independent init slices by (parallelisms/seeded_init.py): this rank's rows, also
                # under the experts' (efsdp, ep) placements.
                shape, offset = shard_offset(t)
                held = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                assert torch.equal(held, t.to_local()), name
            else:
                assert torch.equal(t, full), name
    shards = [m for m in model.modules() if isinstance(m, ExpertParallelExperts if ep > 1 else GroupedExperts)]
    assert len(shards) == ARGS.n_layers
    dp_rank = dims.dp_mesh.get_local_rank()
    tokens = batch().chunk(dims.dp_degree)[dp_rank]
    loss = loss_of(model, tokens)
    loss.backward()
    logged = loss.detach().clone()
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)  # a TP group's ranks hold the same loss
    grads = {unwrapped_fqn(n): full_grad(p) for n, p in model.named_parameters()}
    norm = total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
    counts = [m.tokens_per_expert.clone() for m in moe_layers(model)]
    for c in counts:
        dist.all_reduce(c)  # over the data ranks and, under TP, each TP rank's part of the sequence
    if ckpt is not None:
        dcp.save(model.state_dict(), checkpoint_id=ckpt)
    held = tuple(shards[0].w1.to_local().shape)  # this rank's shard of block 0's w1 (after EP and FSDP)
    return {"loss": logged.item(), "grads": grads, "norm": norm, "counts": counts, "held": held}


def _by_value(obj: Any) -> Any:
    """Tensors as numpy arrays: a tensor crosses the result queue through shared memory, which the rank's exit
    may free before the parent reads it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: _by_value(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_by_value(v) for v in obj]
    return obj


def _tensors(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tensors(v) for v in obj]
    return torch.from_numpy(obj) if hasattr(obj, "dtype") and hasattr(obj, "shape") else obj


def _sac_case() -> dict[str, Any]:
    """Per-op SAC over an EP 2 model: what the policy saved and left to recompute of the all-to-alls, by op name."""
    from parallelisms.activation_checkpoint import SACStats, apply_ac

    dims = ParallelDims.for_world(1, -1, 1, dist.get_world_size(), ep=2)
    dims.build_mesh("cpu")
    model = reference_model()
    apply_ep(model, dims.ep_mesh, dims.degrees.ep_data_ranks)
    stats = SACStats()
    apply_ac(model, ActivationCheckpoint("selective", selective_ac_option="op"), stats)
    loss_of(model, batch().chunk(2)[dist.get_rank()]).backward()
    a2a = "all_to_all_single"
    return {
        "kept": sorted(str(f) for f in stats.kept_bytes if a2a in str(f)),
        "recomputed": sorted(str(f) for f in stats.recomputed if a2a in str(f)),
    }


def _two_rank_job(ckpt: str) -> dict[str, Any]:
    return _by_value(
        {
            "sac": _sac_case(),
            "layer": _layer_case(grouped_mm=True),
            "layer_loop": _layer_case(grouped_mm=False),
            "ep2": _model_case(1, 2, "none", ckpt),
            "ep2_full_ac": _model_case(1, 2, "full", None),
            "layer_float8": _layer_case(grouped_mm=True, float8=True),
            "ep2_float8": _model_case(1, 2, "none", None, float8=True),
            "fsdp2_float8": _model_case(1, 1, "none", None, float8=True),  # no EP: the experts FSDP-sharded
            "ep2_tp2": _model_case(1, 2, "none", None, tp=2),  # no FSDP: the router's gradient reduced by DTensor
        }
    )


def _four_rank_job(ckpt: str) -> dict[str, Any]:
    """EP 2 x efsdp 2 resumes the 2-rank EP 2 checkpoint (another layout); HSDP copies the weights in."""
    cases = {"ep2_efsdp2": _model_case(1, 2, "none", None, load=ckpt), "hsdp2_ep2": _model_case(2, 2, "none", None)}
    cases["ep2_tp2_efsdp2"] = _model_case(1, 2, "none", None, tp=2)
    cases["ep4_tp2_full_ac"] = _model_case(1, 4, "full", None, tp=2)
    return _by_value(cases)


# ----------------------------------------------------------------------------- the comparisons


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    ckpt = str(tmp_path_factory.mktemp("ep_ckpt"))
    return _tensors(run_distributed(_two_rank_job, 2, ckpt)), ckpt


@pytest.fixture(scope="module")
def reference_float8() -> dict[str, Any]:
    return reference_run(float8=True)


def _assert_model_matches(
    got: dict[str, Any], ref: dict[str, Any], held: tuple[int, ...], recomputed: int = 1, atol: float = ATOL
) -> None:
    """Loss, every gradient, the gradient norm and the counts equal one process's (`recomputed`: 2 when activation
    checkpointing runs each MoE forward twice, counting its tokens twice, models/moe.py); `held`: the shape of this
    rank's shard of block 0's experts' w1."""
    assert abs(got["loss"] - ref["loss"]) < atol, (got["loss"], ref["loss"])
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, atol=atol, rtol=0, msg=name)
    assert abs(got["norm"] - ref["norm"]) < atol
    for c, r in zip(got["counts"], ref["counts"], strict=True):
        assert torch.equal(c, r * recomputed)
    assert got["held"] == held


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["layer", "layer_loop"])
def test_ep_layer_matches_one_process(case: str, two_ranks: tuple[list[dict[str, Any]], str]) -> None:
    """Forward, input, router and expert gradients and the counts of one MoE layer with its 4 experts over 2 ranks
    (2 each) equal one process's (grouped GEMM), including an expert that receives no rows; the local experts as a
    grouped GEMM and as the loop."""
    ranks = [r[case] for r in two_ranks[0]]
    moe = moe_layers(reference_model())[0]
    x = torch.randn(2 * 6, ARGS.dim, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    moe.reset_counts()
    y, _ = moe(x.view(1, -1, ARGS.dim))
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    (y.view_as(probe) * probe).sum().backward()
    assert all(r["local"] == 2 for r in ranks)
    assert moe.tokens_per_expert[3] == 0 and moe.tokens_per_expert.sum() == x.shape[0] * ARGS.moe_top_k
    got = torch.cat([r["y"].view(-1, ARGS.dim) for r in ranks])
    torch.testing.assert_close(got, y.view(-1, ARGS.dim), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in ranks]), x.grad, atol=ATOL, rtol=0)
    for r in ranks:
        torch.testing.assert_close(r["router"], moe.router.gate.weight.grad, atol=ATOL, rtol=0)
        for name in ("w1", "w2", "w3"):
            # Without FSDP the experts' gradient is the EP ranks' mean (mean_over_ep; FSDP's average does the rest).
            ref = getattr(moe.experts, name).grad / len(ranks)
            torch.testing.assert_close(r["experts"][name], ref, atol=ATOL, rtol=0)
        assert torch.equal(r["counts"], moe.tokens_per_expert)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["ep2", "ep2_full_ac"])
def test_ep_model_matches_one_process(
    case: str, two_ranks: tuple[list[dict[str, Any]], str], reference: dict[str, Any]
) -> None:
    """The whole model, EP 2 x FSDP (efsdp 1) on 2 ranks, without and with full activation checkpointing: loss,
    every gradient, the gradient norm and the counts equal one process's."""
    for rank in two_ranks[0]:
        # Each rank holds its 2 whole experts (efsdp 1: FSDP does not split them further).
        recomputed = 2 if case == "ep2_full_ac" else 1
        _assert_model_matches(rank[case], reference, (2, ARGS.moe_hidden_dim, ARGS.dim), recomputed)


@pytest.mark.distributed
def test_ep_runs_the_experts_float8_grouped_gemms(
    two_ranks: tuple[list[dict[str, Any]], str], reference: dict[str, Any], reference_float8: dict[str, Any]
) -> None:
    """float8 on the experts under EP: each rank's local experts run the float8 grouped GEMMs (3 per layer's
    forward, counted), and EP 2 x FSDP on 2 ranks, and FSDP 2 alone (the experts sharded), give one process's float8
    loss and gradients, which differ from high precision's (the float8 path is the one that ran)."""
    for rank in two_ranks[0]:
        assert rank["layer_float8"]["gemms"] == 3 and rank["layer"]["gemms"] == 0
        _assert_model_matches(rank["ep2_float8"], reference_float8, (2, ARGS.moe_hidden_dim, ARGS.dim), atol=ATOL_F8)
        # FSDP 2 without EP: each rank holds 2 of the 4 experts' rows, all-gathered for the float8 GEMMs
        _assert_model_matches(rank["fsdp2_float8"], reference_float8, (2, ARGS.moe_hidden_dim, ARGS.dim), atol=ATOL_F8)
    w1 = "layers.0.moe.experts.w1"
    assert not torch.allclose(reference_float8["grads"][w1], reference["grads"][w1], atol=5 * ATOL_F8, rtol=0)


@pytest.mark.distributed
def test_per_op_sac_saves_the_dispatch(two_ranks: tuple[list[dict[str, Any]], str]) -> None:
    """Per-op SAC keeps the all-to-alls' outputs (the counts and the rows, dispatch and combine): the backward's
    recompute does not redo the exchange."""
    for rank in two_ranks[0]:
        assert rank["sac"] == {"kept": ["_c10d_functional.all_to_all_single.default"], "recomputed": []}


@pytest.mark.distributed
def test_ep_with_tp_matches_one_process(two_ranks: tuple[list[dict[str, Any]], str], reference: dict[str, Any]) -> None:
    """EP 2 x TP 2 on 2 ranks (the EP group is the TP pair: each routes its half of every sequence; no FSDP):
    loss, every gradient (the router's and the shared experts' summed over both halves), the norm and the counts
    equal one process's."""
    for rank in two_ranks[0]:
        _assert_model_matches(rank["ep2_tp2"], reference, (2, ARGS.moe_hidden_dim, ARGS.dim))


@pytest.mark.distributed
def test_ep_checkpoint_holds_the_whole_experts(two_ranks: tuple[list[dict[str, Any]], str]) -> None:
    """A DCP checkpoint saved under EP 2 loads into one process's plain model: the same names, the whole [E, ...]
    expert tensors (the reference weights)."""
    import torch.distributed.checkpoint as dcp

    ref = reference_model()
    model = Transformer(ARGS)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=two_ranks[1], no_dist=True)
    for name, t in ref.state_dict().items():
        if name != "freqs_cis":
            assert torch.equal(state[name], t), name


@pytest.mark.distributed
def test_ep_with_efsdp_and_hsdp_matches_one_process(
    reference: dict[str, Any], two_ranks: tuple[list[dict[str, Any]], str]
) -> None:
    """4 ranks: EP 2 x efsdp 2 (FSDP splits each EP rank's 2 experts, one whole expert a rank), its weights loaded
    from the checkpoint the 2-rank EP 2 layout saved, HSDP 2 x (EP 2 over dp_shard 2), and with TP 2: EP 2 x
    efsdp 2, and EP 4 under full activation checkpointing."""
    for rank in _tensors(run_distributed(_four_rank_job, 4, two_ranks[1])):
        _assert_model_matches(rank["ep2_efsdp2"], reference, (1, ARGS.moe_hidden_dim, ARGS.dim))  # 1 expert a rank
        _assert_model_matches(rank["hsdp2_ep2"], reference, (2, ARGS.moe_hidden_dim, ARGS.dim))  # 2, replicated
        # EP 2 x TP 2 x dp_shard 2: each EP group a TP pair, its experts FSDP-split over efsdp 2 (1 a rank); EP 4 x
        # TP 2: the EP group is 2 shard ranks x their TP pairs, whole experts (efsdp 1), under full AC.
        _assert_model_matches(rank["ep2_tp2_efsdp2"], reference, (1, ARGS.moe_hidden_dim, ARGS.dim))
        _assert_model_matches(rank["ep4_tp2_full_ac"], reference, (1, ARGS.moe_hidden_dim, ARGS.dim), recomputed=2)


# ----------------------------------------------------------------------------- the config rules


def _check(world: int, model: ModelArgs = ARGS, **parallelism: Any) -> None:
    """The checks a config, then the launcher and each rank run (parse time, the world, the plan)."""
    training = Training(compile=parallelism.pop("compile", False))
    ac = ActivationCheckpoint(parallelism.pop("ac", "selective"), selective_ac_option=parallelism.pop("sac", "op"))
    cfg = JobConfig(training=training, parallelism=Parallelism(**parallelism), activation_checkpoint=ac)
    check_config_alone(cfg)
    check_world(cfg, world)
    check_parallel_plan(cfg, model.shape(), "cpu")


@pytest.mark.parametrize(
    ("world", "settings", "message"),
    [
        (4, dict(expert_parallel_degree=3), r"expert_parallel_degree \(3\) must divide data_parallel_shard_degree"),
        (6, dict(expert_parallel_degree=3), r"expert_parallel_degree \(3\) must divide the model's 4 experts"),
        (4, dict(expert_tensor_parallel_degree=2), "expert_tensor_parallel_degree 2: kiln has no tensor parallel"),
        (8, dict(expert_parallel_degree=2, tensor_parallel_degree=4), r"\(2\) must be a multiple of tensor_para"),
        (8, dict(expert_parallel_degree=4, tensor_parallel_degree=4, context_parallel_degree=2), r"context_.* x te"),
        (4, dict(tensor_parallel_degree=2), "tensor_parallel_degree 2 with a mixture-of-experts model .* needs exp"),
        (4, dict(expert_parallel_degree=2, context_parallel_degree=4), r"\(2\) must be a multiple of context_para"),
        (6, dict(expert_parallel_degree=4, context_parallel_degree=2), r"\(4\) must divide .*\(3\) x context_para"),
        (4, dict(expert_parallel_degree=4, data_parallel_replicate_degree=2), r"\(4\) must divide .*degree \(2\)"),
        (4, dict(expert_parallel_degree=2, compile=True), "2 with training.compile and per-op selective activation"),
    ],
)
def test_ep_config_refusals(world: int, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"parallelism.*{message}"):
        _check(world, **settings)


def test_ep_refused_for_a_dense_model() -> None:
    dense = dataclasses.replace(ARGS, moe_num_experts=0)
    with pytest.raises(ConfigError, match="parallelism.expert_parallel_degree 2: model.flavor .* is dense"):
        _check(2, dense, expert_parallel_degree=2)


def test_ep_plan_borrows_from_dp_shard() -> None:
    _check(8, expert_parallel_degree=4)  # accepted: 4 experts over 4 of the 8 shard ranks
    dims = ParallelDims.for_world(2, -1, 1, 8, ep=2)
    degrees = dims.degrees
    assert (degrees.dp_shard, degrees.ep, degrees.efsdp, degrees.world_size, dims.dp_degree) == (4, 2, 2, 8, 8)


def test_ep_composes_with_pipeline_and_context_parallel() -> None:
    """Accepted (run: tests/e2e/test_expert_parallel_composed.py): EP inside each pipeline stage's shard ranks, and
    EP over dp_shard x cp (an EP group holds whole CP groups, torchtitan's rule)."""
    _check(4, expert_parallel_degree=2, pipeline_parallel_degree=2)
    _check(4, expert_parallel_degree=2, context_parallel_degree=2)
    _check(2, expert_parallel_degree=2, context_parallel_degree=2)  # dp_shard 1: the EP group is the CP pair
    degrees = ParallelDims.for_world(1, -1, 1, 8, cp=2, ep=4).degrees  # dp_shard 4 x cp 2 = efsdp 2 x ep 4
    assert (degrees.dp_shard, degrees.cp, degrees.ep, degrees.efsdp) == (4, 2, 4, 2)


def test_ep_with_compile_is_accepted_without_per_op_sac() -> None:
    """EP under training.compile: the dispatch runs eagerly between the block's graphs; full or every-Nth-block AC (or
    none) compose, per-op SAC is refused (test_ep_config_refusals)."""
    for ac, sac in (("full", "op"), ("selective", "2"), ("none", "op")):
        _check(2, expert_parallel_degree=2, compile=True, ac=ac, sac=sac)
