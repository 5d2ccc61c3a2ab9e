"""[fault_tolerance] as torchtitan spells it: a torchtitan TOML with the section runs as it is (kiln's keys, the same
names and meanings), and each combination kiln's synchronous mode does not run is one ConfigError naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln_base.config import parse_args
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
        (
            ["--fault_tolerance.semi_sync_method", "diloco"],
            '"diloco": DiLoCo (its outer optimizer and model fragments)',
        ),
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
