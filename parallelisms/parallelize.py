"""parallelize_llama: the one place a meta-device model gets its parallel plan.

Order matters and follows torchtitan: (float8 conversion happens before this) -> EP -> TP -> AC -> compile -> FSDP.
Context parallelism only swaps each block's attention core (torchtitan does it at run time, kiln at build time);
it comes first so that the compiled blocks trace the context-parallel attention.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from float8.converter import is_float8_linear
from kiln_base.config import BF16_WIRE, ActivationCheckpoint, Float8, Parallelism, Training, resolve_mixed_precision
from kiln_base.internals import (
    compile_inside_checkpoint,
    enable_emulate_precision_casts,
    enable_micro_pipeline_tp,
    enable_tiled_reductions,
    fsdp_reduce_tp_partial_grads_in_reduce_dtype,
    is_checkpoint_wrapped,
)
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.context_parallel import ContextParallel
from parallelisms.expert_parallel import (
    ExpertParallelExperts,
    MoEOnLocalTokens,
    ReplicatedOnLocalTokens,
    apply_ep,
    expert_shard_placement,
)
from parallelisms.grad_reduce import REDUCE_DTYPE, Bf16WireReduceScatter
from parallelisms.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from models import Transformer
    from models.llama3 import Attention

logger = logging.getLogger("kiln")
QK_NORMS = ("q_norm", "k_norm")


def float8_tensorwise_tp(float8: Float8) -> bool:
    """Tensorwise float8 can all-gather activations in float8; rowwise recipes use the high-precision styles."""
    return float8.enable_float8_linear and float8.recipe == "tensorwise"


def apply_tp(
    model: Transformer, tp_mesh: DeviceMesh, loss_parallel: bool, float8_tensorwise: bool
) -> dict[str, ParallelStyle]:
    """Megatron-style TP with sequence parallel norms (torchtitan's plan).

    Activations between blocks are sharded on the sequence dim (Shard(1)); attention and FFN all-gather them
    (Replicate), run column-wise then row-wise Linears, and reduce-scatter back to Shard(1).
    """
    root_plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Loss parallel keeps the logits sharded on the vocab dim: no all-gather of (bs, seq, vocab).
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    # A pipeline stage holds some of these, or none (its model's tok_embeddings / norm / output are None).
    root_plan = {name: style for name, style in root_plan.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, root_plan)
    applied = dict(root_plan)
    if float8_tensorwise:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        from parallelisms.float8_gloo import enable_float8_tp_on_cpu

        if tp_mesh.device_type == "cpu":
            enable_float8_tp_on_cpu()
    for block_name, block in model.layers.items():
        plan: dict[str, ParallelStyle] = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        subs: list[tuple[str, tuple[Shard | None, ...], tuple[str, ...], str]] = [
            ("attention", (Shard(1), None, None), ("wq", "wk", "wv"), "wo")  # (x, freqs_cis, mask)
        ]
        if getattr(block.get_submodule("attention"), "q_norm", None) is not None:
            # Qwen3's q/k norms act on this rank's heads, (bs, seq, local heads, head_dim): the weight replicated,
            # the input sharded on the head dim, so its gradient is summed over every rank's heads.
            plan |= {f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in QK_NORMS}
        if getattr(block, "feed_forward", None) is not None:
            subs.append(("feed_forward", (Shard(1),), ("w1", "w3"), "w2"))
        moe = getattr(block, "moe", None)
        if moe is not None:  # each TP rank routes its own tokens to experts split over EP (expert_parallel.py)
            plan |= {"moe": MoEOnLocalTokens(), "moe.router.gate": ReplicatedOnLocalTokens()}
            if moe.shared_experts is not None:  # over every TP rank's tokens (rows), column- then row-wise
                subs.append(("moe.shared_experts", (Shard(0),), ("w1", "w3"), "w2"))
        for sub, inputs, col, row in subs:
            # float8 styles only where every Linear of the sub-module is Float8Linear (some may be filtered).
            fp8 = float8_tensorwise and all(is_float8_linear(block.get_submodule(f"{sub}.{n}")) for n in (*col, row))
            prepare = PrepareFloat8ModuleInput if fp8 else PrepareModuleInput
            colwise = Float8ColwiseParallel if fp8 else ColwiseParallel
            rowwise = Float8RowwiseParallel if fp8 else RowwiseParallel
            desired = tuple(None if p is None else Replicate() for p in inputs)
            plan[sub] = prepare(input_layouts=inputs, desired_input_layouts=desired)
            plan.update({f"{sub}.{n}": colwise() for n in col})
            plan[f"{sub}.{row}"] = rowwise(output_layouts=inputs[0])
        parallelize_module(block, tp_mesh, plan)
        applied |= {f"layers.{block_name}.{k}": v for k, v in plan.items()}
    return applied


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Overlap TP collectives with matmuls (inductor's micro-pipeline pass over symmetric memory; CUDA only)."""
    enable_micro_pipeline_tp(tp_mesh.get_group().group_name)


def apply_compile(model: Transformer, float8: Float8) -> None:
    """Compile each transformer block separately: blocks are identical, so one graph serves all.

    Float8 rowwise recipes also turn on inductor's emulate_precision_casts (process-wide), as torchtitan does:
    without it inductor keeps bf16 intermediates of the rowwise casts in fp32, so compiled numerics differ
    from eager (pytorch#150859).
    """
    if float8.enable_float8_linear and float8.recipe_name in ("rowwise", "rowwise_with_gw_hp"):
        enable_emulate_precision_casts()
        logger.info("float8 rowwise + compile: inductor emulate_precision_casts on (pytorch#150859)")
    if float8.enable_float8_linear:
        enable_tiled_reductions()
        logger.info("float8 + compile: inductor tile_reductions on (coalesced transposed float8 copies)")
    dispatching, inside_checkpoint = 0, 0
    for name, block in model.layers.named_children():
        # An expert-parallel MoE layer's dispatch, experts and combine run eagerly (torch.compiler.disable: the
        # all-to-all's split sizes are a host sync), the rest of the block in graphs around them, of fixed shapes
        # (the tokens x top k rows in and out): the varying rows per expert recompile nothing. Dynamo does not
        # compile a checkpoint with an eager call inside (torch 2.13: it would run the block eagerly whole), so a
        # checkpointed such block is compiled inside its checkpoint, which stays eager and recomputes through the
        # same graphs.
        eager_part = any(isinstance(m, ExpertParallelExperts) for m in block.modules())
        dispatching += eager_part
        if eager_part and is_checkpoint_wrapped(block):
            inside_checkpoint += 1
            compile_inside_checkpoint(block, fullgraph=False)
            outer = block  # the eager checkpoint wrapper
        else:
            outer = cast(nn.Module, torch.compile(block, fullgraph=not eager_part))  # an OptimizedModule
            model.layers.register_module(name, outer)
        # A hook on the outer (eager) wrapper runs before the compiled graph sees the inputs.
        outer.register_forward_pre_hook(wait_async_collective_inputs)
    if dispatching:
        checkpointed = f" ({inside_checkpoint} inside their activation checkpoint)" * bool(inside_checkpoint)
        logger.info(
            f"compile: the expert-parallel dispatch and experts of {dispatching} MoE layers run eagerly, the rest of "
            f"each block compiled around them{checkpointed}"
        )


def wait_async_collective_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Turn AsyncCollectiveTensor inputs into plain tensors with `wait_tensor`, keeping their autograd edge.

    With TP the eager embedding hands block 0 an AsyncCollectiveTensor (RowwiseParallel's output is an async
    redistribute + to_local()). torch 2.13's AOTAutograd unwraps such an input with trigger_wait(), which drops
    its autograd edge: the block's input gradient then reaches the embedding's Redistribute backward as a plain
    tensor ('Tensor' object has no attribute '_local_tensor'; scripts/repro_tp_compile_async_input.py, fixed
    upstream by pytorch/pytorch#191113). `wait_tensor` is differentiable and costs nothing extra: the block's
    first op would wait for the collective anyway. FSDP's pre-forward hook used to hide this by rewrapping inputs.
    """
    from kiln_base.internals import wait_if_async_collective

    return tuple(wait_if_async_collective(a) for a in args)


def apply_fsdp(
    model: Transformer, parallel_dims: ParallelDims, training: Training, parallelism: Parallelism, float8: Float8
) -> None:
    """fully_shard each block, then the root, over dp_shard x cp; HSDP (replicate x that) when dp_replicate > 1.

    Context-parallel ranks hold the same weights and different tokens of the same sequences, so they average
    gradients like data-parallel ranks: each CP rank's loss is its tokens' share of the sequence mean times cp
    (Trainer.forward_backward), and FSDP's mean over dp_shard x cp is then the gradient of the mean over all tokens.

    With float8 all-gather the float8 conversion has already made each weight a torchao tensor subclass whose
    FSDP hooks cast the local shard to float8 before the all-gather; nothing else is needed here, except on gloo.
    Every gradient reduction runs in training.mixed_precision_reduce's precision (parallelisms/grad_reduce.py).
    """
    dp_mesh = parallel_dims.fsdp_mesh  # context-parallel ranks shard parameters too (torchtitan: dp_shard_cp)
    mp = MixedPrecisionPolicy(
        # The config's choices are torch dtype names (auto: bfloat16 on CUDA, float32 on CPU).
        param_dtype=getattr(torch, resolve_mixed_precision(training.mixed_precision_param, dp_mesh.device_type)),
        reduce_dtype=REDUCE_DTYPE[training.mixed_precision_reduce],
    )
    if parallel_dims.tp_enabled:
        fsdp_reduce_tp_partial_grads_in_reduce_dtype()  # pytorch#190626: else the TP all-reduce ignores reduce_dtype
    policy = parallelism.fsdp_reshard_after_forward
    # Groups as torchtitan makes them: the embedding, each block, the final norm with the output layer, then the
    # root. The output layer's gradients (a quarter of the 8B's weights with vocab 128,256) are then reduced while
    # the blocks' backward runs, not after it; tied weights stay in the root (one parameter, one group).
    tied = model.output is not None and model.tok_embeddings is not None
    tied = tied and model.output.weight is model.tok_embeddings.weight
    if model.tok_embeddings is not None and not tied:
        reshard = {"always": True, "never": False}.get(policy, not parallel_dims.pp_enabled)
        fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # By default the last block keeps its params: backward needs them right away. A pipeline stage runs the
        # forwards of several micro-batches before their backwards: by default it keeps every block's params
        # gathered, one all-gather per step instead of one per micro-batch (torchtitan's default under PP).
        default = i < len(blocks) - 1 and not parallel_dims.pp_enabled
        reshard = {"always": True, "never": False}.get(policy, default)
        # An expert-parallel block's routed experts (inside any AC wrapper): split over ep already, FSDP'd over the
        # rest (efsdp) in a group of their own; the block's group then leaves them out.
        for experts in [m for m in block.modules() if isinstance(m, ExpertParallelExperts)]:
            fully_shard(
                experts,
                mesh=parallel_dims.expert_fsdp_mesh,
                mp_policy=mp,
                reshard_after_forward=reshard,
                shard_placement_fn=expert_shard_placement(experts.num_experts, parallel_dims.degrees),
            )
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    if model.norm is not None and model.output is not None and not tied:
        # Backward needs them first: kept gathered after the forward unless resharding is always asked for.
        fully_shard([model.norm, model.output], mesh=dp_mesh, mp_policy=mp, reshard_after_forward=policy == "always")
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=policy == "always")
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if training.mixed_precision_reduce == BF16_WIRE and parallel_dims.fsdp_enabled:  # a reduce-scatter: dp_shard x cp
        for module in fsdp_modules:
            module.set_custom_reduce_scatter(Bf16WireReduceScatter())
    if float8.enable_fsdp_float8_all_gather and dp_mesh.device_type == "cpu":
        # gloo cannot all-gather a float8 buffer (FSDP2 makes one when all of a group's params are float8).
        from parallelisms.float8_gloo import Float8AsUint8AllGather

        for module in fsdp_modules:
            module.set_custom_all_gather(Float8AsUint8AllGather())


def apply_cp(model: Transformer, cp: ContextParallel) -> None:
    """Every block's attention becomes context-parallel: this rank's queries over the whole sequence's keys/values."""
    for block in model.layers.values():
        cast("Attention", block.get_submodule("attention")).core = cp.attention


def parallelize_llama(
    model: Transformer,
    parallel_dims: ParallelDims,
    training: Training,
    parallelism: Parallelism,
    ac: ActivationCheckpoint,
    float8: Float8,
    cp: ContextParallel | None = None,
) -> dict[str, ParallelStyle]:
    """Apply CP, TP, AC, compile and FSDP/HSDP to a meta-device Llama3 (already float8-converted if enabled). `cp`:
    this rank's ContextParallel (parallelisms/context_parallel.py build_context_parallel), whose attention every
    block gets; None without context parallelism.

    Returns the TP plan applied (module FQN -> style; empty without TP), for the dry run to print.
    """
    tp_plan: dict[str, ParallelStyle] = {}
    if cp is not None:
        apply_cp(model, cp)
    if parallel_dims.ep_enabled:
        layers = apply_ep(model, parallel_dims.ep_mesh, parallel_dims.degrees.ep_data_ranks)
        logger.info(f"Expert parallel: the routed experts of {layers} MoE layers split over {parallel_dims.ep} ranks")
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.mesh["tp"]
        tp_plan = apply_tp(model, tp_mesh, not parallelism.disable_loss_parallel, float8_tensorwise_tp(float8))
        if parallelism.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)
    apply_ac(model, ac)
    if training.compile:
        apply_compile(model, float8)
    if parallel_dims.fully_shard_enabled:
        apply_fsdp(model, parallel_dims, training, parallelism, float8)
    return tp_plan


def loss_parallel_enabled(parallel_dims: ParallelDims, parallelism: Parallelism) -> bool:
    """Whether logits stay vocab-sharded: the loss must then run under torch's loss_parallel() context."""
    return parallel_dims.tp_enabled and not parallelism.disable_loss_parallel
