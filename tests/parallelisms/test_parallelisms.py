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
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kiln_base.config import (
    ActivationCheckpoint,
    Float8,
    JobConfig,
    Parallelism,
    Training,
    check_parallel_plan,
    check_world,
)
from kiln_base.errors import ConfigError
from models import ModelArgs, Transformer
from models.args import ffn_hidden_dim
from parallelisms.activation_checkpoint import SAC_SAVE_LIST
from parallelisms.parallel_dims import ParallelDims
from tests.helpers.common import run_trainer, tiny_run_args
from tests.helpers.distributed import run_distributed

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


def _build(recipe: str | None, device: str = "meta", fsdp_float8_all_gather: bool = True) -> nn.Module:
    """The tiny Llama3, float8-converted (all but the output layer) when a recipe is given.

    Tensorwise comes with FSDP float8 all-gather unless turned off (then weights are cast inside forward).
    """
    with torch.device(device):
        model = Transformer(ARGS)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from float8.converter import prepare_cpu_float8

        prepare_cpu_float8()  # torch's CPU float8 matmul, as kiln's build uses

        config = Float8LinearConfig.from_recipe_name(recipe)
        if recipe == "tensorwise":
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "output")
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
    compile: bool = False
    ac: str = "none"  # activation_checkpoint.selective_ac_option ("op", "1", ...) or "none"

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

    dims = ParallelDims.for_world(case.dp_replicate, case.dp_shard, case.tp, dist.get_world_size())
    dims.build_mesh("cpu")
    model = _build(case.recipe)
    training = Training(mixed_precision_param="float32", compile=case.compile)
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
    ac = ActivationCheckpoint(mode="none") if case.ac == "none" else ActivationCheckpoint("selective", case.ac)
    parallelize_llama(model, dims, training, parallelism, ac, float8)
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


def _sac_run(recipe: str | None) -> dict[str, dict[str, int] | int]:
    """One bf16 forward/backward of the tiny model, FSDP on 2 ranks, per-op SAC on every block: what is kept."""
    from parallelisms.activation_checkpoint import SACStats, apply_ac
    from parallelisms.parallelize import parallelize_llama

    dims = ParallelDims.for_world(1, -1, 1, dist.get_world_size())
    dims.build_mesh("cpu")
    # Tensorwise without float8 all-gather: the weight's max(abs(W)) then runs inside the checkpointed block.
    model = _build(recipe, fsdp_float8_all_gather=False)
    stats = SACStats()
    # AC before parallelize_llama (which then adds none): the same order parallelize_llama uses without TP.
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"), stats)
    float8 = Float8(enable_float8_linear=recipe is not None, recipe_name=recipe)
    training = Training(mixed_precision_param="bfloat16")  # rowwise float8 matmuls need bf16
    parallelize_llama(model, dims, training, Parallelism(), ActivationCheckpoint(mode="none"), float8)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    tokens = _batches()[0].chunk(2)[dist.get_rank()]
    outside = 0  # bytes autograd saves outside the checkpointed blocks (embedding, final norm, output, loss)

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        outside += t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()  # the recompute must find everything the policy kept
    return {
        "kept": {str(op): n for op, n in stats.kept_bytes.items()},
        "recomputed": {str(op): n for op, n in stats.recomputed.items()},
        "outside": outside,
    }


# The Trainer end to end (debug model, its data loader) with each AC mode, compile, and TP + loss parallel.

TRAINER_ARGS = tiny_run_args(
    "--training.steps", "3", "--training.seed", "0", "--lr_scheduler.warmup_steps", "1", ac="selective"
)


def _trainer_runs(runs: dict[str, list[str]], folder: str) -> dict[str, list[float]]:
    losses = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    for i, (name, overrides) in enumerate(runs.items()):
        if not dist.is_initialized():  # Trainer.close() destroyed the last one; a fresh store per run
            dist.init_process_group("gloo", init_method=f"file://{folder}/store_{i}", rank=rank, world_size=world)
        losses[name] = run_trainer([*TRAINER_ARGS, "--job.dump_folder", f"{folder}/{name}", *overrides]).losses
    return losses


def _two_rank_job(
    cases: list[Case], state_path: str, trainer_runs: dict[str, list[str]], folder: str
) -> dict[str, Any]:
    spy = _Spy()
    out: dict[str, Any] = {case.name: _run_case(case, state_path, spy) for case in cases}
    out["sac"] = {str(recipe): _sac_run(recipe) for recipe in (None, "rowwise", "tensorwise")}
    out["trainer"] = _trainer_runs(trainer_runs, folder)  # last: Trainer.close() ends the process group
    return out


def _four_rank_job(cases: list[Case], state_path: str) -> dict[str, Any]:
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


@pytest.fixture(scope="module")
def two_ranks(state_path: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One spawned group of 2 gloo ranks runs every 2-rank configuration (process start-up dominates)."""
    ac, opt = "--activation_checkpoint.mode", "--activation_checkpoint.selective_ac_option"
    trainer_runs = {
        "none": [ac, "none"],
        "full": [ac, "full"],
        "selective_2": [ac, "selective", opt, "2"],
        "selective_op": [ac, "selective", opt, "op"],
        "selective_op_compiled": [ac, "selective", opt, "op", "--training.compile"],
        "tp_selective_op": [ac, "selective", opt, "op", "--parallelism.tensor_parallel_degree", "2"],
    }
    cases = [
        Case("fsdp", dp_shard=2),
        Case("replicate", dp_replicate=2),  # HSDP with shard degree 1: plain data parallelism
        Case("tp", tp=2),
        Case("tp_gathered_logits", tp=2, loss_parallel=False),
        Case("fsdp_float8", dp_shard=2, recipe="tensorwise"),
        Case("fsdp_float8_ffn_groups", dp_shard=2, recipe="tensorwise", shard_ffn_first=True),
        Case("tp_float8", tp=2, recipe="tensorwise"),
    ]
    folder = str(tmp_path_factory.mktemp("trainer"))
    return run_distributed(_two_rank_job, 2, cases, state_path, trainer_runs, folder)


@pytest.fixture(scope="module")
def four_ranks(state_path: str) -> list[dict[str, Any]]:
    cases = [
        Case("fsdp_tp", dp_shard=2, tp=2),
        Case("hsdp", dp_replicate=2, dp_shard=2),
        Case("fsdp_tp_float8", dp_shard=2, tp=2, recipe="tensorwise"),
    ]
    return run_distributed(_four_rank_job, 4, cases, state_path)


@pytest.fixture(scope="module")
def compiled_two_ranks(state_path: str) -> list[dict[str, Any]]:
    """TP without FSDP, blocks compiled: block 0's input is the TP embedding's AsyncCollectiveTensor."""
    return run_distributed(_four_rank_job, 2, [Case("tp_compiled", tp=2, compile=True)], state_path)


@pytest.fixture(scope="module")
def reference(state_path: str) -> Any:
    """Single-process losses by (float8 recipe, number of micro-batches), computed once each."""
    state = torch.load(state_path)
    cache: dict[tuple[str | None, int], list[float]] = {}

    def get(recipe: str | None, n_micro: int) -> list[float]:
        if (recipe, n_micro) not in cache:
            cache[recipe, n_micro] = _reference(state, recipe, n_micro)
        return cache[recipe, n_micro]

    return get


def _assert_losses(got: list[float], ref: list[float], **tol: float) -> None:
    assert len(got) == STEPS and ref[0] - ref[-1] > 0.3, ref  # the reference really trains
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), **tol)


@pytest.mark.distributed
def test_fsdp_replicate_and_tp_match_single_process(two_ranks: list[dict[str, Any]], reference: Any) -> None:
    for r in two_ranks:  # every rank reports the same (dp-averaged) losses
        _assert_losses(r["fsdp"]["losses"], reference(None, 2), **FP32_TOL)
        _assert_losses(r["replicate"]["losses"], reference(None, 2), **FP32_TOL)
        _assert_losses(r["tp"]["losses"], reference(None, 1), **FP32_TOL)
        _assert_losses(r["tp_gathered_logits"]["losses"], reference(None, 1), **FP32_TOL)


@pytest.mark.distributed
def test_fsdp_float8_all_gather_with_precompute_matches_single_process_float8(
    two_ranks: list[dict[str, Any]], reference: Any
) -> None:
    for r in two_ranks:
        _assert_losses(r["fsdp_float8"]["losses"], reference("tensorwise", 2), **FP32_TOL)
        _assert_losses(r["fsdp_float8_ffn_groups"]["losses"], reference("tensorwise", 2), **FP32_TOL)
    # The all-gather really moves float8 bytes: per block, one byte per Linear weight element plus the two
    # fp32 norm weights (4 bytes each), halved by the 2-way shard; FSDP packs that as a uint8 buffer.
    hidden = ffn_hidden_dim(ARGS)
    kv_dim = ARGS.n_kv_heads * ARGS.dim // ARGS.n_heads
    attn = 2 * ARGS.dim * ARGS.dim + 2 * kv_dim * ARGS.dim
    ffn = 3 * ARGS.dim * hidden
    norms = 2 * ARGS.dim
    gathers = set(two_ranks[0]["fsdp_float8"]["fsdp_all_gathers"])
    assert (torch.uint8, (attn + ffn + 4 * norms) // 2) in gathers, gathers
    assert all(dtype in (torch.uint8, torch.float32) for dtype, _ in gathers), gathers  # fp32: the root group
    # A group of float8 weights only (an extra fully_shard per FeedForward): FSDP's buffer is float8 itself,
    # which gloo cannot move; Float8AsUint8AllGather sends it as uint8.
    gathers = set(two_ranks[0]["fsdp_float8_ffn_groups"]["fsdp_all_gathers"])
    assert (torch.float8_e4m3fn, ffn // 2) in gathers, gathers
    assert (torch.uint8, (attn + 4 * norms) // 2) in gathers, gathers


@pytest.mark.distributed
def test_float8_tp_runs_on_gloo_and_matches_single_process_float8(
    two_ranks: list[dict[str, Any]], reference: Any
) -> None:
    for r in two_ranks:
        _assert_losses(r["tp_float8"]["losses"], reference("tensorwise", 1), **FP8_TP_TOL)
    # PrepareFloat8ModuleInput all-gathers float8 activations (attention and FFN input, every block and step).
    assert two_ranks[0]["tp_float8"]["tp_float8_all_gathers"] >= 2 * ARGS.n_layers * STEPS
    assert two_ranks[0]["tp"]["tp_float8_all_gathers"] == 0


@pytest.mark.distributed
def test_fsdp_x_tp_and_hsdp_match_single_process(four_ranks: list[dict[str, Any]], reference: Any) -> None:
    for r in four_ranks:
        _assert_losses(r["fsdp_tp"]["losses"], reference(None, 2), **FP32_TOL)
        _assert_losses(r["hsdp"]["losses"], reference(None, 4), **FP32_TOL)
        _assert_losses(r["fsdp_tp_float8"]["losses"], reference("tensorwise", 2), **FP8_TP_TOL)
    assert four_ranks[0]["fsdp_tp_float8"]["tp_float8_all_gathers"] >= 2 * ARGS.n_layers * STEPS


@pytest.mark.distributed
def test_per_op_sac_keeps_amax_not_abs(two_ranks: list[dict[str, Any]]) -> None:
    abs_, max_, amax, mm = "aten.abs.default", "aten.max.default", "aten.amax.default", "aten.mm.default"
    assert abs_ not in {str(op) for op in SAC_SAVE_LIST}
    sac = two_ranks[0]["sac"]
    bf16, rowwise, tensorwise = sac["None"], sac["rowwise"], sac["tensorwise"]
    for run in (rowwise, tensorwise):
        assert abs_ not in run["kept"] and run["recomputed"][abs_] > 0, run  # abs ran, and is recomputed
    assert rowwise["kept"][amax] > 0 and tensorwise["kept"][max_] > 0
    assert bf16["kept"][mm] > 0 and "aten._scaled_dot_product_flash_attention_for_cpu.default" in bf16["kept"]
    # 7 mms per block (wq wk wv wo w1 w3 w2): the 2nd, 4th and 6th are recomputed.
    assert bf16["recomputed"][mm] == 3 * ARGS.n_layers
    # float8 keeps exactly what bf16 keeps plus its own scale inputs (amax / max outputs), which are tiny.
    for run in (rowwise, tensorwise):
        scales = run["kept"].get(amax, 0) + run["kept"].get(max_, 0)
        total = sum(run["kept"].values()) + run["outside"]
        assert total - scales <= sum(bf16["kept"].values()) + bf16["outside"], (run, bf16)
        # One fp32 per row (rowwise) or per tensor (tensorwise): 1.2% of the total at dim 64, 0.5% on the
        # debug model (docs/parallelisms.md); abs(W) would instead add the size of every weight.
        assert scales < 0.02 * total, run


@pytest.mark.distributed
def test_trainer_ac_modes_compile_and_tp_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    losses = two_ranks[0]["trainer"]
    none = losses["none"]
    assert len(none) == 3 and all(7.0 < x < 9.0 for x in none), none
    # Recomputation repeats the same fp32 kernels: every AC mode gives the same losses as no AC.
    for name in ("full", "selective_2", "selective_op"):
        assert losses[name] == none, (name, losses[name], none)
    torch.testing.assert_close(torch.tensor(losses["selective_op_compiled"]), torch.tensor(none), rtol=1e-4, atol=1e-4)
    # TP with loss parallel through the Trainer (one data stream: differs from the FSDP runs' data).
    tp = losses["tp_selective_op"]
    assert len(tp) == 3 and all(7.0 < x < 9.0 for x in tp), tp


@pytest.mark.slow
@pytest.mark.distributed
def test_tp_without_fsdp_compiles_and_matches_single_process(
    compiled_two_ranks: list[dict[str, Any]], reference: Any
) -> None:
    # Without wait_async_collective_inputs the first backward fails (torch drops the input's autograd edge);
    # a workaround that lost the edge instead (AsyncCollectiveTensor.wait()) would leave the embedding untrained.
    for r in compiled_two_ranks:
        _assert_losses(r["tp_compiled"]["losses"], reference(None, 1), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- config checks (no processes)


def _dims(tp: int = 1, world: int = 2) -> ParallelDims:
    return ParallelDims.for_world(1, -1, tp, world)


def _plan(
    args: ModelArgs,
    training: Training,
    parallelism: Parallelism,
    device_type: str,
    ac: ActivationCheckpoint | None = None,
    tp: int = 2,
    world: int = 2,
) -> None:
    """The world and parallel-plan checks a rank runs before its build (kiln_base/config/checks.py)."""
    cfg = JobConfig(
        training=training,
        parallelism=dataclasses.replace(parallelism, tensor_parallel_degree=tp),
        activation_checkpoint=ac or ActivationCheckpoint("none"),
    )
    check_world(cfg, world)
    check_parallel_plan(cfg, args.shape(), device_type)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(n_heads=3, n_kv_heads=3, dim=96), "must divide the model's n_heads \\(3\\)"),
        (dict(n_kv_heads=1), "must divide the model's n_kv_heads \\(1\\)"),
        (dict(multiple_of=3, dim=64), "must divide the model's FFN hidden dim \\(171\\)"),
    ],
)
def test_tp_degree_must_divide_model_shapes(args: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _plan(dataclasses.replace(ARGS, **args), Training(seq_len=32), Parallelism(), "cpu")


def test_batch_and_async_tp_checks() -> None:
    _plan(ARGS, Training(seq_len=32), Parallelism(), "cpu")  # fits
    with pytest.raises(ConfigError, match="training.seq_len \\(33\\) must be divisible by tensor_parallel_degree"):
        _plan(ARGS, Training(seq_len=33), Parallelism(), "cpu")
    async_tp = Parallelism(enable_async_tensor_parallel=True)
    with pytest.raises(ConfigError, match="enable_async_tensor_parallel needs CUDA"):
        _plan(ARGS, Training(seq_len=32, compile=True), async_tp, "cpu")
    with pytest.raises(ConfigError, match="needs tensor_parallel_degree > 1 and training.compile"):
        _plan(ARGS, Training(seq_len=32), async_tp, "cuda")


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
        ParallelDims.for_world(*dims)


def test_dp_shard_takes_the_rest() -> None:
    dims = ParallelDims.for_world(2, -1, 2, 16)
    assert (dims.dp_shard, dims.dp_degree, dims.fsdp_enabled, dims.tp_enabled) == (4, 8, True, True)


def test_tp_compile_without_fsdp_is_accepted() -> None:
    compiled = Training(seq_len=32, compile=True)
    for device_type in ("cpu", "cuda"):  # the torch bug it once hit is worked around in apply_compile
        _plan(ARGS, compiled, Parallelism(), device_type)


@pytest.mark.parametrize(
    ("recipe", "compile", "expected"),
    [
        ("rowwise", True, True),
        ("rowwise_with_gw_hp", True, True),
        ("tensorwise", True, False),
        ("rowwise", False, False),
    ],
)
def test_rowwise_compile_turns_on_emulate_precision_casts(recipe: str, compile: bool, expected: bool) -> None:
    """Building a float8 rowwise model with compile (the one build path, here through the dry run) sets inductor's
    emulate_precision_casts (pytorch#150859, as torchtitan does); tensorwise or eager leave it alone."""
    import torch._inductor.config as inductor_config

    from kiln_base.config import parse_args
    from kiln_base.internals import emulate_precision_casts_enabled
    from trainer.tools.dry_run import dry_run

    argv = tiny_run_args("--job.dry_run", "--float8.enable_float8_linear", "--float8.recipe_name", recipe)
    # Process-wide, so restored after; config.patch (pytest's monkeypatch deletes the key on torch 2.11).
    with inductor_config.patch(emulate_precision_casts=False):
        dry_run(parse_args(argv + (["--training.compile"] if compile else [])))
        assert emulate_precision_casts_enabled() is expected


@pytest.mark.parametrize(
    ("float8", "compile", "expected"),
    [
        (["--float8.recipe_name", "tensorwise"], True, True),
        (["--float8.recipe_name", "rowwise"], True, True),
        ([], True, False),
        (["--float8.recipe_name", "tensorwise"], False, False),
    ],
)
def test_float8_compile_turns_on_tiled_reductions(float8: list[str], compile: bool, expected: bool) -> None:
    """Float8 + compile tiles inductor's reductions in two dimensions (the transposed float8 copy fused into the
    backward's norm kernel is written coalesced; docs/performance.md); bf16 or eager leave inductor alone."""
    import torch._inductor.config as inductor_config

    from kiln_base.config import parse_args
    from kiln_base.internals import tiled_reductions_enabled
    from trainer.tools.dry_run import dry_run

    argv = tiny_run_args("--job.dry_run", *(["--float8.enable_float8_linear", *float8] if float8 else []))
    with inductor_config.patch({"triton.tile_reductions": False, "triton.prefer_nd_tiling": False}):
        dry_run(parse_args(argv + (["--training.compile"] if compile else [])))
        assert tiled_reductions_enabled() is expected


def test_fsdp_param_dtype_follows_resolved_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP's MixedPrecisionPolicy takes training.mixed_precision_param through resolve_mixed_precision: `auto` on a
    gloo (CPU) mesh is float32, an explicit bfloat16 is kept. Two fake ranks: only the policy handed over matters."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallelisms import parallelize

    policies = []

    def spy(module: nn.Module, **kwargs: Any) -> nn.Module:
        policies.append(kwargs["mp_policy"].param_dtype)
        return module

    monkeypatch.setattr(parallelize, "fully_shard", spy)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dims = ParallelDims.for_world(1, -1, 1, 2)
        dims.build_mesh("cpu")
        for param, want in (("auto", torch.float32), ("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            policies.clear()
            with torch.device("meta"):
                model = Transformer(ARGS)
            training = Training(mixed_precision_param=param)
            parallelize.parallelize_llama(model, dims, training, Parallelism(), ActivationCheckpoint("none"), Float8())
            # the embedding, each block, the final norm with the output layer, the root
            assert policies == [want] * (ARGS.n_layers + 3), (param, policies)
    finally:
        dist.destroy_process_group()


def test_tp_compile_with_whole_block_ac_is_refused_on_cpu() -> None:
    compiled = Training(seq_len=32, compile=True)
    for ac in (ActivationCheckpoint("full"), ActivationCheckpoint("selective", "2")):
        with pytest.raises(
            ConfigError, match=rf"tensor parallel \+ training.compile \+ activation_checkpoint.mode {ac.mode}"
        ):
            _plan(ARGS, compiled, Parallelism(), "cpu", ac, world=4)
        _plan(ARGS, Training(seq_len=32), Parallelism(), "cpu", ac, world=4)  # eager: fine
        _plan(ARGS, compiled, Parallelism(), "cuda", ac, world=4)  # not known to fail on CUDA
        _plan(ARGS, compiled, Parallelism(), "cpu", ac, tp=1, world=4)  # no TP: fine
    for ac in (ActivationCheckpoint("none"), ActivationCheckpoint("selective", "op")):  # these compile and train
        _plan(ARGS, compiled, Parallelism(), "cpu", ac, world=4)
