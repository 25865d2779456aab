"""Memory per rank of few-shot text meta-training: ZeRO-2, ZeRO-3 with the body split
(the default: the non-adapted encoder stays partitioned, gathered layer by layer by
DeepSpeed's hooks) and ZeRO-3 gathering every parameter per micro-step (``meta.split_body:
false``, what ZeRO-3 did before issue 18), at 1, 2 and 4 ranks.

Runs ``gmeta-ds train`` on ``examples/hf_fewshot/config.yaml`` under ``deepspeed --num_gpus W``
for a few meta-steps (evaluation off):

- ``example``: the example as configured (BERT 64 x 2, head-only adaptation): its memory is
  the runtime and the workload (interpreter, torch, DeepSpeed, transformers, tokenizer,
  episodes), the baseline subtracted from ``state`` below;
- ``state``: BERT 1024 x 6 (~80M parameters), head-only adaptation (ANIL), 1-shot 1-query
  episodes, 1 inner step: the dense state dominates;
- ``activations``: a wider BERT (512 x 4, ~13M parameters), MAML adapting every parameter:
  second-order activations dominate (no split possible; both ZeRO-3 variants are the same).

Each rank reports (summary.json ``peak_rss_mib_per_rank``) its peak (VmHWM through the
training loop), its resident size before any model was built and after the training loop
(garbage collected: no activations). The *model-state part* of a run is its (after -
before) minus the same difference of the ``example`` run at the same world size and
variant; it is compared with the analytic ZeRO state per rank for fp32 Adam
(`gmeta_ds.ds_config.dense_state_bytes`: parameters 4 bytes, gradients 4, Adam moments 8 per
parameter; ZeRO-2 partitions gradients and moments, ZeRO-3 also the parameters: ZeRO-2
(4 + 12/W) bytes per parameter, ZeRO-3 16/W).

    python benchmarks/hf_memory.py [--steps 3] [--worlds 1 2 4] [--cases example state]
    (-> benchmarks/results/hf_memory.json)
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

RESULTS = REPO / "benchmarks" / "results" / "hf_memory.json"


CASES = {  # name: (hidden, layers, extra --set overrides)
    "example": (64, 2, []),
    "state": (1024, 6, ["meta.inner_steps=1", "text.data.shots=1", "text.data.queries=1"]),
    "activations": (512, 4, ["meta.adapt=['*']", "meta.inner_steps=2", "meta.inner_lr=0.5",
                             "meta.tasks_per_micro_batch=4", "meta.tasks_per_meta_step=8"]),
}
VARIANTS = {  # name: (ZeRO stage, extra --set overrides)
    "zero2": (2, []),
    "zero3": (3, []),
    "zero3-gathered": (3, ["meta.split_body=false"]),
}


def run(case: str, variant: str, world: int, steps: int, out: Path, timeout: float) -> dict:
    from gmeta_ds.ds_config import dense_state_bytes

    hidden, layers, extra = CASES[case]
    stage, more = VARIANTS[variant]
    model = (f"text.model.config={{model_type: bert, hidden_size: {hidden}, num_hidden_layers: {layers}, "
             f"num_attention_heads: 4, intermediate_size: {4 * hidden}}}")
    tasks = 2 * world  # 2 episodes per micro-batch on every rank
    sets = [f"output_dir={out}", f"train.meta_steps={steps}", "train.log_every=1", "train.progress=false",
            "train.tensorboard=false", "eval.enabled=false", model,
            "meta.tasks_per_micro_batch=2", f"meta.tasks_per_meta_step={tasks}", *extra, *more,
            f"deepspeed=ds_configs/zero{stage}.json"]
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port()),
           str(BIN / "gmeta-ds"), "train", "--config", "examples/hf_fewshot/config.yaml",
           *[a for s in sets for a in ("--set", s)]]
    start = time.perf_counter()
    run_group(cmd, timeout, f"{variant} hidden {hidden} x {layers} layers, {world} rank(s)")
    summary = json.loads((out / "summary.json").read_text())
    n = summary["parameters"]
    state = dense_state_bytes(summary["ds_config"], n, world)
    ranks = summary["peak_rss_mib_per_rank"]
    return {"case": case, "variant": variant, "stage": stage, "world": world, "hidden": hidden,
            "layers": layers, "parameters": n, "wall_s": time.perf_counter() - start,
            "meta_steps": steps, "final_query_loss": summary["final_query_loss"],
            "dense_checksum": summary["dense_checksum"],
            "peak_mib_per_rank": [r["training_vmhwm_mib"] for r in ranks],
            "runtime_mib_per_rank": [r.get("runtime_rss_mib") for r in ranks],
            "after_training_mib_per_rank": [r.get("after_training_rss_mib") for r in ranks],
            "analytic_state_mib": sum(state[k] for k in ("params", "grads", "optimizer")) / 2**20}


def _mean(values) -> float:
    return sum(values) / len(values)


def held(row: dict) -> float:
    """Mean over ranks of (after training - before the model): state, buffers, workload."""
    return _mean([a - b for a, b in zip(row["after_training_mib_per_rank"], row["runtime_mib_per_rank"])])


def add_model_state(rows: list[dict]) -> None:
    """``measured_state_mib``: `held` minus the ``example`` run's at the same world and variant."""
    base = {(r["world"], r["variant"]): held(r) for r in rows if r["case"] == "example"}
    for r in rows:
        key = (r["world"], r["variant"])
        if r["case"] != "example" and key in base:
            r["measured_state_mib"] = held(r) - base[key]
            r["state_vs_analytic"] = r["measured_state_mib"] / r["analytic_state_mib"]


def table(rows: list[dict]) -> list[str]:
    lines = ["| case | parameters | ranks | ZeRO | peak per rank (MiB, max) | x ZeRO-2 peak | model-state "
             "part (MiB) | analytic (MiB) | measured / analytic | final query loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    z2 = {(r["case"], r["world"]): max(r["peak_mib_per_rank"]) for r in rows if r["variant"] == "zero2"}
    for r in rows:
        peak = max(r["peak_mib_per_rank"])
        ratio = peak / z2[(r["case"], r["world"])] if (r["case"], r["world"]) in z2 else float("nan")
        measured = r.get("measured_state_mib")
        lines.append(f"| {r['case']} (BERT {r['hidden']} x {r['layers']}) | {r['parameters'] / 1e6:.1f}M | "
                     f"{r['world']} | {r['variant']} | {peak:.0f} | {ratio:.2f} | "
                     f"{'-' if measured is None else f'{measured:.0f}'} | {r['analytic_state_mib']:.0f} | "
                     f"{'-' if measured is None else format(r['state_vs_analytic'], '.2f')} | "
                     f"{r['final_query_loss']:.5f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=["example", "state"], choices=list(CASES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            for world in args.worlds:
                for variant in args.variants:
                    rows.append(run(case, variant, world, args.steps,
                                    Path(tmp) / f"{case}_{variant}_{world}", args.timeout))
                    print(json.dumps(rows[-1]), flush=True)
    add_model_state(rows)
    print("\n".join(table(rows)))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "steps": args.steps, "runs": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
