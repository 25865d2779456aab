#!/usr/bin/env bash
# On a machine with a CUDA GPU: the GPU-marked tests, the inner-loop benchmark on the device
# (CUDA == CPU checked first) and the real trainer on DeepSpeed's NCCL backend at world 1 vs the
# same run on the CPU (same model? tasks/s). Every step has its own time limit (the limits add
# up to 12.3 minutes) and the script goes on after a failing step; exit 1 if any step failed.
#
#   benchmarks/gpu_check.sh OUT_DIR        (PYTHON=... to use another interpreter)
#
# OUT_DIR gets: status.txt (one line per step: name, exit code, seconds), <step>.log for each
# step, gpu_tests.xml (JUnit), inner_loop_cuda.json, trainer_{cuda,cpu}/ (run dirs) and
# trainer_compare.json, demo_{cuda,cpu}/ (with profile.json) and demo_compare.json.
set -u -o pipefail

OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
BIN=$(dirname "$PY")
export PATH="$BIN:$PATH" OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$REPO" || exit 1
: > "$OUT/status.txt"
failed=0

# step NAME LIMIT_S COMMAND...: run with a hard limit, log to OUT/NAME.log, record the outcome.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (limit ${limit}s)"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    printf '%-18s rc=%-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - start ))" | tee -a "$OUT/status.txt"
    if [ "$rc" -ne 0 ]; then
        failed=1
        tail -n 20 "$OUT/$name.log"
    fi
    return 0
}

# 0. the device and versions
step device 60 "$PY" -c '
import json, sys, torch, deepspeed
info = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "cuda": torch.version.cuda,
        "available": torch.cuda.is_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": torch.cuda.nccl.version() if torch.cuda.is_available() else None}
print(json.dumps(info))
sys.exit(0 if info["available"] else "no CUDA device visible")'

# 1. the test subset marked for GPUs (tests/launch first: tests/gpu imports its helpers)
step gpu_tests 150 "$PY" -m pytest -q -m gpu tests/launch tests/gpu tests/unit tests/distributed \
    --junitxml="$OUT/gpu_tests.xml"

# 2. inner loop on the device: CUDA == CPU (loss, gradients), then tasks/s of every variant
step inner_loop_cuda 90 "$PY" benchmarks/inner_loop.py --device cuda --threads 1 --iters 200 \
    --rounds 4 --out "$OUT/inner_loop_cuda.json"

# 3. the real trainer, world 1: deepspeed launcher on the GPU (NCCL) vs plain process on the CPU,
#    torch's Adam on both (no fused-op build), replicated tables (inside the engine)
"$PY" - "$OUT/ds_gpu_check.json" <<'EOF'
import json, sys
ds = json.load(open("ds_configs/zero0.json"))
ds["optimizer"]["params"]["torch_adam"] = True
json.dump(ds, open(sys.argv[1], "w"), indent=2)
EOF
TRAIN=(train --config examples/synthetic/config.yaml --set "deepspeed=$OUT/ds_gpu_check.json"
       --set embedding.sharding=dense --set "embedding.tables={}" --set train.meta_steps=60
       --set train.log_every=10 --set train.progress=false --set train.tensorboard=false
       --set eval.enabled=false)
step trainer_cuda 100 "$BIN/deepspeed" --num_gpus 1 "$BIN/gmeta-ds" "${TRAIN[@]}" \
    --set "output_dir=$OUT/trainer_cuda"
step trainer_cpu 70 env CUDA_VISIBLE_DEVICES= "$BIN/gmeta-ds" "${TRAIN[@]}" --set "output_dir=$OUT/trainer_cpu"
step trainer_compare 20 "$PY" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
res = {}
for dev in ("cuda", "cpu"):
    run = out / f"trainer_{dev}"
    summary = json.loads((run / "summary.json").read_text())
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    res[dev] = {"tasks_per_s": statistics.median(r["tasks_per_s"] for r in recs[1:] or recs),
                **{k: summary[k] for k in ("final_query_loss", "dense_checksum", "embedding_checksum")}}
same = all(abs(res["cuda"][k] - res["cpu"][k]) <= 1e-4 * max(1.0, abs(res["cpu"][k]))
           for k in ("final_query_loss", "dense_checksum", "embedding_checksum"))
res["same_model_1e-4"] = same
res["cuda_over_cpu_tasks_per_s"] = res["cuda"]["tasks_per_s"] / res["cpu"]["tasks_per_s"]
(out / "trainer_compare.json").write_text(json.dumps(res, indent=2) + "\n")
print(json.dumps(res, indent=2))
sys.exit(0 if same else "the GPU run trained a different model than the CPU run")
EOF

# 4. the demo config itself (sharded tables, ZeRO-2), world 1: tasks/s on CUDA against the CPU,
#    with the per-phase breakdown of 20 profiled meta-steps each (profile.json in the run dirs;
#    issue 17: the fixed per-step costs, e.g. DeepSpeed's reduction and the non-finite check,
#    are host syncs on a GPU)
DEMO=(train --config examples/synthetic/config.yaml --set train.meta_steps=45 --set train.log_every=10
      --set train.progress=false --set train.tensorboard=false --set eval.enabled=false
      --set train.profile_steps=20 --set train.profile_warmup=5)
step demo_cuda 100 "$BIN/deepspeed" --num_gpus 1 "$BIN/gmeta-ds" "${DEMO[@]}" --set "output_dir=$OUT/demo_cuda"
step demo_cpu 70 env CUDA_VISIBLE_DEVICES= "$BIN/gmeta-ds" "${DEMO[@]}" --set "output_dir=$OUT/demo_cpu"
step demo_compare 20 "$PY" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
res = {}
for dev in ("cuda", "cpu"):
    run = out / f"demo_{dev}"
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    prof = json.loads((run / "profile.json").read_text())["ranks"][0]
    res[dev] = {"tasks_per_s": statistics.median(r["tasks_per_s"] for r in recs[1:] or recs),
                "step_ms_profiled": prof["step_ms"],
                "phases_ms": {k: round(v["ms"], 3) for k, v in prof["phases"].items() if v["calls"]}}
res["cuda_over_cpu_tasks_per_s"] = res["cuda"]["tasks_per_s"] / res["cpu"]["tasks_per_s"]
(out / "demo_compare.json").write_text(json.dumps(res, indent=2) + "\n")
print(json.dumps(res, indent=2))
EOF

# 5. issue 19: sharded tables placed on the accelerator vs the host (pinned, rows moved to the
#    GPU after the lookup), static and dynamic 1M-row tables: ms per lookup + backward + step at
#    world 1 (the equality with the CPU is in step 1, tests/gpu/test_embedding_placement_cuda.py)
step placements 60 "$PY" benchmarks/dynamic_tables.py --placements "$OUT/placements.json" --rounds 3 --steps 10

echo "== summary ($OUT/status.txt)"
cat "$OUT/status.txt"
exit "$failed"
