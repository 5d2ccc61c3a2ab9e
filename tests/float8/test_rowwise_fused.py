"""float8.rowwise_fused_cast: kiln's Triton casts (float8/rowwise_kernels.py) against torchao's rowwise recipe.

The kernels run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, which Triton reads when a kernel is
decorated, so it is set before float8.rowwise_kernels is first imported; the fused Linear imports it at its first
call). Every comparison is bit for bit: the e4m3 bytes, the scales, the Linear's output and both gradients, against
torchao's own functions and Float8Linear on the same inputs. Shapes stay small: the interpreter runs each program
in Python.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from kiln_base.config import parse_args
from kiln_base.errors import ConfigError
from tests.helpers.common import needs_cpu_rowwise, run_trainer, tiny_run_args
from tests.helpers.kiln_process import run_kiln, run_python

E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter() -> Iterator[None]:
    """TRITON_INTERPRET=1 for this module's tests (and for the first import of the kernels)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import float8.rowwise_kernels  # noqa: F401  (decorated now, in interpreter mode)

    yield
    if before is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = before


def torchao_cast(t: torch.Tensor, axiswise_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's rowwise cast (e4m3, axiswise, power-of-two scales): (e4m3 data, scale)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    f8 = hp_tensor_to_float8_dynamic(
        t,
        E4M3,
        LinearMMConfig(),
        scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=axiswise_dim,
        round_scales_to_power_of_2=True,
    )
    return f8._data, f8._scale


def awkward(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows spanning 1e-30 to 1e30, a zero row, a row at the dtype's maximum, subnormal rows, a column with one
    huge value, negative zeros, and (float32) rows whose scale 448 / amax lies one ulp below a power of two."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.logspace(-30, 30, rows)[:, None]
    t[1] = 0
    t[2] = torch.finfo(dtype).max * torch.rand(cols, generator=g)
    t[2, 3] = -torch.finfo(dtype).max
    t[3] = 1e-39 * torch.randn(cols, generator=g)  # subnormal in bf16 and float32
    t[4] = torch.linspace(-1, 1, cols) * 448  # every e4m3 rounding case, ties included
    t[5, ::2] = -0.0
    t[:, 6] = 3e4 * torch.randn(rows, generator=g)
    if dtype == torch.float32:
        for row, k in ((7, 4), (8, 20), (9, -10)):  # amax the float32 above 448 2^-k: s = 2^k (1 - 2^-23)
            amax = torch.nextafter(torch.tensor(448.0 * 2.0**-k), torch.tensor(1e30))
            t[row] = torch.rand(cols, generator=g) * amax
            t[row, 0] = amax
    return t.to(dtype)


SHAPES = [(64, 96), (50, 96), (17, 300), (130, 40)]  # rows not a multiple of either kernel's block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_casts_match_torchao_bit_for_bit(shape: tuple[int, int], dtype: torch.dtype) -> None:
    from float8.rowwise_kernels import amax, cast_both, cast_cols_t, cast_rows

    t = awkward(*shape, dtype)
    row_amax, col_amax = amax(t)
    assert torch.equal(row_amax.view(torch.float32), t.float().abs().amax(1))
    assert torch.equal(col_amax.view(torch.float32), t.float().abs().amax(0))
    q, row_scale = cast_rows(t, row_amax)
    q_t, col_scale = cast_cols_t(t, col_amax)
    assert [
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(cast_both(t, row_amax, col_amax), (q, row_scale, q_t, col_scale))
    ] == [True] * 4

    ref_q, ref_scale = torchao_cast(t, -1)  # per row: [R, C] and [R, 1]
    assert q.dtype == E4M3 and q.shape == shape and q.is_contiguous()
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(row_scale, ref_scale)

    ref_q, ref_scale = torchao_cast(t, 0)  # per column: [R, C] and [1, C]; ours transposed, contiguous
    assert q_t.shape == shape[::-1] and q_t.is_contiguous()
    assert torch.equal(q_t.view(torch.uint8), ref_q.t().contiguous().view(torch.uint8))
    assert torch.equal(col_scale, ref_scale.t())


def test_scale_of_float32_just_below_a_power_of_two_follows_log2() -> None:
    """The case where rounding by exponent bits would differ from torchao's exp2(floor(log2(s))): amax one ulp
    above 448 / 16 gives s one ulp below 16, which log2 rounds to exactly 4, so torchao's scale is 16, not 8."""
    from float8.rowwise_kernels import amax, cast_rows

    big = torch.nextafter(torch.tensor(28.0), torch.tensor(1e30))
    t = torch.full((1, 16), float(big))
    ref_q, ref_scale = torchao_cast(t, -1)
    assert float(ref_scale) == 16.0
    q, scale = cast_rows(t, amax(t)[0])
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def linear_pair(bias: bool, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """torchao's rowwise Float8Linear and the same module (same weights) switched to the fused casts."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from float8.rowwise_fused import FusedRowwiseFloat8Linear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 64, bias=bias).to(dtype))
    ref = convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"))
    fused = copy.deepcopy(ref)
    fused[0].__class__ = FusedRowwiseFloat8Linear
    return ref, fused


def forward_backward(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(g)
    return [y, x.grad, *(p.grad for p in model.parameters())]


@needs_cpu_rowwise
@pytest.mark.parametrize("bias,weight_dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float32)])
def test_linear_matches_torchao_float8_linear(bias: bool, weight_dtype: torch.dtype) -> None:
    """Output, grad_input, grad_weight (and grad_bias) equal torchao's rowwise Float8Linear's bit for bit; bf16
    activations with a bf16 weight (FSDP's mixed precision) or a float32 one (one device under autocast)."""
    ref, fused = linear_pair(bias, weight_dtype)
    x = awkward(48, 96, torch.bfloat16, seed=1).reshape(2, 24, 96) / 1e20  # 48 rows of widely spread magnitudes
    g = torch.randn(2, 24, 64).to(torch.bfloat16)
    g[0, 3] = 0
    expected, got = forward_backward(ref, x, g), forward_backward(fused, x, g)
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    for name, a, b in zip(["output", "grad_input", "grad_weight", "grad_bias"], expected, got):
        assert torch.equal(a, b), name
    assert expected[0].abs().sum() > 0 and expected[2].abs().sum() > 0


def test_other_dtypes_run_torchao_forward() -> None:
    """fp16 operands are not the fused kernels' business: the module runs torchao's forward, same result."""
    ref, fused = linear_pair(False, torch.float16)
    x = torch.randn(8, 96, dtype=torch.float16)
    assert torch.equal(ref(x), fused(x))


# Compiles the kernels for an H100/H200 (sm90) as torch.compile would, without a GPU: Inductor's copy of each kernel
# module, Triton's frontend, LLVM and the bundled ptxas. In a fresh process, without TRITON_INTERPRET.
BUILD_FOR_SM90 = """
import importlib.util, pathlib, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import float8.rowwise_kernels as k
from kiln_base.internals import inductor_user_kernel_source

SIG = {"R": "i32", "C": "i32", "row_amax_ptr": "*i32", "col_amax_ptr": "*i32", "row_scale_ptr": "*fp32",
       "col_scale_ptr": "*fp32", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv"}
cases = [(k._amax_kernel, {"BLOCK_R": 64, "BLOCK_C": 128})]
cases += [(k._cast_kernel, {"BLOCK_R": 64, "BLOCK_C": 64, "ROWS": r, "COLS": c}) for r, c in ((1, 0), (0, 1), (1, 1))]
for kernel, consts in cases:
    for dtype in ("bf16", "fp32"):
        path = pathlib.Path(tempfile.mkdtemp()) / "inductor_copy.py"
        path.write_text(inductor_user_kernel_source(kernel))
        spec = importlib.util.spec_from_file_location("inductor_copy", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, kernel.__name__)
        consts = {**consts, "INTERPRETED": False}
        sig = {a: ("*" + dtype if a == "t_ptr" else "constexpr" if a in consts else SIG[a]) for a in fn.arg_names}
        where = {(fn.arg_names.index(a),): v for a, v in consts.items()}
        ptx = triton.compile(ASTSource(fn, sig, constexprs=where), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert "lg2.approx" not in ptx  # libdevice's log2, as Inductor's code for torchao calls it
        if kernel is k._cast_kernel:
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # round to nearest even
print("built", len(cases) * 2)
"""


@pytest.mark.slow  # Triton compiles 8 kernels: ~30 s
def test_kernels_build_for_the_gpu_as_torch_compile_copies_them() -> None:
    """The first version built eagerly but not under torch.compile on the H200 (`NameError: _MAX is not defined`:
    Inductor copies a jit function under its own name); this builds what Inductor would run, for sm90."""
    proc = run_python(BUILD_FOR_SM90, env={"TRITON_INTERPRET": None})
    assert proc.returncode == 0 and "built 8" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


# ----------------------------------------------------------------------------- config and training


FUSED = ["--float8.enable_float8_linear", "--float8.recipe_name", "rowwise", "--float8.rowwise_fused_cast"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--float8.rowwise_fused_cast"], "fuses the casts of recipe_name rowwise, but float8 is off"),
        (
            ["--float8.enable_float8_linear", "--float8.rowwise_fused_cast"],
            "fuses the casts of recipe_name rowwise, but float8.recipe_name is 'tensorwise'",
        ),
        ([*FUSED, "--parallelism.tensor_parallel_degree", "2"], "does not run under tensor parallelism"),
    ],
    ids=["float8_off", "tensorwise", "tp"],
)
def test_fused_cast_config_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)
    parse_args(FUSED)  # the valid combination


def test_fused_cast_on_cpu_without_interpreter_is_one_line_error() -> None:
    """The machine check, in the rank before the build: a CPU runs the kernels only in Triton's interpreter. Exit 2
    and the error as the last line, no traceback; the lines before it are the log and torchao 0.18's own import
    warnings on torch 2.13 (torchao is imported before the rank checks the machine), so assert_one_line_error's
    "nothing else on stderr" cannot hold here."""
    proc = run_kiln([*tiny_run_args(*FUSED), "--training.steps", "1"], env={"TRITON_INTERPRET": None})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kiln: error: float8.rowwise_fused_cast") and "TRITON_INTERPRET=1" in last, last
    assert sum(line.startswith("kiln: error:") for line in out.splitlines()) == 1


@pytest.mark.slow  # two 3-step runs, the fused one in the interpreter: ~40 s of CPU, minutes on a loaded machine
@needs_cpu_rowwise
def test_fused_cast_trains_like_torchao(tmp_path: Path) -> None:
    """3 steps of the debug model (float32 compute: a CPU's bf16 autocast is slow, and the Linear test above covers
    bf16 activations): the converter swaps every rowwise Float8Linear for the fused one, and the losses equal
    torchao's rowwise run exactly."""
    common = ["--float8.enable_float8_linear", "--float8.recipe_name", "rowwise", "--model.n_layers", "1"]
    common += ["--training.steps", "3"]
    ref = run_trainer(tiny_run_args(*common, "--job.dump_folder", str(tmp_path / "ref")))
    fused = run_trainer(tiny_run_args(*common, "--float8.rowwise_fused_cast", "--job.dump_folder", str(tmp_path)))
    linears = [m for m in fused.model.modules() if type(m).__name__ == "FusedRowwiseFloat8Linear"]
    assert len(linears) == 7  # wq, wk, wv, wo, w1, w2, w3 of the one block; the output layer stays bf16
    assert fused.losses == ref.losses and len(ref.losses) == 3
