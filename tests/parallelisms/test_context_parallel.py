"""Context parallelism: CP 2 and CP 4 train the debug model as one process does, with each rotate method, with and
without head-tail load balancing; the sequence layout, the attention kernels' calls and the config's refusals.

The parity runs go through the Trainer (parse_args + Trainer on gloo ranks), fp32 and deterministic, from the same
seed (the layout-independent init gives every layout the same weights) and the same global batches: the losses of
every step within 1e-5 relative of one process's, and the gradients of step 1 (full tensors, as the optimizer gets
them) close to one process's. Each run also checks one seed, one model (CP's initial weights, gathered whole, equal
one process's bitwise) and validation under CP (the validation loss of step 1 within 1e-5 of one process's). One
spawned group per world size trains all four settings in turn, then the long-context run (a sequence over one rank's
memory budget) and, on 2 ranks, the saved-activation report.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import train
from kiln_base.config import check_world, parse_args
from kiln_base.errors import ConfigError
from models.llama3 import attention_core
from parallelisms.context_parallel import ContextParallel, SequenceLayout, attention_backward, attention_forward
from tests.helpers.common import DEBUG_CONFIG, ROOT, free_port, open_trainer
from tests.helpers.distributed import reopen_group, run_distributed

P = "--parallelism."
SEQ = 64  # divisible into 2 x 4 head-tail chunks
COMMON = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", str(SEQ)),
    *("--training.local_batch_size", "2", "--training.steps", "3", "--training.seed", "0"),
    *("--training.mixed_precision_param", "float32", "--training.deterministic", "--metrics.log_freq", "1"),
    *("--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1", "--activation_checkpoint.mode", "none"),
    # No clipping: the gradients compared are the ones CP computes (torch's clip_grad_norm_ itself scales plain and
    # sharded gradients differently by up to 1e-4 relative: measured 1.0000112 vs 0.99993 after clipping to 1.0).
    *("--training.max_norm", "0"),
    # Validation under CP (at step 1): the held-out batches are split like training's, the loss averaged over dp x cp.
    *("--validation.enable", "--validation.steps", "2"),
)
SETTINGS: dict[str, tuple[str, ...]] = {
    f"{method}-{balancer}": (
        f"{P}context_parallel_rotate_method",
        method,
        f"{P}context_parallel_load_balancer",
        balancer,
    )
    for method in ("allgather", "alltoall")
    for balancer in ("headtail", "none")
}
LOSS_RTOL = 1e-5
# Per parameter: max |gradient difference| / max |one process's gradient| (measured: 6.3e-7 at most).
GRAD_TOL = 1e-5


def _step1_grads(trainer: Any) -> dict[str, torch.Tensor]:
    """Filled with step 1's gradients, whole, as the optimizer gets them (a collective per sharded gradient: every
    rank runs it)."""
    grads: dict[str, torch.Tensor] = {}
    names = {p: n for n, p in trainer.model.named_parameters()}

    def record(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if grads:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[names[p]] = g.detach().clone()

    trainer.optimizer.register_step_pre_hook(record)
    return grads


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(argv: list[str]) -> dict[str, Any]:
    """Train with `argv` in this process's group (world 1 without one); initial weights (whole), losses, step-1
    gradients, validation losses, tokens per rank."""
    seen: list[tuple[int, ...]] = []
    with open_trainer(argv) as trainer:
        init = {n: _whole(p) for n, p in trainer.model.named_parameters()}  # a collective per sharded parameter
        grads = _step1_grads(trainer)
        trainer.model.tok_embeddings.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
        trainer.train()
    val = dict(trainer.validator.losses) if trainer.validator is not None else {}
    return {"init": init, "losses": trainer.losses, "grads": grads, "val": val, "input_shapes": sorted(set(seen))}


# Long context: seq 4096 is over training.memory_budget_gib for one rank (the dry run's estimate: 0.18 GiB) and
# under it for CP 2 (0.10 GiB) and CP 4 (0.06 GiB).
LONG = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "4096"),
    *("--training.local_batch_size", "1", "--training.steps", "2", "--training.seed", "0", "--metrics.log_freq", "1"),
    *("--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none"),
    *("--training.memory_budget_gib", "0.2"),  # float32 activations: 0.291 GiB on one rank, 0.157 with CP 2
)
# The saved-activation report per rank: one forward/backward at seq 512.
REPORT = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "512"),
    *("--training.local_batch_size", "1", "--training.seed", "0", "--training.mixed_precision_param", "float32"),
    *("--activation_checkpoint.mode", "none", "--profiling.saved_activations_report"),
)


def _saved_bytes(argv: list[str]) -> int:
    with open_trainer(argv) as trainer:
        return trainer.report_saved_activations().total_bytes


def _cp_group(world: int, folder: str) -> None:
    """On each rank of one group (CP degree = the world): every parity setting in turn, the long-context run and,
    on 2 ranks, the saved-activation report; rank 0 saves what it saw to `folder`/results.pt (tensors cannot
    travel back through the result queue once the rank has exited)."""
    cp = (f"{P}context_parallel_degree", str(world))
    out: dict[str, Any] = {"parity": {}}
    for i, (name, extra) in enumerate(SETTINGS.items()):
        reopen_group(f"{folder}/store_{i}")
        out["parity"][name] = _train([*COMMON, *cp, *extra, "--job.dump_folder", f"{folder}/{name}"])
    reopen_group(f"{folder}/store_long")
    out["long"] = _train([*LONG, *cp, "--job.dump_folder", f"{folder}/long"])["losses"]
    if world == 2:
        reopen_group(f"{folder}/store_report")
        out["saved_bytes"] = _saved_bytes([*REPORT, *cp, "--job.dump_folder", f"{folder}/report"])
    if int(os.environ["RANK"]) == 0:
        torch.save(out, f"{folder}/results.pt")


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """What rank 0 of the CP `world`-rank group saw; each group runs once, when first asked."""
    done: dict[int, dict[str, Any]] = {}

    def get(world: int) -> dict[str, Any]:
        if world not in done:
            folder = tmp_path_factory.mktemp(f"cp{world}")
            run_distributed(_cp_group, world, world, str(folder))
            done[world] = torch.load(folder / "results.pt")
        return done[world]

    return get


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _train([*COMMON, "--job.dump_folder", str(tmp_path_factory.mktemp("one"))])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_cp_matches_one_process(world: int, reference: dict[str, Any], cp_runs: Any) -> None:
    results = cp_runs(world)["parity"]
    assert results.keys() == SETTINGS.keys()
    ref_losses = torch.tensor(reference["losses"])
    assert list(reference["val"]) == [1]
    for name, result in results.items():
        assert result["input_shapes"] == [(2, SEQ // world)], (name, result["input_shapes"])  # only its part
        # One seed, one model: CP's ranks (FSDP shards over dp_shard x cp) start from one process's weights.
        assert result["init"].keys() == reference["init"].keys()
        for param, w in result["init"].items():
            assert torch.equal(w, reference["init"][param]), f"{name}: initial {param} differs from one process's"
        torch.testing.assert_close(torch.tensor(result["losses"]), ref_losses, rtol=LOSS_RTOL, atol=0, msg=name)
        assert result["grads"].keys() == reference["grads"].keys()
        worst_grad = 0.0
        for param, g in result["grads"].items():
            ref = reference["grads"][param]
            worst = ((g - ref).abs().max() / ref.abs().max()).item()
            assert worst < GRAD_TOL, f"{name}: {param} differs by {worst:.2e} of its largest gradient"
            worst_grad = max(worst_grad, worst)
        assert list(result["val"]) == [1], (name, result["val"])
        val_rel = abs(result["val"][1] - reference["val"][1]) / reference["val"][1]
        assert val_rel < LOSS_RTOL, (name, result["val"], reference["val"])
        loss_rel = ((torch.tensor(result["losses"]) - ref_losses).abs() / ref_losses.abs()).max().item()
        # The measurements docs/parallelisms.md quotes (pytest -s prints them).
        print(
            f"\nCP {world} {name}: losses {result['losses']} (max relative {loss_rel:.1e}), step-1 gradients "
            f"{worst_grad:.1e}, validation {result['val'][1]:.6f} vs {reference['val'][1]:.6f} ({val_rel:.1e}), "
            "initial weights equal"
        )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_a_sequence_over_one_ranks_memory_budget_trains_with_cp(
    world: int, cp_runs: Any, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """training.memory_budget_gib: one rank refuses seq 4096 before allocating anything (exit 2, one line naming
    the key and the estimate); CP 2 and CP 4 split it and train."""
    assert train.main([*LONG, "--job.dump_folder", str(tmp_path)]) == 2
    (line,) = capfd.readouterr().err.strip().splitlines()
    assert line.startswith("kiln: error: training.memory_budget_gib 0.2: this rank would need about 0.291"), line
    assert "raise parallelism.context_parallel_degree (1)" in line and "pipeline_parallel_degree (1)" in line, line
    losses = cp_runs(world)["long"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses


@pytest.mark.slow
@pytest.mark.distributed
def test_cp2_keeps_half_the_activation_bytes_per_rank(cp_runs: Any, tmp_path: Path) -> None:
    """The saved-activation report per rank (seq 512, no AC, fp32): CP 2 keeps at most 0.55x one rank's bytes
    (measured 0.500x; at seq 8192 too: docs/parallelisms.md)."""
    one = _saved_bytes([*REPORT, "--job.dump_folder", str(tmp_path)])
    assert cp_runs(2)["saved_bytes"] <= 0.55 * one, (cp_runs(2)["saved_bytes"], one)


@pytest.mark.parametrize("release", ["v0.1.0", "v0.2.2"])
def test_torchtitan_toml_with_cp_keys_runs_as_it_is(release: str, tmp_path: Path) -> None:
    """torchtitan's own debug config (tests/fixtures/torchtitan) with its CP keys set: read with their meanings,
    and its seq_len 2048 splits into 2 x 2 head-tail chunks on 2 ranks."""
    text = (ROOT / "tests" / "fixtures" / "torchtitan" / release / "debug_model.toml").read_text()
    keys = 'context_parallel_degree = 2\ncontext_parallel_rotate_method = "alltoall"'
    if release == "v0.2.2":  # the load balancer key came with v0.2.2
        keys += '\ncontext_parallel_load_balancer = "headtail"'
    assert "context_parallel_degree = 1" in text
    (tmp_path / "cp.toml").write_text(text.replace("context_parallel_degree = 1", keys))
    cfg = parse_args(["--job.config_file", str(tmp_path / "cp.toml")])
    p = cfg.parallelism
    assert (p.context_parallel_degree, p.context_parallel_rotate_method, p.context_parallel_load_balancer) == (
        2,
        "alltoall",
        "headtail",
    )
    check_world(cfg, 2)
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        check_world(cfg, 3)


# ----------------------------------------------------------------------------- layout and attention, one process


def test_sequence_layout_head_tail_and_contiguous() -> None:
    tokens = torch.arange(16).view(1, 16)
    head_tail = SequenceLayout(cp=2, load_balance=True)  # 4 chunks of 4: rank 0 holds 0 and 3, rank 1 holds 1 and 2
    assert head_tail.positions(0, 16).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert head_tail.positions(1, 16).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    contiguous = SequenceLayout(cp=4, load_balance=False)
    assert contiguous.positions(2, 16).tolist() == [8, 9, 10, 11]
    for layout in (head_tail, contiguous, SequenceLayout(4, True)):
        parts = [layout.shard(tokens, r) for r in range(layout.cp)]
        for r, part in enumerate(parts):  # a rank's tokens are the ones at its positions
            assert torch.equal(part[0], layout.positions(r, 16))
        assert sorted(torch.cat(parts, dim=1)[0].tolist()) == list(range(16))  # every token on exactly one rank


def _one_rank_group() -> str:
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"  # the collectives of either device
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return dist.group.WORLD.group_name


@pytest.mark.parametrize("rotate_method", ["allgather", "alltoall"])
def test_chunked_attention_equals_sdpa_in_one_process(rotate_method: str) -> None:
    """One rank holding both head-tail chunks (cp 1 with load balancing): the attention runs its pairs (chunk 1 over
    chunk 0 whole, each chunk over itself causally), merges them by log-sum-exp and backpropagates each pair with the
    merged output; output and q/k/v gradients equal SDPA over the whole sequence (grouped-query heads, fp32)."""
    cp = ContextParallel(SequenceLayout(1, load_balance=True), 0, _one_rank_group(), rotate_method)
    assert cp.pairs(0) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(2, 24, 4, 8, generator=g)
    ours = cp.attention(q, k, v)
    assert ours.is_contiguous()  # built in q's layout: wo's input needs no copy
    ours_grads = torch.autograd.grad(ours, (q, k, v), dout)
    ref = attention_core(q, k, v, None)
    for a, b in zip((ours, *ours_grads), (ref, *torch.autograd.grad(ref, (q, k, v), dout)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotate_method", ["allgather", "alltoall"])
def test_chunked_attention_on_cuda_equals_attention_in_float64(rotate_method: str, dtype: torch.dtype) -> None:
    """The CUDA kernels (flash for bf16, memory-efficient for fp32) through the same pairs, merging and per-pair
    backward as on the CPU: output and q/k/v gradients against attention over the whole sequence in float64 (CPU)."""
    cp = ContextParallel(SequenceLayout(1, load_balance=True), 0, _one_rank_group(), rotate_method)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(2, 256, h, 64, generator=g) for h in (8, 2, 2)]
    dout = torch.randn(2, 256, 8, 64, generator=g)
    q, k, v = (t.to("cuda", dtype).requires_grad_() for t in qkv)
    ours = cp.attention(q, k, v)
    ours_grads = torch.autograd.grad(ours, (q, k, v), dout.to("cuda", dtype))
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = attention_core(q64, k64, v64, None)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.to(dtype).double())
    tol = {torch.bfloat16: 3e-2, torch.float32: 1e-4}[dtype]
    for a, b in zip((ours, *ours_grads), (ref, *ref_grads), strict=True):
        worst = ((a.detach().cpu().double() - b).abs().max() / b.abs().max()).item()
        print(f"\ncuda {rotate_method} {dtype}: max |difference| / max |reference| = {worst:.2e}")
        assert worst < tol, worst


@pytest.mark.parametrize("kernel,dtype", [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)])
def test_cuda_kernel_calls_match_their_schemas(kernel: str, dtype: torch.dtype) -> None:
    """No GPU here: the CUDA kernels' calls run on meta tensors (torch's shape functions check every argument)."""
    q, k = (torch.empty(2, 4, 48, 64, device="meta", dtype=dtype) for _ in range(2))
    out, lse = attention_forward(q, k, k, True, kernel)
    assert out.shape == q.shape and lse.shape == (2, 4, 48) and lse.dtype == torch.float32
    grads = attention_backward(out, q, k, k, out, lse, True, kernel)
    assert [t.shape for t in grads] == [q.shape] * 3


# ----------------------------------------------------------------------------- composition with main's features


def test_cp_with_a_document_mask_or_an_unsplittable_validation_length_is_refused_in_one_line() -> None:
    """Document masks (block_causal, the _flex/_varlen flavors) are refused with CP before any rank starts; a
    validation.seq_len that does not split into the CP chunks is refused by name, like training.seq_len."""
    from kiln_base.config import check_parallel_plan
    from models import LLAMA3_FLAVORS

    cp2 = [*COMMON, f"{P}context_parallel_degree", "2", f"{P}data_parallel_shard_degree", "1"]
    flex = parse_args([*cp2, "--model.flavor", "debugmodel_flex_attn"])
    with pytest.raises(ConfigError) as e:
        check_parallel_plan(flex, LLAMA3_FLAVORS["debugmodel_flex_attn"].shape(), "cpu")
    assert len(str(e.value).splitlines()) == 1
    assert str(e.value).startswith("parallelism.context_parallel_degree 2 with model.flavor debugmodel_flex_attn")
    check_parallel_plan(parse_args(cp2), LLAMA3_FLAVORS["debugmodel"].shape(), "cpu")  # causal: composes
    with pytest.raises(ConfigError, match=r"^validation.seq_len \(30\) must split into 2 x context_parallel_degree"):
        check_world(parse_args([*cp2, "--validation.seq_len", "30"]), 2)
    check_world(parse_args([*cp2, "--validation.seq_len", "32"]), 2)


def test_cp_with_emulated_nvfp4_passes_the_launchers_checks() -> None:
    """NVFP4 (emulated) composes with CP: the launcher's checks for 2 ranks pass it (the composition suite trains
    the nvfp4 x cp2 cells), and a block-causal flavor with CP is the launcher's one line."""
    argv = [*COMMON, f"{P}context_parallel_degree", "2", f"{P}data_parallel_shard_degree", "1"]
    nvfp4 = ["--float8.enable_float8_linear", "--float8.recipe_name", "nvfp4", "--float8.emulate"]
    assert train.check_config([*argv, *nvfp4], world_size=2) is not None
    assert train.check_config([*argv, *nvfp4, "--model.flavor", "debugmodel_flex_attn"], world_size=2) is None
