#!/bin/bash
# Multi-node MoE pretraining under SLURM: one torchrun per node, all meeting in a c10d rendezvous
# hosted on the first node of the allocation; each torchrun starts NPROC_PER_NODE trainers running
# `python -m megamoe.train --config CONFIG [key=value ...]`.
#
# Submit from the repository root (jobs run in the submission folder):
#   mkdir -p logs      # once: sbatch does not create the folder of --output
#   sbatch launch/pretrain_moe.sh configs/tiny_cpu.yaml output_dir=runs/tiny
#   CONFIG=configs/big.yaml sbatch --nodes=8 --gpus-per-node=8 --cpus-per-task=96 \
#       launch/pretrain_moe.sh output_dir=runs/big
# Every #SBATCH default below can be overridden on the sbatch command line.
#
# Script arguments: [CONFIG] [key=value ...]; the config comes first unless CONFIG is set, the
# rest is passed to megamoe.train unchanged.
# Environment (all optional; sbatch passes the submitting shell's environment to the job):
#   CONFIG           config YAML, instead of the first argument
#   PYTHON           the python that has torch and megamoe, e.g. a venv's (default: python)
#   NPROC_PER_NODE   trainers per node (default: the node's GPUs, 1 on a node without GPUs)
#   RDZV_PORT        TCP port of the rendezvous on the first node (default: from the job id)
#   CONTAINER_IMAGE  run every node's torchrun in this image with pyxis (srun --container-image)
#   CONTAINER_MOUNTS pyxis mounts (default: the submission folder, at the same path)
#
# Pre-emption and time limit: 120 s before the limit Slurm sends SIGUSR1 to this script
# (--signal=B:USR1@120; the B: matters, it lets this script know). The script forwards it to every
# trainer, which saves a checkpoint, points `latest_checkpointed_iteration.txt` in its output_dir
# at it and exits; then the script requeues the job. The requeued job keeps its id, appends to the
# same log and resumes from that checkpoint, so output_dir must not change between runs (put it in the config or the arguments).
#
# NCCL / InfiniBand (GPU clusters): NCCL finds InfiniBand adapters by itself. Export these before
# sbatch when it needs help:
#   NCCL_DEBUG=INFO              logs the transport it chose (look for "NET/IB"; "NET/Socket"
#                                means plain TCP, i.e. InfiniBand is not used)
#   NCCL_SOCKET_IFNAME=ib0       interface for NCCL's bootstrap and socket traffic (^lo,docker0
#                                excludes instead); GLOO_SOCKET_IFNAME does the same for gloo
#   NCCL_IB_HCA=mlx5_0,mlx5_1    which adapters to use; NCCL_IB_DISABLE=1 forces TCP
#   NCCL_IB_GID_INDEX=3          usually needed on RoCE (Ethernet RDMA) fabrics
#   NCCL_NET_GDR_LEVEL=PHB       how far apart GPU and NIC may be for GPUDirect RDMA
#   NCCL_IB_TIMEOUT=22           longer InfiniBand retry timeout for large or busy fabrics

#SBATCH --job-name=megamoe-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
# --ntasks-per-node=1: one torchrun per node. --cpus-per-task: CPUs for a node's torchrun and
# its trainers; raise it on real nodes (or add --exclusive). --open-mode=append: a requeued job
# adds to its log instead of overwriting it.

set -euo pipefail

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "error: submit this script with sbatch (SLURM_JOB_ID is not set)" >&2
    exit 2
fi

# Every number below reaches bash arithmetic, srun or torchrun. Bash evaluates a variable's value
# as an expression inside $(( )) (so "a[$(cmd)]" would run cmd), and 0 or -4 would divide by zero
# or reach torchrun: each must be a plain decimal integer in its range before any use.
require_integer() {  # NAME MIN MAX: $NAME, when set and not empty, is an integer in MIN..MAX
    local name=$1 value=${!1:-} shown
    [[ -z "$value" ]] && return 0
    if [[ ! "$value" =~ ^(0|[1-9][0-9]{0,9})$ ]] || (( value < $2 || value > $3 )); then
        printf -v shown '%q' "$value"
        echo "error: $name=${shown:0:60} is not an integer from $2 to $3; set it to one" \
             "or unset it" >&2
        exit 2
    fi
}
require_integer SLURM_JOB_ID 1 4294967295
require_integer SLURM_JOB_NUM_NODES 1 1000000
require_integer SLURM_CPUS_PER_TASK 1 1000000
require_integer SLURM_GPUS_ON_NODE 0 1024
require_integer SLURM_RESTART_COUNT 0 1000000000
require_integer NPROC_PER_NODE 1 1024
require_integer RDZV_PORT 1 65535
if [[ -z "${CONFIG:-}" ]]; then
    if (( $# == 0 )); then
        echo "error: no config given: pass it first" \
             "(sbatch launch/pretrain_moe.sh configs/X.yaml) or set CONFIG=configs/X.yaml" >&2
        exit 2
    fi
    CONFIG=$1
    shift
fi
PYTHON=${PYTHON:-python}

# Trainers per node: what the user asked for, else one per GPU Slurm gave us, else one per GPU
# nvidia-smi sees, else 1 (CPU). Nodes are assumed alike; this runs on the first node.
gpus_on_node() {
    if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        echo "$SLURM_GPUS_ON_NODE"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$(gpus_on_node)
    (( NPROC_PER_NODE > 0 )) || NPROC_PER_NODE=1
fi

# The rendezvous lives on the first node; a port derived from the job id keeps two jobs that
# share a first node apart (20000-29999, below Linux's ephemeral port range).
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${RDZV_PORT:-$(( 20000 + SLURM_JOB_ID % 10000 ))}

# CPU threads per trainer: the node's CPUs split between its trainers.
CPUS_PER_NODE=${SLURM_CPUS_PER_TASK:-1}
THREADS_PER_TRAINER=$(( CPUS_PER_NODE / NPROC_PER_NODE > 0 ? CPUS_PER_NODE / NPROC_PER_NODE : 1 ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS_PER_TRAINER}
# Megatron-Core's tensor/sequence-parallel communication overlap needs kernels issued in order,
# i.e. a single CUDA work queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

container_args=()
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    container_args=(--container-image="$CONTAINER_IMAGE"
                    --container-mounts="${CONTAINER_MOUNTS:-$PWD:$PWD}"
                    --container-workdir="$PWD")
fi

# On SIGUSR1, pass it on to every process of the training step (scancel without --batch/--full
# leaves this script alone) and remember to requeue once the trainers have checkpointed and exited.
preempted=0
# shellcheck disable=SC2317  # (shellcheck cannot see that the trap below calls it)
forward_preemption() {
    preempted=1
    echo "pretrain_moe.sh $(date -u +%FT%TZ): SIGUSR1 received: asking the trainers to checkpoint"
    scancel --signal=USR1 "$SLURM_JOB_ID" ||
        echo "pretrain_moe.sh: warning: scancel could not forward SIGUSR1" >&2
}
trap forward_preemption USR1

echo "pretrain_moe.sh $(date -u +%FT%TZ): job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})" \
     "on $SLURM_JOB_NUM_NODES node(s) [$SLURM_JOB_NODELIST] x $NPROC_PER_NODE trainer(s)," \
     "rendezvous $HEAD_NODE:$RDZV_PORT, config $CONFIG, overrides: ${*:-none}"

# One task per node. Slurm signals every process of a step, so the trainers receive the forwarded
# SIGUSR1 themselves, once. torchrun would die of it (and take the trainers down before they have
# saved), so each node starts torchrun with SIGUSR1 ignored; the trainers inherit that until they
# install their own handler (a signal during start-up is then harmless), and torchrun exits
# normally once they are done. A scancel or the time limit sends SIGTERM instead, which reaches a
# trainer both from Slurm and from torchrun. --kill-on-bad-exit: a failed node stops the others.
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_NODE" \
     --kill-on-bad-exit=1 --label "${container_args[@]}" \
    bash -c 'trap "" USR1; exec "$@"' torchrun-ignoring-usr1 \
    "$PYTHON" -m torch.distributed.run \
        --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$NPROC_PER_NODE" \
        --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
        --max-restarts=0 \
        -m megamoe.train --config "$CONFIG" "$@" &
srun_pid=$!

# `wait` returns early whenever a trapped signal arrives: wait until srun has really exited, then
# collect its exit status (bash keeps it).
while kill -0 "$srun_pid" 2>/dev/null; do
    wait "$srun_pid" || true
done
status=0
wait "$srun_pid" || status=$?

if (( preempted )); then
    echo "pretrain_moe.sh $(date -u +%FT%TZ): trainers exited (status $status);" \
         "requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
