#!/usr/bin/env bash
# GPU speed work (issue 42) in budgeted parts, each one device command (docs/performance.md, "GPU figures, part two"):
#   bash scripts/gpu_speed.sh diag  [budget s]   optimizer kernels; bf16 and tensorwise profiles with their top
#                                                kernels and Inductor's generated code; an Inductor tuning row
#   bash scripts/gpu_speed.sh rows  [budget s]   rows with and without inductor's tiled reductions, their loss
#                                                curves, torchtitan's missing rows, CUDA graphs, flex vs causal, a
#                                                longer kiln-vs-torchtitan run, the compiled saved-activation report
#   bash scripts/gpu_speed.sh moe   [budget s]   the MoE preset qwen3_30b_a3b_4l (Qwen3-30B-A3B widths, 4 layers,
#                                                seq 4096, compiled, per-op SAC): bf16, Linear-only float8 rowwise,
#                                                MXFP8 on a Blackwell GPU (capability 10+), then bf16 eager
#   bash scripts/gpu_speed.sh check              on any machine, no GPU: every MoE preset row's dry run (it parses,
#                                                builds on meta and fits), before spending device time on it
# Needs gpu_bundle/ (python scripts/prepare_gpu_run.py). Results: $OUT/<part>.tgz and the printed tables.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?diag, rows, moe or check}
BUDGET=${2:-240}
if [[ $PART == check ]]; then
    exec python3 benchmarks/run.py --preset qwen3_30b_a3b_4l --check
fi
START=$(date +%s)
OUT=${OUT:-/tmp/gpu_speed_out}
RES=/tmp/gpu_speed/$PART
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    gpu_bundle/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, torchao, triton; print('torch', torch.__version__, 'torchao', torchao.__version__, 'triton', triton.__version__)"

left() { echo $((BUDGET - ($(date +%s) - START))); }
save() { tar czf "$OUT/$PART.tgz" -C "$(dirname "$RES")" --exclude=outputs "$(basename "$RES")"; }
# step NAME MIN_SECONDS COMMAND...: run it if at least MIN_SECONDS of the budget are left (each command bounds
# its own time: run.py's --timeout, `timeout`), keep its log, and save the results folder.
step() {
    local name=$1 need=$2
    shift 2
    local room=$(($(left) - 3))
    if ((room < need)); then
        echo "== skipped $name (${room}s left, needs ${need})"
        return
    fi
    echo "== $name ($(left)s left)"
    "$@" 2>&1 | grep -v "^all rows\|^$\|Warning\|warn(" | tee "$RES/$name.log" | tail -45
    save
}
# row OUTDIR PRECISION [run.py flags]: one llama3_8b_8l row, 2 warm-up, 2 measured and 2 profiled steps, killed
# at 150 s or at the budget's end.
row() {
    local out=$1 precision=$2
    shift 2
    local room=$(($(left) - 5))
    python3 benchmarks/run.py --preset llama3_8b_8l --precision "$precision" --warmup 2 --steps 2 --profile 2 \
        --timeout $((room < 150 ? room : 150)) --out "$RES/$out" "$@"
}

if [[ $PART == diag ]]; then
    step optimizer 40 timeout 90 python3 benchmarks/optimizer_step.py --flavor 8B --n-layers 8 --vocab-size 128256 \
        --steps 5
    export TORCHINDUCTOR_CACHE_DIR=$RES/inductor_tensorwise
    step tensorwise 50 row base tensorwise
    export TORCHINDUCTOR_CACHE_DIR=$RES/inductor_bf16
    step bf16 45 row base bf16
    unset TORCHINDUCTOR_CACHE_DIR
    export TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1
    step tensorwise_cdt 60 row cdt tensorwise
    unset TORCHINDUCTOR_COORDINATE_DESCENT_TUNING
    # Inductor's generated code of the tensorwise block (its forward and backward graphs), for reading later
    find "$RES" -path '*inductor_*' -name '*.py' -size -3M | tar czf "$OUT/inductor_code.tgz" -T - 2>/dev/null
    rm -rf "$RES"/inductor_*
    save
fi
NO_TILES=(-- --bench.inductor triton.tile_reductions=false --bench.inductor triton.prefer_nd_tiling=false)
# loss NAME ARGS...: the debug model (seq 2048, batch 4, compiled) for 100 steps, every step logged
loss() {
    local name=$1
    shift
    timeout 90 python3 benchmarks/row.py --job.config_file train_configs/debug_model.toml --training.steps 100 \
        --training.seq_len 2048 --training.local_batch_size 4 --training.compile --metrics.log_freq 1 \
        --job.dump_folder "$RES/outputs/loss_$name" "$@" >"$RES/loss_$name.log" 2>&1
    tail -2 "$RES/loss_$name.log"
}
if [[ $PART == rows ]]; then
    step rowwise_no_tiles 45 row no_tiles rowwise "${NO_TILES[@]}"
    step rowwise 45 row tiles rowwise
    step tensorwise 40 row tiles tensorwise
    step tensorwise_no_tiles 40 row no_tiles tensorwise "${NO_TILES[@]}"
    step bf16 35 row tiles bf16
    # each change against today's loss curve: 100 steps of the debug model, compiled
    step loss_tiles 50 bash -c "$(declare -f loss); RES=$RES; loss tensorwise_tiles --float8.enable_float8_linear; \
        loss tensorwise_no_tiles --float8.enable_float8_linear ${NO_TILES[*]:1}"
    step tt_tensorwise 45 python3 benchmarks/run.py --preset llama3_8b_8l --engine torchtitan --precision tensorwise \
        --warmup 2 --steps 4 --timeout 100 --out "$RES/tiles"
    step tt_rowwise_with_gw_hp 45 python3 benchmarks/run.py --preset llama3_8b_8l --engine torchtitan \
        --precision rowwise_with_gw_hp --warmup 2 --steps 4 --timeout 100 --out "$RES/tiles"
    step cudagraphs 45 row cudagraphs tensorwise -- --bench.inductor triton.cudagraphs=true
    step flex 45 row flex bf16 -- --model.flavor 8B_flex
    step kiln_bf16_long 45 python3 benchmarks/run.py --preset llama3_8b_8l --precision bf16 --warmup 3 --steps 12 \
        --timeout 100 --out "$RES/long"
    step tt_bf16_long 50 python3 benchmarks/run.py --preset llama3_8b_8l --engine torchtitan --precision bf16 \
        --warmup 3 --steps 12 --timeout 100 --out "$RES/long"
    step report_compiled 35 timeout 60 env NGPU=1 ./run_train.sh --training.compile --float8.enable_float8_linear \
        --float8.recipe_name rowwise --activation_checkpoint.mode selective \
        --activation_checkpoint.selective_ac_option op --training.seq_len 2048 --training.local_batch_size 4 \
        --profiling.saved_activations_report --job.dump_folder "$RES/outputs/report"
    for d in tiles no_tiles cudagraphs flex long; do
        [[ -f $RES/$d/results.jsonl ]] && python3 benchmarks/run.py --preset llama3_8b_8l --summary --out "$RES/$d"
    done
    python3 benchmarks/projection.py --results "$RES/tiles"
    save
fi
# moe_row PRECISION [run.py flags]: one qwen3_30b_a3b_4l row (3 warm-up, 5 measured steps), killed at 200 s or at
# the budget's end.
moe_row() {
    local precision=$1
    shift
    local room=$(($(left) - 5))
    python3 benchmarks/run.py --preset qwen3_30b_a3b_4l --precision "$precision" \
        --timeout $((room < 200 ? room : 200)) --out "$RES/moe" "$@"
}
if [[ $PART == moe ]]; then
    step moe_check 30 python3 benchmarks/run.py --preset qwen3_30b_a3b_4l --check --rows 0
    step moe_bf16 90 moe_row bf16
    step moe_rowwise 90 moe_row rowwise
    major=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | cut -d. -f1)
    if ((major >= 10)); then
        step moe_mxfp8 90 moe_row mxfp8_rceil
    else
        echo "== skipped moe_mxfp8: compute capability ${major}.x has no MXFP8 matmuls (needs 10.0+)"
    fi
    step moe_bf16_eager 90 moe_row bf16 --compile off
    [[ -f $RES/moe/results.jsonl ]] && python3 benchmarks/run.py --preset qwen3_30b_a3b_4l --summary --out "$RES/moe"
    save
fi
echo "== done after $(($(date +%s) - START))s"
