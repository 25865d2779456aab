#!/usr/bin/env bash
# Multi-node meta-training with the deepspeed launcher over ssh/pdsh: run once, on node 0.
#   launch/multinode.sh HOSTFILE MASTER_ADDR CONFIG.yaml [--set key=value ...]
# HOSTFILE lists every node ("node0 slots=8", see hostfile.example); the launcher reaches them
# by passwordless ssh (pdsh) and starts `gmeta-ds train` there with the same arguments, so
# gmeta_ds, this checkout and the data must be at the same paths on every node.
# MASTER_ADDR: an address of node 0 that every node can reach. MASTER_PORT (env) default 29500.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 HOSTFILE MASTER_ADDR CONFIG.yaml [--set key=value ...]" >&2
  exit 2
fi
hostfile=$1; master_addr=$2; config=$3; shift 3
# Fail here, with the line named, on a bad hostfile or batch arithmetic (before any ssh).
gmeta-ds validate --config "$config" --hostfile "$hostfile" "$@" > /dev/null
exec deepspeed --hostfile "$hostfile" --master_addr "$master_addr" --master_port "${MASTER_PORT:-29500}" \
  "$(command -v gmeta-ds)" train --config "$config" "$@"
