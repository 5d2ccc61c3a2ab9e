"""`--job.dry_run`: build the model on the meta device, apply float8 and the parallel plan, print the plan.

No weights are allocated and nothing is communicated: the world is simulated with torch's fake process
group, so an 8B/70B/405B plan for any mesh prints on a laptop CPU in seconds.

Simulated world size = pp x dp_replicate x max(dp_shard, 1) x cp x tp: `data_parallel_shard_degree = -1` ("the
rest") counts as 1, so a TP-only config plans a single TP group; pass an explicit
`--parallelism.data_parallel_shard_degree N` to plan FSDP over N shards as well. Under run_train.sh with NGPU (or
several nodes) set, the world is the one the launcher would start, NNODES x NGPU.

The plan is checked by the function the launcher and every rank check theirs with (trainer/build.py run_plan: the
degrees against the world, the batch, the sequence split, the TP degree against the heads, the pipeline split),
for a CUDA run: what the launcher refuses, the dry run refuses in the same line. Only the files the run reads and
the memory fit are left to the run (the dry run plans for files that may be elsewhere and prints its estimate).

It runs the same code as training: float8/'s converter (its per-Linear decisions give the reasons) and
parallelize_llama (whose returned TP plan gives the styles; each module's weight layout is read back from its
DTensor placement on the `tp` mesh dimension). An MoE's lines (total and active parameters; where the routed experts
live under expert parallelism, which borrows its ranks from dp_shard and adds none to the world) are read from the
built model's shards too: the memory per device is that of the simulated rank 0.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping

import torch.distributed as dist
import torch.nn as nn

from float8.converter import build_float8_converter, is_float8_linear
from float8.experts import is_experts, is_low_precision_experts
from kiln_base.config import (
    ActivationCheckpoint,
    Degrees,
    Float8,
    JobConfig,
    Parallelism,
    RunPlan,
    memory_estimate,
    resolve_mixed_precision,
    training_bytes,
)
from kiln_base.internals import init_fake_process_group, unwrapped_fqn
from models import moe_layers
from models.args import FAMILIES
from parallelisms.grad_reduce import reduction_line
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import StagedModel
from trainer.build import active_text, build_model, flops_line, local_params, model_args, run_plan
from trainer.checkpoint.initial_load import open_source

LLAMA3_VOCAB = 128256  # Meta's Llama 3 tokenizer: 128000 BPE ranks + 256 special tokens


def simulated_world_size(p: Parallelism) -> int:
    return (
        p.pipeline_parallel_degree
        * p.data_parallel_replicate_degree
        * max(p.data_parallel_shard_degree, 1)
        * p.context_parallel_degree
        * p.tensor_parallel_degree
    )


def _vocab_size(tokenizer_path: str, name: str, flavor: str) -> tuple[int, str]:
    if os.path.isfile(tokenizer_path):
        from trainer.components.tokenizer import Tokenizer

        return Tokenizer(tokenizer_path).n_words, tokenizer_path
    if flavor.startswith("debugmodel"):
        return 2256, f"{tokenizer_path} missing; the bundled tokenizer's size"
    published = FAMILIES[name][flavor].vocab_size if flavor in FAMILIES[name] else -1
    if published > 0:  # Qwen3's flavors carry their tokenizer's size
        return published, f"{tokenizer_path} missing; {name} {flavor}'s published vocabulary"
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


# ----------------------------------------------------------------------------- the plan


def _init_fake_world(world_size: int) -> None:
    assert not dist.is_initialized(), "the dry run simulates its own world; call it before any process group"
    init_fake_process_group(world_size)


def dry_run(cfg: JobConfig, world_size: int | None = None) -> str:
    """Build on meta under a simulated world (`world_size` ranks, else the degrees' product), apply float8 and the
    parallel plan, return the printed plan; ConfigError where the launcher would refuse the run."""
    t0 = time.perf_counter()
    p, t, ac, f8 = cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.float8
    world = world_size or simulated_world_size(p)
    _init_fake_world(world)
    try:
        vocab, vocab_source = _vocab_size(cfg.model.tokenizer_path, cfg.model.name, cfg.model.flavor)
        converter = build_float8_converter(f8, p.tensor_parallel_degree)
        path = cfg.checkpoint.initial_load_path
        source = open_source(path) if path else None  # its stored shape: from_checkpoint builds it, a flavor must match
        args = model_args(cfg.model, t.seq_len, vocab, source)
        run = run_plan(cfg, args, world, "cuda")  # the launcher's and the ranks' plan and rules, for a GPU run
        dims = ParallelDims.of(run.degrees)
        dims.build_mesh("cpu")
        pipeline = run.pipeline
        every_stage = None if pipeline is None else tuple(range(len(pipeline.stages)))  # plan them all
        built = build_model(cfg, args, dims, converter, pipeline=pipeline, stage_ids=every_stage)
        model, plan = built.model, built.tp_plan
        reasons = {d.fqn: d.reason for d in converter.decisions} if converter else {}
        float8_lines = _float8_lines(model, built.linear_fqns, f8, reasons)
        on = {True: "on", False: "off"}
        lines = [
            f"kiln dry run: {cfg.model.name} {cfg.model.flavor}, {args.n_layers} layers"
            + (f", MoE {args.moe_num_experts} experts (top {args.moe_top_k})" if args.moe else "")
            + f" (vocab {args.vocab_size}: {vocab_source})",
            f"parameters: {built.n_params:,}{active_text(built)}   seq {t.seq_len}   "
            + flops_line(built.flops_per_token_by_convention, cfg.metrics.attention_flops, args.moe),
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
            reduction_line(t, dims.dp_replicate, run.degrees.fsdp_shards, dims.tp, "cuda", dims.pp),
        ]
        if dims.tp_enabled:
            lines.append(f"tensor parallel (tp={dims.tp}, loss parallel {on[not p.disable_loss_parallel]}):")
            lines += [f"  {pat:<34} x{n:<4} {v}" for pat, v, n in sorted(_group(_tp_styles(model, plan)), key=_order)]
        lines += _cp_lines(run, p, t.seq_len)
        lines += _expert_lines(model, run.degrees)
        lines += _ac_lines(ac)
        if pipeline is None:
            mem = memory_estimate(cfg, run, local_params(model), "cuda")
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
            lines += _pipeline_lines(cfg, run, built.parts)
        state = training_bytes(args.shape(), run.degrees.param_shards, pipeline)
        whose = "a rank" if pipeline is None else "on the pipeline rank holding the most"
        lines.append(
            f"  start-up check (not applied to a dry run): {state / 2**30:,.2f} GiB of weights, gradients and AdamW "
            f"state {whose} must fit the rank's memory (host RAM on a CPU node, shared by its ranks; the GPU's)"
        )
        lines.append(f"dry run took {time.perf_counter() - t0:.1f}s; nothing was allocated or trained")
        return "\n".join(lines)
    finally:
        dist.destroy_process_group()


def _pipeline_lines(cfg: JobConfig, run: RunPlan, parts: list[nn.Module]) -> list[str]:
    """Each stage's modules and parameters, then each pipeline rank's stages and memory per device (under CP with
    the key/value buffers of the configured rotate method, as a run counts them)."""
    pipeline, t = run.pipeline, cfg.training
    assert pipeline is not None
    n, microbatch_size = len(pipeline.stages), cfg.parallelism.pipeline_parallel_microbatch_size
    lines = [
        f"pipeline: {pipeline.schedule}, {n} stages over pp {pipeline.degree} ({pipeline.stages_per_rank} per rank), "
        f"{pipeline.microbatches} micro-batches of {microbatch_size} per local batch of {t.local_batch_size}",
    ]
    for i, (modules, part) in enumerate(zip(pipeline.stages, parts, strict=True)):
        count = sum(p.numel() for p in part.parameters())  # the whole tensors' (a DTensor's numel is global)
        lines.append(f"  stage {i:<3} rank {pipeline.rank_of(i):<3} {count:>16,} params  {_modules(list(modules))}")
    lines.append(f"memory per device by pipeline rank (estimate; seq {t.seq_len}, each pp rank's TP/FSDP share):")
    totals = []
    for r in range(pipeline.degree):
        ids, in_flight = pipeline.stage_ids(r), pipeline.in_flight(r)
        mem = memory_estimate(cfg, run, local_params(StagedModel([parts[i] for i in ids])), "cuda", r)
        totals.append(sum(mem.values()))
        values = ", ".join(f"{k.split(' (')[0]} {v / 2**30:.2f}" for k, v in mem.items())
        lines.append(
            f"  pp rank {r:<3} stages {','.join(map(str, ids)):<8} {totals[-1] / 2**30:9.2f} GiB "
            f"({values} GiB; {in_flight} micro-batch{'es' * (in_flight > 1)} in flight)"
        )
    if t.memory_budget_gib is not None:  # each rank checks its own estimate at start (Trainer: check_budget)
        worst = max(range(pipeline.degree), key=lambda r: totals[r])
        fits = totals[worst] <= t.memory_budget_gib * 2**30
        lines.append(
            f"  training.memory_budget_gib {t.memory_budget_gib:g}: {'fits' if fits else 'DOES NOT FIT'} "
            f"(pipeline rank {worst} needs the most, {totals[worst] / 2**30:.2f} GiB)"
        )
    return lines


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
    experts = [m for m in model.modules() if is_experts(m)]
    if f8.enable_float8_linear and f8.moe_fqns:
        low = sum(is_low_precision_experts(m) for m in experts)
        what = f"{f8.recipe if f8.is_mxfp8 else 'float8 rowwise'} grouped GEMMs{' (emulated)' if f8.emulate else ''}"
        rows.append(f"  {'routed experts (float8.moe_fqns)':<34} x{len(experts):<4} {low} run {what}")
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


def _cp_lines(run: RunPlan, p: Parallelism, seq_len: int) -> list[str]:
    cp, balanced, n_chunks = run.sequence.cp, run.sequence.load_balance, run.sequence.n_chunks
    if cp == 1:
        return []
    split = (
        f"{n_chunks} chunks of {seq_len // n_chunks}, rank i holds chunks i and {n_chunks - 1} - i (headtail)"
        if balanced
        else f"{n_chunks} contiguous chunks of {seq_len // n_chunks}, one per rank"
    )
    return [
        f"context parallel (cp={cp}, rotate {p.context_parallel_rotate_method}): each rank holds "
        f"{seq_len // cp} of every sequence's {seq_len} tokens: {split}; FSDP shards over dp_shard x cp "
        f"= {run.degrees.fsdp_shards} ranks",
    ]


def _held(params: list[nn.Parameter]) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole tensors) of `params`."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params), sum(p.numel() for p in params)


def _expert_lines(model: nn.Module, degrees: Degrees) -> list[str]:
    """Where an MoE's routed experts live and what this (simulated) rank holds of them and of the other weights,
    read from the built model's shards: with expert parallelism each EP rank holds E / ep experts of every layer and
    FSDP splits those over efsdp = dp_shard x cp x tp / ep, the other weights over dp_shard x cp (and TP's shards);
    both over dp_shard x cp x tp ranks in all (under pipeline parallelism within each stage's ranks)."""
    layers = moe_layers(model)
    if not layers:
        return []
    experts = [p for moe in layers for p in moe.experts.parameters()]
    ids = {id(p) for p in experts}
    held, whole = _held(experts)
    rest_held, rest_whole = _held([p for p in model.parameters() if id(p) not in ids])
    w1 = layers[0].experts.w1
    n = layers[0].experts.num_experts
    local = tuple((w1.to_local() if hasattr(w1, "to_local") else w1).shape)
    if degrees.ep > 1:
        shard_ranks = f"dp_shard {degrees.dp_shard}" + "".join(
            f" x {k} {v}" for k, v in (("cp", degrees.cp), ("tp", degrees.tp)) if v > 1
        )
        where = (
            f"expert parallel: {shard_ranks} = efsdp {degrees.efsdp} x ep {degrees.ep}; each EP rank "
            f"holds {n // degrees.ep} of every MoE layer's {n} experts, FSDP-sharded over efsdp {degrees.efsdp}"
        )
    else:
        where = f"experts: {n} per MoE layer, FSDP-sharded with the other weights over {degrees.fsdp_shards} ranks"
    # The dry run builds every pipeline stage: a rank's share of each, summed (a pp rank holds its stages' part).
    who = "" if degrees.pp == 1 else f" (a share of each of the pp {degrees.pp} stages, summed)"
    return [
        f"{where} (a rank's w1: {list(local)} of {list(w1.shape)})",
        f"  parameters a rank holds{who}: {held:,} of the experts' {whole:,} (1/{whole / max(held, 1):.4g}) + "
        f"{rest_held:,} of the other weights' {rest_whole:,} (1/{rest_whole / max(rest_held, 1):.4g}) = "
        f"{held + rest_held:,}",
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
