#!/usr/bin/env bash
# Multi-node meta-training without ssh: run this on every node, each with its own NODE_RANK
# (line k of HOSTFILE is node rank k; every node needs the same HOSTFILE).
#   launch/multinode_no_ssh.sh HOSTFILE NODE_RANK MASTER_ADDR CONFIG.yaml [--set key=value ...]
# MASTER_ADDR: node 0's address, reachable from every node. MASTER_PORT (env) default 29500.
# NUM_GPUS (env, optional): ranks per node instead of the hostfile's slots.
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 HOSTFILE NODE_RANK MASTER_ADDR CONFIG.yaml [--set key=value ...]" >&2
  exit 2
fi
hostfile=$1; node_rank=$2; master_addr=$3; config=$4; shift 4
per_node=()
if [ -n "${NUM_GPUS:-}" ]; then per_node=(--num_gpus "$NUM_GPUS"); fi
gmeta-ds validate --config "$config" --hostfile "$hostfile" "${per_node[@]}" "$@" > /dev/null
exec deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$node_rank" "${per_node[@]}" \
  --master_addr "$master_addr" --master_port "${MASTER_PORT:-29500}" \
  "$(command -v gmeta-ds)" train --config "$config" "$@"
