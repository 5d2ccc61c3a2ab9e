"""A seed checkpoint seeds the run it starts: `--checkpoint.create_seed_checkpoint` in one layout, then training in
another layout from that folder, logs the losses and grad norms of the same run started from scratch in the
training layout, value for value (TensorBoard's float32 scalars, compared exactly).

Through run_train.sh, the path users take: fp32, deterministic, seed 7, 2 layers, seq 64, global batch 4, 3 steps
(the first step's loss comes before any update; steps 2 and 3 show the optimizer state the seed restored). The
initial weights do not depend on the layout (parallelisms/seeded_init.py), so the from-scratch run in the training
layout is the reference. Before the fix, the seed held AdamW step counts of 1 (torch's get_optimizer_state_dict
fills an unstepped optimizer's state by a zero step): step 2 was 8.2811 against 8.2703.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.common import DEBUG_CONFIG
from tests.helpers.kiln_process import run_kiln
from tests.helpers.run_files import tensorboard_scalars

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

P = "--parallelism."
RUN = (
    *("--job.config_file", DEBUG_CONFIG, "--model.n_layers", "2", "--training.seq_len", "64"),
    *("--training.steps", "3", "--training.seed", "7", "--training.deterministic", "--metrics.log_freq", "1"),
    *("--training.mixed_precision_param", "float32", "--metrics.enable_tensorboard"),
    *("--checkpoint.enable_checkpoint", "--checkpoint.interval", "100"),
)
# name -> (ranks, arguments); global batch 4 in each
LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "1rank": (1, ("--training.local_batch_size", "4")),
    "pp2": (2, (f"{P}pipeline_parallel_degree", "2", "--training.local_batch_size", "4")),
    "fsdp2": (2, (f"{P}data_parallel_shard_degree", "2", "--training.local_batch_size", "2")),
    "cp2": (2, (f"{P}context_parallel_degree", "2", "--training.local_batch_size", "4")),
    "tp2": (2, (f"{P}data_parallel_shard_degree", "1", f"{P}tensor_parallel_degree", "2",
                "--training.local_batch_size", "4")),
}  # fmt: skip


def _run(dump: Path, layout: str, *extra: str) -> dict[int, tuple[float, float]]:
    """Run RUN in `layout` dumping to `dump`; step -> (loss, grad_norm) of rank 0's TensorBoard scalars."""
    ranks, args = LAYOUTS[layout]
    run_kiln([*RUN, *args, "--job.dump_folder", dump, *extra], ngpu=ranks, threads=1, check=True)
    scalars = tensorboard_scalars(dump / "tb" / "rank_0")
    return {step: (s["kiln/loss"], s["kiln/grad_norm"]) for step, s in sorted(scalars.items())}


@pytest.mark.parametrize(("seed_layout", "train_layout"), [("pp2", "1rank"), ("fsdp2", "pp2"), ("cp2", "tp2")])
def test_a_run_from_a_seed_checkpoint_is_the_run_from_scratch(
    tmp_path: Path, seed_layout: str, train_layout: str
) -> None:
    scratch = _run(tmp_path / "scratch", train_layout)
    seeded = tmp_path / "seeded"
    assert _run(seeded, seed_layout, "--checkpoint.create_seed_checkpoint") == {}  # nothing trained
    assert [p.name for p in (seeded / "checkpoint").glob("step-*")] == ["step-0"]
    from_seed = _run(seeded, train_layout)
    assert sorted(scratch) == [1, 2, 3]
    assert from_seed == scratch  # every step's loss and grad norm, exactly
