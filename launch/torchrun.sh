#!/usr/bin/env bash
# Meta-training under torchrun (no DeepSpeed launcher; gmeta_ds still trains on DeepSpeed).
#   launch/torchrun.sh NPROC_PER_NODE CONFIG.yaml [--set key=value ...]
# Multi-node: set NNODES, NODE_RANK and MASTER_ADDR (env) and run it on every node.
# MASTER_PORT (env) default 29500.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NPROC_PER_NODE CONFIG.yaml [--set key=value ...]" >&2
  exit 2
fi
nproc=$1; config=$2; shift 2
exec torchrun --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$nproc" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  "$(command -v gmeta-ds)" train --config "$config" "$@"
