"""scripts/measure_sac.py: its what-if flags really change the save list it measures (they once changed nothing,
because the policy bound SAC_SAVE_LIST as a default argument when the module was imported)."""

from __future__ import annotations

import pytest

from tests.helpers.common import ROOT, needs_cpu_rowwise
from tests.helpers.kiln_process import run_kiln


def _kept(*flags: str) -> dict[str, str]:
    script = ROOT / "scripts" / "measure_sac.py"
    out = run_kiln(["--seq-len", "32", "--repeats", "1", *flags], launcher="python", script=script, check=True).stdout
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
