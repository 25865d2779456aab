#!/usr/bin/env bash
# A wheel that works anywhere: build gmeta-ds's wheel from this checkout (git's files only,
# copied to a temporary folder so a stale build/ cannot leak into it), install it (not
# editable) into a fresh virtualenv, and from an empty directory outside the checkout run
#   gmeta-ds validate            tiny CTR config, no 'deepspeed:' key (the packaged default)
#   gmeta-ds validate            the same with a shipped name, via --set and --deepspeed_config
#   gmeta-ds train   task: ctr   tiny synthetic run (default DeepSpeed config), summary.json
#   gmeta-ds train   task: text  tiny BERT, synthetic episodes, summary.json
# Every step runs under `timeout` and prints its wall time. Needs network for the wheel's
# dependencies (pip's registry / cache) unless they are local.
#   TORCH_SPEC   torch to install first (default torch==2.13.0: the CPU build CI machines have)
#   PYTHON       interpreter for the build and the virtualenv (default python3)
#   KEEP=1       keep the temporary folder (printed) for inspection
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gmeta-wheel-check.XXXXXX")"
case "$WORK" in "$REPO"/*) echo "check_wheel: temporary folder $WORK is inside the checkout" >&2; exit 1;; esac

cleanup() {
    local rc=$?
    if [[ "${KEEP:-0}" == 1 || $rc -ne 0 ]]; then
        echo "[wheel-check] files kept in $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

# Nothing from the checkout or the caller's environment may leak into the installed runs.
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV PYTHONDONTWRITEBYTECODE
export PYTHONNOUSERSITE=1 PYTHONUNBUFFERED=1 PIP_NO_INPUT=1
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"   # DeepSpeed's JIT builds, never a shared lock
export TMPDIR="$WORK/tmp"
mkdir -p "$TMPDIR"
T_ALL=$(date +%s.%N)

step() {  # step NAME LIMIT_S CMD...: run CMD under timeout, print its wall time
    local name=$1 limit=$2 t0 rc=0
    shift 2
    t0=$(date +%s.%N)
    echo "[wheel-check] $name ..."
    # a child bash so that the script's own functions (exported below) run under timeout too
    timeout --kill-after=20 "$limit" bash -euo pipefail -c '"$@"' "$name" "$@" || rc=$?
    local dt
    dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [[ $rc -ne 0 ]]; then
        [[ $rc -eq 124 || $rc -eq 137 ]] && echo "[wheel-check] $name: timed out after ${limit} s" >&2
        echo "[wheel-check] FAILED: $name (exit $rc, ${dt} s)" >&2
        exit "$rc"
    fi
    echo "[wheel-check] $name: ${dt} s"
}

# --------------------------------------------------------------- build the wheel from git's files
copy_sources() {
    "$PYTHON" - "$REPO" "$WORK/src" <<'EOF'
import os, shutil, subprocess, sys
src, dst = sys.argv[1:]
try:
    out = subprocess.run(["git", "-C", src, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True, timeout=60).stdout
    names = sorted({os.fsdecode(n) for n in out.split(b"\0") if n})
except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist): all of it
    names = None
if names is None:
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(".venv", "build", "*.egg-info"))
    sys.exit(0)
for rel in names:
    parts = rel.split("/")
    # skip deleted files and index entries below a folder that is now a symlink (ds_configs/)
    if any(os.path.islink(os.path.join(src, *parts[:i])) for i in range(1, len(parts))):
        continue
    path = os.path.join(src, rel)
    if not os.path.lexists(path):
        continue
    target = os.path.join(dst, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
    elif os.path.isfile(path):
        shutil.copy2(path, target)
EOF
}
export REPO PYTHON WORK
export -f copy_sources
step "copy the checkout's files" 120 copy_sources
step "build the wheel (pip wheel --no-deps)" 600 \
    "$PYTHON" -m pip wheel -q --no-deps "$WORK/src" -w "$WORK/dist"
WHEEL="$(ls "$WORK"/dist/gmeta_ds-*.whl)"
echo "[wheel-check] built $(basename "$WHEEL")"

check_wheel_contents() {
    "$PYTHON" - "$WHEEL" "$WORK/src" <<'EOF'
import pathlib, sys, zipfile
wheel, src = sys.argv[1], pathlib.Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
want = {str(p.relative_to(src)) for p in (src / "gmeta_ds").rglob("*.py") if "__pycache__" not in p.parts}
want |= {str(p.relative_to(src)) for p in (src / "gmeta_ds" / "ds_configs").glob("*.json")}
missing = sorted(want - names)
stray = sorted({n.split("/")[0] for n in names} - {"gmeta_ds"} - {n.split("/")[0] for n in names if ".dist-info" in n})
if missing or stray or not any(n.startswith("gmeta_ds/ds_configs/") for n in names):
    sys.exit(f"wheel {wheel}: missing {missing}; unexpected top-level entries {stray}")
print(f"wheel holds all {len(want)} package files (modules and DeepSpeed configs)")
EOF
}
export WHEEL
export -f check_wheel_contents
step "check the wheel's contents" 60 check_wheel_contents

# --------------------------------------------------------------- install into a fresh virtualenv
VENV="$WORK/venv"
step "create a fresh virtualenv" 180 "$PYTHON" -m venv "$VENV"
# --no-compile: byte-compiling every installed module costs more than the install (torch: 62 vs
# 20 s here); the runs below compile what they import and keep it (PYTHONDONTWRITEBYTECODE unset
# for this throwaway virtualenv: the first run writes the .pyc files the later ones read).
step "install $TORCH_SPEC" 900 "$VENV/bin/python" -m pip install -q --no-compile "$TORCH_SPEC"
step "install the wheel and its dependencies" 900 "$VENV/bin/python" -m pip install -q --no-compile "$WHEEL"
# The venv's bin first: DeepSpeed JIT-rebuilds its CPU ops when it sees another PATH.
export PATH="$VENV/bin:$PATH"

# --------------------------------------------------------------- run it from outside the checkout
RUN="$WORK/cwd"
mkdir -p "$RUN"
cd "$RUN"
case "$(pwd -P)" in "$(cd "$REPO" && pwd -P)"*) echo "check_wheel: $RUN is inside the checkout" >&2; exit 1;; esac

cat > ctr.yaml <<'EOF'
# no 'deepspeed:' key: the packaged default (ds_configs/zero0.json)
output_dir: runs/ctr
seed: 3
model: {embed_dim: 4, hidden: [8]}
meta: {algorithm: maml, inner_steps: 2, inner_lr: 0.1, tasks_per_micro_batch: 4, tasks_per_meta_step: 8}
data: {synthetic: {num_users: 80, num_items: 50, max_interactions: 30}}
train: {meta_steps: 4, log_every: 2, lr: 0.01, progress: false}
eval: {enabled: false}
EOF
cat > text.yaml <<'EOF'
task: text
output_dir: runs/text
seed: 1
meta: {algorithm: maml, inner_steps: 2, inner_lr: 0.5, adapt: ["*"], tasks_per_micro_batch: 2, tasks_per_meta_step: 4}
text:
  data: {ways: 3, shots: 2, queries: 2, max_length: 10,
         synthetic: {num_classes: 12, examples_per_class: 6, topic_words: 8, filler_words: 20, words_per_text: 5}}
  model: {config: {model_type: bert, hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2,
                   intermediate_size: 32}}
  eval_episodes: 6
  baseline_steps: 3
train: {meta_steps: 4, log_every: 1, lr: 0.01, progress: false}
eval: {enabled: false}
deepspeed: ds_configs/zero1.json   # a shipped name, with no ds_configs/ folder here
EOF

check_installed() {
    python - "$REPO" <<'EOF'
import pathlib, sys
import gmeta_ds
from gmeta_ds.config import RunConfig
from gmeta_ds.config.deepspeed import load_ds_config, shipped_ds_configs
repo = pathlib.Path(sys.argv[1]).resolve()
pkg = pathlib.Path(gmeta_ds.__file__).resolve()
assert repo not in pkg.parents, f"gmeta_ds imported from the checkout: {pkg}"
assert "site-packages" in pkg.parts, pkg
ds, source = load_ds_config(RunConfig())
assert pathlib.Path(source).resolve() == pkg.parent / "ds_configs" / "zero0.json", source
assert ds["zero_optimization"]["stage"] == 0, ds
print(f"gmeta_ds {gmeta_ds.__version__} from {pkg.parent}; default DeepSpeed config: {source}")
print("shipped: " + ", ".join(shipped_ds_configs()))
EOF
}
expect_summary() {  # expect_summary RUN_DIR: summary.json is there, a JSON object of a finished run
    python - "$1" <<'EOF'
import json, pathlib, sys
path = pathlib.Path(sys.argv[1]) / "summary.json"
summary = json.loads(path.read_text())
assert isinstance(summary, dict) and summary, summary
shown = {k: summary[k] for k in ("world_size", "batch", "meta_steps", "final_query_loss") if k in summary}
print(f"{path}: {shown}")
EOF
}
validate_shipped_names() {
    gmeta-ds validate --config ctr.yaml --set deepspeed=ds_configs/zero2.json --world-size 2 > validate_zero2.log
    grep -q '"stage": 2' validate_zero2.log
    gmeta-ds validate --config ctr.yaml --deepspeed_config ds_configs/zero3.json > validate_zero3.log
    grep -q '"stage": 3' validate_zero3.log
    if gmeta-ds validate --config ctr.yaml --set deepspeed=ds_configs/nope.json 2> missing.err; then
        echo "a missing DeepSpeed config validated" >&2; return 1
    fi
    grep -q "ds_configs/nope.json' not found" missing.err
    grep -q "shipped DeepSpeed configs: ds_configs/zero0.json" missing.err
    echo "shipped names resolve via --set and --deepspeed_config; a missing one lists the shipped names"
}

export -f check_installed expect_summary validate_shipped_names
step "installed package and default DeepSpeed config" 120 check_installed
step "gmeta-ds validate (CTR, default DeepSpeed config)" 300 \
    bash -c 'gmeta-ds validate --config ctr.yaml > validate.log && grep -q "config OK" validate.log && grep -q "\"stage\": 0" validate.log'
step "gmeta-ds validate (shipped names, missing file)" 300 validate_shipped_names
echo "[wheel-check] the first DeepSpeed run JIT-builds its CPU ops into \$TORCH_EXTENSIONS_DIR (minutes on 2 cores)"
step "gmeta-ds train (task: ctr)" 600 gmeta-ds train --config ctr.yaml
step "summary.json (ctr)" 60 expect_summary runs/ctr
step "gmeta-ds train (task: text)" 600 gmeta-ds train --config text.yaml
step "summary.json (text)" 60 expect_summary runs/text

echo "[wheel-check] OK: $(basename "$WHEEL") works outside the checkout; total" \
     "$(awk -v a="$T_ALL" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
