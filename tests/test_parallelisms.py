"""Parallelisms on CPU/gloo: parity of FSDP, TP, FSDP x TP, HSDP and float8 (all-gather, TP) with one process.

Every parallel run starts from the same full state dict (built once, seeded, in this process) and sees the same
global batches: each data-parallel rank takes its slice, TP ranks share it. The single-process reference runs
the data-parallel slices as gradient-accumulation micro-batches, which is what data parallelism computes (and
keeps float8's per-tensor activation scales identical). Several configurations share one spawned group: the
process start-up dominates the cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models import ModelArgs, Transformer
from models.args import ffn_hidden_dim
from parallelisms.parallel_dims import ParallelDims, validate_parallelism
from tests.distributed import run_distributed
from trainer.config import ActivationCheckpoint, ConfigError, Float8, Parallelism, Training

ARGS = ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=32, rope_theta=500000
)
SEQ, GLOBAL_BS, STEPS = 32, 4, 10
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
# Float8 TP: the row-wise Linears' partial sums are reduced in another order; a float8 cast downstream can round
# one element differently (measured: 8.5e-5 after 10 steps).
FP8_TP_TOL = {"rtol": 0.0, "atol": 1e-3}


# ----------------------------------------------------------------------------- shared by parent and ranks


def _batches() -> list[torch.Tensor]:
    """STEPS batches of (GLOBAL_BS, SEQ + 1) tokens: runs of consecutive ids with random starts and strides."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, ARGS.vocab_size, (STEPS, GLOBAL_BS, 1), generator=g)
    stride = torch.randint(1, 4, (STEPS, GLOBAL_BS, 1), generator=g)
    return list((start + stride * torch.arange(SEQ + 1)) % ARGS.vocab_size)


def _float8_config(recipe: str | None) -> Any:
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return Float8LinearConfig.from_recipe_name(recipe)


def _build(recipe: str | None, device: str = "meta") -> nn.Module:
    with torch.device(device):
        model = Transformer(ARGS)
    if recipe is not None:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(
            model, config=_float8_config(recipe), module_filter_fn=lambda m, fqn: fqn != "output"
        )
    return model


def _train(
    model: nn.Module,
    micro: list[int],
    n_micro: int,
    dp_group: dist.ProcessGroup | None = None,
    loss_parallel: bool = False,
    precompute: bool = False,
) -> list[float]:
    """STEPS AdamW steps with clipping; this process runs micro-batches `micro` of each global batch's n_micro."""
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    losses = []
    for batch in _batches():
        opt.zero_grad()
        total = torch.zeros(())
        for i in micro:
            tokens = batch.chunk(n_micro)[i]
            logits = model(tokens[:, :-1])
            with loss_parallel_ctx() if loss_parallel else contextlib.nullcontext():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                (loss / len(micro)).backward()
            total += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach() / len(micro)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        if precompute:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        if dp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=dp_group)
        losses.append(total.item())
    return losses


def _reference(state: dict[str, torch.Tensor], recipe: str | None, n_micro: int) -> list[float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra OpenMP threads only spin (10x slower on a busy machine)
    try:
        model = _build(recipe, "cpu")
        model.load_state_dict(state)
        return _train(model, list(range(n_micro)), n_micro)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- rank side


@dataclasses.dataclass
class Case:
    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    recipe: str | None = None  # float8 recipe: None (high precision), tensorwise (+ FSDP float8 all-gather), rowwise
    loss_parallel: bool = True
    shard_ffn_first: bool = False  # an extra fully_shard per FeedForward: groups whose params are all float8

    @property
    def n_micro(self) -> int:
        return self.dp_replicate * self.dp_shard


class _Spy:
    """Records what FSDP2 hands the gloo all-gather (dtype, numel) and how often float8 TP all-gathers ran."""

    def __init__(self) -> None:
        from parallelisms import float8_gloo

        self.fsdp: list[tuple[torch.dtype, int]] = []
        self.tp_float8 = 0
        comm_call = float8_gloo.Float8AsUint8AllGather.__call__

        def fsdp_call(comm: Any, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.fsdp.append((input_tensor.dtype, input_tensor.numel()))
            return comm_call(comm, output_tensor, input_tensor, *a, **k)

        float8_gloo.Float8AsUint8AllGather.__call__ = fsdp_call
        # Install the CPU float8 handler now, then count through it (it stays installed once per process).
        float8_gloo.enable_float8_tp_on_cpu()
        from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

        for op in [op for op in FLOAT8_OPS_TABLE if "all_gather_into_tensor" in str(op)]:
            handler = FLOAT8_OPS_TABLE[op]

            def counted(*args: Any, _h: Any = handler, **kwargs: Any) -> Any:
                self.tp_float8 += 1
                return _h(*args, **kwargs)

            counted._kiln_uint8_on_cpu = True
            FLOAT8_OPS_TABLE[op] = counted


def _run_case(case: Case, state_path: str, spy: _Spy) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from parallelisms.parallelize import parallelize_llama

    dims = ParallelDims(case.dp_replicate, case.dp_shard, case.tp, dist.get_world_size())
    dims.build_mesh("cpu")
    model = _build(case.recipe)
    training = Training(mixed_precision_param="float32")
    float8 = Float8(
        enable_float8_linear=case.recipe is not None,
        recipe_name=case.recipe,
        enable_fsdp_float8_all_gather=case.recipe == "tensorwise",
        precompute_float8_dynamic_scale_for_fsdp=case.recipe == "tensorwise",
    )
    if case.shard_ffn_first:
        for block in model.layers.values():
            fully_shard(block.feed_forward, mesh=dims.mesh["dp_shard"])
    parallelism = Parallelism(disable_loss_parallel=not case.loss_parallel)
    parallelize_llama(model, dims, training, parallelism, ActivationCheckpoint(mode="none"), float8)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()  # computes the RoPE buffer; parameters are overwritten next
    state = torch.load(state_path) if dist.get_rank() == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    spy.fsdp.clear()
    spy.tp_float8 = 0
    dp_group = dims.dp_mesh.get_group() if dims.dp_enabled else None
    losses = _train(
        model,
        [dims.dp_mesh.get_local_rank()],
        case.n_micro,
        dp_group,
        loss_parallel=dims.tp_enabled and case.loss_parallel,
        precompute=float8.precompute_float8_dynamic_scale_for_fsdp and dims.dp_enabled,
    )
    return {"losses": losses, "fsdp_all_gathers": list(spy.fsdp), "tp_float8_all_gathers": spy.tp_float8}


def _run_cases(cases: list[Case], state_path: str) -> dict[str, dict[str, Any]]:
    spy = _Spy()
    return {case.name: _run_case(case, state_path, spy) for case in cases}


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def state_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    model = _build(None, "cpu")
    with torch.no_grad():
        model.init_weights()
    path = str(tmp_path_factory.mktemp("state") / "init.pt")
    torch.save(model.state_dict(), path)
    return path


def _assert_losses(got: list[float], ref: list[float], **tol: float) -> None:
    assert len(got) == STEPS and ref[0] - ref[-1] > 0.3, ref  # the reference really trains
    print("MAXDIFF", max(abs(a - b) for a, b in zip(got, ref)), got[-1], ref[-1])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), **tol)


def test_two_ranks_fsdp_tp_float8_match_single_process(state_path: str) -> None:
    cases = [
        Case("fsdp", dp_shard=2),
        Case("tp", tp=2),
        Case("tp_gathered_logits", tp=2, loss_parallel=False),
        Case("fsdp_float8", dp_shard=2, recipe="tensorwise"),
        Case("fsdp_float8_ffn_groups", dp_shard=2, recipe="tensorwise", shard_ffn_first=True),
        Case("tp_float8", tp=2, recipe="tensorwise"),
    ]
    results = run_distributed(_run_cases, 2, cases, state_path)
    state = torch.load(state_path)
    ref = {n: _reference(state, None, n) for n in (1, 2)}
    ref_fp8 = {n: _reference(state, "tensorwise", n) for n in (1, 2)}
    for rank_results in results:  # every rank reports the same (dp-averaged) losses
        r = rank_results
        _assert_losses(r["fsdp"]["losses"], ref[2], **FP32_TOL)
        _assert_losses(r["tp"]["losses"], ref[1], **FP32_TOL)
        _assert_losses(r["tp_gathered_logits"]["losses"], ref[1], **FP32_TOL)
        _assert_losses(r["fsdp_float8"]["losses"], ref_fp8[2], **FP32_TOL)
        _assert_losses(r["fsdp_float8_ffn_groups"]["losses"], ref_fp8[2], **FP32_TOL)
        _assert_losses(r["tp_float8"]["losses"], ref_fp8[1], **FP8_TP_TOL)

    # The float8 all-gather really moves float8 bytes: per block, one byte per Linear weight element plus the
    # two fp32 norm weights, halved by the 2-way shard (FSDP packs it as a uint8 buffer).
    hidden = ffn_hidden_dim(ARGS)
    kv_dim = ARGS.n_kv_heads * ARGS.dim // ARGS.n_heads
    attn = 2 * ARGS.dim * ARGS.dim + 2 * kv_dim * ARGS.dim
    ffn = 3 * ARGS.dim * hidden
    norms = 2 * ARGS.dim
    gathers = set(results[0]["fsdp_float8"]["fsdp_all_gathers"])
    assert (torch.uint8, (attn + ffn + 4 * norms) // 2) in gathers, gathers
    assert all(dtype in (torch.uint8, torch.float32) for dtype, _ in gathers)
    # With a group of float8 weights only, FSDP's buffer is float8 itself: gloo gets it as uint8.
    gathers = set(results[0]["fsdp_float8_ffn_groups"]["fsdp_all_gathers"])
    assert (torch.float8_e4m3fn, ffn // 2) in gathers, gathers
    assert (torch.uint8, (attn + 4 * norms) // 2) in gathers, gathers
    # Float8 TP: PrepareFloat8ModuleInput all-gathers float8 activations (attention + FFN input, per block).
    assert results[0]["tp_float8"]["tp_float8_all_gathers"] >= 2 * ARGS.n_layers
    assert results[0]["tp"]["tp_float8_all_gathers"] == 0


def test_four_ranks_2d_and_hsdp_match_single_process(state_path: str) -> None:
    cases = [
        Case("fsdp_tp", dp_shard=2, tp=2),
        Case("hsdp", dp_replicate=2, dp_shard=2),
        Case("fsdp_tp_float8", dp_shard=2, tp=2, recipe="tensorwise"),
    ]
    results = run_distributed(_run_cases, 4, cases, state_path)
    state = torch.load(state_path)
    ref2, ref4 = _reference(state, None, 2), _reference(state, None, 4)
    ref_fp8 = _reference(state, "tensorwise", 2)
    for r in results:
        _assert_losses(r["fsdp_tp"]["losses"], ref2, **FP32_TOL)
        _assert_losses(r["hsdp"]["losses"], ref4, **FP32_TOL)
        _assert_losses(r["fsdp_tp_float8"]["losses"], ref_fp8, **FP8_TP_TOL)
    assert results[0]["fsdp_tp_float8"]["tp_float8_all_gathers"] >= 2 * ARGS.n_layers


# ----------------------------------------------------------------------------- config checks (no processes)


def _dims(tp: int = 1, world: int = 2) -> ParallelDims:
    return ParallelDims(1, -1, tp, world)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(n_heads=6, n_kv_heads=6, dim=96), "must divide the model's n_heads \\(6\\)"),
        (dict(n_kv_heads=1), "must divide the model's n_kv_heads \\(1\\)"),
        (dict(multiple_of=3, dim=64), "must divide the model's FFN hidden dim \\(171\\)"),
    ],
)
def test_tp_degree_must_divide_model_shapes(args: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_parallelism(_dims(tp=2), dataclasses.replace(ARGS, **args), Training(), Parallelism(), "cpu")


def test_batch_and_async_tp_checks() -> None:
    validate_parallelism(_dims(tp=2), ARGS, Training(seq_len=32), Parallelism(), "cpu")  # fits
    with pytest.raises(ConfigError, match="training.seq_len \\(33\\) must be divisible by tensor_parallel_degree"):
        validate_parallelism(_dims(tp=2), ARGS, Training(seq_len=33), Parallelism(), "cpu")
    async_tp = Parallelism(enable_async_tensor_parallel=True)
    with pytest.raises(ConfigError, match="enable_async_tensor_parallel needs CUDA"):
        validate_parallelism(_dims(tp=2), ARGS, Training(seq_len=32, compile=True), async_tp, "cpu")
    with pytest.raises(ConfigError, match="needs tensor_parallel_degree > 1 and training.compile"):
        validate_parallelism(_dims(tp=2), ARGS, Training(seq_len=32), async_tp, "cuda")


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ((1, -1, 3, 4), "x tensor_parallel_degree = 3 does not divide the world size 4"),
        ((2, 3, 1, 4), "must equal the world size 4"),
        ((0, -1, 1, 4), "data_parallel_replicate_degree must be >= 1"),
    ],
)
def test_degrees_must_fit_world_size(dims: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelDims(*dims)


def test_dp_shard_takes_the_rest() -> None:
    dims = ParallelDims(2, -1, 2, 16)
    assert (dims.dp_shard, dims.dp_degree, dims.fsdp_enabled, dims.tp_enabled) == (4, 8, True, True)
