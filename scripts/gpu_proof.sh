#!/usr/bin/env bash
# The GPU proof in one command (docs/performance.md, "How to run the GPU proof"), for a lease of ~10 minutes:
# kiln's and torchtitan 0.2.2's rows of benchmarks/run.py's llama3_8b_8l preset, most important first, each
# skipped once too little of the budget is left, then the CUDA-only checks on the debug model.
#   bash scripts/gpu_proof.sh [budget seconds, default 540]      (after scripts/prepare_gpu_run.py; needs gpu_bundle/)
# Results: $OUT/results.tgz (benchmarks/run.py's results.jsonl, results.md and each row's log), $OUT/proof.log.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${1:-540}
START=$(date +%s)
OUT=${OUT:-/tmp/gpu_proof_out}
RES=/tmp/gpu_proof/results
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    gpu_bundle/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())"

left() { echo $((BUDGET - ($(date +%s) - START))); }
save() { tar czf "$OUT/results.tgz" -C "$(dirname "$RES")" --exclude=outputs "$(basename "$RES")"; }
# row ENGINE PRECISION COMPILE(on|off) AC TIMEOUT [more run.py flags]: run it if at least 60 s are left.
row() {
    local engine=$1 precision=$2 compile=$3 ac=$4 timeout=$5
    shift 5
    local room=$(($(left) - 5))
    if ((room < 60)); then
        echo "== skipped (${room}s left): $engine $precision compile=$compile ac=$ac"
        return
    fi
    ((timeout > room)) && timeout=$room
    echo "== $engine $precision compile=$compile ac=$ac (timeout ${timeout}s, $(left)s left)"
    python3 benchmarks/run.py --preset llama3_8b_8l --engine "$engine" --precision "$precision" --compile "$compile" \
        --ac "$ac" --warmup 3 --steps 6 --timeout "$timeout" --out "$RES" "$@" 2>&1 | grep -v "^all rows\|^| \|^$"
    save
}

row kiln bf16 on op 170 --profile 2
row kiln rowwise on op 170 --profile 2
row torchtitan bf16 on op 150
row torchtitan rowwise on op 150
row kiln tensorwise on op 150 --profile 2
row kiln rowwise_with_gw_hp on op 150
row kiln bf16 off op 120
row kiln bf16 on none 150
row kiln rowwise on none 150

# CUDA-only checks on the debug model: rowwise + compile with fp32 master weights, the float8-in-use checks,
# async checkpointing from pinned memory, a memory snapshot, the saved-activation report.
if (($(left) > 70)); then
    echo "== debug model CUDA checks ($(left)s left)"
    {
        timeout 60 env NGPU=1 ./run_train.sh --training.compile --float8.enable_float8_linear \
            --float8.recipe_name rowwise --activation_checkpoint.mode selective \
            --activation_checkpoint.selective_ac_option op --training.seq_len 2048 --training.local_batch_size 4 \
            --profiling.saved_activations_report --job.dump_folder "$RES/outputs/debug_report" 2>&1 | tail -30
        timeout $(($(left) - 10)) env NGPU=1 ./run_train.sh --training.steps 10 --float8.enable_float8_linear \
            --float8.recipe_name rowwise --training.compile --training.mixed_precision_param float32 \
            --checkpoint.enable --checkpoint.interval 5 --checkpoint.async_mode async_with_pinned_mem \
            --profiling.enable_memory_snapshot --job.dump_folder "$RES/outputs/debug_cuda" 2>&1 | tail -40
        find "$RES/outputs/debug_cuda" -maxdepth 3 | head -40
    } >"$RES/debug_cuda.log" 2>&1
    save
fi
python3 benchmarks/run.py --preset llama3_8b_8l --summary --out "$RES"
echo "== done after $(($(date +%s) - START))s"
