"""Document masking in training: what per-op SAC keeps of flex attention, and compiled blocks that take a new mask
every batch without recompiling (models/attention.py, parallelisms/activation_checkpoint.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln_base.config import ActivationCheckpoint, JobConfig
from kiln_base.internals import cpu_flex_backward, dynamo_graphs_compiled
from models import LLAMA3_FLAVORS, Transformer
from parallelisms.activation_checkpoint import SAC_SAVE_LIST, apply_ac
from trainer.checkpoint.resume import check_resume, training_settings
from trainer.data.text import build_dataloader
from trainer.hooks import StepHook, StepOutput
from trainer.tools.saved_activations import SavedActivationReport, measure_saved_activations

BOS, SEQ, BATCH, LAYERS = 2000, 64, 2, 2
HEADS, HEAD_DIM = 16, 16  # debugmodel


def _sac_model(save_list: frozenset) -> Transformer:
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel_flex_attn"], vocab_size=2256, n_layers=LAYERS, max_seq_len=SEQ, bos_id=BOS
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"), save_list=save_list)
    return model


def _tokens() -> torch.Tensor:
    tokens = torch.randint(0, 1900, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    tokens[:, [0, 20, 41]] = BOS
    return tokens


def _run(model: Transformer, flex: bool, monkeypatch: pytest.MonkeyPatch) -> SavedActivationReport:
    """One forward/backward under the saved-activation report, through flex_attention itself (`flex`; its eager
    reference, which has a backward on a CPU once torch's refusal is lifted) or the CPU's dense-mask SDPA."""
    tokens = _tokens()

    def forward() -> torch.Tensor:
        return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    if not flex:
        return measure_saved_activations(model, forward)
    # force_eager, as Trainer.report_saved_activations runs it: eager flex_attention compiles its own call otherwise
    with monkeypatch.context() as m, cpu_flex_backward(), torch.compiler.set_stance("force_eager"):
        m.setattr("models.attention.flex_trains_on", lambda device: True)  # what a GPU runs
        return measure_saved_activations(model, forward)


def test_per_op_sac_keeps_flex_attention_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """SAC_SAVE_LIST saves flex attention (torch.ops.higher_order.flex_attention) as it saves SDPA: per block its
    output, log-sum-exp and row max, so backward does not redo the attention; measured with the saved-activation
    report, the report kiln prints for --profiling.saved_activations_report. Gradients equal the dense path's."""
    flex_model = _sac_model(SAC_SAVE_LIST)
    flex = _run(flex_model, True, monkeypatch)
    out, lse, row_max = BATCH * HEADS * SEQ * HEAD_DIM * 4, BATCH * HEADS * SEQ * 4, BATCH * HEADS * SEQ * 4
    row = flex.row("higher_order.flex_attention")
    assert row is not None and (row.count, row.nbytes) == (3 * LAYERS, LAYERS * (out + lse + row_max)), row
    assert flex.row("aten._scaled_dot_product_flash_attention_for_cpu") is None

    dense_model = _sac_model(SAC_SAVE_LIST)
    dense = _run(dense_model, False, monkeypatch)
    sdpa = dense.row("aten._scaled_dot_product_flash_attention_for_cpu")
    assert sdpa is not None and sdpa.nbytes == LAYERS * (out + lse)  # SDPA has no row-max output
    assert flex.total_bytes - dense.total_bytes == LAYERS * row_max
    for a, b in zip(flex_model.parameters(), dense_model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)

    without = _sac_model(SAC_SAVE_LIST - {torch.ops.higher_order.flex_attention})  # the list is what decides
    assert _run(without, True, monkeypatch).row("higher_order.flex_attention") is None


class GraphCount(StepHook):
    """Dynamo's graph count after each step (kiln_base.internals.dynamo_graphs_compiled)."""

    def __init__(self) -> None:
        self.after: dict[int, int] = {}

    def post_step(self, out: StepOutput) -> None:
        self.after[out.step] = dynamo_graphs_compiled()


@pytest.mark.slow
def test_compiled_blocks_take_a_new_mask_every_batch_without_recompiling(
    tiny_args: Callable[..., list[str]], make_trainer: Callable, tmp_path: Path
) -> None:
    """Compiled per-op-SAC blocks fed a new block mask every batch (documents in new places), with validation every
    second step: every graph is compiled in step 1 (training's, and validation's inference graphs); none after."""
    argv = tiny_args(
        *("--model.flavor", "debugmodel_flex_attn", "--model.n_layers", "2", "--training.seq_len", "64"),
        *("--training.compile", "--training.steps", "5", "--metrics.log_freq", "1"),
        *("--validation.enable", "--validation.freq", "2", "--validation.steps", "2"),
        ac="selective",
    )
    argv += ["--activation_checkpoint.selective_ac_option", "op"]
    torch._dynamo.reset()
    trainer = make_trainer(argv)
    batches = build_dataloader(trainer.cfg.training, trainer.tokenizer, 0, 1)  # the same global order
    bos = trainer.tokenizer.bos_id
    boundaries = {tuple(map(tuple, (next(batches)[0] == bos).nonzero().tolist())) for _ in range(5)}
    batches.close()
    assert len(boundaries) == 5  # documents start in other places every step: a different mask every batch
    counts = GraphCount()
    trainer.train(extra_hooks=[counts])
    assert counts.after[1] > 0
    assert counts.after[5] == counts.after[1], counts.after
    assert sorted(trainer.validator.losses) == [1, 2, 4]


def test_resuming_under_another_attention_warns() -> None:
    """A checkpoint of a causal run resumes as a document-masked one (the same weights) with one warning, and a
    checkpoint saved before kiln recorded the attention counts as causal."""
    causal = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=2256, bos_id=BOS)
    masked = dataclasses.replace(LLAMA3_FLAVORS["debugmodel_flex_attn"], vocab_size=2256, bos_id=BOS)
    saved, flex = (training_settings(JobConfig(), a, 8, {"hub": "c4"}, "sha") for a in (causal, masked))
    (line,) = check_resume(saved, flex, "ckpt")
    assert "changed model.attention ('sdpa attention, causal mask' there, 'flex attention, block_causal mask'" in line
    older = {k: v for k, v in saved.items() if k != "model.attention"}
    assert check_resume(older, saved, "ckpt") == [] and len(check_resume(older, flex, "ckpt")) == 1
