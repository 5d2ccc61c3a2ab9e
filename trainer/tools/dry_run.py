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

import torch.distributed as dist
import torch.nn as nn

from float8.converter import build_float8_converter, is_float8_linear
from kiln_base.config import (
    ActivationCheckpoint,
    Float8,
    JobConfig,
    Parallelism,
    Training,
    check_sequence_split,
    resolve_mixed_precision,
    training_bytes,
)
from kiln_base.internals import init_fake_process_group, unwrapped_fqn
from models.args import ModelArgs, ffn_hidden_dim
from parallelisms.grad_reduce import reduction_line
from parallelisms.parallel_dims import ParallelDims
from trainer.build import build_model, flops_line, model_args
from trainer.components.initial_load import open_source

LLAMA3_VOCAB = 128256  # Meta's Llama 3 tokenizer: 128000 BPE ranks + 256 special tokens


def simulated_world_size(p: Parallelism) -> int:
    shard = max(p.data_parallel_shard_degree, 1)
    return p.data_parallel_replicate_degree * shard * p.context_parallel_degree * p.tensor_parallel_degree


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
    """
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    cp, tp = parallel_dims.cp, parallel_dims.tp
    tokens = training.local_batch_size * training.seq_len // cp
    per_layer = _activation_elems_per_token_layer(args, ac) * 2 / tp
    logits = 6 * args.vocab_size / tp
    estimate = {
        "params (fp32)": 4 * local,
        "grads (fp32)": 4 * local,
        "optimizer (AdamW m+v fp32)": 8 * local,
        "activations (one micro-batch)": int(tokens * (args.n_layers * per_layer + logits)),
    }
    if cp > 1:
        kv = 2 * args.dim // args.n_heads * (args.n_kv_heads or args.n_heads) // tp  # k and v elements per token
        held = cp if rotate_method == "allgather" else 2  # ranks' keys/values held at once
        estimate["CP key/value buffers (one block)"] = tokens * held * kv * (2 + 4)
    return estimate


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
        )
        dims.build_mesh("cpu")
        vocab, vocab_source = _vocab_size(cfg.model.tokenizer_path, cfg.model.flavor)
        converter = build_float8_converter(f8, p.tensor_parallel_degree)
        path = cfg.checkpoint.initial_load_path
        source = open_source(path) if path else None  # its stored shape: from_checkpoint builds it, a flavor must match
        built = build_model(cfg, model_args(cfg.model, t.seq_len, vocab, source), dims, converter)
        model, args, plan = built.model, built.args, built.tp_plan
        reasons = {d.fqn: d.reason for d in converter.decisions} if converter else {}
        n_params = built.n_params
        float8_lines = _float8_lines(model, built.linear_fqns, f8, reasons)
        on = {True: "on", False: "off"}
        lines = [
            f"kiln dry run: llama3 {cfg.model.flavor}, {args.n_layers} layers "
            f"(vocab {args.vocab_size}: {vocab_source})",
            f"parameters: {n_params:,}   seq {t.seq_len}   "
            + flops_line(built.flops_per_token_by_convention, cfg.metrics.attention_flops),
            f"simulated world: {world} = dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}"
            + (f" x cp {dims.cp}" if dims.cp_enabled else "")
            + f" x tp {dims.tp}",
            f"mesh: {dict(zip(dims.mesh.mesh_dim_names or (), dims.mesh.shape))}  (FSDP {on[dims.fsdp_enabled]}, "
            f"HSDP {on[dims.dp_replicate_enabled]}, CP {on[dims.cp_enabled]}, TP {on[dims.tp_enabled]})",
            *float8_lines,
            f"mixed precision: {resolve_mixed_precision(t.mixed_precision_param, 'cuda')} compute on a GPU, "
            f"{resolve_mixed_precision(t.mixed_precision_param, 'cpu')} on a CPU (training.mixed_precision_param = "
            f"{t.mixed_precision_param}); master weights float32",
            reduction_line(t, dims.dp_replicate, dims.dp_shard * dims.cp, dims.tp, "cuda"),
        ]
        if dims.tp_enabled:
            lines.append(f"tensor parallel (tp={dims.tp}, loss parallel {on[not p.disable_loss_parallel]}):")
            lines += [f"  {pat:<34} x{n:<4} {v}" for pat, v, n in sorted(_group(_tp_styles(model, plan)), key=_order)]
        lines += _cp_lines(dims, p, t.seq_len)
        lines += _ac_lines(ac)
        mem = memory_estimate(model, args, t, ac, dims, p.context_parallel_rotate_method)
        per_rank = f" / cp {dims.cp} = {t.seq_len // dims.cp} tokens" if dims.cp_enabled else ""
        lines.append(f"memory per device (estimate; local batch {t.local_batch_size} x seq {t.seq_len}{per_rank}):")
        unit, size = ("GiB", 2**30) if sum(mem.values()) >= 2**30 else ("MiB", 2**20)  # small models: MiB
        lines += [f"  {k:<32} {v / size:9.2f} {unit}" for k, v in mem.items()]
        lines.append(f"  {'total':<32} {sum(mem.values()) / size:9.2f} {unit}")
        if t.memory_budget_gib is not None:
            fits = sum(mem.values()) <= t.memory_budget_gib * 2**30
            lines.append(f"  training.memory_budget_gib {t.memory_budget_gib:g}: {'fits' if fits else 'DOES NOT FIT'}")
        state = training_bytes(args.shape(), dims.dp_shard * dims.cp * dims.tp)
        lines.append(
            f"  start-up check (not applied to a dry run): {state / 2**30:,.2f} GiB a rank of weights, gradients and "
            "AdamW state must fit the rank's memory (host RAM on a CPU node, shared by its ranks; the GPU's)"
        )
        lines.append(f"dry run took {time.perf_counter() - t0:.1f}s; nothing was allocated or trained")
        return "\n".join(lines)
    finally:
        dist.destroy_process_group()


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
