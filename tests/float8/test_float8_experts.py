"""float8 on the MoE routed experts (float8/experts.py, float8.moe_fqns) on a CPU, emulated: the padding of each
expert's rows, the emulated float8 rowwise grouped GEMM against a per-expert reference built from torchao's own
reference casts, torchao's emulated MXFP8 grouped GEMM, the conversion's count line, the first-step check, and the
config refusals. run_train.sh runs are in tests/e2e/test_float8_experts_run_train.py, EP in
tests/parallelisms/test_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from float8.checks import Float8UsageProbe
from float8.converter import Float8Converter, switch_to_high_precision
from float8.experts import LowPrecisionGroupedGemm, _EmulatedFloat8GroupedMM, is_low_precision_experts
from kiln_base.config import Float8
from kiln_base.config.checks import _check_float8_flags, check_float8_cpu, check_float8_experts, check_float8_gpus
from kiln_base.config.plan import ModelShape
from kiln_base.errors import ConfigError
from kiln_base.internals import grouped_mm
from models import ModelArgs, Transformer
from models.moe import HIGH_PRECISION, GroupedExperts, GroupedGemm, moe_layers, padded_groups, swiglu_experts
from tests.helpers.common import kiln_log_lines

ARGS = ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    vocab_size=128,
    max_seq_len=16,
    qk_norm=True,
    moe_num_experts=4,
    moe_top_k=2,
    moe_hidden_dim=64,
    moe_shared_hidden_dim=32,
)


def _f8(recipe: str = "rowwise", **kw: object) -> Float8:
    kw = {"moe_fqns": ["experts"], "filter_fqns": ["output"], "emulate": True, **kw}
    return Float8(enable_float8_linear=True, recipe_name=recipe, **kw)  # type: ignore[arg-type]


def _model(cfg: Float8 | None = None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    if cfg is not None:
        Float8Converter(cfg).convert(model)
    return model


def _loss(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len + 1), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _sqnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (20 * torch.log10(ref.norm() / (x - ref).norm())).item()


# ----------------------------------------------------------------------------- padding each expert's rows


def test_padded_groups_puts_each_experts_rows_at_a_multiple_without_reading_counts() -> None:
    counts = torch.tensor([5, 0, 17, 3])
    x = torch.randn(int(counts.sum()), 8, requires_grad=True)
    padded, offs, dest = padded_groups(x, counts, 16)
    assert padded.shape[0] % 16 == 0 and padded.shape[0] >= 16 * 5  # 16 + 0 + 32 + 16 rows needed
    assert offs.tolist()[:-1] == [16, 16, 48] and offs[-1] == padded.shape[0]  # the last group takes the spare rows
    starts = [0, 16, 16, 48]
    for e, (s, n) in enumerate(zip(starts, counts.tolist(), strict=True)):
        first = int(counts[:e].sum())
        assert torch.equal(padded[s : s + n], x[first : first + n].detach())
    kept = torch.zeros(padded.shape[0], dtype=torch.bool)
    kept[dest] = True
    assert torch.all(padded[~kept] == 0) and torch.equal(padded[dest], x.detach())
    padded[dest].sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_padded_grouped_experts_equal_unpadded() -> None:
    """Zero rows change nothing: the high-precision experts with groups padded to 16 give the same output and
    gradients as unpadded, to float32 rounding (both are ~1e-4 of the largest gradient from a float64 reference)."""

    class Padded16(GroupedGemm):
        group_multiple = 16

    torch.manual_seed(0)
    w1, w3 = (torch.randn(4, 32, 16, requires_grad=True) for _ in range(2))
    w2 = torch.randn(4, 16, 32, requires_grad=True)
    counts = torch.tensor([3, 0, 9, 4])
    x = torch.randn(16, 16)
    outs = []
    for gemm in (HIGH_PRECISION, Padded16()):
        y = swiglu_experts(x, counts, w1, w2, w3, True, gemm=gemm)
        g = torch.autograd.grad(y.square().sum(), (w1, w2, w3))
        outs.append((y, *g))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4 * b.abs().max().item(), rtol=0)


# ----------------------------------------------------------------------------- the GEMMs


def _reference_float8_grouped(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor, grad: torch.Tensor):
    """torchao's float8 rowwise grouped GEMM spelled out per expert with torchao's own reference casts
    (torchao.prototype.moe_training.utils: the per-group colwise cast of the weight gradient's operands, with its
    host loop; tensor_to_scale for the rest): (output, grad_a, grad_b_t)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training.utils import torch_to_float8_per_group_colwise

    e4m3 = torch.float8_e4m3fn

    def rowwise(x: torch.Tensor, dim: int) -> torch.Tensor:
        s = tensor_to_scale(
            x, e4m3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim, round_scales_to_power_of_2=True
        )
        return to_fp8_saturated(x * s, e4m3).float() / s

    def per_group(x: torch.Tensor) -> torch.Tensor:
        q, scales = torch_to_float8_per_group_colwise(x, offs, e4m3, round_scales_to_power_of_2=True)
        out, start = torch.empty_like(x), 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = q[start:end].float() / scales[g * x.shape[1] : (g + 1) * x.shape[1]]
            start = end
        return out

    a_q, b_fwd, b_bwd, g_q = rowwise(a, -1), rowwise(b_t, -2), rowwise(b_t, -1), rowwise(grad, -1)
    a_c, g_c = per_group(a), per_group(grad)
    out, grad_a, grad_b = torch.empty(a.shape[0], b_t.shape[2]), torch.empty_like(a), torch.empty_like(b_t)
    start = 0
    for e, end in enumerate(offs.tolist()):
        rows = slice(start, end)
        out[rows] = a_q[rows] @ b_fwd[e]
        grad_a[rows] = g_q[rows] @ b_bwd[e].T
        grad_b[e] = a_c[rows].T @ g_c[rows]
        start = end
    return out, grad_a, grad_b


def test_emulated_float8_grouped_gemm_is_torchaos_casts_per_expert() -> None:
    """kiln's emulation (no host sync) equals the per-expert reference from torchao's casts, in all three GEMMs,
    to float32 summation order; and it is float8: about 30 dB from the high-precision GEMM (e4m3's 3 mantissa bits),
    not exact."""
    torch.manual_seed(0)
    offs = torch.tensor([16, 32, 64, 80], dtype=torch.int32)  # (torchao's reference casts refuse an empty group)
    scale = torch.ones(80, 1)
    scale[32:64] = 256  # one expert's rows larger: the weight gradient's casts must scale each expert's own rows
    a = (torch.randn(80, 32) * scale).requires_grad_(True)
    b_t = torch.randn(4, 48, 32).transpose(-2, -1).requires_grad_(True)  # (E, k, n), column-major as w.transpose
    grad = torch.randn(80, 48) / scale
    out = _EmulatedFloat8GroupedMM.apply(a, b_t, offs)
    out.backward(grad)
    ref_out, ref_ga, ref_gb = _reference_float8_grouped(a.detach(), b_t.detach(), offs, grad)
    for got, ref in ((out, ref_out), (a.grad, ref_ga), (b_t.grad, ref_gb)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    exact = grouped_mm(a.detach(), b_t.detach(), offs)
    assert 25 < _sqnr(out.detach(), exact) < 40


def test_the_emulated_gemms_are_custom_ops_whose_fake_kernels_agree() -> None:
    """The emulation's three GEMMs and the first-step report are custom ops, opaque to torch.compile: torch's own
    check of each (schema, fake kernel's shapes and strides against the real one, no aliasing) passes."""
    torch.manual_seed(0)
    offs = torch.tensor([16, 32, 64, 80], dtype=torch.int32)
    a, grad = torch.randn(80, 32), torch.randn(80, 48)
    b_t = torch.randn(4, 48, 32).transpose(-2, -1)
    gemm = torch.ops.kiln.emulated_float8_grouped_mm
    for args in ((a, b_t, offs, "output"), (grad, b_t, offs, "grad_input"), (a, grad, offs, "grad_weight")):
        torch.library.opcheck(gemm, args, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kiln.low_precision_grouped_gemm_offsets, (offs,))


def test_mxfp8_grouped_gemm_runs_torchaos_emulation() -> None:
    """torchao's emulated MXFP8 grouped GEMM through the experts' gemm: float32 out, MXFP8-sized error (e4m3 with
    power-of-2 scales per 32 elements: ~30 dB) in the output and both gradients."""
    gemm = LowPrecisionGroupedGemm(_f8("mxfp8_rceil"), Float8Converter(_f8("mxfp8_rceil")).config)  # type: ignore[arg-type]
    torch.manual_seed(0)
    offs = torch.tensor([32, 32, 96, 128], dtype=torch.int32)
    a = torch.randn(128, 64, requires_grad=True)
    b_t = torch.randn(4, 64, 64).transpose(-2, -1).requires_grad_(True)
    out = gemm(a, b_t, offs)
    assert out.dtype == torch.float32
    out.backward(torch.ones_like(out))
    a2, b2 = a.detach().requires_grad_(True), b_t.detach().requires_grad_(True)
    exact = grouped_mm(a2, b2, offs)
    exact.backward(torch.ones_like(exact))
    for got, ref in ((out, exact), (a.grad, a2.grad), (b_t.grad, b2.grad)):
        assert 22 < _sqnr(got.detach(), ref.detach()) < 45


def test_mxfp8_experts_scale_each_experts_rows_alone() -> None:
    """With each expert's rows padded to 32, no MXFP8 block of the weight gradient (32 tokens) mixes two experts:
    every expert's output and gradients are what torchao computes for that expert's rows alone (with one expert's
    rows 256 times larger than its neighbours', a shared block would flush the small ones)."""
    cfg = _f8("mxfp8_rceil")
    gemm = LowPrecisionGroupedGemm(cfg, Float8Converter(cfg).config)  # type: ignore[arg-type]
    torch.manual_seed(0)
    w1, w3 = torch.randn(3, 64, 32), torch.randn(3, 64, 32)
    w2 = torch.randn(3, 32, 64)
    counts = torch.tensor([5, 40, 19])
    x = torch.randn(int(counts.sum()), 32)
    x[5:45] *= 256  # expert 1's rows: a block shared with expert 0's would take its scale from them
    ws = [w.clone().requires_grad_(True) for w in (w1, w2, w3)]
    y = swiglu_experts(x, counts, *ws, True, gemm=gemm)
    y.square().sum().backward()
    start = 0
    for e, n in enumerate(counts.tolist()):
        # expert e alone on its rows and zero rows up to 64 (torchao's MXFP8 needs whole blocks of tokens)
        alone = [w[e : e + 1].clone().requires_grad_(True) for w in (w1, w2, w3)]
        rows = torch.cat([x[start : start + n], x.new_zeros(64 - n, 32)])
        ye = swiglu_experts(rows, torch.tensor([64]), *alone, True, gemm=gemm)[:n]
        ye.square().sum().backward()
        torch.testing.assert_close(y[start : start + n], ye, atol=1e-5, rtol=1e-5)
        for w, a in zip(ws, alone, strict=True):
            torch.testing.assert_close(w.grad[e : e + 1], a.grad, atol=1e-3 * a.grad.abs().max().item(), rtol=0)
        start += n


# ----------------------------------------------------------------------------- conversion and the first step


@pytest.mark.parametrize("recipe,name", [("rowwise", "float8 rowwise"), ("mxfp8_rceil", "mxfp8_rceil")])
def test_conversion_line_counts_the_experts(recipe: str, name: str) -> None:
    with kiln_log_lines() as log:
        model = _model(_f8(recipe, filter_fqns=["output", "router.gate"]))
    line = next(line for line in log.lines if "converted" in line)
    assert f"experts: 2 of 2 run {name} grouped GEMMs (emulated) on their w1, w2, w3 (6 weights); skipped 0" in line
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert all(is_low_precision_experts(m) for m in experts)
    assert experts[0].gemm.group_multiple == (32 if recipe.startswith("mxfp8") else 16)


def test_filter_fqns_keeps_experts_high_precision() -> None:
    with kiln_log_lines() as log:
        model = _model(_f8(filter_fqns=["output", "experts"]))
    line = next(line for line in log.lines if "converted" in line)
    assert "experts: 0 of 2 run float8 rowwise" in line and "skipped 2: layers.*.moe.experts x2 (filter_fqns" in line
    assert all(m.gemm is HIGH_PRECISION for m in model.modules() if isinstance(m, GroupedExperts))
    # the first block's experts only (the name rule a Linear's)
    model = _model(_f8(filter_fqns=["output", "layers.0.moe.experts"]))
    assert [is_low_precision_experts(m) for m in moe_layers(model) for m in [m.experts]] == [False, True]


def test_moe_fqns_naming_nothing_fails() -> None:
    with pytest.raises(ConfigError, match=r"float8.moe_fqns \['expertz'\] names no routed experts"):
        _model(_f8(moe_fqns=["expertz"]))


def _first_step(model: torch.nn.Module, cfg: Float8) -> list[str]:
    probe = Float8UsageProbe(model, cfg, fsdp_enabled=False)
    with probe.during_first_step():
        _loss(model).backward()
    return probe.verify()


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8_rceil"])
def test_first_step_check_counts_the_experts_grouped_gemms(recipe: str) -> None:
    cfg = _f8(recipe)
    findings = _first_step(_model(cfg), cfg)
    what = "MXFP8" if recipe.startswith("mxfp8") else "float8 rowwise"
    assert f"float8 in use: 2/2 routed experts run {what} grouped GEMMs" in findings
    # 3 grouped GEMMs (w1, w3, w2) per MoE layer's forward
    assert f"float8 in use: emulated {what} grouped GEMMs in the first step: 6 ran" in findings


def test_first_step_check_fails_when_experts_bypass_their_gemm() -> None:
    """Converted experts that loop over F.linear (model.moe_grouped_mm false) ran no low-precision GEMM."""
    cfg = _f8()
    model = _model(cfg)
    for moe in moe_layers(model):
        moe.experts.use_grouped_mm = False
    with pytest.raises(ConfigError, match="2 routed experts have float8 rowwise grouped GEMMs but none ran"):
        _first_step(model, cfg)


def test_experts_only_float8_passes_and_all_filtered_fails() -> None:
    every_linear = ["output", "attention", "feed_forward", "router", "shared"]
    cfg = _f8(filter_fqns=every_linear)
    findings = _first_step(_model(cfg), cfg)
    assert findings[0].startswith("float8 in use: 0/") and "2/2 routed experts" in findings[1]
    cfg = _f8(filter_fqns=[*every_linear, "experts"])
    with pytest.raises(ConfigError, match="none of the 2 routed experts runs low-precision GEMMs"):
        _first_step(_model(cfg), cfg)


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8_rceil"])
def test_low_precision_experts_train_close_to_high_precision(recipe: str) -> None:
    """One step's loss and expert gradients of the converted model against the same weights in high precision."""
    hp, lp = _model(), _model(_f8(recipe, filter_fqns=["output", "attention", "feed_forward", "router", "shared"]))
    loss_hp, loss_lp = _loss(hp), _loss(lp)
    loss_hp.backward()
    loss_lp.backward()
    assert loss_lp.item() != loss_hp.item() and abs(loss_lp.item() - loss_hp.item()) < 1e-2
    for a, b in zip(moe_layers(lp), moe_layers(hp), strict=True):
        for name in ("w1", "w2", "w3"):
            assert _sqnr(getattr(a.experts, name).grad, getattr(b.experts, name).grad) > 20, name


def test_switch_to_high_precision_gives_experts_torchs_grouped_mm() -> None:
    model = _model(_f8())
    names = switch_to_high_precision(model)
    assert sum(n.endswith("moe.experts") for n in names) == 2
    assert all(m.gemm is HIGH_PRECISION for m in model.modules() if isinstance(m, GroupedExperts))


# ----------------------------------------------------------------------------- config refusals


MOE = ModelShape(
    dim=256,
    n_layers=2,
    n_heads=8,
    n_kv_heads=8,
    ffn_hidden_dim=0,
    vocab_size=2256,
    experts=8,
    top_k=2,
    expert_hidden_dim=128,
)


@pytest.mark.parametrize(
    "cfg,shape,message",
    [
        (_f8("nvfp4"), MOE, "float8.moe_fqns: the experts' grouped GEMMs have no nvfp4 recipe"),
        (_f8("rowwise_with_gw_hp"), MOE, "have no rowwise_with_gw_hp recipe"),
        (
            _f8("mxfp8_rceil"),
            ModelShape(**{**MOE.__dict__, "expert_hidden_dim": 48}),
            "need dims divisible by 32, but model.moe_hidden_dim 48 is not",
        ),
        (_f8(), ModelShape(**{**MOE.__dict__, "dim": 72}), "need dims divisible by 16, but model.dim 72 is not"),
        (_f8(), ModelShape(**{**MOE.__dict__, "experts": 0}), "model.flavor f is dense (no routed experts)"),
    ],
)
def test_config_refuses_what_the_experts_cannot_run(cfg: Float8, shape: ModelShape, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        _check_float8_flags(cfg)
        check_float8_experts(cfg, shape, "f", compile_on=False)
    assert "\n" not in str(err.value)


def test_config_refuses_moe_fqns_without_float8_or_emulation_where_needed() -> None:
    with pytest.raises(ConfigError, match="float8.moe_fqns set but float8 is off"):
        _check_float8_flags(Float8(moe_fqns=["experts"]))
    with pytest.raises(ConfigError, match="grouped GEMMs \\(the experts\\) run on CUDA only; on a CPU add"):
        check_float8_cpu(_f8(emulate=False), "2.13", cpu_rowwise=True)
    with pytest.raises(ConfigError, match="has no float8 grouped GEMM"):
        check_float8_gpus(_f8(emulate=False), [("NVIDIA L4", (8, 9))], rocm=False)
    check_float8_gpus(_f8(emulate=False), [("NVIDIA H100", (9, 0))], rocm=False)  # accepted
    check_float8_experts(_f8(), MOE, "debugmodel_moe", compile_on=False)  # accepted
