#!/usr/bin/env bash
# Multi-node launch with torchrun's c10d rendezvous. Run the SAME command on every
# node (same MASTER_ADDR/PORT and RDZV_ID; torchrun assigns node ranks):
#
#   NNODES=4 MASTER_ADDR=node0.cluster MASTER_PORT=29500 \
#       bash scripts/multinode_torchrun.sh --config train_configs/llama3_8b_multinode.toml
#
# MASTER_ADDR is any one of the nodes (it hosts the rendezvous store). Put
# job.dump_folder on a file system every node sees: checkpoints are written by
# all ranks and renamed to complete by rank 0. Restarting the same command
# resumes from the latest complete checkpoint.
#
# MAX_RESTARTS=N: when a rank fails (or is lost: every collective is bounded by
# [comm] init_timeout_seconds / train_timeout_seconds), torchrun restarts all
# ranks of all nodes, up to N times, and they resume from the newest complete
# checkpoint. For that the agents must not share their store with the workers:
# a restarted attempt would read the failed one's addresses (pytorch#135712).
# With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each attempt's rank 0 serves a new
# store, on a free port of its node (open ports between nodes needed).
# Environment: NNODES (required), MASTER_ADDR (required), MASTER_PORT (29500),
# NPROC_PER_NODE (GPUs on this node), RDZV_ID (ulysses), MAX_RESTARTS (0).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
: "${NNODES:?set NNODES, the number of nodes}"
: "${MASTER_ADDR:?set MASTER_ADDR, the host name of one node (the rendezvous host)}"
py="${PYTHON:-python}"
nproc="${NPROC_PER_NODE:-$("$py" -c 'import torch; print(torch.cuda.device_count() or 1)')}"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a new worker store per attempt: restarts start clean
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# Typical NCCL settings for InfiniBand clusters; adjust to yours.
# export NCCL_IB_HCA=mlx5 NCCL_SOCKET_IFNAME=eth0 NCCL_DEBUG=WARN
exec "$py" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --nproc_per_node="$nproc" \
    --rdzv_backend=c10d \
    --rdzv_endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" \
    --rdzv_id="${RDZV_ID:-ulysses}" \
    --max_restarts="${MAX_RESTARTS:-0}" \
    -m ulysses_dtensor.train "$@"
