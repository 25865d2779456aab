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
training loop), its resident size before any model was built, after the training loop
(garbage collected, ``malloc_trim``: no activations) and how much of that is tensor storage
(`gmeta_ds.engine.memory.host_tensor_mib`: every distinct storage reachable, ZeRO-3 partitions
included). The *model-state part* of a run is its tensor storage minus DeepSpeed's gradient
bucket (``reduce_bucket_size`` fp32 elements, allocated by ZeRO-3) and minus the ``example``
run's at the same world size and variant (the workload's own tensors); it is compared with the
analytic ZeRO state per rank for fp32 Adam (`gmeta_ds.config.deepspeed.dense_state_bytes`):
parameters 4 bytes, gradients 4, Adam moments 8 and DeepSpeed's fp32 master copy 4 per
parameter, partitioned by stage: ZeRO-2 (4 + 16/W) bytes per parameter, ZeRO-3 20/W; between
meta-steps ZeRO-2 has freed its gradient partition, so what it holds then is (4 + 12/W). The
*held* part (after - before) is reported too: it adds the interpreter's objects and the
allocator's own pages.

``--throughput``: ZeRO-2 against ZeRO-3 (body split) at world 2 on the ``state`` case, runs
alternated (``--rounds`` pairs), each profiling ``--profile-steps`` meta-steps after 2 warm-up
ones (`gmeta_ds.run.profiling`): the ratio of ZeRO-3's to ZeRO-2's tasks per second per pair
(median) and the per-phase milliseconds per meta-step of each (where the time goes).

    python benchmarks/hf_memory.py [--steps 3] [--worlds 1 2 4] [--cases example state]
    (-> benchmarks/results/hf_memory.json)
    python benchmarks/hf_memory.py --report   (the table of the results file again)
    python benchmarks/hf_memory.py --update --variants zero3 ...   (re-measure some rows only)
    python benchmarks/hf_memory.py --throughput [--rounds 3] [--profile-steps 4]
    (-> benchmarks/results/hf_zero3_throughput.json)
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
THROUGHPUT = REPO / "benchmarks" / "results" / "hf_zero3_throughput.json"


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


def train_args(case: str, variant: str, world: int, steps: int, out: Path,
               ds_config: str | None = None) -> list[str]:
    """The arguments after ``gmeta-ds`` for one run of ``case`` / ``variant`` on ``world`` ranks
    (``ds_config``: the DeepSpeed JSON, default ``ds_configs/zero{stage}.json``)."""
    hidden, layers, extra = CASES[case]
    stage, more = VARIANTS[variant]
    model = (f"text.model.config={{model_type: bert, hidden_size: {hidden}, num_hidden_layers: {layers}, "
             f"num_attention_heads: 4, intermediate_size: {4 * hidden}}}")
    tasks = 2 * world  # 2 episodes per micro-batch on every rank
    sets = [f"output_dir={out}", f"train.meta_steps={steps}", "train.log_every=1", "train.progress=false",
            "train.tensorboard=false", "eval.enabled=false", model,
            "meta.tasks_per_micro_batch=2", f"meta.tasks_per_meta_step={tasks}", *extra, *more,
            f"deepspeed={ds_config or f'ds_configs/zero{stage}.json'}"]
    return ["train", "--config", "examples/hf_fewshot/config.yaml", *[a for s in sets for a in ("--set", s)]]


def run(case: str, variant: str, world: int, steps: int, out: Path, timeout: float,
        more: tuple[str, ...] = ()) -> dict:
    from gmeta_ds.config.deepspeed import dense_state_bytes

    hidden, layers, _ = CASES[case]
    stage, _ = VARIANTS[variant]
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port()),
           str(BIN / "gmeta-ds"), *train_args(case, variant, world, steps, out),
           *[a for s in more for a in ("--set", s)]]
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
            "tensor_mib_per_rank": [r.get("after_training_tensor_mib") for r in ranks],
            "bucket_mib": (4 * summary["ds_config"]["zero_optimization"].get("reduce_bucket_size", 5e8) / 2**20
                           if stage == 3 else 0.0),
            "analytic_state_mib": sum(state[k] for k in ("params", "grads", "optimizer")) / 2**20,
            "analytic_grads_mib": state["grads"] / 2**20}


def _mean(values) -> float:
    return sum(values) / len(values)


def statistics_median(values) -> float:
    import statistics

    return statistics.median(values)


def held(row: dict) -> float:
    """Mean over ranks of (after training - before the model): state, buffers, workload."""
    return _mean([a - b for a, b in zip(row["after_training_mib_per_rank"], row["runtime_mib_per_rank"])])


def tensors(row: dict) -> float:
    """Mean over ranks of the tensor storage held after training, less DeepSpeed's bucket."""
    return _mean(row["tensor_mib_per_rank"]) - row["bucket_mib"]


def add_model_state(rows: list[dict]) -> None:
    """``measured_state_mib``: `tensors` minus the ``example`` run's at the same world and
    variant; ``held_mib``: `held` minus the example's (adds interpreter objects, allocator pages)."""
    base = {(r["world"], r["variant"]): r for r in rows if r["case"] == "example"}
    for r in rows:
        key = (r["world"], r["variant"])
        if r["case"] != "example" and key in base:
            r["measured_state_mib"] = tensors(r) - tensors(base[key])
            r["held_mib"] = held(r) - held(base[key])
            r["analytic_held_mib"] = analytic_held(r)
            r["state_vs_analytic"] = r["measured_state_mib"] / r["analytic_held_mib"]


def analytic_held(row: dict) -> float:
    """The analytic state a rank holds between meta-steps: ZeRO-3 keeps its gradient
    partition buffer, ZeRO 0-2 free theirs after each step (held only from the backward to
    the step), so (4 + 12/W) bytes per parameter under ZeRO-2."""
    grads = row.get("analytic_grads_mib", 4 * row["parameters"] / row["world"] / 2**20)
    return row["analytic_state_mib"] - (grads if row["stage"] < 3 else 0.0)


def table(rows: list[dict]) -> list[str]:
    lines = ["| case | parameters | ranks | ZeRO | peak per rank (MiB, max) | x ZeRO-2 peak | model-state "
             "part (MiB) | analytic, between steps (MiB) | measured / analytic | held (MiB) | final query loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    z2 = {(r["case"], r["world"]): max(r["peak_mib_per_rank"]) for r in rows if r["variant"] == "zero2"}
    for r in rows:
        peak = max(r["peak_mib_per_rank"])
        ratio = peak / z2[(r["case"], r["world"])] if (r["case"], r["world"]) in z2 else float("nan")
        measured = r.get("measured_state_mib")
        lines.append(f"| {r['case']} (BERT {r['hidden']} x {r['layers']}) | {r['parameters'] / 1e6:.1f}M | "
                     f"{r['world']} | {r['variant']} | {peak:.0f} | {ratio:.2f} | "
                     f"{'-' if measured is None else f'{measured:.0f}'} | {analytic_held(r):.0f} | "
                     f"{'-' if measured is None else format(r['state_vs_analytic'], '.2f')} | "
                     f"{'-' if measured is None else format(r['held_mib'], '.0f')} | "
                     f"{r['final_query_loss']:.5f} |")
    return lines


def throughput(rounds: int, profile_steps: int, timeout: float) -> dict:
    """ZeRO-2 and ZeRO-3 (body split) alternated at world 2 on the ``state`` case."""
    import statistics

    warmup = 2
    more = (f"train.profile_steps={profile_steps}", f"train.profile_warmup={warmup}")
    runs = {"zero2": [], "zero3": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            for variant in ("zero2", "zero3") if k % 2 == 0 else ("zero3", "zero2"):
                out = Path(tmp) / f"{variant}_{k}"
                row = run("state", variant, 2, warmup + profile_steps, out, timeout, more)
                report = json.loads((out / "profile.json").read_text())
                ranks = report["ranks"]
                row["step_ms"] = _mean([r["step_ms"] for r in ranks])
                row["phases_ms"] = {name: _mean([r["phases"].get(name, {}).get("ms", 0.0) for r in ranks])
                                    for name in ranks[0]["phases"]}
                row["collective_ms"] = {name: _mean([r["phases"].get(name, {}).get("collective_ms", 0.0)
                                                     for r in ranks]) for name in ranks[0]["phases"]}
                row["tasks_per_s"] = 4 * 1000.0 / row["step_ms"]  # 2 ranks x 2 tasks per meta-step
                runs[variant].append(row)
                print(json.dumps({k2: row[k2] for k2 in ("variant", "step_ms", "tasks_per_s", "phases_ms")}),
                      flush=True)
    ratios = [b["tasks_per_s"] / a["tasks_per_s"] for a, b in zip(runs["zero2"], runs["zero3"])]
    return {"machine": machine(), "world": 2, "rounds": rounds, "profile_steps": profile_steps,
            "zero3_over_zero2_tasks_per_s": statistics.median(ratios), "pair_ratios": ratios, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=["example", "state"], choices=list(CASES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--throughput", action="store_true", help="ZeRO-3 / ZeRO-2 tasks/s at world 2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--report", action="store_true", help="re-print the table of the results file")
    parser.add_argument("--update", action="store_true",
                        help="replace only the measured (case, variant, world) rows of the results file")
    args = parser.parse_args()
    if args.report:
        rows = json.loads(RESULTS.read_text())["runs"]
        add_model_state(rows)
        print("\n".join(table(rows)))
        return 0
    if args.throughput:
        result = throughput(args.rounds, args.profile_steps, args.timeout)
        for variant, rows in result["runs"].items():
            phases = {n: round(statistics_median([r["phases_ms"][n] for r in rows]), 1) for n in rows[0]["phases_ms"]}
            print(f"{variant}: {statistics_median([r['step_ms'] for r in rows]):.0f} ms per meta-step; {phases}")
        print(f"ZeRO-3 / ZeRO-2 tasks/s at world 2: {result['zero3_over_zero2_tasks_per_s']:.3f} "
              f"(pairs {', '.join(f'{x:.3f}' for x in result['pair_ratios'])})")
        THROUGHPUT.parent.mkdir(parents=True, exist_ok=True)
        tmp = THROUGHPUT.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(THROUGHPUT)
        print(f"wrote {THROUGHPUT}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            for world in args.worlds:
                for variant in args.variants:
                    rows.append(run(case, variant, world, args.steps,
                                    Path(tmp) / f"{case}_{variant}_{world}", args.timeout))
                    print(json.dumps(rows[-1]), flush=True)
    if args.update and RESULTS.exists():
        fresh = {(r["case"], r["variant"], r["world"]) for r in rows}
        rows = [r for r in json.loads(RESULTS.read_text())["runs"]
                if (r["case"], r["variant"], r["world"]) not in fresh] + rows
        order = {name: i for i, name in enumerate(CASES)}, {name: i for i, name in enumerate(VARIANTS)}
        rows.sort(key=lambda r: (order[0][r["case"]], r["world"], order[1][r["variant"]]))
    add_model_state(rows)
    print("\n".join(table(rows)))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"machine": machine(), "steps": args.steps, "runs": rows}, indent=2) + "\n")
    tmp.replace(RESULTS)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
