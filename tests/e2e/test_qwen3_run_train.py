"""Qwen3 (`--model.name qwen3`) through run_train.sh, dense and mixture-of-experts, as users start it.

Each run is a qwen3 debug flavor at 2 layers, seq 32, float32, 4 steps; the checks read rank 0's step lines. The one-
rank runs save their last step, which scripts/convert_hf.py exports and transformers loads (AutoModelForCausalLM):
its logits are kiln's on the same weights. FSDP over 2 ranks (the experts' [E, out, in] weights sharded on the
experts) and TP over 2 ranks (the q/k norms replicated over the heads) follow the one-rank runs' losses: one seed,
one model, the same global batch. The refusals: a flavor of the other family, an HF folder of another MoE family.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.common import DEBUG_CONFIG
from tests.helpers.kiln_process import assert_one_line_error, run_kiln
from tests.helpers.scripts import load_script

conv = load_script("convert_hf")

STEP = re.compile(r"step: +(\d+)  loss: +(\S+)  ")
TINY = (
    *("--job.config_file", DEBUG_CONFIG, "--model.name", "qwen3", "--model.n_layers", "2"),
    *("--training.seq_len", "32", "--training.steps", "4", "--training.seed", "0"),
    *("--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--optimizer.lr", "3e-3"),
    *("--lr_scheduler.warmup_steps", "1", "--activation_checkpoint.mode", "none"),
)
P = "--parallelism."
SAVE_LAST = ("--checkpoint.enable_checkpoint", "--checkpoint.interval", "4")
# Global batch 2 in every layout: local batch 2 on one data-parallel rank (TP ranks read the same), 1 on two.
ONE_RANK = ("--training.local_batch_size", "2")
FSDP2 = (f"{P}data_parallel_shard_degree", "2", "--training.local_batch_size", "1")
TP2 = (f"{P}data_parallel_shard_degree", "1", f"{P}tensor_parallel_degree", "2", "--training.local_batch_size", "2")
TOKENS = torch.randint(0, 2256, (2, 24), generator=torch.Generator().manual_seed(5))


def run_train(ngpu: int, dump: Path, *args: str) -> tuple[list[float], str]:
    """`NGPU=ngpu ./run_train.sh TINY args`: rank 0's loss per step, and its output."""
    proc = run_kiln([*TINY, "--job.dump_folder", dump, *args], ngpu=ngpu, threads=1, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = [m.groups() for line in proc.stdout.splitlines() if (m := STEP.search(line))]
    assert [int(s) for s, _ in steps] == [1, 2, 3, 4], proc.stdout[-4000:]
    losses = [float(loss) for _, loss in steps]
    assert all(math.isfinite(x) for x in losses) and min(losses[1:]) < losses[0] - 0.1, losses
    return losses, proc.stdout


def exported_logits_match(run: Path, out: Path) -> None:
    """The run's last step -> convert_hf.py to_hf -> transformers: the logits of kiln's model on the same weights."""
    from transformers import AutoModelForCausalLM

    from models import Transformer

    assert conv.main(["to_hf", str(run / "checkpoint"), str(out), "--dtype", "float32"]) == 0
    sd, args = conv.load_kiln_weights(str(run / "checkpoint" / "step-4"))
    model = Transformer(args)
    model.load_state_dict(sd)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if args.moe else "Qwen3ForCausalLM")
    with torch.no_grad():
        ours, theirs = model.eval()(TOKENS), hf(TOKENS).logits
    diff, scale = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    assert diff <= 1e-5 * scale, (diff, scale)


@pytest.fixture(scope="module")
def moe_one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], str, Path]:
    dump = tmp_path_factory.mktemp("moe1")
    losses, out = run_train(1, dump, "--model.flavor", "debugmodel_moe", *ONE_RANK, *SAVE_LAST)
    return losses, out, dump


@pytest.fixture(scope="module")
def dense_one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], str, Path]:
    dump = tmp_path_factory.mktemp("dense1")
    losses, out = run_train(1, dump, "--model.flavor", "debugmodel", *ONE_RANK, *SAVE_LAST)
    return losses, out, dump


@pytest.mark.slow
def test_moe_trains_logs_active_params_and_exports(moe_one_rank: tuple, tmp_path: Path) -> None:
    _, out, dump = moe_one_rank
    line = next(line for line in out.splitlines() if "INFO Model qwen3 debugmodel_moe" in line)
    m = re.search(r"2 layers, MoE 8 experts \(top 2\), ([\d,]+) params total, ([\d,]+) active per token", line)
    assert m is not None, line
    total, active = (int(g.replace(",", "")) for g in m.groups())
    # Per layer, 6 of the 8 experts' three 256 x 128 matrices are idle for a token.
    assert total - active == 2 * 6 * 3 * 256 * 128, line
    assert "an MoE's FLOPs count its active parameters" in line
    exported_logits_match(dump, tmp_path / "hf")


@pytest.mark.slow
def test_dense_trains_and_exports(dense_one_rank: tuple, tmp_path: Path) -> None:
    _, out, dump = dense_one_rank
    assert re.search(r"INFO Model qwen3 debugmodel: 2 layers, [\d,]+ params, vocab", out), out[-3000:]
    exported_logits_match(dump, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3"


@pytest.mark.slow
@pytest.mark.distributed
def test_moe_fsdp2_follows_one_rank(moe_one_rank: tuple, tmp_path: Path) -> None:
    losses, _ = run_train(2, tmp_path, "--model.flavor", "debugmodel_moe", *FSDP2)
    assert losses == pytest.approx(moe_one_rank[0], abs=2e-4), (losses, moe_one_rank[0])


@pytest.mark.slow
@pytest.mark.distributed
def test_dense_tp2_follows_one_rank(dense_one_rank: tuple, tmp_path: Path) -> None:
    losses, _ = run_train(2, tmp_path, "--model.flavor", "debugmodel", *TP2)
    assert losses == pytest.approx(dense_one_rank[0], abs=2e-4), (losses, dense_one_rank[0])


def test_flavor_of_the_other_family_refused() -> None:
    proc = run_kiln(["--model.name", "qwen3", "--model.flavor", "3.2-1B"], ngpu=1)
    assert_one_line_error(proc, "model.flavor '3.2-1B' is not a model.name qwen3 flavor", "debugmodel_moe, 0.6B")


def test_other_moe_family_folder_refused(tmp_path: Path) -> None:
    """A Mixtral folder (config.json is read first: no weights needed) is refused before any rank starts."""
    src = tmp_path / "mixtral"
    src.mkdir()
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8}
    (src / "config.json").write_text(json.dumps(config))
    args = ["--model.name", "qwen3", "--model.flavor", "from_checkpoint", "--checkpoint.initial_load_path", src]
    proc = run_kiln(args, ngpu=1)
    line = assert_one_line_error(proc, "checkpoint.initial_load_path", 'model_type = "mixtral"', "mixture-of-experts")
    assert "Model qwen3" not in proc.stdout, line
