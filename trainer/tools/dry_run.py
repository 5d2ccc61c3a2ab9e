"""`--job.dry_run`: build the model on the meta device, apply float8 and the parallel plan, print the plan.

No weights are allocated and nothing is communicated: the world is simulated with torch's fake process
group, so an 8B/70B/405B plan for any mesh prints on a laptop CPU in seconds.

Simulated world size = dp_replicate x max(dp_shard, 1) x cp x tp: `data_parallel_shard_degree = -1` ("the
rest") counts as 1, so a TP-only config plans a single TP group; pass an explicit
`--parallelism.data_parallel_shard_degree N` to plan FSDP over N shards as well.

It runs the same code as training: float8/'s converter (its per-Linear decisions give the reasons) and
parallelize_llama (whose returned TP plan gives the styles; each module's weight layout is read back from its
DTensor placement on the `tp` mesh dimension).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

from float8.converter import build_float8_converter, is_float8_linear
from kiln_base.config import (
    ActivationCheckpoint,
    Float8,
    JobConfig,
    Parallelism,
    PipelinePlan,
    Training,
    check_pipeline,
    check_sequence_split,
    resolve_mixed_precision,
    training_bytes,
)
from kiln_base.internals import init_fake_process_group, unwrapped_fqn
from models.args import ModelArgs, ffn_hidden_dim
from parallelisms.grad_reduce import reduction_line
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import StagedModel
from trainer.build import build_model, flops_line, model_args
from trainer.components.initial_load import open_source

LLAMA3_VOCAB = 128256  # Meta's Llama 3 tokenizer: 128000 BPE ranks + 256 special tokens


def simulated_world_size(p: Parallelism) -> int:
    return (
        p.pipeline_parallel_degree
        * p.data_parallel_replicate_degree
        * max(p.data_parallel_shard_degree, 1)
        * p.context_parallel_degree
        * p.tensor_parallel_degree
    )


def _vocab_size(tokenizer_path: str, flavor: str) -> tuple[int, str]:
    if os.path.isfile(tokenizer_path):
        from trainer.components.tokenizer import Tokenizer

        return Tokenizer(tokenizer_path).n_words, tokenizer_path
    if flavor.startswith("debugmodel"):
        return 2256, f"{tokenizer_path} missing; the bundled tokenizer's size"
    return LLAMA3_VOCAB, f"{tokenizer_path} missing; Llama 3's tokenizer size"


# ----------------------------------------------------------------------------- float8


# ----------------------------------------------------------------------------- parallel plan


def _tp_layout(module: nn.Module) -> str | None:
    """A module's TP layout read from its weight's placement on the 'tp' mesh dimension."""
    w = getattr(module, "weight", None)
    mesh = getattr(w, "device_mesh", None)
    if w is None or mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    placement = w.placements[mesh.mesh_dim_names.index("tp")]
    if not placement.is_shard():
        return "weight replicated over tp"
    what = {0: "output features", 1: "input features"}[placement.dim]
    if isinstance(module, nn.Embedding):
        what = {0: "vocab", 1: "embedding dim"}[placement.dim]
    return f"weight sharded on {what} (dim {placement.dim}) over tp"


def _group(names_to_value: dict[str, str]) -> list[tuple[str, str, int]]:
    """Collapse `layers.N.x` into `layers.*.x` when every layer agrees: (pattern, value, count)."""
    groups: dict[tuple[str, str], int] = {}
    for name, value in names_to_value.items():
        key = (re.sub(r"^layers\.\d+\.", "layers.*.", name), value)
        groups[key] = groups.get(key, 0) + 1
    return [(pattern, value, n) for (pattern, value), n in groups.items()]


# ----------------------------------------------------------------------------- memory estimate


def _activation_elems_per_token_layer(args: ModelArgs, ac: ActivationCheckpoint) -> float:
    """Elements kept for backward per token per block (bf16, flash SDPA, eager), before TP/SP division.

    No AC: norm inputs 2*dim, norm outputs feeding the Linears 2*dim, q/k/v 3 projections (dim + 2*kv),
    RoPE'd q/k (dim + kv) and SDPA out (dim), wo input shared with it, FFN w1/w3 outputs, silu output and
    the product (4*hidden): ~8*dim + 3*kv + 4*hidden. Full AC keeps only the block input (dim).
    Per-op SAC keeps the block input plus every second mm output (wq, wv, w1, w2) and SDPA out.
    Selective every N blocks: 1 block in N is fully recomputed.
    """
    kv = args.dim // args.n_heads * (args.n_kv_heads or args.n_heads)
    hidden = ffn_hidden_dim(args)
    full_block = 8 * args.dim + 3 * kv + 4 * hidden
    if ac.mode == "none":
        return full_block
    if ac.mode == "full":
        return args.dim
    if ac.selective_ac_option == "op":
        return args.dim + (args.dim + kv + hidden + args.dim) + args.dim
    every = int(ac.selective_ac_option)
    return (args.dim + (every - 1) * full_block) / every


def memory_estimate(
    model: nn.Module,
    args: ModelArgs,
    training: Training,
    ac: ActivationCheckpoint,
    parallel_dims: ParallelDims,
    rotate_method: str = "allgather",
    stage: StageShare | None = None,
) -> dict[str, int]:
    """Bytes per device: fp32 master params, fp32 grads, AdamW m+v (fp32), activations of one micro-batch, and
    with context parallelism the key/value buffers of one block's attention.

    Params/grads/optimizer use each parameter's local shard (DTensor shard shape after TP and FSDP).
    Activations: tokens = local_batch_size x seq_len / cp per device; per block see
    `_activation_elems_per_token_layer` x 2 bytes (bf16), divided by tp (TP shards heads/hidden, sequence
    parallel shards the rest); plus the logits kept for the loss: bf16 logits + fp32 log-softmax
    (6 bytes x vocab per token, / tp with loss parallel). Context parallel attention briefly holds other ranks'
    keys and values (bf16) and, in backward, float32 gradients for them: all cp ranks' with `allgather`, two
    ranks' with `alltoall` (the one in use and the one arriving). Not included: bf16 copies of the weights held
    for backward (FSDP's unsharded params, autocast's casts), other transient buffers and allocator
    fragmentation: budget ~10-20% on top. On the debug model (seq 64, batch 2, bf16 autocast) the estimate
    is within 10% of the saved-activation report (no AC: 10.8 vs 10.1 MB; per-op SAC: 4.9 vs 5.0 MB).

    Under pipeline parallelism (`stage`: a rank's share) `model` holds that rank's stages: its blocks and, on the
    last stage's rank, the logits, for each micro-batch in flight (StageShare.in_flight).
    """
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    cp, tp = parallel_dims.cp, parallel_dims.tp
    per_layer = _activation_elems_per_token_layer(args, ac) * 2 / tp
    logits = 6 * args.vocab_size / tp
    if stage is None:
        tokens, blocks, what = training.local_batch_size * training.seq_len // cp, args.n_layers, "one micro-batch"
        running = tokens  # the micro-batch a block's attention runs on
    else:
        running = stage.microbatch_size * training.seq_len // cp
        tokens, blocks = running * stage.in_flight, stage.blocks
        logits = logits if stage.has_output else 0
        what = f"{stage.in_flight} pipeline micro-batch{'es' * (stage.in_flight > 1)} in flight"
    estimate = {
        "params (fp32)": 4 * local,
        "grads (fp32)": 4 * local,
        "optimizer (AdamW m+v fp32)": 8 * local,
        f"activations ({what})": int(tokens * (blocks * per_layer + logits)),
    }
    if cp > 1:
        kv = 2 * args.dim // args.n_heads * (args.n_kv_heads or args.n_heads) // tp  # k and v elements per token
        held = cp if rotate_method == "allgather" else 2  # ranks' keys/values held at once
        estimate["CP key/value buffers (one block)"] = running * held * kv * (2 + 4)
    return estimate


@dataclass(frozen=True)
class StageShare:
    """What one pipeline rank holds, for the memory estimate: its blocks, whether it computes the logits, and the
    micro-batches whose activations it keeps at once: every micro-batch of the step under GPipe (all forwards
    first) and, as an upper bound, under the looped and V schedules; at most degree - rank under 1F1B (the first
    rank keeps the most)."""

    blocks: int
    has_output: bool
    microbatch_size: int
    in_flight: int


def stage_share(plan: PipelinePlan, pp_rank: int, microbatch_size: int) -> StageShare:
    ids = plan.stage_ids(pp_rank)
    blocks = sum(m.startswith("layers.") for i in ids for m in plan.stages[i])
    in_flight = plan.microbatches
    if plan.schedule == "1F1B":
        in_flight = min(plan.microbatches, plan.degree - pp_rank)
    return StageShare(blocks, any("output" in plan.stages[i] for i in ids), microbatch_size, in_flight)


# ----------------------------------------------------------------------------- the plan


def _init_fake_world(world_size: int) -> None:
    assert not dist.is_initialized(), "the dry run simulates its own world; call it before any process group"
    init_fake_process_group(world_size)


def dry_run(cfg: JobConfig) -> str:
    """Build on meta under a simulated world, apply `convert` and `parallelize`, return the printed plan."""
    t0 = time.perf_counter()
    p, t, ac, f8 = cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.float8
    world = simulated_world_size(p)
    _init_fake_world(world)
    try:
        check_sequence_split(t.seq_len, p)
        dims = ParallelDims(
            p.data_parallel_replicate_degree,
            max(p.data_parallel_shard_degree, 1),
            p.tensor_parallel_degree,
            world,
            cp=p.context_parallel_degree,
            pp=p.pipeline_parallel_degree,
        )
        dims.build_mesh("cpu")
        vocab, vocab_source = _vocab_size(cfg.model.tokenizer_path, cfg.model.flavor)
        converter = build_float8_converter(f8, p.tensor_parallel_degree)
        path = cfg.checkpoint.initial_load_path
        source = open_source(path) if path else None  # its stored shape: from_checkpoint builds it, a flavor must match
        args = model_args(cfg.model, t.seq_len, vocab, source)
        pipeline = check_pipeline(cfg, args.shape())
        every_stage = None if pipeline is None else tuple(range(len(pipeline.stages)))  # plan them all
        built = build_model(cfg, args, dims, converter, stage_ids=every_stage)
        model, plan = built.model, built.tp_plan
        reasons = {d.fqn: d.reason for d in converter.decisions} if converter else {}
        n_params = built.n_params
        float8_lines = _float8_lines(model, built.linear_fqns, f8, reasons)
        on = {True: "on", False: "off"}
        lines = [
            f"kiln dry run: llama3 {cfg.model.flavor}, {args.n_layers} layers "
            f"(vocab {args.vocab_size}: {vocab_source})",
            f"parameters: {n_params:,}   seq {t.seq_len}   "
            + flops_line(built.flops_per_token_by_convention, cfg.metrics.attention_flops),
            f"simulated world: {world} = "
            + ("" if pipeline is None else f"pp {dims.pp} x ")
            + f"dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}"
            + (f" x cp {dims.cp}" if dims.cp_enabled else "")
            + f" x tp {dims.tp}",
            f"mesh: {dict(zip(dims.mesh.mesh_dim_names or (), dims.mesh.shape))}  (FSDP {on[dims.fsdp_enabled]}, "
            f"HSDP {on[dims.dp_replicate_enabled]}, CP {on[dims.cp_enabled]}, TP {on[dims.tp_enabled]}, "
            f"PP {on[dims.pp_enabled]})",
            *float8_lines,
            f"mixed precision: {resolve_mixed_precision(t.mixed_precision_param, 'cuda')} compute on a GPU, "
            f"{resolve_mixed_precision(t.mixed_precision_param, 'cpu')} on a CPU (training.mixed_precision_param = "
            f"{t.mixed_precision_param}); master weights float32",
            reduction_line(t, dims.dp_replicate, dims.dp_shard * dims.cp, dims.tp, "cuda", dims.pp),
        ]
        if dims.tp_enabled:
            lines.append(f"tensor parallel (tp={dims.tp}, loss parallel {on[not p.disable_loss_parallel]}):")
            lines += [f"  {pat:<34} x{n:<4} {v}" for pat, v, n in sorted(_group(_tp_styles(model, plan)), key=_order)]
        lines += _cp_lines(dims, p, t.seq_len)
        lines += _ac_lines(ac)
        if pipeline is None:
            mem = memory_estimate(model, args, t, ac, dims, p.context_parallel_rotate_method)
            per_rank = f" / cp {dims.cp} = {t.seq_len // dims.cp} tokens" if dims.cp_enabled else ""
            lines.append(f"memory per device (estimate; local batch {t.local_batch_size} x seq {t.seq_len}{per_rank}):")
            unit, size = ("GiB", 2**30) if sum(mem.values()) >= 2**30 else ("MiB", 2**20)  # small models: MiB
            lines += [f"  {k:<32} {v / size:9.2f} {unit}" for k, v in mem.items()]
            lines.append(f"  {'total':<32} {sum(mem.values()) / size:9.2f} {unit}")
            if t.memory_budget_gib is not None:
                fits = sum(mem.values()) <= t.memory_budget_gib * 2**30
                lines.append(
                    f"  training.memory_budget_gib {t.memory_budget_gib:g}: {'fits' if fits else 'DOES NOT FIT'}"
                )
        else:
            lines += _pipeline_lines(built.parts, pipeline, args, t, ac, dims, p)
        state = training_bytes(args.shape(), dims.dp_shard * dims.cp * dims.tp, pipeline)
        whose = "a rank" if pipeline is None else "on the pipeline rank holding the most"
        lines.append(
            f"  start-up check (not applied to a dry run): {state / 2**30:,.2f} GiB of weights, gradients and AdamW "
            f"state {whose} must fit the rank's memory (host RAM on a CPU node, shared by its ranks; the GPU's)"
        )
        lines.append(f"dry run took {time.perf_counter() - t0:.1f}s; nothing was allocated or trained")
        return "\n".join(lines)
    finally:
        dist.destroy_process_group()


def _pipeline_lines(
    parts: list[nn.Module],
    pipeline: PipelinePlan,
    args: ModelArgs,
    t: Training,
    ac: ActivationCheckpoint,
    dims: ParallelDims,
    p: Parallelism,
) -> list[str]:
    """Each stage's modules and parameters, then each pipeline rank's stages and memory per device (under CP with
    the key/value buffers of p's rotate method, as a run counts them)."""
    n, microbatch_size = len(pipeline.stages), p.pipeline_parallel_microbatch_size
    lines = [
        f"pipeline: {pipeline.schedule}, {n} stages over pp {pipeline.degree} ({pipeline.stages_per_rank} per rank), "
        f"{pipeline.microbatches} micro-batches of {microbatch_size} per local batch of {t.local_batch_size}",
    ]
    for i, (modules, part) in enumerate(zip(pipeline.stages, parts, strict=True)):
        count = sum(p.numel() for p in part.parameters())  # the whole tensors' (a DTensor's numel is global)
        lines.append(f"  stage {i:<3} rank {_rank_of(pipeline, i):<3} {count:>16,} params  {_modules(list(modules))}")
    lines.append(f"memory per device by pipeline rank (estimate; seq {t.seq_len}, each pp rank's TP/FSDP share):")
    totals = []
    for r in range(pipeline.degree):
        ids = pipeline.stage_ids(r)
        share = stage_share(pipeline, r, microbatch_size)
        rotate = p.context_parallel_rotate_method
        mem = memory_estimate(StagedModel([parts[i] for i in ids]), args, t, ac, dims, rotate, stage=share)
        totals.append(sum(mem.values()))
        values = ", ".join(f"{k.split(' (')[0]} {v / 2**30:.2f}" for k, v in mem.items())
        lines.append(
            f"  pp rank {r:<3} stages {','.join(map(str, ids)):<8} {totals[-1] / 2**30:9.2f} GiB "
            f"({values} GiB; {share.in_flight} micro-batch{'es' * (share.in_flight > 1)} in flight)"
        )
    if t.memory_budget_gib is not None:  # each rank checks its own estimate at start (Trainer: check_budget)
        worst = max(range(pipeline.degree), key=lambda r: totals[r])
        fits = totals[worst] <= t.memory_budget_gib * 2**30
        lines.append(
            f"  training.memory_budget_gib {t.memory_budget_gib:g}: {'fits' if fits else 'DOES NOT FIT'} "
            f"(pipeline rank {worst} needs the most, {totals[worst] / 2**30:.2f} GiB)"
        )
    return lines


def _rank_of(pipeline: PipelinePlan, stage: int) -> int:
    return next(r for r in range(pipeline.degree) if stage in pipeline.stage_ids(r))


def _modules(modules: list[str]) -> str:
    """tok_embeddings, layers.0-15, norm, output: consecutive blocks as one range."""
    blocks = [int(m.split(".")[1]) for m in modules if m.startswith("layers.")]
    head = [m for m in modules if m == "tok_embeddings"]
    tail = [m for m in modules if m in ("norm", "output")]
    if blocks:
        head.append(f"layers.{blocks[0]}" if len(blocks) == 1 else f"layers.{blocks[0]}-{blocks[-1]}")
    return ", ".join(head + tail)


def _unwrapped_name(name: str) -> str:
    """A module's FQN without the AC and compile wrappers' path components."""
    return unwrapped_fqn(name)


def _order(row: tuple[str, str, int]) -> tuple[bool, str]:
    return (row[0].startswith("layers."), row[0])


def _float8_lines(model: nn.Module, linear_fqns: list[str], f8: Float8, reasons: dict[str, str]) -> list[str]:
    """Which Linears are Float8Linear, and for the others why not (read from the converted model)."""
    modules = {_unwrapped_name(n): m for n, m in model.named_modules()}  # names as before AC/compile wrapping
    status: dict[str, str] = {}
    for fqn in linear_fqns:
        module = modules[fqn]
        if is_float8_linear(module) and f8.is_mxfp8:
            status[fqn] = f"Float8 MXFP8 weight ({f8.recipe}: blocks of 32, e8m0 scales)"
        elif is_float8_linear(module) and f8.is_nvfp4:
            status[fqn] = "Float8 NVFP4Linear (emulated: e2m1 in blocks of 16, e4m3 block + float32 tensor scales)"
        elif is_float8_linear(module):
            status[fqn] = f"Float8Linear (weight scaling {module.config.cast_config_weight.scaling_granularity.value})"
        else:
            why = reasons.get(fqn) or ("float8.enable_float8_linear is off" if not f8.enable_float8_linear else "?")
            status[fqn] = f"high precision: {why}"
    n_f8 = sum(s.startswith("Float8") for s in status.values())
    recipe = f" (recipe {f8.recipe})" if f8.enable_float8_linear else ""
    policy = []
    if f8.enable_float8_linear and f8.disable_after_step:
        policy = [f"float8 policy: high precision from step {f8.disable_after_step + 1} (float8.disable_after_step)"]
    rows = [f"  {pat:<34} x{n:<4} {value}" for pat, value, n in _group(status)]
    return [f"float8: {n_f8}/{len(status)} Linears converted{recipe}", *rows, *policy]


def _tp_styles(model: nn.Module, plan: Mapping[str, object] | None) -> dict[str, str]:
    """TP style per module: the plan's style class (when the parallelize seam returns it) + weight layout."""
    styles = {k: type(v).__name__ for k, v in (plan or {}).items()}
    for name, module in model.named_modules():
        layout = _tp_layout(module)
        if layout:
            name = _unwrapped_name(name)
            styles[name] = f"{styles.get(name, '')} {layout}".strip()
    return styles


def _cp_lines(dims: ParallelDims, p: Parallelism, seq_len: int) -> list[str]:
    if not dims.cp_enabled:
        return []
    balanced = p.context_parallel_load_balancer == "headtail"
    n_chunks = 2 * dims.cp if balanced else dims.cp
    split = (
        f"{n_chunks} chunks of {seq_len // n_chunks}, rank i holds chunks i and {n_chunks - 1} - i (headtail)"
        if balanced
        else f"{n_chunks} contiguous chunks of {seq_len // n_chunks}, one per rank"
    )
    return [
        f"context parallel (cp={dims.cp}, rotate {p.context_parallel_rotate_method}): each rank holds "
        f"{seq_len // dims.cp} of every sequence's {seq_len} tokens: {split}; FSDP shards over dp_shard x cp "
        f"= {dims.dp_shard * dims.cp} ranks",
    ]


def _ac_lines(ac: ActivationCheckpoint) -> list[str]:
    if ac.mode != "selective":
        return [f"activation checkpointing: {ac.mode}" + (" (every block recomputed)" if ac.mode == "full" else "")]
    if ac.selective_ac_option != "op":
        return [f"activation checkpointing: selective, every {ac.selective_ac_option} blocks fully recomputed"]
    from parallelisms import activation_checkpoint

    save_list = getattr(activation_checkpoint, "SAC_SAVE_LIST", None)
    saved = ", ".join(sorted(str(op) for op in save_list)) if save_list else "(parallelisms has no SAC_SAVE_LIST yet)"
    return [
        "activation checkpointing: selective per-op (SAC): outputs of the save list are kept, every 2nd mm recomputed",
        f"  save list: {saved}",
    ]
