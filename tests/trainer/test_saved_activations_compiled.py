"""The saved-activation report under torch.compile, beside the eager one (docs/debugging.md shows both tables).

Compiled blocks are read from their partitioned graphs (inductor's decompositions and partitioner); the debug
model (2 blocks, seq 64, batch 2, fp32, eager loss), its blocks compiled one by one as apply_compile does.
Where both must agree: full AC, where each block keeps only its input either way. Where they differ: without AC
the partitioner keeps the two FFN matmul outputs and recomputes SiLU and the norms' products in backward, where
eager autograd keeps every op's inputs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kiln_base.internals import checkpoint_wrapper
from tests.helpers.common import DEBUG_CONFIG
from tests.helpers.sac import batch, debug_model, loss_fn
from trainer.tools.saved_activations import SavedActivationReport, measure_saved_activations


def eager_and_compiled(ac: str) -> tuple[SavedActivationReport, SavedActivationReport]:
    """The report of one step eager, then of the same model with each block compiled (fullgraph), from a fresh
    dynamo: a block compiled earlier in this process (another test's, another shape) would make this a recompile
    (with other guards), whose graph slices the RoPE table itself (an `aten.slice` row the comparison does not
    expect; seen when tests/models/test_qwen3.py ran first on the same worker)."""
    torch._dynamo.reset()
    model = debug_model(None, save_list=None)
    if ac == "full":
        for name, block in model.layers.named_children():
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
    tokens = batch()
    eager = measure_saved_activations(model, loss_fn(model, tokens, autocast=False))
    model.zero_grad()
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=True))
    compiled = measure_saved_activations(model, loss_fn(model, tokens, autocast=False))
    return eager, compiled


def rows(report: SavedActivationReport) -> dict[str, tuple[int, int]]:
    return {r.op: (r.count, r.nbytes) for r in report.rows}


@pytest.fixture(scope="module")
def full_ac() -> tuple[SavedActivationReport, SavedActivationReport]:
    return eager_and_compiled("full")


@pytest.fixture(scope="module")
def no_ac() -> tuple[SavedActivationReport, SavedActivationReport]:
    return eager_and_compiled("none")


def test_full_ac_compiled_agrees_with_eager(full_ac: tuple[SavedActivationReport, SavedActivationReport]) -> None:
    """Each compiled checkpointed block keeps its input, as eager checkpoint does; the eager parts are unchanged. The
    one addition: the partition keeps the CPU RNG state (5,056 bytes) per block to recompute SDPA, which torch
    counts as a random op. The RoPE table is the same 4,096 bytes, named after the graph's view of it."""
    eager, compiled = full_ac
    same = ("aten.add.Tensor", "aten.mul.Tensor", "aten.embedding", "aten._log_softmax", "aten.rsqrt")
    assert {op: rows(compiled)[op] for op in same} == {op: rows(eager)[op] for op in same}
    assert compiled.row("aten.add.Tensor").where == {"graph"}  # the blocks' outputs, kept as the next one's input
    rng = compiled.bytes_of("higher_order.run_and_save_rng_state")
    assert rng == 2 * torch.get_rng_state().nbytes  # one per block
    assert compiled.total_bytes - rng == eager.total_bytes
    assert eager.row("aten.slice.Tensor").nbytes == 4096 and compiled.row("aten.slice.Tensor") is None


def test_no_ac_compiled_keeps_less_than_eager(no_ac: tuple[SavedActivationReport, SavedActivationReport]) -> None:
    """Without AC eager autograd keeps every op's inputs; the partitioner keeps the matmul outputs and recomputes
    the cheap pointwise ops (SiLU, the norms' and gate's products, a residual sum) in backward."""
    eager, compiled = no_ac
    e, c = rows(eager), rows(compiled)
    assert e["aten.silu"] == (2, 2 * 2 * 64 * 768 * 4) and "aten.silu" not in c  # 786,432 bytes recomputed
    assert (e["aten.mul.Tensor"][1] - c["aten.mul.Tensor"][1], e["aten.add.Tensor"][1] - c["aten.add.Tensor"][1]) == (
        524_288,
        262_144,
    )
    assert c["aten.mm"][1] - e["aten.mm"][1] == 262_144  # one more (tokens x dim) matmul output per block
    assert (
        e["aten._scaled_dot_product_flash_attention_for_cpu"] == c["aten._scaled_dot_product_flash_attention_for_cpu"]
    )
    assert eager.total_bytes - compiled.total_bytes == 786_432 + 524_288 + 262_144 - 262_144
    text = compiled.format()
    assert text.splitlines()[0].endswith("  where") and "aten.silu" not in text
    assert (
        "read from the partitioned graphs (inductor's decompositions and partitioner, run eagerly): layers.0 (1 "
        in text
    )
    assert "measured eagerly (not compiled): tok_embeddings, norm, output" in text
    assert "where" not in eager.format() and not eager.regions  # the eager table is as before


@pytest.mark.slow
def test_cli_report_under_compile_reads_blocks_and_loss_from_graphs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--training.compile: the blocks and the compiled loss are read from their graphs. The compiled loss keeps
    the logits and per-token statistics where eager cross-entropy keeps its (tokens x vocab) log-softmax."""
    import train

    caplog.set_level(logging.INFO, logger="kiln")
    argv = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), "--model.n_layers", "2"]
    argv += ["--training.seq_len", "64", "--training.local_batch_size", "2", "--training.mixed_precision_param"]
    argv += ["float32", "--training.compile", "--profiling.saved_activations_report"]
    assert train.main(argv) == 0
    (text,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Tensors kept for backward")]
    assert "layers.0 (1 graph run), layers.1 (1 graph run)" in text
    assert "compiled outside the model's modules (kiln's loss): 1 graph run(s)" in text
    assert "aten._log_softmax" not in text and "aten.amax" in text


def test_a_compiled_module_that_runs_no_graph_is_said_measured_eagerly() -> None:
    """Dynamo may run a compiled module's code eagerly (here: its forward is marked torch.compiler.disable); the
    report measures it eagerly, like the rest of the eager code, and says so."""
    model = debug_model(None, save_list=None)
    for name, block in model.layers.named_children():
        if name == "1":
            block.forward = torch.compiler.disable(block.forward)  # dynamo skips it: no graph, eager ops
        model.layers.register_module(name, torch.compile(block))
    report = measure_saved_activations(model, loss_fn(model, batch(), autocast=False))
    text = report.format()
    assert "compiled modules in which no compiled graph ran, measured eagerly: layers.1" in text
    assert "layers.0 (1 graph run)" in text and "layers.1 (" not in text
    silu = report.row("aten.silu")  # eager autograd keeps layers.1's SiLU output; layers.0's graph recomputes it
    assert silu is not None and silu.count == 1 and silu.where == {"eager"}
