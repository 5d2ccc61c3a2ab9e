#!/bin/bash
# kiln on a SLURM cluster: `sbatch scripts/slurm_train.sh [train.py arguments]`, submitted from kiln's directory
# (or with KILN_DIR set). One task per node: run_train.sh starts torchrun there, which starts the node's NGPU
# ranks; the nodes meet at a c10d rendezvous on the first node of the allocation (launch.py reads SLURM_NNODES,
# SLURM_NODEID, SLURM_JOB_ID and SLURM_JOB_NODELIST). The config is checked for the whole world on every node.
#   CONFIG_FILE    TOML config (default: kiln's debug config)
#   NGPU           ranks per node (default here: 8)
#   MAX_RESTARTS   torchrun's restarts of the whole job after a rank or node fails (default: 0)
#   RDZV_PORT      the rendezvous port on the first node (default: 29500)
# Example: CONFIG_FILE=train_configs/llama3_70b.toml sbatch --nodes 4 scripts/slurm_train.sh \
#            --parallelism.data_parallel_replicate_degree 4 --parallelism.tensor_parallel_degree 8
#SBATCH --job-name=kiln
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
KILN_DIR=${KILN_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}  # sbatch runs a copy of this script: find kiln by the submit dir
if [[ ! -f "${KILN_DIR}/run_train.sh" ]]; then
    echo "kiln: error: no run_train.sh in ${KILN_DIR}: submit from kiln's directory or set KILN_DIR" >&2
    exit 2
fi
export NGPU=${NGPU:-8}
# --kill-on-bad-exit=0: a node whose torchrun fails does not cancel the others at once; their torchrun decides
# (a restart when MAX_RESTARTS allows, else their own exit).
exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash "${KILN_DIR}/run_train.sh" "$@"
