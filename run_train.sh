#!/usr/bin/env bash
# Launch kiln with torchrun on this node, from any directory; on several nodes, run it once on each.
#   CONFIG_FILE  TOML config (default: kiln's train_configs/debug_model.toml); --job.config_file in the arguments wins
#   NGPU         processes on this node (default: visible GPUs, else 1 CPU rank)
#   LOG_RANK     which rank(s) to show output of (default: 0)
#   NNODES, NODE_RANK, RDZV_ENDPOINT, RDZV_ID  several nodes (under SLURM taken from SLURM's variables; launch.py)
#   MAX_RESTARTS torchrun's restarts of the whole job after a rank or node fails (default: 0)
#   OMP_WAIT_POLICY  default PASSIVE: spinning OpenMP threads slowed CPU runs 3-6x on shared cores (docs/performance.md)
# Extra arguments go to train.py, e.g. ./run_train.sh --training.steps 50 --float8.enable_float8_linear
# Relative paths (CONFIG_FILE, dump folder, tokenizer, dataset) are taken from the directory you run it in;
# kiln's own configs and bundled assets are found wherever you stand. A mistake: one line, exit status 2.
set -euo pipefail
KILN_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=$(command -v python || command -v python3) || {
    echo "kiln: error: neither python nor python3 is on PATH" >&2
    exit 2
}
# launch.py checks the config for NGPU ranks, then runs torchrun in its own process (see its docstring).
exec "${PYTHON}" "${KILN_DIR}/launch.py" "$@"
