"""What the numerics observatory's measurements mean to a user: one JSONL per rank, TensorBoard scalars, the
worst-layers line, the alarms with their suggested fixes, and the heatmap. The Trainer's NumericsHook only decides
when the observatory records (trainer/hooks.py) and hands each logged step here.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from float8.numerics import iter_operand_values
from float8.plots import write_heatmap
from kiln_base.config import Float8

logger = logging.getLogger("kiln")


class NumericsReport:
    """Writes `<folder>/rank_<r>.jsonl` on every rank (operands are this rank's shards); on the logging rank also
    scalars through the metrics' `writer` (TensorBoard and W&B, those that are on) and the worst-layers line, and a
    warning once per layer when an operand's SQNR or underflow crosses the alarm thresholds; at close, the heatmap
    PNG."""

    def __init__(self, cfg: Float8, folder: str, rank: int, is_logging_rank: bool, writer: Any) -> None:
        self.cfg, self.is_logging_rank, self.writer = cfg, is_logging_rank, writer
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"rank_{rank}.jsonl")
        self.alarmed: set[str] = set()

    def step(
        self, step: int, stats: dict[str, dict[str, Any]], every_stage: dict[str, dict[str, Any]] | None = None
    ) -> None:
        """Write this rank's `stats`; on the logging rank report `every_stage` (a pipeline's stages' stats, each
        rank's own layers) when given, else `stats`."""
        with open(self.path, "a", encoding="utf-8") as f:
            for layer, entry in stats.items():
                f.write(json.dumps({"step": step, "layer": layer, **_json_safe(entry)}, allow_nan=False) + "\n")
        stats = stats if every_stage is None else every_stage
        if not self.is_logging_rank or not stats:
            return
        if self.writer is not None:
            for layer, entry in stats.items():
                for operand, values in entry.items():
                    if isinstance(values, dict):
                        for stat, v in values.items():
                            if math.isfinite(v):
                                self.writer.add_scalar(f"float8/{layer}/{operand}/{stat}", v, step)
        logger.info(worst_layers_line(step, stats))
        self._alarms(step, stats)

    def _alarms(self, step: int, stats: dict[str, dict[str, Any]]) -> None:
        low, high = self.cfg.numerics_alarm_sqnr_db, self.cfg.numerics_alarm_underflow
        for layer, entry in stats.items():
            for operand, values in entry.items():
                if layer in self.alarmed or not isinstance(values, dict):
                    continue
                problems = []
                if values["sqnr_db"] < low:
                    problems.append(f"SQNR {values['sqnr_db']:.1f} dB (alarm below {low:g})")
                if values["underflow"] > high:
                    problems.append(
                        f"{values['underflow']:.1%} of nonzero elements underflow to 0 (alarm above {high:.1%})"
                    )
                if problems:
                    self.alarmed.add(layer)
                    logger.warning(
                        f"float8 numerics alarm: {layer} {operand} at step {step}: {', '.join(problems)}; "
                        f"suggested fix: {suggested_fix(self.cfg.recipe, layer, operand)}"
                    )

    def close(self) -> None:
        """On the logging rank, draw the JSONL as a PNG heatmap when matplotlib is installed."""
        if not self.is_logging_rank or not os.path.exists(self.path):
            return
        try:
            write_heatmap(self.path, self.path.replace(".jsonl", "_heatmap.png"))
        except ImportError:
            logger.info("float8 numerics: no heatmap PNG (matplotlib is not installed: pip install -e '.[plots]')")


def _json_safe(value: Any) -> Any:
    """Non-finite floats as null (an exact cast has SQNR inf), so the JSONL is standard JSON."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def suggested_fix(recipe: str, layer: str, operand: str) -> str:
    """What to try for a float8 layer in numerical trouble, finest-grained first."""
    fixes = []
    if recipe == "tensorwise":
        fixes.append("--float8.recipe_name rowwise (one scale per row, e4m3 gradients)")
    if operand == "grad_output" and recipe in ("rowwise", "mxfp8_rceil"):
        fixes.append(
            f"--float8.recipe_name {'rowwise_with_gw_hp' if recipe == 'rowwise' else 'mxfp8_rceil_wgrad_with_hp'} "
            "(weight gradients in high precision)"
        )
    fixes.append(f"keep it in high precision: --float8.filter_fqns {layer}")
    return "; or ".join(fixes)


def worst_layers_line(step: int, stats: dict[str, dict[str, Any]], n: int = 3) -> str:
    """'float8 numerics step S: lowest SQNR ...; most underflow ...; saturation ...': the few worst of each."""
    sqnr = sorted(iter_operand_values(stats, "sqnr_db"), key=lambda t: t[2])[:n]
    under = sorted(iter_operand_values(stats, "underflow"), key=lambda t: -t[2])[:n]
    sat = max((v for _, _, v in iter_operand_values(stats, "saturation")), default=0.0)
    outs = [e["output_sqnr_db"] for e in stats.values() if "output_sqnr_db" in e]
    return (
        f"float8 numerics step {step} ({len(stats)} layers): lowest SQNR (dB) "
        + ", ".join(f"{layer} {op} {v:.1f}" for layer, op, v in sqnr)
        + "; most underflow "
        + ", ".join(f"{layer} {op} {v:.2%}" for layer, op, v in under)
        + f"; max saturation {sat:.2%}"
        + (f"; output SQNR min {min(outs):.1f} dB" if outs else "")
    )
