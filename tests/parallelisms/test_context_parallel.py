"""Context parallelism: CP 2 and CP 4 train the debug model as one process does, with each rotate method, with and
without head-tail load balancing; the sequence layout, the attention kernels' calls and the config's refusals.

The parity runs go through the Trainer (parse_args + Trainer on gloo ranks), fp32 and deterministic, from the same
seed (the layout-independent init gives every layout the same weights) and the same global batches: the losses of
every step within 1e-5 relative of one process's, and the gradients of step 1 (full tensors, as the optimizer gets
them) close to one process's. One spawned group per world size trains all four settings in turn, then the
long-context run (a sequence over one rank's memory budget) and, on 2 ranks, the saved-activation report.
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


def _train(argv: list[str]) -> dict[str, Any]:
    """Train with `argv` in this process's group (world 1 without one); losses, step-1 gradients, tokens per rank."""
    seen: list[tuple[int, ...]] = []
    with open_trainer(argv) as trainer:
        grads = _step1_grads(trainer)
        trainer.model.tok_embeddings.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
        trainer.train()
    return {"losses": trainer.losses, "grads": grads, "input_shapes": sorted(set(seen))}


# Long context: seq 4096 is over training.memory_budget_gib for one rank (the dry run's estimate: 0.18 GiB) and
# under it for CP 2 (0.10 GiB) and CP 4 (0.06 GiB).
LONG = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "4096"),
    *("--training.local_batch_size", "1", "--training.steps", "2", "--training.seed", "0", "--metrics.log_freq", "1"),
    *("--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none"),
    *("--training.memory_budget_gib", "0.12"),
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
    for name, result in results.items():
        assert result["input_shapes"] == [(2, SEQ // world)], (name, result["input_shapes"])  # only its part
        torch.testing.assert_close(torch.tensor(result["losses"]), ref_losses, rtol=LOSS_RTOL, atol=0, msg=name)
        assert result["grads"].keys() == reference["grads"].keys()
        for param, g in result["grads"].items():
            ref = reference["grads"][param]
            worst = ((g - ref).abs().max() / ref.abs().max()).item()
            assert worst < GRAD_TOL, f"{name}: {param} differs by {worst:.2e} of its largest gradient"


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
    assert line.startswith("kiln: error: training.memory_budget_gib 0.12: this rank would need about 0.18"), line
    assert "raise parallelism.context_parallel_degree (1)" in line, line
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
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
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


@pytest.mark.parametrize("kernel,dtype", [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)])
def test_cuda_kernel_calls_match_their_schemas(kernel: str, dtype: torch.dtype) -> None:
    """No GPU here: the CUDA kernels' calls run on meta tensors (torch's shape functions check every argument)."""
    q, k = (torch.empty(2, 4, 48, 64, device="meta", dtype=dtype) for _ in range(2))
    out, lse = attention_forward(q, k, k, True, kernel)
    assert out.shape == q.shape and lse.shape == (2, 4, 48) and lse.dtype == torch.float32
    grads = attention_backward(out, q, k, k, out, lse, True, kernel)
    assert [t.shape for t in grads] == [q.shape] * 3
