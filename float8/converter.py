"""The float8 model converter: `[float8]` config -> torchao Float8LinearConfig -> Float8Linear modules, or for
the MXFP8 recipes MXFP8TrainingOpConfig -> MXFP8Linear modules whose weight is torchao's MXFP8 training wrapper
tensor (its F.linear runs the three GEMMs in MXFP8, also on TP shards), or for nvfp4 NVFP4Linear modules (emulated
NVFP4 GEMMs, float8/nvfp4.py). "float8 Linear" below means any of them. With `float8.moe_fqns` the routed experts
named there also get low-precision grouped GEMMs (float8/experts.py).

The Trainer calls `build_float8_converter(cfg)` before anything heavy (it checks torchao and the GPU), then
`convert(model)` on the meta-device model before parallelisation, and `post_optimizer_hook(model)` after each
optimizer step. torchao is imported only inside these calls.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from float8.environment import check_float8_environment
from float8.experts import LowPrecisionGroupedGemm, is_low_precision_experts
from float8.nvfp4 import nvfp4_linear
from kiln_base.config import Float8
from kiln_base.errors import ConfigError
from kiln_base.internals import disable_torch_function_subclass, local_tensor_or_self, skip_torchao_triton_min_max_patch
from models.moe import HIGH_PRECISION, GroupedExperts

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig

logger = logging.getLogger("kiln")


_MXFP8_WEIGHT = "MXFP8TrainingWeightWrapperTensor"


def is_mxfp8_weight(weight: torch.Tensor | None) -> bool:
    """Whether a weight (plain, or the local tensor of a DTensor) is torchao's MXFP8 training wrapper tensor."""
    return weight is not None and type(local_tensor_or_self(weight)).__name__ == _MXFP8_WEIGHT


def is_float8_linear(module: nn.Module) -> bool:
    """Whether `module` runs its matmuls in low precision: torchao's Float8Linear, an MXFP8Linear with its MXFP8
    training weight, or an NVFP4Linear. Never imports torchao to ask. A Linear switched to high precision answers
    False."""
    if isinstance(module, NVFP4Linear):
        return True
    if isinstance(module, MXFP8Linear):
        return is_mxfp8_weight(module.weight)
    return type(module).__name__ == "Float8Linear"


class MXFP8Linear(nn.Linear):
    """An nn.Linear whose weight is torchao's MXFP8 training wrapper tensor: F.linear reaches the wrapper's
    `__torch_function__`, which runs the three GEMMs in MXFP8 (torchao's `_to_mxfp8_then_scaled_mm`).

    Under TP the weight is a DTensor around the wrapper. DTensor has no `__torch_function__`: it decomposes F.linear
    and hands aten.mm to the local tensors, whose dispatch unwraps to a plain matmul, so the wrapper would silently
    run high precision (torchao 0.18; pytorch/ao#4010 reverses the nesting upstream). Here the matmul runs on the
    local shards instead, where the wrapper sees F.linear, and the result becomes a DTensor again
    (`linear_on_local_shards`). The TP styles around the module are torch's own ColwiseParallel/RowwiseParallel.

    torchao's wrapper ignores F.linear's bias (0.18), so the bias is added here, outside the MXFP8 matmul.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        out = linear_on_local_shards(x, w) if isinstance(w, DTensor) else F.linear(x, w)
        return out if self.bias is None else out + self.bias


class NVFP4Linear(nn.Linear):
    """An nn.Linear whose three GEMMs run emulated NVFP4 (float8/nvfp4.py); same parameters, plain tensors.

    Under TP the matmul runs on the local shards (`linear_on_local_shards`, as for MXFP8): each rank scales its own
    shard's blocks of 16 (`decide` asks for 16 x tp_degree) and takes its shard's amax for the per-tensor scale.
    torchao's NVFP4 TP path all-reduces that amax; here each TP rank's per-tensor scale is its shard's, so TP
    numerics differ from one process's in the rounding of the e4m3 block scales.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        out = linear_on_local_shards(x, w, nvfp4_linear) if isinstance(w, DTensor) else nvfp4_linear(x, w)
        return out if self.bias is None else out + self.bias


LocalLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def linear_on_local_shards(x: torch.Tensor, weight: DTensor, linear: LocalLinear = F.linear) -> DTensor:
    """linear(x, weight) computed from each rank's shards, with the placements DTensor's own sharded matmul gives.

    Per mesh dim: a colwise weight (Shard(0), out_features split) needs all of x and gives out Shard(-1); x's
    gradient is then a partial sum over ranks. A rowwise weight (Shard(1), in_features split) needs x split the same
    way (Shard(-1)) and gives a partial sum (Partial, reduced by RowwiseParallel's output redistribution). Each rank
    scales whole blocks (MXFP8 32, NVFP4 16) of its own shard, as one process would: the decision asks that every dim
    split by TP divide into whole blocks per rank (`decide`), so MXFP8 matches one process up to summation order.
    """
    assert isinstance(x, DTensor), f"a TP-sharded block-scaled Linear got a {type(x).__name__} input, not a DTensor"
    last = x.ndim - 1
    # weight placement -> (what x must be, what the output is, what x's gradient is)
    rules: dict[Placement, tuple[Placement, Placement, Placement]] = {
        Shard(0): (Replicate(), Shard(last), Partial()),
        Shard(1): (Shard(last), Partial(), Shard(last)),
    }
    # The TP plan makes every Linear colwise or rowwise; FSDP's dim is all-gathered before forward.
    assert all(p in rules for p in weight.placements), f"block-scaled Linear weight placements {weight.placements}"
    want, out, x_grad = zip(*(rules[p] for p in weight.placements))
    x = x.redistribute(placements=want)  # a no-op under kiln's plan: the TP styles already deliver these layouts
    y = linear(x.to_local(grad_placements=x_grad), weight.to_local())
    return DTensor.from_local(y, weight.device_mesh, out, run_check=False)


class HighPrecisionLinear(nn.Linear):
    """A float8 Linear switched to high precision (float8.disable_after_step): the same parameters, a plain matmul.

    Torch-function subclass handling is off for the call, so an MXFP8 weight wrapper does not route F.linear to
    its MXFP8 matmul; below, at dispatch, every torchao weight wrapper (MXFP8, float8 all-gather) unwraps to its
    high-precision tensor, and DTensor still runs the sharded matmul.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with disable_torch_function_subclass():
            return F.linear(x, self.weight, self.bias)


def switch_to_high_precision(model: nn.Module) -> list[str]:
    """Make every float8 Linear a HighPrecisionLinear and give low-precision experts the high-precision grouped GEMM,
    in place (parameters, hooks, FSDP and TP untouched); return their names. Compiled blocks recompile once: dynamo
    guards on the module's class."""
    names = []
    for fqn, module in model.named_modules():
        if is_float8_linear(module):
            module.__class__ = HighPrecisionLinear
            names.append(fqn)
        elif is_low_precision_experts(module):
            module.gemm = HIGH_PRECISION  # the experts' grouped GEMMs back to torch._grouped_mm
            names.append(fqn)
    return names


class PrecisionSchedule:
    """float8.disable_after_step S: from step S + 1 on, every float8 Linear runs in high precision (the end of
    training), by a switch of the modules' class that keeps parameters, FSDP and TP as they are.

    The switch depends only on the step, so a run resumed past S switches before its first step: the checkpoint
    needs no extra state. Compiled blocks recompile once at the switch (dynamo guards on module classes)."""

    def __init__(self, model: nn.Module, after_step: int, total_steps: int) -> None:
        self.model, self.after, self.switched = model, after_step, False
        if after_step < total_steps:
            logger.info(
                f"float8 policy: float8 Linears switch to high precision after step {after_step} of {total_steps}"
            )

    def before_step(self, step: int) -> None:
        if not self.switched and step > self.after:
            self.switched = True
            experts = sum(is_low_precision_experts(m) for m in self.model.modules())
            names = switch_to_high_precision(self.model)
            also = f" and {experts} routed experts" if experts else ""
            logger.info(
                f"float8 policy: step {step}: {len(names) - experts} float8 Linears{also} now run in high precision "
                f"(float8.disable_after_step {self.after})"
            )


class LinearDecision(NamedTuple):
    """Whether one nn.Linear became a Float8Linear; `reason` says why not ("" when converted)."""

    fqn: str
    converted: bool
    reason: str


def too_small_to_gain(recipe: str, in_features: int, out_features: int) -> str | None:
    """torchao's auto-filter thresholds (`_auto_filter_for_recipe`, torchao 0.18): GEMMs measured on H100 to
    run no faster in float8 than in bf16, because the casts cost more than the smaller matmul saves.

    K = in_features, N = out_features. Returns the reason to skip, or None. rowwise_with_gw_hp has no
    torchao thresholds; it runs the rowwise forward/grad_input GEMMs plus a bf16 grad_weight GEMM, so it
    gains at most what rowwise gains and the rowwise thresholds apply.
    """
    k, n = in_features, out_features
    if recipe == "tensorwise":
        small = k <= 4096 and n <= 1024
        rule = "K<=4096 and N<=1024"
    else:
        small = n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
        rule = "N<=2048, K<=1024, or N<=4096 and K<=2048"
    return f"auto filter: {recipe} GEMM K={k} N={n} too small to gain ({rule})" if small else None


_BLOCK_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def kept_high_precision(fqn: str, cfg: Float8, n_layers: int) -> str | None:
    """Why a module (a Linear, or routed experts) stays high precision by name: named in filter_fqns, or in the
    first/last blocks kept high precision (high_precision_first_last, then high_precision_last: nvfp4 keeps the last
    15% by default); None when neither."""
    matched = [f for f in cfg.filter_fqns if f in fqn]
    if matched:
        return f"filter_fqns '{matched[0]}'"
    first_last, last, block = cfg.high_precision_first_last, cfg.high_precision_last_blocks(n_layers), None
    found = _BLOCK_INDEX.search(fqn)
    if found:
        block = int(found.group(1))
    if block is not None and first_last and (block < first_last or block >= n_layers - first_last):
        return f"high_precision_first_last {first_last} (block {block} of {n_layers})"
    if block is not None and last and block >= n_layers - last:
        default = f"; {cfg.recipe}'s default: the last 15%" if cfg.high_precision_last < 0 else ""
        blocks = f"block {n_layers - 1}" if last == 1 else f"blocks {n_layers - last}-{n_layers - 1}"
        return f"high_precision_last {last} ({blocks} of {n_layers}{default})"
    return None


def decide_experts(fqn: str, cfg: Float8, n_layers: int) -> LinearDecision:
    """Low-precision grouped GEMMs or not for one experts module named by float8.moe_fqns: the same name rules as
    a Linear's (filter_fqns, the first/last blocks); their dims were checked at start-up (checks.py)."""
    kept = kept_high_precision(fqn, cfg, n_layers)
    return LinearDecision(fqn, not kept, kept or "")


def decide(fqn: str, linear: nn.Linear, cfg: Float8, n_layers: int = 0, tp_degree: int = 1) -> LinearDecision:
    """Float8 or not for one Linear, in order: named in filter_fqns, in the first/last blocks kept high precision
    (high_precision_first_last, then high_precision_last: nvfp4 keeps the last 15% by default), dims not divisible
    by 16 (block-scaled recipes: by their block, 32 or 16, times tp_degree, since each rank scales its own shard's
    blocks and TP splits one of the two dims), too small."""
    kept = kept_high_precision(fqn, cfg, n_layers)
    if kept:
        return LinearDecision(fqn, False, kept)
    k, n = linear.in_features, linear.out_features
    scaled = cfg.block_size  # block-scaled recipes: blocks along K (and along N for the grad_input GEMM)
    multiple = scaled * tp_degree if scaled else 16
    if k % multiple or n % multiple:  # torch._scaled_mm needs both GEMM dims divisible by 16
        per_rank = f" ({scaled} per rank x tensor_parallel_degree {tp_degree})" if scaled and tp_degree > 1 else ""
        return LinearDecision(fqn, False, f"in/out features {k}/{n} not divisible by {multiple}{per_rank}")
    if cfg.auto_filter_small_kn:
        reason = too_small_to_gain(cfg.recipe, k, n)
        if reason:
            return LinearDecision(fqn, False, reason)
    return LinearDecision(fqn, True, "")


def float8_linear_config(cfg: Float8) -> Float8LinearConfig:
    """The torchao config: the named recipe (default tensorwise) plus the all-gather and emulate flags."""
    from torchao.float8 import Float8LinearConfig

    base = Float8LinearConfig.from_recipe_name(cfg.recipe)
    # validate_float8 has already refused the all-gather with anything but tensorwise scaling.
    return dataclasses.replace(
        base, enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather, emulate=cfg.emulate
    )


def mxfp8_training_config(cfg: Float8) -> MXFP8TrainingOpConfig:
    """torchao's MXFP8 recipe; with `emulate`, its EMULATED kernel preference (plain-PyTorch casts and a
    dequantised high-precision matmul: any device, same rounding)."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization.quantize_.common import KernelPreference

    base = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(cfg.recipe))
    return dataclasses.replace(base, kernel_preference=KernelPreference.EMULATED) if cfg.emulate else base


def _as_linear(linear: nn.Module, cls: type[nn.Linear]) -> nn.Linear:
    """A `cls` (MXFP8Linear, NVFP4Linear) holding `linear`'s own parameters (built on meta: nothing allocated,
    nothing initialised)."""
    assert type(linear) is nn.Linear, f"{type(linear).__name__} is not an nn.Linear"
    with torch.device("meta"):
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
    new.weight, new.bias = linear.weight, linear.bias
    return new


def prepare_cpu_float8() -> None:
    """Without CUDA, before torchao's float8 training runs (kiln's build, and scripts or tests that convert with
    torchao directly): torch's own CPU float8 matmul instead of oneDNN's, process-wide. oneDNN's took 0.49 s for a
    256^3 matmul on a Xeon with amx_bf16 where torch's took 6.7 ms (torch 2.13, 2026-11-28)."""
    if torch.cuda.is_available():
        return
    skip_torchao_triton_min_max_patch()  # a GPU-only codegen fix whose import costs 0.7 s per rank
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a ContextProp: set as a bool


def _cast_input_to_autocast_dtype(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook: Float8Linear honours only CUDA autocast when casting its input. Under CPU autocast
    the input stayed fp32 while grad_output came back bf16, and rowwise_with_gw_hp's high-precision
    grad_weight GEMM failed on the dtype mismatch. Cast as F.linear would under any device's autocast."""
    (x,) = args
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return (x.to(torch.get_autocast_dtype(device_type)),)
    return None


def _why(decisions: list[LinearDecision]) -> str:
    """': <names> (<reason>); ...' for the decisions not converted, '' when all were."""
    skipped: dict[str, list[str]] = {}
    for d in decisions:
        if not d.converted:
            skipped.setdefault(d.reason, []).append(d.fqn)
    why = "; ".join(f"{_summarise(fqns)} ({reason})" for reason, fqns in skipped.items())
    return f": {why}" if why else ""


def _summarise(fqns: list[str]) -> str:
    """'layers.*.attention.wk x6' instead of six names: one short line even for 126-layer models."""
    counts = Counter(re.sub(r"\.\d+\.", ".*.", f) for f in fqns)
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in counts.items())


class Float8Converter:
    """Swaps the selected nn.Linear modules for torchao Float8Linear (MXFP8: MXFP8Linear with torchao's weight wrapper);
    runs the FSDP amax precompute hook."""

    def __init__(self, cfg: Float8, tp_degree: int = 1) -> None:
        self.cfg = cfg
        self.tp_degree = tp_degree
        self.recipe = cfg.recipe
        self.decisions: list[LinearDecision] = []  # filled by convert(); the dry run prints them
        self.expert_decisions: list[LinearDecision] = []  # the experts named by float8.moe_fqns

    @functools.cached_property
    def config(self) -> Float8LinearConfig | MXFP8TrainingOpConfig | None:
        """torchao's config of the recipe, built (torchao imported) at first use. nvfp4 has none: kiln's NVFP4Linear
        runs torchao's numerics emulated (float8/nvfp4.py)."""
        cfg = self.cfg
        return mxfp8_training_config(cfg) if cfg.is_mxfp8 else None if cfg.is_nvfp4 else float8_linear_config(cfg)

    def convert(self, model: nn.Module) -> None:
        """Convert in place (meta device is fine: only shapes are read); log one summary line."""
        # The experts named by float8.moe_fqns are looked up before torchao is first imported: its import prints
        # warnings on stderr (C extensions it cannot load, a deprecated pytree registration), which must not
        # precede a refusal's one line.
        experts = self._named_experts(model) if self.cfg.moe_fqns else []
        from torchao.float8 import convert_to_float8_training

        n_layers = len(getattr(model, "layers", ()))
        self.decisions = [
            decide(fqn, mod, self.cfg, n_layers, self.tp_degree if self.cfg.block_size else 1)
            for fqn, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and not is_float8_linear(mod)
        ]
        chosen = {d.fqn for d in self.decisions if d.converted}
        if self.cfg.is_nvfp4:
            for fqn in chosen:
                model.set_submodule(fqn, _as_linear(model.get_submodule(fqn), NVFP4Linear))
        elif self.cfg.is_mxfp8:
            from torchao.quantization import quantize_

            for fqn in chosen:
                model.set_submodule(fqn, _as_linear(model.get_submodule(fqn), MXFP8Linear))
            quantize_(model, self.config, filter_fn=lambda mod, fqn: fqn in chosen)
        else:
            prepare_cpu_float8()
            convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn in chosen, config=self.config)
        for fqn, mod in model.named_modules():
            if fqn in chosen:
                assert is_float8_linear(mod), fqn
                mod.register_forward_pre_hook(_cast_input_to_autocast_dtype)

        experts_line = self._convert_experts(experts, n_layers) if experts else ""

        on = [("fsdp float8 all-gather", self.cfg.enable_fsdp_float8_all_gather), ("emulate", self.cfg.emulate)]
        flags = "".join(f" + {name}" for name, enabled in on if enabled)
        into = "MXFP8 weights" if self.cfg.is_mxfp8 else "NVFP4Linear" if self.cfg.is_nvfp4 else "Float8Linear"
        logger.info(
            f"float8 {self.recipe}{flags}: converted {len(chosen)} of {len(self.decisions)} Linears to {into}; "
            f"skipped {len(self.decisions) - len(chosen)}" + _why(self.decisions) + experts_line
        )

    def _named_experts(self, model: nn.Module) -> list[tuple[str, GroupedExperts]]:
        """The routed experts float8.moe_fqns names; ConfigError when it names none."""
        named = [
            (fqn, mod)
            for fqn, mod in model.named_modules()
            if isinstance(mod, GroupedExperts) and any(f in fqn for f in self.cfg.moe_fqns)
        ]
        if not named:
            raise ConfigError(
                f"float8.moe_fqns {self.cfg.moe_fqns} names no routed experts of the model (an MoE model's are "
                'layers.<i>.moe.experts; e.g. float8.moe_fqns = ["experts"])'
            )
        return named

    def _convert_experts(self, named: list[tuple[str, GroupedExperts]], n_layers: int) -> str:
        """Give the routed experts named by float8.moe_fqns (and not kept high precision) torchao's scaled grouped
        GEMMs (float8/experts.py); the summary line's part about them."""
        self.expert_decisions = [decide_experts(fqn, self.cfg, n_layers) for fqn, _ in named]
        mxfp8 = self.config if self.cfg.is_mxfp8 else None
        gemm = LowPrecisionGroupedGemm(self.cfg, mxfp8)
        for (_, mod), d in zip(named, self.expert_decisions, strict=True):
            if d.converted:
                mod.gemm = gemm
        n = sum(d.converted for d in self.expert_decisions)
        return (
            f"; experts: {n} of {len(named)} run {gemm.name} grouped GEMMs"
            + (" (emulated)" if gemm.emulated else "")
            + f" on their w1, w2, w3 ({3 * n} weights); skipped {len(named) - n}"
            + _why(self.expert_decisions)
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """After optimizer.step(): one all-reduce of every float8-all-gathered weight's amax, so FSDP casts
        each weight shard with the global scale without a collective per Linear in the next forward.

        torchao's function only touches Float8Linear weights that are FSDP DTensors of its float8 weight
        subclass, so it is a no-op on a model without FSDP-sharded float8 weights.
        """
        if not self.cfg.precompute_float8_dynamic_scale_for_fsdp:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model if isinstance(model, list) else [model]:
            precompute_float8_dynamic_scale_for_fsdp(part)


def build_float8_converter(cfg: Float8, tp_degree: int = 1) -> Float8Converter | None:
    """None when float8 is off; otherwise check torchao and the GPUs first (ConfigError, exit 2). `tp_degree`:
    block-scaled Linears need whole blocks (MXFP8 32, NVFP4 16) in each rank's shard."""
    if not cfg.enable_float8_linear:
        return None
    check_float8_environment(cfg)
    return Float8Converter(cfg, tp_degree)
