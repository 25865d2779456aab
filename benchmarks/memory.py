"""Peak resident memory per rank of the real trainer, by embedding plan and world size.

Runs ``gmeta-ds train`` under ``deepspeed --num_gpus W`` (W = 1, 2) on the demo config with an
``--items`` x ``--dim`` item table (default 2M x 64, 512 MB of float32; every field's table
gets dim ``--dim``, the others are tiny), for two plans:

- ``replicated``: every table inside the DeepSpeed engine (``embedding.sharding=dense``):
  each rank holds the whole table, its dense gradient and Adam's two moments;
- ``sharded``: the demo's plan (item_id and brand row-wise, small tables replicated), Adagrad
  on the shards: each rank holds ~1/W of the item rows and their Adagrad state.

Each rank reports its VmHWM (the peak resident size of its own process image; ``ru_maxrss``
would include the launcher's size at fork, since it survives exec) in ``summary.json``
(``peak_rss_mib_per_rank``, gathered at the end of `gmeta_ds.run.trainer.train`): once right
after the training loop ("training") and once at the end ("end": after the sharded tables
are gathered to rank 0 for ``model.safetensors``). Evaluation is off. The "model" column is
the analytic size of what the plan keeps per rank for the item table (fp32): replicated
under the demo's ZeRO-2 = full rows + 1/W of (fp32 master copy, gradient, Adam's 2
moments); sharded = ceil(R/W) rows + their Adagrad sums.

    python benchmarks/memory.py [--items 2000000] [--dim 64] [--steps 5]   (-> benchmarks/results/memory.json)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, REPO, free_port, machine, run_group

RESULTS = REPO / "benchmarks" / "results" / "memory.json"
PLANS = {"replicated": ["embedding.sharding=dense", "embedding.tables={}"],
         "sharded": ["embedding.sharding=sharded"]}


def table_model_mib(plan: str, items: int, dim: int, world: int) -> float:
    """Bytes per rank the plan keeps for the item table, MiB: replicated under ZeRO-2 = rows
    + 4/W of them (fp32 partition, gradient partition, Adam's 2 moments); sharded = ceil(R/W)
    rows + Adagrad sum (the sparse gradient of touched rows is negligible)."""
    row = dim * 4
    if plan == "replicated":
        return (1 + 4 / world) * items * row / 2**20
    return 2 * -(-items // world) * row / 2**20


def run(plan: str, world: int, items: int, dim: int, steps: int, out: Path, timeout: float) -> dict:
    sets = [f"output_dir={out}", f"train.meta_steps={steps}", f"data.synthetic.num_items={items}",
            f"model.embed_dim={dim}", "train.log_every=1", "train.progress=false", "train.tensorboard=false", "eval.enabled=false",
            *PLANS[plan]]
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port()),
           str(BIN / "gmeta-ds"), "train", "--config", "examples/synthetic/config.yaml",
           *[a for s in sets for a in ("--set", s)]]
    start = time.perf_counter()
    run_group(cmd, timeout, f"{plan} at world {world}")
    summary = json.loads((out / "summary.json").read_text())
    return {"plan": plan, "world_size": world, "wall_s": time.perf_counter() - start,
            "peak_rss_mib_per_rank": summary["peak_rss_mib_per_rank"],
            "training_vmhwm_mib_max": max(r["training_vmhwm_mib"] for r in summary["peak_rss_mib_per_rank"]),
            "vmhwm_mib_max": max(r["vmhwm_mib"] for r in summary["peak_rss_mib_per_rank"]),
            "item_table_model_mib": table_model_mib(plan, items, dim, world)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            for plan in PLANS:
                runs.append(run(plan, world, args.items, args.dim, args.steps, Path(tmp) / f"{plan}{world}",
                                args.timeout))
    print(f"\npeak RSS per rank (VmHWM, MiB), demo config with a {args.items:,} x {args.dim} item table, "
          f"{args.steps} meta-steps, no evaluation")
    print(f"{'plan':<11} {'world':>5} {'training, per rank':>19} {'end, per rank':>15} "
          f"{'item table model':>17}")
    for r in runs:
        per = {k: " / ".join(f"{x[k]:.0f}" for x in r["peak_rss_mib_per_rank"])
               for k in ("training_vmhwm_mib", "vmhwm_mib")}
        print(f"{r['plan']:<11} {r['world_size']:>5} {per['training_vmhwm_mib']:>19} {per['vmhwm_mib']:>15} "
              f"{r['item_table_model_mib']:>17.0f}")
    peak = {(r["plan"], r["world_size"]): r["training_vmhwm_mib_max"] for r in runs}
    deltas = {}
    for world in args.worlds:
        deltas[f"replicated - sharded, world {world}"] = peak["replicated", world] - peak["sharded", world]
    for plan in PLANS:
        if 1 in args.worlds and 2 in args.worlds:
            deltas[f"{plan}: world 1 - world 2"] = peak[plan, 1] - peak[plan, 2]
    for k, v in deltas.items():
        print(f"  training peak, max over ranks, {k}: {v:.0f} MiB")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "parameters": vars(args), "runs": runs,
                                   "deltas_mib": deltas, "runtime_s": time.perf_counter() - start},
                                  indent=2) + "\n")
    print(f"total {time.perf_counter() - start:.0f}s; wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
