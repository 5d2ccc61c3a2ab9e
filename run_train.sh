#!/usr/bin/bash
# Launch kiln with torchrun on this node.
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml)
#   NGPU         processes on this node (default: visible GPUs, else 1 CPU rank)
#   LOG_RANK     which rank(s) to show output of (default: 0)
# Extra arguments go to train.py, e.g. ./run_train.sh --training.steps 50 --float8.enable_float8_linear
set -euo pipefail
cd "$(dirname "$0")"

CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
if [ -z "${NGPU:-}" ]; then
    NGPU=$(python -c "import torch; print(torch.cuda.device_count() or 1)" 2>/dev/null || echo 1)
fi
LOG_RANK=${LOG_RANK:-0}

export LOG_RANK
# Config mistakes: one line and exit 2 here, before torchrun starts any rank.
python -c 'import sys, train; sys.exit(train.check_config(sys.argv[1:]))' --job.config_file "${CONFIG_FILE}" "$@"
exec torchrun --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
    train.py --job.config_file "${CONFIG_FILE}" "$@"
