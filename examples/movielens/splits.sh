#!/usr/bin/env bash
# The shipped ml-100k recipe (ml-100k.yaml) over K user splits (default 10; issue 39 item 5):
# K full runs, seeds 0..K-1, each split's fine-tune lr and steps chosen on its own validation
# users, then OUTPUT_DIR/splits.json (per baseline and metric: the mean difference over the
# splits with a 95% interval over splits and users; also along the few-shot curve) and
# OUTPUT_DIR/report.html. A split already finished is reused, so an interrupted run continues.
#
#   examples/movielens/splits.sh [DATA_DIR [OUTPUT_DIR [K]]]
#
# DATA_DIR (default /tmp/ml-100k) is made by prepare_ml100k.py when it holds no u.data.
set -euo pipefail
data=${1:-/tmp/ml-100k}
out=${2:-runs/ml-100k-splits}
splits=${3:-10}
here=$(dirname "$0")
if [ ! -f "$data/u.data" ]; then
  python "$here/prepare_ml100k.py" "$data"
fi
gmeta-ds eval --config "$here/ml-100k.yaml" --splits "$splits" --set data.path="$data" \
  --set eval.finetune_search=true --set train.threads=1 --set train.progress=false --set output_dir="$out"
gmeta-ds report "$out"
