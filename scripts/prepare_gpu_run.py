"""Prepare, on a machine with PyPI, everything a GPU run needs offline, in one folder (default gpu_bundle/).

    python scripts/prepare_gpu_run.py [--out gpu_bundle]

The GPU machine has torch 2.11.0+cu130 on Python 3.12 and many packages (KINDS.md's list, GPU_IMAGE_HAS below),
but neither torchao nor datasets, and no network. The bundle holds:

- wheels/: the missing wheels, pinned, pure Python (no binary that could mismatch the GPU's torch): kiln's
  torchao and datasets (+ dill, multiprocess), torchtitan 0.2.2 (its last TOML-era release, which runs on
  torch 2.11; 0.3.0 does not) and what it needs beyond the image (torchdata, tyro, docstring-parser,
  typeguard). Checked here: every requirement of every bundled wheel is bundled, in the image, or not needed.
- torchtitan/: a TOML config for torchtitan that matches kiln's `llama3_8b_8l` benchmark preset (Llama3 8B
  widths, 8 layers, seq 8192, local batch 1, per-op SAC, compile, bf16), the module that registers that
  8-layer flavour (`--experimental.custom_import`), kiln's tokenizer converted to Hugging Face's tokenizer.json
  (same ids as kiln's tiktoken tokenizer), kiln's corpus as the dataset, and run.sh to launch it.
- MANIFEST.txt: every file with its size and sha256.

The GPU-session commands are in docs/performance.md ("How to run the GPU proof").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> version. Pure-Python wheels only (`--platform any`).
WHEELS: dict[str, str] = {
    "torchao": "0.18.0",  # pyproject: torchao>=0.18,<0.19
    "datasets": "5.2.0",  # needs huggingface-hub>=1.31 (the image has 1.33.0)
    "dill": "0.4.1",
    "multiprocess": "0.70.19",
    "torchtitan": "0.2.2",
    "torchdata": "0.11.0",
    "tyro": "1.0.17",
    "docstring-parser": "0.18.0",
    "typeguard": "4.6.0",
}
# Requirements that need nothing on the GPU machine, and why.
NOT_NEEDED = {
    "tomli": "Python 3.12 has tomllib; torchtitan imports tomli only before 3.11",
    "eval-type-backport": "only for Python < 3.10",
}
# The GPU image's Python packages (device README KINDS.md, read 2026-11-17); torch 2.11.0, Python 3.12.3.
GPU_IMAGE_HAS = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib
    kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
    mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas
    pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
    py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
    scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
    tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
    uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)
PIP_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--platform", "any", "--only-binary=:all:"]

# kiln's `llama3_8b_8l` preset (benchmarks/run.py) in torchtitan 0.2.2's keys. Precision, AC and compile are
# set per row on the command line (run.sh); these are the shared settings.
TORCHTITAN_TOML = """\
# torchtitan 0.2.2 on the shape of kiln's `llama3_8b_8l` benchmark preset (benchmarks/run.py): Llama3 8B widths,
# 8 layers, vocab 128256, seq 8192, local batch 1, one GPU (bf16 autocast), per-op SAC, compiled model and loss.
# Written by scripts/prepare_gpu_run.py; launch with run.sh (float8 recipe as its argument).
[job]
dump_folder = "./outputs/torchtitan"
description = "kiln side-by-side: Llama3 8B widths, 8 layers"

[profiling]
enable_profiling = false

[metrics]
log_freq = 1
enable_tensorboard = false
disable_color_printing = true

[model]
name = "llama3"
flavor = "8B_8L"  # registered by kiln_flavors.py (experimental.custom_import)
hf_assets_path = "gpu_bundle/torchtitan/tokenizer"

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0
steps = 12
dataset = "c4_test"  # the local-folder loader (load_dataset(path, split="train")), fed kiln's corpus
dataset_path = "gpu_bundle/torchtitan/data"
mixed_precision_param = "bfloat16"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1

[checkpoint]
enable = false

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"

[compile]
enable = true
components = ["model", "loss"]

[quantize.linear.float8]
filter_fqns = ["output"]

[experimental]
custom_import = "kiln_flavors"
"""

KILN_FLAVORS = '''\
"""Registers torchtitan flavour "8B_8L": Llama3 8B widths with 8 layers (kiln's llama3_8b_8l benchmark shape).

Imported by torchtitan through `--experimental.custom_import kiln_flavors` (gpu_bundle/torchtitan on PYTHONPATH).
"""

import dataclasses

from torchtitan.models.llama3 import llama3_args

llama3_args["8B_8L"] = dataclasses.replace(llama3_args["8B"], n_layers=8)
'''

RUN_SH = """\
#!/usr/bin/env bash
# torchtitan 0.2.2 on kiln's llama3_8b_8l shape, one GPU. From the kiln checkout, after installing the bundle:
#   bash gpu_bundle/torchtitan/run.sh [bf16|tensorwise|rowwise|rowwise_with_gw_hp] [steps] [more torchtitan flags]
# Step lines: step, loss, memory, tps, tflops, mfu (torchtitan's format); compare the median tps of the steps
# after kiln's warm-up count with benchmarks/run.py's row of the same precision.
set -euo pipefail
cd "$(dirname "$0")/../.."
precision=${1:-bf16}
steps=${2:-12}
shift $(( $# > 2 ? 2 : $# ))
case "$precision" in
    bf16) float8=() ;;
    tensorwise|rowwise|rowwise_with_gw_hp)
        float8=(--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name "$precision") ;;
    *) echo "run.sh: unknown precision '$precision' (bf16, tensorwise, rowwise, rowwise_with_gw_hp)" >&2; exit 2 ;;
esac
export PYTHONPATH="gpu_bundle/torchtitan${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m torchtitan.train \\
    --job.config_file gpu_bundle/torchtitan/llama3_8b_8l.toml --training.steps "$steps" "${float8[@]}" "$@"
"""


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(wheels_dir: Path) -> list[Path]:
    wheels_dir.mkdir(parents=True, exist_ok=True)
    specs = [f"{n}=={v}" for n, v in WHEELS.items()]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *PIP_TARGET, "-d", str(wheels_dir)]
    subprocess.run([*cmd, *specs], check=True)
    found = sorted(wheels_dir.glob("*.whl"))
    names = {_canon(p.name.split("-")[0]) for p in found}
    missing = {_canon(n) for n in WHEELS} - names
    if missing:
        raise SystemExit(f"prepare_gpu_run: no wheel downloaded for {sorted(missing)}")
    extra = names - {_canon(n) for n in WHEELS}
    if extra:  # two versions of one package, or a stale wheel, stop the GPU-side install
        raise SystemExit(f"prepare_gpu_run: {wheels_dir} holds wheels not in the pinned list: {sorted(extra)}")
    return found


def check_closure(wheels: list[Path]) -> list[str]:
    """Every requirement (Python 3.12, Linux, no extras) of every wheel: bundled, in the GPU image, or not needed."""
    bundled = {_canon(n) for n in WHEELS}
    problems = []
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = line.split(":", 1)[1].strip()
            if "extra ==" in req or "python_version < '3.1" in req:
                continue
            name = _canon(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))
            if name not in bundled and name not in GPU_IMAGE_HAS and name not in NOT_NEEDED:
                problems.append(f"{w.name} needs {req}: neither bundled nor in the GPU image")
    return problems


def tiktoken_to_hf(model_path: Path) -> dict:
    """kiln's tiktoken BPE as a Hugging Face tokenizer.json for torchtitan (the same ids): the one kiln's HF export
    writes, without its BOS post-processor, since torchtitan adds BOS itself from tokenizer_config.json."""
    from trainer.checkpoint.hf import tokenizer_json
    from trainer.components.tokenizer import Tokenizer

    return tokenizer_json(Tokenizer(str(model_path))) | {"post_processor": None}


def write_torchtitan(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "llama3_8b_8l.toml").write_text(TORCHTITAN_TOML)
    (folder / "kiln_flavors.py").write_text(KILN_FLAVORS)
    (folder / "run.sh").write_text(RUN_SH)
    (folder / "run.sh").chmod(0o755)
    tok = folder / "tokenizer"
    tok.mkdir(exist_ok=True)
    (tok / "tokenizer.json").write_text(json.dumps(tiktoken_to_hf(ROOT / "assets" / "tokenizer" / "tokenizer.model")))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}
    (tok / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    data = folder / "data"
    data.mkdir(exist_ok=True)
    shutil.copy(ROOT / "assets" / "corpus" / "kiln_corpus.jsonl", data / "kiln_corpus.jsonl")


def manifest(out: Path) -> str:
    lines, total = [], 0
    for p in sorted(q for q in out.rglob("*") if q.is_file() and q.name != "MANIFEST.txt"):
        size = p.stat().st_size
        total += size
        lines.append(f"{size:>10}  {hashlib.sha256(p.read_bytes()).hexdigest()[:16]}  {p.relative_to(out)}")
    lines.append(f"{total:>10}  total ({total / 2**20:.1f} MiB)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "gpu_bundle")
    a = ap.parse_args(argv)
    if a.out.exists():
        shutil.rmtree(a.out)  # a stale wheel of another version would stop the install there
    wheels = download(a.out / "wheels")
    problems = check_closure(wheels)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    write_torchtitan(a.out / "torchtitan")
    text = manifest(a.out)
    (a.out / "MANIFEST.txt").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
