"""Every use of private torch and torchao internals in kiln, in one place.

A private API (`torch.x._y`, `tensor._field`, a module path with an underscore) can change in any release
without notice. Keeping each use here, behind a small named function, means a torch upgrade breaks one
module whose tests (tests/kiln_base/test_internals.py) exercise every function and fail loudly; the rest of kiln calls
these functions and never touches the internals itself (tests/kiln_base/test_internals.py also scans the source tree
for private uses outside this file).

Supported range: torch 2.11 (the GPU image's torch, and the oldest kiln supports) to 2.13 (the CPU
development image), torchao 0.18. Each function's docstring says where its behaviour differs between them
("checked on" lists the versions whose source and tests it was verified against). Where torch renamed or
reshaped something between 2.11 and 2.13, the function detects the feature (never the version string) and
handles both.

Aten op names with an underscore (`aten._scaled_mm`, `aten._scaled_dot_product_flash_attention`) are operator
identifiers in the dispatcher's registry, not Python internals: they stay where they are used.

Layer 2 of the import contract (tests/test_architecture.py): this module imports torch, and torchao lazily
inside the functions that need it; nothing from kiln.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from datetime import timedelta
from typing import IO, Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

# Re-exported: these live only under private module paths. Checked on torch 2.11.0, 2.13.0.
from torch._ops import (
    HigherOrderOperator,  # the type of `torch.ops.higher_order.*` (in compiled graphs)
    OpOverload,  # the type of `torch.ops.aten.mm.default`
)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo as DCPStorageInfo  # a record: file, offset, length
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FSDPAllGather  # set_custom_all_gather's base
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FSDPReduceScatter  # and reduce-scatter's
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = [
    "DCPStorageInfo",
    "FSDPAllGather",
    "HigherOrderOperator",
    "FSDPReduceScatter",
    "OpOverload",
    "TorchDispatchMode",
    "is_traceable_wrapper_subclass",
    "tree_leaves",
]


# ----------------------------------------------------------------------------- tensors


def tensor_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (`Tensor._base`), or None. Checked on torch 2.11.0, 2.13.0."""
    return t._base


# ----------------------------------------------------------------------------- module wrappers

# The child-module names torch's wrappers insert into FQNs: checkpoint_wrapper's (torch.distributed.algorithms.
# _checkpoint.checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE) and torch.compile's OptimizedModule (`_orig_mod`).
_WRAPPER_FQN_PARTS = ("._checkpoint_wrapped_module", "._orig_mod")


def unwrapped_fqn(name: str) -> str:
    """A module FQN without the activation-checkpoint and compile wrappers' components.

    Checked on torch 2.11.0, 2.13.0 (both use `_checkpoint_wrapped_module` and `_orig_mod`).
    """
    for part in _WRAPPER_FQN_PARTS:
        name = name.replace(part, "")
    return name


# ----------------------------------------------------------------------------- activation checkpointing


def checkpoint_wrapper(module: nn.Module, **kwargs: Any) -> nn.Module:
    """torch's non-reentrant activation-checkpoint wrapper module (what torchtitan uses per block).

    Checked on torch 2.11.0, 2.13.0 (torch.distributed.algorithms._checkpoint.checkpoint_wrapper).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


def is_checkpoint_wrapped(module: nn.Module) -> bool:
    """Whether `module` is checkpoint_wrapper's wrapper (activation checkpointing of a whole block).

    Checked on torch 2.13.0 (torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper, the class
    checkpoint_wrapper returns); tests/kiln_base/test_internals.py runs on the oldest torch too.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper)


def compile_inside_checkpoint(wrapper: nn.Module, **compile_kwargs: Any) -> None:
    """torch.compile the module a checkpoint_wrapper wraps, in place (nn.Module.compile: the module keeps its type and
    its parameters their names, no `_orig_mod` part, which the state dict's names would keep inside the wrapper): the
    checkpoint stays eager, and its forward and its recompute both run the compiled module.

    Checked on torch 2.11.0, 2.13.0 (CheckpointWrapper calls its `_checkpoint_wrapped_module` child at each forward).
    """
    cast(nn.Module, wrapper._checkpoint_wrapped_module).compile(**compile_kwargs)


def sac_op_output(ctx: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """The output of the op a per-op SAC policy is deciding on.

    torch 2.13 runs the op first and passes it as `ctx.op_output`; torch 2.11 calls the policy before the
    op runs and its context has no `op_output`, so the output is derived on fake tensors (shapes, dtypes and
    so `nbytes` are exact; no memory, no compute, no collective). Only measurement code (SACStats) asks.
    Checked on torch 2.11.0 (fake path), 2.13.0 (`op_output`).
    """
    if hasattr(ctx, "op_output"):
        return ctx.op_output
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return func(*args, **kwargs)


@contextlib.contextmanager
def capture_sac_caches() -> Iterator[list[Any]]:
    """Collect every per-op SAC caching mode (`torch.utils.checkpoint._CachingTorchDispatchMode`) created inside.

    Their `.storage` holds what SAC keeps for backward; read it with `sac_cached_tensors` before backward
    consumes it. Modes created while torch.compile traces a checkpointed region hold its fake tensors, not memory:
    left out (the compiled partition decides what such a region keeps). Checked on torch 2.11.0, 2.13.0 (the class
    and its `__init__` storing `.storage`).
    """
    import torch.utils.checkpoint as torch_checkpoint

    cls = torch_checkpoint._CachingTorchDispatchMode
    original_init = cls.__init__
    modes: list[Any] = []

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if not torch.compiler.is_compiling():
            modes.append(self)

    cls.__init__ = init  # type: ignore[method-assign]  # patched for the block, restored below
    try:
        yield modes
    finally:
        cls.__init__ = original_init  # type: ignore[method-assign]


def sac_cached_tensors(modes: list[Any]) -> Iterator[torch.Tensor]:
    """The tensors held in the storage of SAC caching modes (from `capture_sac_caches`).

    torch 2.11 keeps `storage[func] = [outputs, ...]` (a list per op, popped in backward); torch 2.13 keeps
    `storage[key] = {index: outputs | marker}`. Outputs are trees of `_VersionWrapper` whose `.val` is the
    tensor; the recompute/consumed markers have none. Checked on torch 2.11.0 (lists), 2.13.0 (dicts).
    """
    for mode in modes:
        for entries in mode.storage.values():
            for entry in entries.values() if isinstance(entries, dict) else entries:
                for w in tree_leaves(entry):
                    val = getattr(w, "val", None)
                    if isinstance(val, torch.Tensor):
                        yield val


# ----------------------------------------------------------------------------- FSDP2


def fsdp_param_groups(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups `fully_shard(module)` created (empty for a module that is not an FSDP root).

    torch 2.13 keeps a list `state._fsdp_param_groups` (grouped `fully_shard([a, b])`); torch 2.11 a single
    `state._fsdp_param_group` (or None). Checked on torch 2.11.0, 2.13.0.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    state = get_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def fsdp_param_owner(fsdp_param: Any) -> tuple[nn.Module, str]:
    """(module, attribute name) of the parameter an FSDPParam manages. Checked on torch 2.11.0, 2.13.0."""
    info = fsdp_param._module_info
    return info.module, info.param_name


def fsdp_reduce_tp_partial_grads_in_reduce_dtype() -> None:
    """Make FSDP2's all-reduce of TP-partial gradients run in the policy's reduce_dtype (pytorch#190626), process-wide
    and idempotent.

    With FSDP2 over TP DTensors, a parameter replicated over TP whose gradient is a partial sum (the norm weights
    under sequence parallel) is all-reduced over the TP mesh by `FSDPParam._get_grad_inner_tensor` (a Partial ->
    Replicate redistribute) in the gradient's own dtype: bfloat16 with param_dtype bfloat16, even when
    `MixedPrecisionPolicy(reduce_dtype=float32)` says float32 (its reduce-scatter then sums the bfloat16-rounded
    result in float32). The wrapper casts every DTensor gradient to the FSDPParam's reduce_dtype first, each rank
    its own local tensor (`from_local`, no collective), which is what pytorch/pytorch#190627 does upstream and what
    FSDP's own gradient-accumulation path (`to_accumulated_grad_if_needed`) already did. All of them, not only the
    partial ones: FSDP's reduce-scatter asserts one gradient dtype per parameter group. The cost is one transient
    reduce_dtype copy of each gradient before FSDP copies it into its (reduce_dtype) reduce-scatter buffer.
    Where torch has the fix, the gradient arrives in reduce_dtype and the cast does nothing.

    Checked on torch 2.13.0 (`FSDPParam._get_grad_inner_tensor(self, grad)` and `FSDPParam.reduce_dtype`; torch
    2.11's source has both, unchanged since 2.4).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    original = FSDPParam._get_grad_inner_tensor
    if getattr(original, "_kiln_reduce_dtype", False):
        return

    def get_grad_inner_tensor(self: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = wait_if_async_collective(grad)
        dtype = self.reduce_dtype
        if dtype is not None and isinstance(grad, DTensor) and grad.dtype != dtype:
            local = grad.to_local().to(dtype)
            grad = DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return original(self, grad)

    get_grad_inner_tensor._kiln_reduce_dtype = True  # type: ignore[attr-defined]  # marks the wrapper as kiln's
    FSDPParam._get_grad_inner_tensor = get_grad_inner_tensor  # type: ignore[method-assign]


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    """All-gather `input` from every rank into the flat `output`.

    torch 2.13 names it `dist.all_gather_single` and deprecates `dist.all_gather_into_tensor` (FutureWarning);
    torch 2.11 has only `all_gather_into_tensor`. Checked on torch 2.11.0, 2.13.0.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


# ----------------------------------------------------------------------------- DTensor, device mesh, process groups


def dtensor_local_tensor(t: Any) -> torch.Tensor:
    """The local shard object a DTensor wraps, itself (not `to_local()`'s autograd view of it).

    Checked on torch 2.11.0, 2.13.0 (`DTensor._local_tensor`).
    """
    return t._local_tensor


def local_tensor_or_self(t: Any) -> Any:
    """A DTensor's local shard object (`_local_tensor`, torch 2.11, 2.13); any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def shard_offset(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of DTensor `t` (uneven FSDP shards included). Checked on
    torch 2.11.0, 2.13.0 (`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A 1-D mesh over all dimensions of `mesh` (e.g. dp_replicate x dp_shard -> dp), registered as `name`.

    Checked on torch 2.11.0, 2.13.0 (`DeviceMesh._flatten(mesh_dim_name=...)`).
    """
    return mesh._flatten(mesh_dim_name=name)


def unflatten_mesh(mesh: Any, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """`mesh` with its dimension `dim` split into `names` of `sizes` (the last innermost), e.g. dp_shard -> (efsdp,
    ep); the same root mesh, so FSDP composes a parameter's placements over both. Checked on torch 2.11.0 and 2.13.0
    (`DeviceMesh._unflatten(dim, mesh_sizes, mesh_dim_names)`); given the dimension's index, as torch 2.11 refuses
    every name it has (its check is inverted: "dim b specified in `_unflatten` is not in ('a', 'b')")."""
    return mesh._unflatten(mesh.mesh_dim_names.index(dim), sizes, names)


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """An all-to-all of equal splits, without autograd, waited for: rank r gets the r-th part of every rank's
    `counts`, in rank order. Checked on torch 2.13.0 (`_functional_collectives.all_to_all_single`, gloo and nccl)."""
    from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

    return wait_tensor(all_to_all_single(counts, None, None, group))


def all_to_all_rows(x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """A differentiable all-to-all of rows with uneven splits (`send[r]` rows of `x` to rank r, `recv[r]` rows from
    it); the backward is the reverse all-to-all. Checked on torch 2.13.0
    (`_functional_collectives.all_to_all_single_autograd`, gloo and nccl)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x, recv, send, group)


def set_pg_timeout(seconds: float, group: dist.ProcessGroup | None = None) -> None:
    """Change the timeout of an initialised process group (default: the world). Checked on torch 2.11.0, 2.13.0."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def all_process_groups() -> list[dist.ProcessGroup]:
    """Every process group this process created: the world and each subgroup (device-mesh dimensions, flattened
    meshes), which FSDP and TP run their collectives on. Checked on torch 2.11.0, 2.13.0 (`_world.pg_map`)."""
    return list(dist.distributed_c10d._world.pg_map)


def pg_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """The current timeout of a process group's CPU backend (gloo). Checked on torch 2.11.0, 2.13.0."""
    group = group or dist.group.WORLD
    assert group is not None, "no default process group"
    return group._get_backend(torch.device("cpu")).options._timeout


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group of `world_size` simulated ranks in this one process; collectives do nothing.

    Checked on torch 2.11.0, 2.13.0 (torch.testing._internal.distributed.fake_pg.FakeStore, backend "fake").
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def flatten_state_dict(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """DCP's flattening of a nested state dict into dotted keys, and the mapping back.

    Checked on torch 2.11.0, 2.13.0 (torch.distributed.checkpoint._nested_dict.flatten_state_dict).
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state)


# ----------------------------------------------------------------------------- reading untrusted checkpoints


class RecordCheckingReader(FileSystemReader):
    """DCP's FileSystemReader with a hook, `check_record(file, info)`, run before each record is read (`file`: the
    open file, `info`: the record's DCPStorageInfo), through the reader's private `_slice_file`, the one place
    every record passes on its way to torch.load. Checked on torch 2.11.0, 2.13.0 (same read_data loop)."""

    def check_record(self, file: IO[bytes], info: Any) -> None:
        """Raise to refuse the record; the default admits all."""

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self.check_record(file, sinfo)
        return super()._slice_file(file, sinfo)


class BuildCheckingUnpickler(pickle._Unpickler):
    """The standard library's pure-Python unpickler (its private `pickle._Unpickler`: the C unpickler has no hook
    per opcode) with a hook, `check_build(target)`, run before each BUILD opcode sets state on `target`. Same in
    Python 3.10 to 3.13."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def check_build(self, target: Any) -> None:
        """Raise to refuse the BUILD; the default admits all."""

    def _load_build(self) -> None:
        stack: list[Any] = self.stack  # type: ignore[attr-defined]  # typeshed types the C Unpickler
        self.check_build(stack[-2] if len(stack) >= 2 else None)
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build  # type: ignore[assignment]


# ----------------------------------------------------------------------------- CUDA memory snapshots


def start_cuda_memory_history(max_entries: int) -> None:
    """Record CUDA allocations with stack traces. Checked on torch 2.11.0, 2.13.0 (signature only: no GPU)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_cuda_memory_history() -> None:
    """Checked on torch 2.11.0, 2.13.0 (signature only: no GPU)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def cuda_memory_snapshot() -> dict[str, Any]:
    """The allocator's state and recorded history (pickle it for pytorch.org/memory_viz).

    Checked on torch 2.11.0, 2.13.0 (signature only: no GPU).
    """
    return torch.cuda.memory._snapshot()


# ----------------------------------------------------------------------------- inductor


def enable_micro_pipeline_tp(group_name: str) -> None:
    """Async TP: inductor's micro-pipeline pass over symmetric memory for the TP group (CUDA only).

    Checked on torch 2.11.0, 2.13.0 (`torch._inductor.config._micro_pipeline_tp`, `enable_symm_mem_for_group`).
    """
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group_name)  # type: ignore[arg-type]  # GroupName: a NewType of str


def enable_emulate_precision_casts() -> None:
    """Make inductor round intermediates to their eager dtype (bf16) as eager does (pytorch#150859).

    Without it, compiled float8 rowwise keeps some bf16 intermediates in fp32 and its numerics (and speed)
    drift from eager; torchtitan sets it for rowwise + compile. Process-wide, like every inductor config.
    Checked on torch 2.11.0, 2.13.0 (`torch._inductor.config.emulate_precision_casts`, default False).
    """
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True


def enable_tiled_reductions() -> None:
    """Let inductor tile reduction kernels in two dimensions (`triton.tile_reductions` with `prefer_nd_tiling`).

    Under float8 + per-op SAC, the backward's RMSNorm kernel also recomputes the norm's output, casts it to float8
    and stores it transposed (the column-major operand of the weight-gradient matmul). A reduction kernel tiled by
    rows only writes that transposed copy one byte per row apart (uncoalesced): on one H200 those kernels took 4x
    the bf16 norms' time (docs/performance.md). Process-wide, like every inductor config.
    Checked on torch 2.11.0, 2.13.0 (`torch._inductor.config.triton.tile_reductions`, `prefer_nd_tiling`).
    """
    import torch._inductor.config as inductor_config

    inductor_config.triton.tile_reductions = True
    inductor_config.triton.prefer_nd_tiling = True


def set_inductor_option(spec: str) -> str:
    """`key=value` into torch._inductor.config (dotted keys, e.g. `triton.tile_reductions=false`; booleans and
    integers converted), for benchmarks/row.py's `--bench.inductor` knob; returns what changed. An unknown key
    raises AttributeError naming it. Checked on torch 2.11.0, 2.13.0."""
    import torch._inductor.config as inductor_config

    key, _, text = spec.partition("=")
    *path, name = key.split(".")
    owner: Any = inductor_config
    for part in path:
        owner = getattr(owner, part)
    old = getattr(owner, name)
    value: Any = {"true": True, "false": False}.get(text.lower(), text)
    if isinstance(old, int) and not isinstance(old, bool) and isinstance(value, str):
        value = int(value)
    setattr(owner, name, value)
    return f"{key} = {value!r} (was {old!r})"


def tiled_reductions_enabled() -> bool:
    """Checked on torch 2.11.0, 2.13.0."""
    import torch._inductor.config as inductor_config

    return bool(inductor_config.triton.tile_reductions and inductor_config.triton.prefer_nd_tiling)


def emulate_precision_casts_enabled() -> bool:
    """Checked on torch 2.11.0, 2.13.0."""
    import torch._inductor.config as inductor_config

    return bool(inductor_config.emulate_precision_casts)


# ----------------------------------------------------------------------------- float8 matmul kernels


def cpu_scaled_mm_supports_rowwise() -> bool:
    """Whether the CPU kernel of `torch._scaled_mm` takes per-row scales (float8 rowwise recipes without emulation).

    torch 2.11's CPU kernel asserts per-tensor scales ("Now _scaled_mm only supports per-tensor scaling for CPU
    backend"); torch 2.13's takes per-row ones. Probed on a 16x16 product (microseconds), not by version.
    Checked on torch 2.11.0 (False), 2.13.0 (True).
    """
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def skip_torchao_triton_min_max_patch() -> None:
    """Mark torchao's Triton min/max codegen patch as applied, without importing inductor's Triton codegen.

    convert_to_float8_training patches inductor's Triton min/max codegen (a Triton fp8 store miscompile,
    triton-lang/triton#11111) and imports torch._inductor.codegen.triton to do it: 0.7 s per process. Only
    GPU kernels are Triton (inductor emits C++ on a CPU), so a CPU run loses nothing by skipping it. A torchao
    without the patch: nothing to skip. Checked on torchao 0.18.0 (`torchao.float8._inductor_patch._PATCHED`).
    """
    try:
        from torchao.float8 import _inductor_patch
    except ImportError:
        return
    if hasattr(_inductor_patch, "_PATCHED"):
        _inductor_patch._PATCHED = True


# ----------------------------------------------------------------------------- torchao float8 tensors


def float8_weight_inner(t: Any) -> torch.Tensor | None:
    """The high-precision tensor inside torchao's FSDP float8 weight wrapper (WeightWithDynamicFloat8CastTensor
    and its delayed/static siblings keep it as `_tensor`), or None for any other tensor.

    Checked on torchao 0.18.0.
    """
    if isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, nn.Parameter):
        inner = getattr(t, "_tensor", None)
        if isinstance(inner, torch.Tensor):
            return inner
    return None


def float8_data(fp8: Any) -> torch.Tensor:
    """The raw float8 payload of a torchao Float8TrainingTensor (`_data`). Checked on torchao 0.18.0."""
    return fp8._data


def float8_with_data(fp8: Any, data: torch.Tensor) -> Any:
    """A Float8TrainingTensor like `fp8` (scale, dtype, mm config, role, axis) holding `data` instead.

    Goes through the subclass's own flatten/unflatten, so metadata torchao adds later travels too.
    Checked on torchao 0.18.0 (inner tensors `_data`, `_scale`).
    """
    names, meta = fp8.__tensor_flatten__()
    inner = {n: getattr(fp8, n) for n in names}
    inner["_data"] = data
    return type(fp8).__tensor_unflatten__(inner, meta, data.size(), data.stride())


def float8_ops_table() -> dict[Any, Any]:
    """torchao's dispatch table for Float8TrainingTensor (op -> handler), editable in place.

    Checked on torchao 0.18.0 (torchao.float8.float8_ops.FLOAT8_OPS_TABLE).
    """
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

    return FLOAT8_OPS_TABLE


# ----------------------------------------------------------------------------- functional collectives


def wait_if_async_collective(t: Any) -> Any:
    """An AsyncCollectiveTensor waited with the differentiable `wait_tensor` (autograd edge kept); else `t`.

    torch.distributed._functional_collectives is private; checked on torch 2.11 and 2.13 (parallelisms/parallelize.py
    uses it for TP blocks under compile: see wait_async_collective_inputs there).
    """
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


# ----------------------------------------------------------------------------- LR scheduler


def set_scheduler_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """What `get_last_lr()` reports (torch keeps it in the private `_last_lr`; checked on torch 2.11 and 2.13)."""
    scheduler._last_lr = list(lrs)


# ----------------------------------------------------------------------------- float8 usage probe (float8/checks.py)


def disable_torch_function_subclass() -> contextlib.AbstractContextManager:
    """Turn off tensor subclasses' `__torch_function__` (torch._C.DisableTorchFunctionSubclass, torch 2.11, 2.13):
    an op then reaches `__torch_dispatch__` directly, where torchao's weight wrappers unwrap to plain tensors."""
    return torch._C.DisableTorchFunctionSubclass()


def mxfp8_weight_data(t: Any) -> torch.Tensor:
    """The high-precision tensor inside torchao's MXFP8TrainingWeightWrapperTensor (`_data`, torchao 0.18)."""
    return t._data


def torchao_float8_rowwise_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torchao's differentiable float8 rowwise scaled grouped GEMM (`_to_fp8_rowwise_then_scaled_grouped_mm`,
    torchao 0.18): Triton casts, torch._scaled_grouped_mm, CUDA only. a (rows, k) row-major, b_t (E, k, n)
    column-major, offs (E,) int32 group ends, multiples of 16; the casts e4m3fn. The GEMMs write bf16 (what
    torch._scaled_grouped_mm writes: torchao's default), cast to a's dtype (a no-op in bf16 training)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    out = _to_fp8_rowwise_then_scaled_grouped_mm(
        a, b_t, offs, out_dtype=torch.bfloat16, float8_dtype=torch.float8_e4m3fn, pad_token_groups_for_grouped_mm=False
    )
    return out.to(a.dtype)


def torchao_mxfp8_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor, config: Any) -> torch.Tensor:
    """torchao's differentiable MXFP8 scaled grouped GEMM (`_to_mxfp8_then_scaled_grouped_mm`, torchao 0.18) with
    an MXFP8TrainingOpConfig's kernel preference (AUTO: SM100 kernels; EMULATED: torch casts and a dequantised
    torch._grouped_mm, any device), weight-gradient precision and scale rounding; the output in a's dtype.
    (EMULATED dequantises to bf16 and multiplies in bf16 with out_dtype = a's: float32 operands need the caller
    to pass bf16 ones.)"""
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm

    return _to_mxfp8_then_scaled_grouped_mm(
        a,
        b_t,
        offs,
        out_dtype=a.dtype,
        kernel_preference=config.kernel_preference,
        wgrad_with_hp=config.wgrad_with_hp,
        scale_calculation_mode=config.scale_calculation_mode,
        pad_token_groups_for_grouped_mm=False,
    )


def mx_tensor_ops_table() -> dict[Any, Any]:
    """torchao's aten-op table of MXTensor (`MXTensor._ATEN_OP_TABLE[MXTensor]`, torchao 0.18): its aten.mm and
    addmm entries run every MXFP8 matmul of the MXFP8 training recipes (real or emulated)."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor._ATEN_OP_TABLE[MXTensor]


def mx_matmul_is_emulated_and_traced(a: Any, b: Any) -> tuple[bool, bool]:
    """For two MXTensor matmul operands: (emulated, traced): torchao's EMULATED kernel preference, and whether the
    operands are fake tensors (a torch.compile trace). Reads `kernel_preference` and `qdata` (torchao 0.18)."""
    from torch._subclasses.fake_tensor import is_fake
    from torchao.quantization.quantize_.common import KernelPreference

    emulated = KernelPreference.EMULATED in (a.kernel_preference, b.kernel_preference)
    return emulated, bool(is_fake(a.qdata))


def float8_matmul_is_emulated_and_traced(a: Any, b: Any) -> tuple[bool, bool]:
    """For two torchao Float8TrainingTensor matmul operands: (emulated, traced). emulated = torchao's emulate flag
    of the matmul config it picks; traced = the operands are fake tensors (a torch.compile trace), not real ones.

    Reads the tensors' private fields `_gemm_input_role`, `_linear_mm_config`, `_data` (torchao 0.18).
    """
    from torch._subclasses.fake_tensor import is_fake
    from torchao.float8.float8_training_tensor import choose_scaled_mm_config

    mm_config = choose_scaled_mm_config(
        a._gemm_input_role, a._linear_mm_config, b._gemm_input_role, b._linear_mm_config
    )
    return bool(mm_config.emulate), bool(is_fake(a._data))


@contextlib.contextmanager
def on_dynamo_compile(callback: Any) -> Iterator[None]:
    """Call `callback(arg)` at the start of every dynamo compilation while active (torch._dynamo.callback_handler,
    checked on torch 2.11 and 2.13)."""
    torch._dynamo.callback_handler.register_start_callback(callback)
    try:
        yield
    finally:
        torch._dynamo.callback_handler.remove_start_callback(callback)


def is_compiled_module(module: Any) -> bool:
    """Whether `module` is torch.compile's wrapper (torch._dynamo.eval_frame.OptimizedModule; torch 2.11, 2.13)."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def partitioned_graphs_backend(graphs: list[tuple[str, Any]]) -> Any:
    """A torch.compile backend that splits forward and backward with the min-cut partitioner inductor uses, runs
    both graphs eagerly, and appends ("forward" | "backward", GraphModule) to `graphs`: the backward graph's
    placeholders (other than `tangents_*`) are the tensors the forward saved, named after their forward nodes.
    Checked on torch 2.11.0, 2.13.0 (`torch._dynamo.backends.common.aot_autograd`)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind: str) -> Any:
        def compiler(gm: Any, _example_inputs: Any) -> Any:
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(
        fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=min_cut_rematerialization_partition
    )


def inductor_partition_backend(around_forward: Any) -> Any:
    """A torch.compile backend that splits each graph into forward and backward exactly as inductor decides:
    inductor's decompositions and its partition function (its joint-graph passes, then the min-cut partitioner
    with compiler="inductor"), then runs both graphs eagerly instead of generating code. The forward graph's
    outputs past the user's are the tensors saved for backward, as in an inductor-compiled run; each forward runs
    inside `around_forward()` (a context manager), so an observer can tell graph work from eager work.
    Checked on torch 2.11.0, 2.13.0 (`torch._inductor.compile_fx.partition_fn`, `torch._inductor.decomposition.
    select_decomp_table`, `torch._dynamo.backends.common.aot_autograd`)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    def forward_compiler(gm: Any, _example_inputs: Any) -> Any:
        def run(*args: Any) -> Any:
            with around_forward():
                return gm(*args)

        return make_boxed_func(run)

    def backward_compiler(gm: Any, _example_inputs: Any) -> Any:
        return make_boxed_func(gm.forward)

    return aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=backward_compiler,
        partition_fn=partition_fn,
        decompositions=select_decomp_table(),
    )


class CompileTransparentDispatchMode(TorchDispatchMode):
    """A TorchDispatchMode under which torch.compile still compiles: dynamo turns the mode off while it traces
    and compiles, and back on while compiled code runs (`ignore_compile_internals`). Under a plain TorchDispatchMode
    torch 2.13's dynamo skips every frame ("non-infra torch dispatch mode present"): compiled code runs eagerly.
    With a backend that runs its graphs eagerly (inductor_partition_backend) the mode sees the graphs' ops, higher
    order ones included (a compiled checkpointed block runs `run_and_save_rng_state`): `__torch_dispatch__` gets
    them too (`supports_higher_order_operators`) and must call them like any op. Checked on torch 2.11.0, 2.13.0."""

    def __init__(self) -> None:
        super().__init__()
        self.supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


# ----------------------------------------------------------------------------- compile: guards and counters


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Compile `t`'s dimension `dim` as a symbolic size from the first call on (torch._dynamo.mark_dynamic), so a
    compiled region taking tensors whose length changes every call compiles once instead of recompiling for the
    second length seen. Checked on torch 2.13.0."""
    torch._dynamo.mark_dynamic(t, dim)


def dynamo_graphs_compiled() -> int:
    """How many graphs dynamo has produced in this process so far (torch._dynamo.utils.counters, stats /
    unique_graphs): every compile and every recompile adds one; a call served by a cached graph adds none.
    Checked on torch 2.13.0."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ----------------------------------------------------------------------------- flex attention


@contextlib.contextmanager
def cpu_flex_backward() -> Iterator[None]:
    """Let eager flex_attention take CPU inputs that require grad while active: measurements and tests only.

    torch refuses them (`torch.nn.attention.flex_attention._validate_device`: "FlexAttention does not support backward
    on CPU"), yet its eager implementation, the unfused reference that materialises the scores, has a backward on
    any device; inductor's compiled backward is Triton only, so compiled code stays refused. kiln's CPU runs evaluate
    a block mask densely for SDPA instead (models/attention.py); this lets a test run the flex kernel's own path on a
    CPU, e.g. to see what per-op SAC keeps of it. Checked on torch 2.13.0."""
    import torch.nn.attention.flex_attention as flex

    original = flex._validate_device

    def validate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != "cpu":
            original(query, key, value)

    flex._validate_device = validate
    try:
        yield
    finally:
        flex._validate_device = original


# ----------------------------------------------------------------------------- pipeline parallelism


def pipeline_warmup_sends_to_own_rank() -> bool:
    """Whether torch's pipeline schedules start by sending from each stage to its neighbours even when both are on
    one rank. torch 2.11's `_PipelineScheduleRuntime._initialize_stages` does (`_get_init_p2p_neighbors_ops`): the
    V schedule's two middle stages share a rank, and gloo has no connection to the rank itself ("Pair is not
    connected"). torch 2.13 starts with a vote protocol (`_PipelineSchedule._warmup_p2p`) that does not. Checked
    on torch 2.11.0 (True) and 2.13.0 (False)."""
    from torch.distributed.pipelining import schedules

    return not hasattr(schedules._PipelineSchedule, "_warmup_p2p")


def forward_only_schedule(schedule: Any) -> None:
    """Drop the backward actions (and their sends, receives and gradient reductions) from a runtime pipeline
    schedule's lowered plan (torch's _PipelineScheduleRuntime), for `eval()`. torch's eval of the V schedule runs
    its backward actions with backward off, and a stage whose previous stage is on the same rank then asserts
    "can't steal_bwd_input if this stage doesn't have backward" (torch 2.13). Removing actions only removes waits:
    the forward order stays as torch planned it. Checked on torch 2.13.0 (gloo); torch 2.11 has the same attribute
    and action types, but its V schedule cannot start on gloo (kiln refuses it on a CPU there), so it is unchecked
    there, and on CUDA."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    backward = {C.FULL_BACKWARD, C.BACKWARD_INPUT, C.BACKWARD_WEIGHT, C.SEND_B, C.RECV_B, C.REDUCE_GRAD}
    schedule.pipeline_order_with_comms = {
        rank: [a for a in actions if a.computation_type not in backward]
        for rank, actions in schedule.pipeline_order_with_comms.items()
    }


def after_pipeline_metadata_inference(stage: Any, fn: Any) -> None:
    """Call `fn()` on this rank once torch's schedule has run `stage`'s metadata inference: at its first step, before
    the micro-batches, the schedule runs the stage's forward (and backward) on placeholder inputs to learn the shapes
    (torch 2.13: real tensors, so a module's buffers that count what passes, such as an MoE layer's tokens per
    expert, count the placeholders too). torch 2.13 ends it with `PipelineStage._post_metadata_inference_cleanup`
    on every stage of the rank, wrapped here (per stage object); where that method is missing (older torch, whose
    `_shape_inference` ran the same forward), `_shape_inference` is. Checked on torch 2.13.0 (gloo); unchecked on
    2.11."""
    name = "_post_metadata_inference_cleanup"
    if not hasattr(stage, name):
        name = "_shape_inference"
    original = getattr(stage, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        fn()
        return out

    setattr(stage, name, wrapped)


def bound_pipeline_waits(group: dist.ProcessGroup) -> None:
    """Make torch's pipeline schedules wait for each send and receive at most `group`'s collective timeout (read at
    each wait: kiln lengthens it for steps that may compile). On gloo a send's or receive's `Work.wait()` without a
    timeout waits forever, whatever the group's timeout (which bounds its collectives only): a pipeline stage that
    froze (SIGSTOP) held its neighbour in a receive until killed from outside. Every schedule waits through
    `schedules._wait_batch_p2p`, replaced here, process-wide; for gloo only: with NCCL a wait with a timeout blocks
    the CPU until the transfer ends (NCCL's watchdog enforces the timeout there). Checked on torch 2.11.0 and 2.13.0
    (tests/e2e/test_frozen_stage.py: a stage stopped with SIGSTOP ends the job 45.5 s later on both)."""
    from torch.distributed.pipelining import schedules

    def wait(work: list[dist.Work]) -> None:
        for w in work:
            w.wait(pg_timeout(group))

    schedules._wait_batch_p2p = wait


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm (private in torch 2.11 and 2.13): rows of `a` (rows, k) split at the end offsets `offs`
    (int32, one per group), group g times b[g] (k, n) -> (rows, n). The MoE experts' kernel (models/moe.py)."""
    return torch._grouped_mm(a, b, offs=offs)
