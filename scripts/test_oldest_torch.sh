#!/usr/bin/env bash
# Run kiln's tests against the oldest supported torch (2.11.0, the GPU image's) on this CPU-only machine.
#
#   bash scripts/test_oldest_torch.sh            # the tests that cover every private-API use (see below)
#   bash scripts/test_oldest_torch.sh tests      # anything pytest accepts: here the whole suite
#   bash scripts/test_oldest_torch.sh --build    # only make the venv ready (CI builds it beside the main suite)
#
# PyPI's only Linux x86_64 torch 2.11.0 wheel is the CUDA 13.0 build (530 MB); the CPU wheel lives on
# download.pytorch.org, which this machine cannot reach. The CUDA build runs on CPU, but importing it loads
# the CUDA libraries libtorch links against (cuBLAS, cuDNN, NCCL, ...), so they are installed too, from PyPI,
# without torch's exact pins: on a machine without a GPU they are only loaded, never called, and the versions
# picked are the ones this machine image keeps in its local package index (install in seconds instead of a
# 2 GB download; any machine without that index fetches the same versions from PyPI).
#
# The virtual environment is kept in $KILN_OLDEST_TORCH_VENV (default ~/.cache/kiln/venv-torch2.11, ~4 GB) and
# reused while its torch is 2.11.0 and its torchao 0.18; the first build takes ~8 minutes (download-bound).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.11.0
TORCHAO_VERSION=0.18.0
VENV=${KILN_OLDEST_TORCH_VENV:-$HOME/.cache/kiln/venv-torch${TORCH_VERSION%.*}}
# The shared libraries libtorch_cuda.so needs (ldd), at versions on PyPI with the sonames torch 2.11 expects.
CUDA_LIBS=(
    nvidia-cublas==13.1.1.3 nvidia-cudnn-cu13==9.24.0.43 nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6
    nvidia-curand==10.4.0.35 nvidia-cusparse==12.6.3.3 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7
    nvidia-nvjitlink==13.4.92 nvidia-nvshmem-cu13==3.4.5
)
# Every private torch/torchao use is in kiln_base/internals.py and test_internals.py exercises each function (its
# FSDP all-gather test on 2 ranks); the other files run the code that calls them: float8 (converter, checks, SQNR,
# FSDP float8 all-gather over gloo), parallelisms (FSDP, TP, SAC, compile), the saved-activation report, the dry
# run (fake process group), checkpoints, the hot path. Their slow and multi-process tests are left to the main
# suite (torch 2.13) to keep this leg to a few minutes; `bash scripts/test_oldest_torch.sh tests` runs everything.
INTERNALS_TESTS=(tests/kiln_base/test_internals.py tests/test_architecture.py)
CALLER_TESTS=(
    tests/float8/test_float8.py tests/float8/test_float8_checks.py tests/parallelisms/test_parallelisms.py tests/trainer/test_saved_activations.py
    tests/trainer/test_dry_run.py tests/e2e/test_measure_sac.py tests/trainer/test_observability.py tests/trainer/test_checkpoint.py
    tests/trainer/test_hot_path.py
)

ready() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as m, torch
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert m.version("torchao") == "$TORCHAO_VERSION"
import datasets, tiktoken, tensorboard, safetensors, pytest  # noqa: F401
EOF
}

if ! ready; then
    echo "building $VENV (torch $TORCH_VERSION, torchao $TORCHAO_VERSION)"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts)
    # --no-deps: torch's own requirements would pull its exact CUDA pins (2 GB more) and triton (GPU only).
    "${pip[@]}" --no-deps "torch==$TORCH_VERSION" "${CUDA_LIBS[@]}"
    "${pip[@]}" filelock "typing-extensions>=4.10" "sympy>=1.13.3" networkx jinja2 fsspec "setuptools<82" numpy
    "${pip[@]}" "torchao==$TORCHAO_VERSION" "tensorboard>=2.15" "datasets>=3.0" "tiktoken>=0.7" "safetensors>=0.4" \
        "pytest>=8"
    ready || { echo "torch $TORCH_VERSION environment in $VENV is incomplete" >&2; exit 1; }
fi

# Test-only extras added since the venv's first build (installed into an existing venv without rebuilding it).
"$VENV/bin/python" -c "import matplotlib" 2>/dev/null ||
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "matplotlib>=3.7"
"$VENV/bin/python" -c "import xdist" 2>/dev/null ||
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "pytest-xdist>=3.6"
[ "${1:-}" = "--build" ] && exit 0
"$VENV/bin/python" -c "import torch, torchao; print(f'oldest-torch leg: torch {torch.__version__}, torchao {torchao.__version__}')"
# kiln is imported from the checkout (tests put the repo root on sys.path), not installed into the venv; the
# venv's bin/ goes first on PATH so tests that start `python`/`torchrun` (run_train.sh) get torch 2.11 too.
export PATH="$VENV/bin:$PATH"
pytest=("$VENV/bin/python" -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then
    exec "${pytest[@]}" "$@"
fi
pytest+=(-n "${KILN_TEST_WORKERS:-2}" --dist loadfile)  # as the main suite (README): a file's tests on one worker
"${pytest[@]}" "${INTERNALS_TESTS[@]}"
# Left to the main suite: tracks_bf16 (20 bf16-autocast steps, minutes on a CPU without bf16 units) and the
# test_parallelisms tests that share a 2-rank job (not marked distributed; it includes a rowwise run, which torch
# 2.11's CPU kernel cannot do). test_internals.py runs the FSDP internals on 2 ranks here.
SKIP="not tracks_bf16 and not single_process and not keeps_amax_not_abs and not on_two_ranks"
"${pytest[@]}" -m "not slow and not distributed" -k "$SKIP" "${CALLER_TESTS[@]}"
