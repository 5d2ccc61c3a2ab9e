"""Saved-activation report: which op produced each tensor kept for backward, and how many bytes it holds.

Seed 001's +23% peak memory came from per-op SAC caching `abs(W)` of unsharded weights; this report makes
such a finding one command (`--profiling.saved_activations_report`). One eager forward+backward is run
under three observers:

- a TorchDispatchMode that records, for every storage an op writes, the op that produced it (views and
  in-place ops keep the original producer, so a transposed weight is still attributed to its cast);
- `torch.autograd.graph.saved_tensors_hooks`: every tensor autograd keeps for backward outside
  checkpointed regions (inside them checkpoint's own hooks win, and those tensors are not kept);
- per-op SAC's cache: `create_selective_checkpoint_contexts` stores the outputs of MUST_SAVE ops in its own
  dict, not through saved-tensor hooks, so the report grabs that dict from every `_CachingTorchDispatchMode`
  built during the forward (private torch API, pinned by tests) and reads it before backward consumes it;
  plus the inputs of checkpoint-wrapped blocks, which checkpoint keeps to recompute from.

Tensors are deduplicated by storage, so views and tensors sharing memory count once, at the storage's
full size (that is what stays allocated). Model parameters are listed but not counted: they are not
activations. Everything here is per rank.

Under torch.compile (`training.compile`) AOTAutograd's partitioner decides what a compiled region keeps, and
inductor's generated code hides the ops. The report then compiles every region with
`inductor_partition_backend`: inductor's own decompositions and partition function split each graph into forward
and backward, and both graphs run eagerly instead of being code-generated. What the forward graph hands to
backward is what an inductor-compiled step keeps (the same partition), and the observers above see it: the
producer mode (a `CompileTransparentDispatchMode`, under which dynamo still compiles) sees the graph's ops run, and
the saved-tensor hooks see AOTAutograd's `save_for_backward` of the partition's saved tensors. Rows then say
whether their tensors came from a compiled graph or from eager code, and the report names the regions read each
way: a compiled module in which no graph ran is said to be measured eagerly. `saved_ops_under_compile` reads a
single region's partition (and the SAC tags on its nodes) for the tests.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn as nn

from kiln_base.internals import (
    CompileTransparentDispatchMode,
    HigherOrderOperator,
    OpOverload,
    capture_sac_caches,
    inductor_partition_backend,
    is_compiled_module,
    is_traceable_wrapper_subclass,
    partitioned_graphs_backend,
    sac_cached_tensors,
    tensor_base,
    tree_leaves,
)

logger = logging.getLogger("kiln")

PARAMETER = "(parameter)"  # a model parameter kept for backward: listed, not counted as activation
UNKNOWN = "(input/unattributed)"  # kept but produced outside the observed step (e.g. the batch)
GRAPH, EAGER = "graph", "eager"  # where a kept tensor was produced: by a compiled region's graph, or eagerly


@dataclass
class OpRow:
    op: str
    count: int = 0
    nbytes: int = 0
    dtypes: set[str] = field(default_factory=set)
    where: set[str] = field(default_factory=set)  # GRAPH and/or EAGER (parameters: neither)


@dataclass
class SavedActivationReport:
    """Bytes kept for backward by producing op (per rank). `total_bytes` excludes parameters. Under compile, `regions`
    says which parts were read from partitioned graphs and which were measured eagerly, one line each."""

    rows: list[OpRow]
    total_bytes: int
    regions: list[str] = field(default_factory=list)
    cuda_held_bytes: int | None = None  # CUDA: memory allocated during the forward and still held at its end

    @property
    def compiled(self) -> bool:
        return any(GRAPH in r.where for r in self.rows)

    def row(self, op: str) -> OpRow | None:
        """The row of an op, by name as printed (e.g. 'aten.abs', 'aten.mm')."""
        return next((r for r in self.rows if r.op == op), None)

    def bytes_of(self, op: str) -> int:
        r = self.row(op)
        return r.nbytes if r else 0

    def format(self) -> str:
        where = self.compiled  # the column only when some tensor came from a compiled graph
        lines = [f"{'op':<52} {'count':>6} {'dtype':<26} {'bytes':>14} {'share':>7}" + ("  where" if where else "")]
        for r in self.rows:
            share = "-" if r.op == PARAMETER or not self.total_bytes else f"{100 * r.nbytes / self.total_bytes:.1f}%"
            line = f"{r.op:<52} {r.count:>6} {','.join(sorted(r.dtypes)):<26} {r.nbytes:>14,} {share:>7}"
            lines.append(line + (f"  {'+'.join(sorted(r.where)) or '-'}" if where else ""))
        lines.append(f"saved_activations_total_bytes: {self.total_bytes}")
        if self.cuda_held_bytes is not None:  # the report's cross-check against the allocator
            ratio = f"{self.total_bytes / self.cuda_held_bytes:.3f}" if self.cuda_held_bytes > 0 else "n/a"
            lines.append(f"cuda_allocated_after_forward_bytes: {self.cuda_held_bytes} (report / allocated: {ratio})")
        return "\n".join(lines + self.regions)


def _op_name(func: OpOverload | Any) -> str:
    """'aten.mm' for aten.mm.default, 'aten.add.Tensor'; a higher order operator (in a compiled graph) by its name."""
    if isinstance(func, HigherOrderOperator):
        return f"higher_order.{func.name()}"
    name = str(func)
    return name[: -len(".default")] if name.endswith(".default") else name


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding a tensor's memory (DTensor's local shard, Float8 data and scale)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for a in attrs:
            inner = getattr(t, a)
            if isinstance(inner, torch.Tensor):  # some subclasses list non-tensor attrs (a DeviceMesh)
                yield from _plain_tensors(inner)
    else:
        yield t


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """The storage a tensor's memory lives in; None for a storage Python cannot read ("invalid python storage": a
    traced SAC cache's tensor under compile, a functional collective's output inside the op that makes it)."""
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except RuntimeError:
        return None


class _ProducerMode(CompileTransparentDispatchMode):
    """Maps each storage written during the step to the (non-aliasing) op that produced it, and whether a compiled
    graph's op (run eagerly by inductor_partition_backend, inside `graph_run`) or eager code produced it."""

    def __init__(self) -> None:
        super().__init__()
        self.producer: dict[tuple[str, int], str] = {}
        self.where: dict[tuple[str, int], str] = {}
        self.graph_runs = 0
        self._in_graph = False

    @contextlib.contextmanager
    def graph_run(self) -> Iterator[None]:
        self.graph_runs += 1
        self._in_graph = True
        try:
            yield
        finally:
            self._in_graph = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        # Let tensor subclasses (DTensor, Float8TrainingTensor) run first: their inner plain ops come back
        # through this mode, so memory is attributed to the op that really allocated it (e.g. _scaled_mm).
        if any(t not in (torch.Tensor, nn.Parameter) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        # An output sharing an input's storage (view, in-place, _unsafe_view of an mm) keeps its producer.
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        name = _op_name(func)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key is not None and (key not in inputs or key not in self.producer):
                    self.producer[key] = name
                    self.where[key] = GRAPH if self._in_graph else EAGER
        return out


def measure_saved_activations(model: nn.Module, forward: Callable[[], torch.Tensor]) -> SavedActivationReport:
    """Run `forward()` (returns a scalar loss) and its backward once; report what was kept in between.

    `model` is used to recognise parameters and checkpoint-wrapped blocks; `forward` does whatever the
    training step does (autocast, loss). Gradients are left on the model; callers zero them if needed.
    """
    kept: dict[tuple[str, int], torch.Tensor] = {}  # one tensor per kept storage

    def keep(t: torch.Tensor) -> None:
        for p in _plain_tensors(t):
            key = _storage_key(p)
            if key is not None:
                kept.setdefault(key, p)

    params = {_storage_key(p) for q in model.parameters() for p in _plain_tensors(q.detach())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or isinstance(tensor_base(t), nn.Parameter):  # incl. FSDP's unsharded params
            params.update(_storage_key(p) for p in _plain_tensors(t.detach()))
        keep(t)
        return t

    def keep_inputs(_module: nn.Module, args: tuple) -> None:
        for a in tree_leaves(args):
            if isinstance(a, torch.Tensor):
                keep(a)

    compiled = {name: m for name, m in model.named_modules() if is_compiled_module(m)}
    in_compiled = {id(sub) for m in compiled.values() for sub in m.modules()}
    # Checkpointed blocks keep their inputs to recompute from (held by checkpoint's frame, not autograd). Inside a
    # compiled region the partition decides, and the inputs it keeps reach `pack` like any saved tensor.
    wrappers = [m for m in model.modules() if type(m).__name__ == "CheckpointWrapper" and id(m) not in in_compiled]
    handles = [w.register_forward_pre_hook(keep_inputs) for w in wrappers]
    producer_mode = _ProducerMode()
    runs = {name: 0 for name in compiled}  # compiled graphs run while each compiled module ran

    def count_runs(name: str) -> tuple[Callable[..., None], Callable[..., None]]:
        start: list[int] = []
        return (
            lambda *_: start.append(producer_mode.graph_runs),
            lambda *_: runs.__setitem__(name, runs[name] + producer_mode.graph_runs - start.pop()),
        )

    for name, m in compiled.items():  # hooks on the compiled wrapper run eagerly, around the compiled call
        before, after = count_runs(name)
        handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    try:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        # With compiled modules, every compiled region (the blocks, kiln's compiled loss) compiles with inductor's
        # partition, run eagerly; an eager model is measured as before.
        backend = inductor_partition_backend(producer_mode.graph_run) if compiled else None
        stance = torch.compiler.set_stance("default", force_backend=backend) if compiled else contextlib.nullcontext()
        cuda, cuda_held = torch.cuda.is_available() and torch.cuda.is_initialized(), 0
        if cuda:
            torch.cuda.synchronize()
            allocated_before = torch.cuda.memory_allocated()
        with capture_sac_caches() as sac_modes, producer_mode, hooks, stance:
            loss = forward()
        if cuda:
            torch.cuda.synchronize()
            cuda_held = torch.cuda.memory_allocated() - allocated_before
        for t in sac_cached_tensors(sac_modes):
            keep(t)
    finally:
        for h in handles:
            h.remove()
    rows: dict[str, OpRow] = {}
    total = 0
    for key, t in kept.items():
        nbytes = t.untyped_storage().nbytes()  # FSDP-resharded storage reads 0: it holds no memory
        op = PARAMETER if key in params else producer_mode.producer.get(key, UNKNOWN)
        row = rows.setdefault(op, OpRow(op))
        row.count += 1
        row.nbytes += nbytes
        row.dtypes.add(str(t.dtype).removeprefix("torch."))
        if op != PARAMETER:
            row.where.add(producer_mode.where.get(key, EAGER))
            total += nbytes
    kept.clear()  # drop our references before backward frees the graph
    loss.backward()
    regions = _regions(model, runs, producer_mode.graph_runs) if compiled else []
    report = SavedActivationReport(sorted(rows.values(), key=lambda r: -r.nbytes), total, regions)
    report.cuda_held_bytes = cuda_held if cuda else None
    return report


def _regions(model: nn.Module, runs: dict[str, int], graph_runs: int) -> list[str]:
    """Which parts of the step were read from partitioned graphs and which were measured eagerly, one line each."""
    read = [f"{name} ({n} graph run{'s' * (n != 1)})" for name, n in runs.items() if n]
    lines = []
    if read:
        lines.append(
            "compiled, read from the partitioned graphs (inductor's decompositions and partitioner, run eagerly): "
            + ", ".join(read)
        )
    outside = graph_runs - sum(runs.values())
    if outside:
        lines.append(f"compiled outside the model's modules (kiln's loss): {outside} graph run(s), read the same way")
    missed = [name for name, n in runs.items() if not n]
    if missed:
        lines.append(f"compiled modules in which no compiled graph ran, measured eagerly: {', '.join(missed)}")
    eager = [
        name
        for name, m in model.named_modules()
        if name
        and any(True for _ in m.parameters(recurse=False))
        and not any(name == c or name.startswith(c + ".") for c in runs)
    ]
    lines.append(
        "measured eagerly (not compiled): " + (", ".join(eager) if eager else "no module") + " and the ops between"
    )
    return lines


# Ops whose outputs are float8 scale material (amax per tensor or per row): the only extra bytes float8 may
# keep for backward compared with bf16. torchao's tensorwise amax is aten.max, rowwise is aten.amax.
FLOAT8_SCALE_OPS = ("aten.max", "aten.amax")


def check_ops_not_saved(report: SavedActivationReport, ops: tuple[str, ...] = ("aten.abs",)) -> list[str]:
    """Violations: any kept output of `ops`. `abs` must never be kept: under per-op SAC with float8 it
    holds abs(W) of every (unsharded) weight, the +23% peak memory reported in torchtitan PR #808; amax is saved
    instead."""
    return [
        f"{r.op}: {r.count} tensors, {r.nbytes:,} bytes kept for backward (must be recomputed)"
        for r in report.rows
        if r.op in ops and r.nbytes > 0
    ]


def check_float8_overhead(
    report_hp: SavedActivationReport,
    report_fp8: SavedActivationReport,
    scale_ops: tuple[str, ...] = FLOAT8_SCALE_OPS,
) -> list[str]:
    """Violations: float8 keeps more bytes than the high-precision run beyond its scale tensors."""
    scales = sum(report_fp8.bytes_of(op) for op in scale_ops)
    excess = report_fp8.total_bytes - scales - report_hp.total_bytes
    if excess <= 0:
        return []
    grew = [
        f"{r.op} +{r.nbytes - report_hp.bytes_of(r.op):,}"
        for r in report_fp8.rows
        if r.op not in scale_ops and r.nbytes > report_hp.bytes_of(r.op)
    ]
    return [f"float8 keeps {excess:,} bytes more than high precision beyond {scales:,} of scales ({', '.join(grew)})"]


@dataclass
class CompiledSAC:
    """What a compiled, per-op-SAC region keeps for backward, by producing op ("input": a forward input kept as
    is), and the SAC policy the compiled forward graph carries (ops tagged must-save / recompute)."""

    saved: Counter[str] = field(default_factory=Counter)
    must_save: Counter[str] = field(default_factory=Counter)
    recompute: Counter[str] = field(default_factory=Counter)


def saved_ops_under_compile(module: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> CompiledSAC:
    """Compile `module` (fullgraph) with the min-cut partitioner inductor uses, run `run(compiled)` (a forward
    returning a loss) and its backward, and read what the compiled forward saves for backward (the backward
    graph's inputs other than incoming gradients) and the SAC tags on the forward graph's nodes. Under compile
    the partitioner saves only what backward needs: a must-save op whose output backward never reads (abs, read
    only by amax) is not saved either way; the tags show that kiln's policy reached the graph."""
    graphs: list[tuple[str, Any]] = []
    compiled = cast(nn.Module, torch.compile(module, backend=partitioned_graphs_backend(graphs), fullgraph=True))
    run(compiled).backward()
    forwards = [gm for kind, gm in graphs if kind == "forward"]
    backwards = [gm for kind, gm in graphs if kind == "backward"]
    out = CompiledSAC()
    for fw, bw in zip(forwards, backwards, strict=True):
        producers = {node.name: node for node in fw.graph.nodes}
        for node in fw.graph.nodes:
            policy = node.meta.get("recompute")
            if node.op == "call_function" and policy is not None:
                tagged = out.must_save if policy.name.startswith("MUST_SAVE") else out.recompute
                tagged[_op_name(node.target)] += 1
        for node in bw.graph.nodes:
            if node.op != "placeholder" or node.name.startswith("tangents"):
                continue
            producer = producers[node.name]
            out.saved["input" if producer.op == "placeholder" else _op_name(producer.target)] += 1
    return out
