#!/usr/bin/env bash
# Meta-train on one node with the deepspeed launcher: N ranks (GPUs, or CPU processes with gloo).
#   launch/deepspeed_single_node.sh N CONFIG.yaml [--set key=value ...]
# MASTER_PORT (env) default 29500.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NUM_RANKS CONFIG.yaml [--set key=value ...]" >&2
  exit 2
fi
nranks=$1; config=$2; shift 2
exec deepspeed --num_gpus "$nranks" --master_port "${MASTER_PORT:-29500}" "$(command -v gmeta-ds)" train --config "$config" "$@"
