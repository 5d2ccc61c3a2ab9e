"""scripts/measure_sac.py: its what-if flags really change the save list it measures (they once changed nothing,
because the policy bound SAC_SAVE_LIST as a default argument when the module was imported)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.common import HANG_TIMEOUT_S, ROOT, needs_cpu_rowwise


def _kept(*flags: str) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "scripts/measure_sac.py", "--seq-len", "32", "--repeats", "1", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_TIMEOUT_S,
        check=True,
    ).stdout
    rows = out.split("kept by SAC:")[1].split("saved outside")[0].splitlines()[1:]
    return {r.split()[0]: r.split()[1] for r in rows if r.strip()}


@pytest.mark.slow
@needs_cpu_rowwise
def test_measure_sac_flags_change_the_save_list() -> None:
    default = _kept()
    assert "aten.amax.default" in default and "aten.abs.default" not in default, default
    with_abs = _kept("--save-abs")
    assert "aten.abs.default" in with_abs, with_abs
    assert "aten.amax.default" not in _kept("--no-amax")
