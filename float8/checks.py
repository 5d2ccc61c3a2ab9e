"""Float8-in-use checks: at the first step, prove each float8 flag changed what runs, or stop the run.

A float8 flag that silently does nothing (a filter that matched every Linear, a converter that was never
called, Float8Linears whose matmuls run in high precision, FSDP float8 all-gather without FSDP) trains a
high-precision model while the user reads float8 numbers. `Float8UsageProbe` watches one training step and
then checks; a flag that had no effect raises ConfigError (exit 2):

    probe = Float8UsageProbe(model, cfg, fsdp_enabled)
    with probe.during_first_step():
        train_step()
    probe.verify()

What counts as a float8 matmul is torchao's own: its Float8TrainingTensor dispatches aten.mm (and addmm,
matmul) on two float8 operands to an entry of torchao's op table, which calls torch._scaled_mm or, with
`emulate`, a high-precision mm of the dequantised operands. The MXFP8 recipes do the same through MXTensor's op
table (torch._scaled_mm with e8m0 block scales, or the EMULATED dequantised mm). The probe wraps those entries
for the step: they count and call through, so the step computes exactly what it would without the probe. NVFP4 is
kiln's own emulation: each of its GEMMs is one call of the custom op `kiln::nvfp4_gemm`, which reports to the
counter `float8.nvfp4.counting_gemms` installs for the step. The routed experts' low-precision grouped GEMMs
(float8.moe_fqns) report each call (3 per MoE layer's forward; their backward GEMMs run inside the same torchao or
kiln autograd function) to the counter `float8.experts.counting_grouped_gemms` installs. The table sits below
DTensor (TP hands it the local shards), FSDP and activation checkpointing, so no layout changes the count.
Under torch.compile the entries run while the graph is traced (dynamo's fake-tensor pass, AOTAutograd's
joint graph), not when the compiled code runs: the count then says the compiled graph holds float8 matmuls.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from float8.converter import is_float8_linear
from float8.experts import counting_grouped_gemms, is_experts, is_low_precision_experts
from float8.nvfp4 import counting_gemms
from kiln_base.config import Float8
from kiln_base.errors import ConfigError
from kiln_base.internals import (
    float8_matmul_is_emulated_and_traced,
    fsdp_param_groups,
    fsdp_param_owner,
    is_compiled_module,
    mx_matmul_is_emulated_and_traced,
    mx_tensor_ops_table,
    on_dynamo_compile,
)

logger = logging.getLogger("kiln")


def _float8_all_gather_itemsizes(model: nn.Module) -> dict[str, int]:
    """Element size of what FSDP2 all-gathers for each Float8Linear weight (1 = float8 on the wire).

    Reads FSDP's own all-gather inputs (the tensor subclass's fsdp_pre_all_gather output); for dynamic
    tensorwise scaling that computes the weight amax with one all-reduce, so call it on every rank.
    """
    sizes: dict[str, int] = {}
    float8_modules = {id(m): n for n, m in model.named_modules() if is_float8_linear(m)}
    for module in model.modules():
        for group in fsdp_param_groups(module):
            for fsdp_param in group.fsdp_params:
                owner, param_name = fsdp_param_owner(fsdp_param)
                name = float8_modules.get(id(owner))
                if name is not None and param_name == "weight":  # after a full step: params are sharded
                    sizes[name] = min(t.element_size() for t in fsdp_param.all_gather_inputs)
    return sizes


def _is_compiled(model: nn.Module) -> bool:
    return any(is_compiled_module(m) for m in model.modules())


class Float8UsageProbe:
    """Counts torchao float8 matmuls during one step, then checks every enabled float8 flag took effect.

    `matmuls` counts by (where, emulated): where is "ran" (eager, real tensors) or "traced" (into a
    torch.compile graph, fake tensors); emulated is torchao's emulate flag of that matmul.
    """

    def __init__(
        self, model: nn.Module, cfg: Float8, fsdp_enabled: bool, group: dist.ProcessGroup | None = None
    ) -> None:
        """`group`: under pipeline parallelism the pipeline's ranks, whose counts `verify` sums (each holds some
        stages)."""
        self.model = model
        self.group = group
        self.cfg = cfg
        self.fsdp_enabled = fsdp_enabled
        self.matmuls: Counter[tuple[str, bool]] = Counter()
        self.grouped_gemms: Counter[str] = Counter()  # the experts' low-precision grouped GEMMs: "ran" or "traced"
        self.compilations = 0  # dynamo compilations during the step: 0 with compiled blocks = graphs reused

    def _counting(self, table_entry: Callable[..., Any], mx: bool) -> Callable[..., Any]:
        """A torchao op-table entry that counts the float8 matmul, then runs the original unchanged."""
        addmm = torch.ops.aten.addmm.default
        how = mx_matmul_is_emulated_and_traced if mx else float8_matmul_is_emulated_and_traced

        def float8_matmul(aten_op: Any, *rest: Any) -> Any:
            args = rest[-2] if mx else rest[0]  # MXTensor's entries take (func, types, args, kwargs)
            a, b = args[1:3] if aten_op == addmm else args[:2]  # addmm(bias, a, b); mm/matmul(a, b)
            emulated, traced = how(a, b)
            self.matmuls["traced" if traced else "ran", emulated] += 1
            return table_entry(aten_op, *rest)

        return float8_matmul

    @contextlib.contextmanager
    def during_first_step(self) -> Iterator[None]:
        """Count while the block runs (one step: forward, backward, optimizer); restores torchao's table."""
        if not self.cfg.enable_float8_linear:
            yield
            return

        def count_grouped(traced: bool) -> None:
            self.grouped_gemms["traced" if traced else "ran"] += 1

        with counting_grouped_gemms(count_grouped), self._counting_linears():
            yield

    @contextlib.contextmanager
    def _counting_linears(self) -> Iterator[None]:
        """The Linears' float8 matmuls: torchao's op-table entries wrapped for the block (NVFP4: kiln's counter)."""
        if self.cfg.is_nvfp4:
            with self._counting_nvfp4():
                yield
            return
        from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

        mx = self.cfg.is_mxfp8
        table = mx_tensor_ops_table() if mx else FLOAT8_OPS_TABLE
        aten = torch.ops.aten
        originals = {op: table[op] for op in (aten.mm.default, aten.matmul.default, aten.addmm.default)}
        wrappers = {op: self._counting(entry, mx) for op, entry in originals.items()}

        def on_compile(_args: Any) -> None:
            self.compilations += 1

        table.update(wrappers)
        try:
            with on_dynamo_compile(on_compile):
                yield
        finally:
            for op, original in originals.items():
                if table.get(op) is wrappers[op]:  # leave an entry someone else swapped since
                    table[op] = original

    @contextlib.contextmanager
    def _counting_nvfp4(self) -> Iterator[None]:
        def count(traced: bool) -> None:
            self.matmuls["traced" if traced else "ran", True] += 1  # always emulated

        def on_compile(_args: Any) -> None:
            self.compilations += 1

        with counting_gemms(count), on_dynamo_compile(on_compile):
            yield

    def verify(self) -> list[str]:
        """Check each enabled float8 flag took effect; return the findings (logged), raise ConfigError if not.

        With a pipeline (`group`: its ranks) the counts are summed over its stages first, so the verdict is the
        whole model's, and the same on every rank (a stage of only norm and output has no Float8Linear)."""
        cfg, model = self.cfg, self.model
        if not cfg.enable_float8_linear:
            return []
        sizes: dict[str, int] = {}
        if cfg.enable_fsdp_float8_all_gather and self.fsdp_enabled:
            for root in getattr(model, "parts", [model]):  # a pipeline's stage models: the FSDP roots
                sizes |= _float8_all_gather_itemsizes(root)
        wide = sorted(n for n, size in sizes.items() if size != 1)
        local = _Counts(
            linears=sum(isinstance(m, nn.Linear) for m in model.modules()),
            float8=sum(is_float8_linear(m) for m in model.modules()),
            ran=sum(n for (where, _), n in self.matmuls.items() if where == "ran"),
            traced=sum(n for (where, _), n in self.matmuls.items() if where == "traced"),
            emulated=sum(n for (_, emulate), n in self.matmuls.items() if emulate),
            compilations=self.compilations,
            compiled=int(_is_compiled(model)),
            gathered=len(sizes),
            wide=len(wide),
            experts=sum(is_experts(m) for m in model.modules()),
            low_experts=sum(is_low_precision_experts(m) for m in model.modules()),
            grouped_ran=self.grouped_gemms["ran"],
            grouped_traced=self.grouped_gemms["traced"],
        )
        total = local.summed(self.group, model)
        if not total.float8 and not total.low_experts:
            experts = (
                f" and none of the {total.experts} routed experts runs low-precision GEMMs" if cfg.moe_fqns else ""
            )
            raise ConfigError(
                f"float8.enable_float8_linear is set but none of the {total.linears} Linears is a Float8Linear"
                f"{experts} (float8.filter_fqns={cfg.filter_fqns}); the run would silently train in high precision"
            )
        kind = "have MXFP8 weights" if cfg.is_mxfp8 else "are NVFP4Linear" if cfg.is_nvfp4 else "are Float8Linear"
        findings = [f"float8 in use: {total.float8}/{total.linears} Linears {kind}"]
        if total.float8:
            findings.append(self._matmul_finding(total))
        if cfg.moe_fqns:
            findings += self._experts_findings(total)
        if cfg.enable_fsdp_float8_all_gather:
            findings.append(self._all_gather_finding(total, wide))
        for line in findings:
            (logger.info if line.startswith("float8 in use") else logger.warning)(line)
        return findings

    def _experts_findings(self, total: _Counts) -> list[str]:
        """float8.moe_fqns: how many routed experts run low-precision grouped GEMMs, and that those GEMMs ran."""
        what = "MXFP8" if self.cfg.is_mxfp8 else "float8 rowwise"
        emulated = "emulated " if self.cfg.emulate else ""
        lines = [f"float8 in use: {total.low_experts}/{total.experts} routed experts run {what} grouped GEMMs"]
        if not total.low_experts:
            return lines  # all kept high precision by name (float8.filter_fqns, the first/last blocks)
        if total.grouped_ran + total.grouped_traced == 0:
            raise ConfigError(
                f"float8.moe_fqns: {total.low_experts} routed experts have {what} grouped GEMMs but none ran in the "
                "first step (the experts looped over high-precision matmuls, or were bypassed)"
            )
        how = [f"{total.grouped_ran} ran"] if total.grouped_ran else []
        how += [f"{total.grouped_traced} traced into compiled graphs"] if total.grouped_traced else []
        lines.append(f"float8 in use: {emulated}{what} grouped GEMMs in the first step: {', '.join(how)}")
        return lines

    def _matmul_finding(self, total: _Counts) -> str:
        ran, traced, emulated = total.ran, total.traced, total.emulated
        if ran + traced == 0:
            if total.compilations == 0 and total.compiled:
                # The compiled blocks ran graphs traced before the probe watched (an earlier model in this
                # process with the same structure); nothing the step did can show what those graphs hold.
                return "float8 not checked: the compiled blocks reused graphs compiled earlier in this process"
            raise ConfigError(
                "float8.enable_float8_linear: Float8Linear modules exist but no float8 matmul ran in the first "
                "step (their matmuls ran in high precision or were bypassed)"
            )
        how = [f"{ran} ran"] if ran else []
        how += [f"{traced} traced into compiled graphs"] if traced else []
        what = "MXFP8 matmuls" if self.cfg.is_mxfp8 else "NVFP4 matmuls" if self.cfg.is_nvfp4 else "float8 matmuls"
        kind = f"emulated {what}" if emulated == ran + traced else what
        if 0 < emulated < ran + traced:
            kind += f" ({emulated} emulated)"
        return f"float8 in use: {kind} in the first step: {', '.join(how)}"

    def _all_gather_finding(self, total: _Counts, wide: list[str]) -> str:
        if not self.fsdp_enabled:
            raise ConfigError(
                "float8.enable_fsdp_float8_all_gather is set but FSDP is not enabled (data_parallel_shard_degree "
                "x context_parallel_degree = 1): nothing is all-gathered; drop the flag or shard over more ranks"
            )
        if not total.gathered or total.wide:
            example = f" (e.g. {wide[0]})" if wide else ""
            what = f"{total.wide} Float8Linear weights in high precision{example}" if total.wide else "no float8 weight"
            raise ConfigError(f"float8.enable_fsdp_float8_all_gather is set but FSDP all-gathers {what}")
        return f"float8 in use: FSDP all-gathers {total.gathered} Float8Linear weights as 1-byte float8"


@dataclass
class _Counts:
    """What the probe counted on one rank (or summed over a pipeline's ranks)."""

    linears: int
    float8: int
    ran: int
    traced: int
    emulated: int
    compilations: int
    compiled: int
    gathered: int  # Float8Linear weights FSDP all-gathers
    wide: int  # of which in high precision
    experts: int  # routed experts modules
    low_experts: int  # of which run low-precision grouped GEMMs (float8.moe_fqns)
    grouped_ran: int  # their grouped GEMM forwards in the step (3 per layer per micro-batch)
    grouped_traced: int

    def summed(self, group: dist.ProcessGroup | None, model: nn.Module) -> _Counts:
        if group is None:
            return self
        device = next(model.parameters()).device
        t = torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.int64, device=device)
        dist.all_reduce(t, group=group)
        return _Counts(*(int(v) for v in t.tolist()))
