"""[fault_tolerance] as torchtitan spells it: a torchtitan TOML with the section runs as it is (kiln's keys, the same
names and meanings), and each combination kiln does not run is one ConfigError naming the key: the synchronous mode's
here, DiLoCo's schedule and fragments through the launcher's check (train.check_config: what run_train.sh runs before
torchrun, one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

import train
from kiln_base.config import ModelShape, diloco_fragments, parse_args
from kiln_base.errors import ConfigError

TORCHTITAN_FT = """
[fault_tolerance]
enable = true
process_group = "gloo"
process_group_timeout_ms = 5000
replica_id = 1
group_size = 3
min_replica_size = 2
sync_steps = 10
should_quantize = false
fragment_sync_delay = 0
fragment_update_alpha = 0.0
num_fragments = 2
module_fqns_per_model_fragment = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
"""


def test_a_torchtitan_fault_tolerance_section_runs_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    path = tmp_path / "ft.toml"
    path.write_text(TORCHTITAN_FT)
    ft = parse_args(["--job.config_file", str(path)]).fault_tolerance
    assert (ft.enable, ft.process_group, ft.process_group_timeout_ms) == (True, "gloo", 5000)
    assert (ft.replica_id, ft.group_size, ft.min_replica_size, ft.semi_sync_method) == (1, 3, 2, None)
    assert (ft.sync_steps, ft.num_fragments, ft.module_fqns_per_model_fragment[1]) == (
        10,
        2,
        ["layers.1", "norm", "output"],
    )
    # the command line wins, as for every key
    cli = parse_args(["--job.config_file", str(path), "--fault_tolerance.replica_id", "2"]).fault_tolerance
    assert cli.replica_id == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--fault_tolerance.replica_id", "3"],
            "fault_tolerance.replica_id must be in [0, group_size) = [0, 3), got 3",
        ),
        (["--fault_tolerance.min_replica_size", "4"], "fault_tolerance.min_replica_size (4) must be <= group_size (3)"),
        (["--fault_tolerance.process_group", "mpi"], "fault_tolerance.process_group"),
        (["--parallelism.pipeline_parallel_degree", "2"], "parallelism.pipeline_parallel_degree = 2: not supported"),
    ],
)
def test_what_synchronous_mode_does_not_run_is_one_error(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    path = tmp_path / "ft.toml"
    path.write_text(TORCHTITAN_FT)
    with pytest.raises(ConfigError) as err:
        parse_args(["--job.config_file", str(path), *argv])
    assert message in str(err.value)


def test_the_fault_tolerance_keys_ask_nothing_while_it_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's defaults and the semi-sync keys with enable = false: no lighthouse or torchft needed."""
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cfg = parse_args(["--fault_tolerance.group_size", "0", "--fault_tolerance.semi_sync_method", "diloco"])
    assert not cfg.fault_tolerance.enable


E, N = "tok_embeddings", ("norm", "output")
# sync_steps 4: one or two fragments fit (2 blocks + the embedding + the output: at most 4 fragments)
DILOCO = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4", "--model.n_layers", "2"]


def _diloco(debug_config: str, *argv: str) -> list[str]:
    ft = ("--fault_tolerance.enable", "--fault_tolerance.group_size", "2")
    return ["--job.config_file", debug_config, *ft, *DILOCO, *argv]


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        ([], ((E, "layers.0", "layers.1", *N),)),
        # torchtitan's even split (generate_llm_fqn_per_model_part(n, 2 blocks, 1, 1), v0.2.2): the embedding and
        # norm + output count as a block each, the first fragments take one more
        (["--fault_tolerance.num_fragments", "2"], ((E, "layers.0"), ("layers.1", *N))),
        (
            ["--fault_tolerance.num_fragments", "3", "--fault_tolerance.sync_steps", "6"],
            ((E, "layers.0"), ("layers.1",), N),
        ),
        (
            ["--fault_tolerance.module_fqns_per_model_fragment", "tok_embeddings;layers.0,layers.1,norm,output"],
            ((E,), ("layers.0", "layers.1", *N)),
        ),
    ],
    ids=["whole", "two", "three", "listed"],
)
def test_diloco_fragments_are_torchtitans(
    argv: list[str], fragments: tuple, debug_config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    cfg = train.check_config(_diloco(debug_config, *argv), world_size=2)
    assert cfg is not None
    assert diloco_fragments(cfg.fault_tolerance, ModelShape(256, 2, 16, 16, 768, 2256)) == fragments


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--fault_tolerance.num_fragments", "3", "--fault_tolerance.module_fqns_per_model_fragment", "a;b"],
            "fault_tolerance.num_fragments (3) contradicts module_fqns_per_model_fragment, which lists 2 fragments",
        ),
        (
            ["--fault_tolerance.num_fragments", "2", "--fault_tolerance.sync_steps", "5"],
            "fault_tolerance.sync_steps (5) must be a multiple of the 2 DiLoCo fragments",
        ),
        (
            ["--fault_tolerance.num_fragments", "2", "--fault_tolerance.fragment_sync_delay", "2"],
            "fault_tolerance.fragment_sync_delay (2) must be below sync_steps / fragments = 4 / 2 = 2",
        ),
        (
            ["--fault_tolerance.module_fqns_per_model_fragment", "tok_embeddings,layers.0;layers.1,norm"],
            "fault_tolerance.module_fqns_per_model_fragment: the fragments must list tok_embeddings, layers.0 .. "
            "layers.1, norm, output once each",
        ),
        (
            ["--fault_tolerance.num_fragments", "5", "--fault_tolerance.sync_steps", "5"],
            "fault_tolerance.num_fragments (5) exceeds the model's 2 blocks + the embedding + the output",
        ),
        (
            ["--fault_tolerance.num_fragments", "2", "--model.flavor", "3.2-1B"],
            "this model ties its output layer to the embedding table (Llama 3.2), which DiLoCo's fragments",
        ),
        (
            ["--fault_tolerance.should_quantize"],
            "fault_tolerance.should_quantize needs CUDA GPUs (torchft's triton kernels); this run is on cpu",
        ),
        (  # lerp to the group's own weights: the average is thrown away at every sync, the groups never meet
            ["--fault_tolerance.fragment_update_alpha", "1.0"],
            "fault_tolerance.fragment_update_alpha must be in [0, 1) (1 keeps each group's own weights: they would "
            "never meet), got 1.0",
        ),
        (  # the second fragment would never sync: the groups' copies of it would train apart to the end
            ["--fault_tolerance.num_fragments", "2", "--training.steps", "3"],
            "fault_tolerance.sync_steps (4) exceeds training.steps (3): under diloco the groups' weights would not "
            "all meet even once",
        ),
    ],
    ids=["num_fragments", "sync_steps", "delay", "fqns", "too_many", "tied", "quantize", "alpha_1", "steps"],
)
def test_diloco_mistakes_are_one_line_in_the_launcher(
    argv: list[str], message: str, debug_config: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    assert train.check_config(_diloco(debug_config, *argv), world_size=2) is None
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kiln: error: ") and message in line, line
