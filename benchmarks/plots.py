"""PNG charts of the benchmark results (benchmarks/results/*.json) under docs/img/.

    python benchmarks/plots.py [--results benchmarks/results] [--out docs/img]

One chart per benchmark whose JSON exists (a missing one is skipped and named): inner_loop,
embedding_comm, comm_model, memory, scaling, overlap, meta_io.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]


def bars(ax, labels, groups: dict, ylabel: str, log: bool = False, fmt: str = "{:.0f}") -> None:
    """Grouped bars: ``groups`` name -> values (one per label), values written on top."""
    width = 0.8 / len(groups)
    for i, (name, values) in enumerate(groups.items()):
        xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(labels))]
        rects = ax.bar(xs, values, width, label=name)
        ax.bar_label(rects, [fmt.format(v) for v in values], fontsize=7, padding=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)


def inner_loop(d, ax):
    rows = d["results"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    threads = sorted({r["threads"] for r in rows})
    ms = {(r["variant"], r["threads"]): r["ms_per_micro_batch"] for r in rows}
    bars(ax, variants, {f"{t} thread(s)": [ms[v, t] for v in variants] for t in threads},
         "ms per micro-batch (32 tasks)", fmt="{:.1f}")
    ax.set_title("Inner loop: MAML forward + outer backward (median)")


def embedding_comm(d, ax):
    parts = d["results"]["bytes"]
    variants = list(parts[0]["variants"])
    bars(ax, variants, {f"{p['rows']:,} rows": [sum(p["variants"][v]["bytes_per_rank"]) for v in variants]
                        for p in parts}, "bytes per meta-step (both ranks)", log=True, fmt="{:.2g}")
    ax.set_title("Embedding traffic per meta-step, world 2")


def comm_model(d, ax):
    model = d["model"]
    ax.loglog([m["world"] for m in model if m["world"] > 1], [m["replicated_bytes"] for m in model if m["world"] > 1],
              "-", label="replicated: ring all-reduce (model)")
    ax.loglog([m["world"] for m in model if m["world"] > 1], [m["sharded_bytes"] for m in model if m["world"] > 1],
              "-", label="sharded fused+dedup (model, E[U])")
    measured = [c for c in d["checks"] if c["world"] > 1]
    ax.loglog([c["world"] for c in measured], [c["measured"]["total"] for c in measured], "o",
              label="sharded, counters (each rank)")
    ax.set_xlabel("world size W")
    ax.set_ylabel("bytes sent per rank per meta-step")
    p = d["parameters"]
    ax.set_title(f"{p['tasks']} tasks x {p['ids_per_task']} ids per meta-step, "
                 f"{p['rows']:,} x {p['dim']} fp32 table")
    ax.legend(fontsize=8)


def memory(d, ax):
    runs = d["runs"]
    labels = [f"{r['plan']}\nW={r['world_size']}" for r in runs]
    bars(ax, labels, {"training peak, max rank (VmHWM)": [r["training_vmhwm_mib_max"] for r in runs],
                      "end peak, max rank": [r["vmhwm_mib_max"] for r in runs],
                      "item table model": [r["item_table_model_mib"] for r in runs]}, "MiB")
    p = d["parameters"]
    ax.set_title(f"Peak RSS per rank, {p['items']:,} x {p['dim']} item table")


def scaling(d, ax):
    configs = d["configs"]
    series = {}
    for mode in ("strong", "weak"):
        for world in [w for w in d["worlds"] if w > 1]:
            series[f"{mode}, W={world}"] = [c["modes"].get(mode, {}).get(str(world), {}).get("speedup", 0.0)
                                            for c in configs.values()]
    bars(ax, list(configs), series, "tasks/s over world 1 (median of paired cycles)", fmt="{:.2f}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title(f"Speed-up over one process, {d['machine']['cpu_count']} cores "
                 "(W above the cores is oversubscribed)")


def overlap(d, ax):
    rows = d["results"]
    bars(ax, [f"GAS {r['gas']}" for r in rows],
         {m: [r[m]["step_ms"] for r in rows] for m in ("sequential", "overlapped")}, "ms per meta-step (median)",
         fmt="{:.1f}")
    ax.set_title(f"Lookup prefetch, world {d['parameters']['world']}: "
                 + ", ".join(f"GAS {r['gas']} {r['paired_speedup']:.2f}x (paired)" for r in rows))


def meta_io(d, ax):
    loader = d["results"]["loader"]
    names = list(loader)
    bars(ax, names, {"loader (prefetch off)": [loader[n]["off"]["tasks_per_s"] for n in names],
                     "trainer consumes": [d["results"]["trainer"]["tasks_per_s"]] * len(names)},
         "tasks/s", log=True, fmt="{:.3g}")
    ax.set_title("Meta-IO: loader throughput vs trainer consumption")


CHARTS = {"inner_loop": inner_loop, "embedding_comm": embedding_comm, "comm_model": comm_model,
          "memory": memory, "scaling": scaling, "overlap": overlap, "meta_io": meta_io}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in CHARTS.items():
        path = args.results / f"{name}.json"
        if not path.exists():
            print(f"skipped {name}: no {path}")
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        draw(json.loads(path.read_text()), ax)
        fig.tight_layout()
        fig.savefig(args.out / f"{name}.png", dpi=110)
        plt.close(fig)
        print(f"wrote {args.out / name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
