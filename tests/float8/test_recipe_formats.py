"""Each recipe's numeric format as docs/float8.md states it, pinned against torchao's own objects: the config torchao
builds for the recipe, the casts its MXFP8 training matmul makes, the scales its float8 casts compute. kiln's own
copies of these facts (the observatory's casts and scale rules, MXFP8_BLOCK for the divisibility checks) must agree
with torchao, so a torchao upgrade that changes a format fails here, not silently in the docs or the checks.

NVFP4 is emulated by kiln; its format (blocks of 16, e4m3 block scales, the per-tensor amax / (448 x 6)) is pinned
bit for bit against torchao's NVFP4Tensor in tests/float8/test_nvfp4.py::test_round_to_nearest_is_torchaos_nvfp4_tensor.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn as nn

from float8.converter import Float8Converter
from float8.numerics import cast_stats, recipe_casts
from kiln_base.config import MXFP8_BLOCK, Float8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# docs/float8.md, "Recipes": per operand (dtype, scale granularity), and whether scales are powers of two.
DOC_FORMATS: dict[str, tuple[dict[str, tuple[torch.dtype, str]], bool]] = {
    "tensorwise": ({"input": (E4M3, "tensor"), "weight": (E4M3, "tensor"), "grad_output": (E5M2, "tensor")}, False),
    "rowwise": ({"input": (E4M3, "row"), "weight": (E4M3, "row"), "grad_output": (E4M3, "row")}, True),
    "rowwise_with_gw_hp": ({"input": (E4M3, "row"), "weight": (E4M3, "row"), "grad_output": (E4M3, "row")}, True),
}


def _float8_config(recipe: str) -> Any:
    """The torchao config of a Linear kiln converted under `recipe`."""
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    Float8Converter(Float8(enable_float8_linear=True, recipe_name=recipe)).convert(model)
    return model[0].config


@pytest.mark.parametrize("recipe", list(DOC_FORMATS))
def test_float8_recipes_are_torchaos_and_the_docs(recipe: str) -> None:
    """kiln runs torchao's recipe unchanged; the dtypes, granularities and power-of-two scales the docs and the
    numerics observatory state are what torchao's config says."""
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity, ScalingType

    config = _float8_config(recipe)
    assert config == Float8LinearConfig.from_recipe_name(recipe)
    granularity = {ScalingGranularity.TENSORWISE: "tensor", ScalingGranularity.AXISWISE: "row"}
    casts = {"input": config.cast_config_input, "weight": config.cast_config_weight}
    casts["grad_output"] = config.cast_config_grad_output
    torchaos = {name: (c.target_dtype, granularity[c.scaling_granularity]) for name, c in casts.items()}
    formats, power_of_two = DOC_FORMATS[recipe]
    assert torchaos == formats
    assert config.round_scales_to_power_of_2 is power_of_two
    observatory = {name: (c.dtype, c.granularity) for name, c in recipe_casts(recipe).items()}
    assert observatory == torchaos
    # The grad_weight GEMM's operands: float8 as the others, or (rowwise_with_gw_hp) not cast at all.
    hp = recipe == "rowwise_with_gw_hp"
    for c in (config.cast_config_input_for_grad_weight, config.cast_config_grad_output_for_grad_weight):
        assert (c.scaling_type is ScalingType.DISABLED) is hp


@pytest.mark.parametrize("recipe", list(DOC_FORMATS))
def test_observatory_scales_are_torchaos(recipe: str) -> None:
    """The observatory recomputes each cast's scale (tensorwise fp8_max / amax; rowwise per row, rounded down to a
    power of two): the smallest scale and the cast error equal torchao's own float8 cast of the same tensor."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.float8_utils import tensor_to_scale

    config = _float8_config(recipe)
    torch.manual_seed(0)
    x = torch.randn(48, 64) * torch.logspace(-2, 2, 48).unsqueeze(1)  # rows four decades apart
    for name, cast in recipe_casts(recipe).items():
        axiswise = cast.granularity == "row"
        kwargs: dict[str, Any] = dict(
            scaling_granularity=ScalingGranularity.AXISWISE if axiswise else ScalingGranularity.TENSORWISE,
            axiswise_dim=-1 if axiswise else None,
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )
        scale = tensor_to_scale(x, cast.dtype, **kwargs)
        dq = hp_tensor_to_float8_dynamic(x, cast.dtype, LinearMMConfig(), **kwargs).to_original_precision()
        amax, kiln_scale, _, saturation, noise, signal = cast_stats(x, cast).tolist()
        assert kiln_scale == scale.min().item(), name
        assert noise == pytest.approx(torch.linalg.vector_norm(x - dq).item(), rel=1e-6), name
        assert saturation == 0.0 and signal == pytest.approx(torch.linalg.vector_norm(x).item(), rel=1e-6)


@pytest.mark.parametrize("recipe", ["mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp"])
def test_mxfp8_casts_are_torchaos_blocks_of_32(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What torchao's MXFP8 training matmul casts when a kiln MXFP8Linear runs forward and backward: e4m3 elements in
    blocks of MXFP8_BLOCK (32) along each GEMM's contraction dimension, e8m0 (power-of-two) scales rounded up
    (rceil), in all three GEMMs (wgrad_with_hp: two; its weight gradient is not cast)."""
    import torchao.prototype.mx_formats.mx_tensor as mx_tensor
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    to_mx = mx_tensor.to_mx  # every MXFP8 cast of the emulated kernels, dim 0 and dim 1 alike, goes through it
    signature = inspect.signature(to_mx)
    seen: list[tuple[tuple[int, ...], Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        scale, data = to_mx(*args, **kwargs)
        cast = (data.dtype, bound.arguments["block_size"], scale.dtype, bound.arguments["scaling_mode"])
        seen.append((tuple(bound.arguments["data_hp"].shape), cast))
        return scale, data

    monkeypatch.setattr(mx_tensor, "to_mx", recording)
    m, k, n = 96, 64, 128  # tokens, in_features, out_features: each contraction a different size
    model = nn.Sequential(nn.Linear(k, n, bias=False))
    Float8Converter(Float8(enable_float8_linear=True, recipe_name=recipe, emulate=True)).convert(model)
    model(torch.randn(m, k, requires_grad=True)).sum().backward()
    # (operand shape, contraction = its last dim): forward x (m, k) @ W (n, k)^T over k; grad_input dy (m, n) @ W
    # over n (W cast transposed: (k, n)); grad_weight dy^T (n, m) @ x (m, k) over m.
    shapes = [(m, k), (n, k), (m, n), (k, n)] + ([] if recipe.endswith("wgrad_with_hp") else [(n, m), (k, m)])
    assert sorted(shape for shape, _ in seen) == sorted(shapes), seen
    assert {cast for _, cast in seen} == {(E4M3, MXFP8_BLOCK, torch.float8_e8m0fnu, ScaleCalculationMode.RCEIL)}
    assert MXFP8_BLOCK == 32
