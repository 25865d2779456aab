"""A two-level model of the exchanges (issue 37 item 5): checked against the emulated runs of
benchmarks/topology.py (pooled on the owners and the deduplicated row exchange, flat and
hierarchical), then extrapolated to 128 hosts x 8 GPUs.

One step of a rank (lookup of B bags of L ids in T row-wise tables, backward, sparse step) on
H hosts of R ranks, each host's link to the others shared by its R ranks:

    T(mode) = T_host(mode) + sum over the step's inter-host all-to-alls s of t_link(pattern, X_s)

  T_host   the step on one host (compute and the intra-host exchange), measured: the 1 x 4 run
           of the same mode and table (hierarchical on one host does the gateway's extra work)
  X_s      bytes a rank sends across hosts in all-to-all s (ids; partial sums or rows; their
           gradients): the planner's estimate, `gmeta_ds.embedding.topology.cross_host_bytes`
           (pooled) or `row_cross_host_bytes` (rows, from the run's measured distinct ratio and
           ids' overlap in a host) per bag x T B, split into the three stages
  t_link   the link's all-to-all curve, measured apart from the runs by benchmarks/topology.py
           (``links``: a bare all-to-all of X bytes per rank, both hosts sending at once; the
           flat pattern for flat, the gateway pattern for hierarchical), interpolated. Links
           loaded both ways carry 52-88% of their nominal rate for 0.5-4 MB (docs/performance.md);
           the nominal rate, R X / b_net, is printed beside it (what the model used before).

On the GPU cluster the intra-host part is not measured but modelled too: the hierarchical
exchange moves the ids and sums once more inside the host (2 V_intra / b_nvl + 2 (R-1) a_nvl),
the flat one sends the host-local share of its all-to-all over NVLink in parallel with the
network share; compute is left out (the same for both), so the table compares exchange time.

    python benchmarks/topology_model.py     # check (benchmarks/results/topology.json) + extrapolation
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (puts the checkout on sys.path)
from gmeta_ds.embedding.topology import Topology, cross_host_bytes, row_cross_host_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "topology.json"
RATES = {"1gbit": 1e9 / 8, "100mbit": 1e8 / 8}
# Published figures: NVLink 4 (H100 SXM) 450 GB/s per GPU each way; InfiniBand NDR 400 Gbit/s,
# one NIC per GPU (50 GB/s per rank, 400 GB/s per host); latencies per message ~2 us and ~5 us.
NVL = {"bw": 450e9, "alpha": 2e-6}
IB = {"bw_per_rank": 50e9, "alpha": 5e-6}


def stage_bytes(topology: Topology, s: dict, run: dict | None = None) -> dict[str, list[float]]:
    """Bytes a rank sends across hosts in each inter-host all-to-all of a step (ids; rows or
    partial sums; their gradients), flat and hierarchical: the planner's estimate (for the row
    exchange from the run's measured distinct ratio and the ids' overlap in a host)."""
    bags = s["tables"] * s["bags"]
    if run is not None and run.get("exchange") == "rows":
        shape = (s["length"], run["distinct_ratio"], run["id_overlap"])
        (flat, hier), (ids, ids_hier) = (row_cross_host_bytes(topology, dim, *shape) for dim in (s["dim"], 0))
    else:  # ids and their (bag, owner) codes: the estimate without the sums (dim 0)
        (flat, hier), (ids, ids_hier) = (cross_host_bytes("row_wise", topology, dim, s["length"]) for dim in (s["dim"], 0))
    return {how: [bags * i, bags * (total - i) / 2, bags * (total - i) / 2]
            for how, i, total in (("flat", ids, flat), ("hierarchical", ids_hier, hier))}


def step_bytes(topology: Topology, s: dict, run: dict | None = None) -> dict[str, float]:
    """Cross-host bytes per rank and step, flat and hierarchical (`stage_bytes` summed)."""
    return {how: sum(stages) for how, stages in stage_bytes(topology, s, run).items()}


def link_seconds(curve: list[list[float]], nbytes: float) -> float:
    """Seconds of one inter-host all-to-all of ``nbytes`` per rank on a measured link curve
    ((bytes, seconds) points of benchmarks/topology.py's ``links``): piecewise linear through
    the origin and the points, the last segment's slope beyond them."""
    x, y = np.array([[0.0, 0.0], *curve], dtype=float).T
    if nbytes <= x[-1]:
        return float(np.interp(nbytes, x, y))
    return float(y[-1] + (nbytes - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2]))


def _host_run(runs: list[dict], run: dict) -> dict | None:
    """The one-host run of the same exchange and table size (its steps give T_host)."""
    return next((r for r in runs if r["hosts"] == 1 and r.get("exchange", "pooled") == run.get("exchange", "pooled")
                 and r.get("rows") == run.get("rows")), None)


def check(results: dict) -> list[dict]:
    """Predicted vs measured steps/s of every emulated run (the 1 x 4 run gives T_host): with
    the link's measured all-to-all curve (flat pattern for flat, gateway pattern for
    hierarchical) per inter-host stage, and with the nominal rate (``nominal``)."""
    runs, links = results["runs"], results.get("links", {})
    rows = []
    for run in runs:
        host = _host_run(runs, run)
        if run["rate"] not in RATES or host is None:
            continue
        s = {**results["settings"], "rows": run.get("rows", results["settings"]["rows"])}
        topology = Topology(run["hosts"] * run["ranks_per_host"], run["ranks_per_host"])
        stages = stage_bytes(topology, s, run)
        for how in ("flat", "hierarchical"):
            model_x = sum(stages[how])
            t_host = 1 / host[how]["steps_per_s"]
            nominal = 1 / (t_host + topology.ranks_per_host * model_x / RATES[run["rate"]])
            curve = links.get(run["rate"], {}).get("flat" if how == "flat" else "gateway")
            predicted = 1 / (t_host + sum(link_seconds(curve, b) for b in stages[how])) if curve else nominal
            rows.append({"run": f"{run.get('exchange', 'pooled')} {run['hosts']} x {run['ranks_per_host']} at "
                                f"{run['rate']} ({s['rows']:,} rows)", "exchange": how,
                         "measured": run[how]["steps_per_s"], "predicted": predicted,
                         "error": predicted / run[how]["steps_per_s"] - 1, "nominal": nominal,
                         "nominal_error": nominal / run[how]["steps_per_s"] - 1,
                         "bytes_measured": run[how]["cross_host_bytes_per_step"], "bytes_model": model_x})
    return rows


def gpu_exchange_s(hosts: int, per_host: int, s: dict, how: str) -> float:
    """Modelled exchange time per step on ``hosts`` x ``per_host`` GPUs (see the docstring)."""
    topology = Topology(hosts * per_host, per_host)
    cross = step_bytes(topology, s)[how]
    net = cross / IB["bw_per_rank"]
    ids_local = 4 * s["length"] * s["tables"] * s["bags"]
    if how == "flat":
        peers = topology.world - 1
        local = (ids_local + 8 * s["dim"] * s["tables"] * s["bags"]) * (per_host - 1) / topology.world
        return 4 * peers * IB["alpha"] + max(net, local / NVL["bw"])
    intra = 2 * (ids_local + 8 * s["dim"] * s["tables"] * s["bags"] * min(per_host, s["length"]))
    return 4 * (hosts - 1) * IB["alpha"] + net + intra / NVL["bw"] + 4 * 2 * (per_host - 1) * NVL["alpha"]


def extrapolate(s: dict) -> list[dict]:
    rows = []
    for length in (s["length"], 200):
        for hosts in (2, 8, 32, 128):
            shape = {**s, "length": length}
            flat, hier = (gpu_exchange_s(hosts, 8, shape, how) for how in ("flat", "hierarchical"))
            rows.append({"hosts": hosts, "gpus": 8 * hosts, "length": length, "flat_ms": 1e3 * flat,
                         "hierarchical_ms": 1e3 * hier, "speedup": flat / hier})
    return rows


def main() -> int:
    results = json.loads(RESULTS.read_text())
    print("check against the emulated runs (steps/s):")
    for r in check(results):
        print(f"  {r['run']:>40} {r['exchange']:>12}: measured {r['measured']:6.2f}, model {r['predicted']:6.2f} "
              f"({r['error']:+.0%}; nominal rate {r['nominal']:.2f}, {r['nominal_error']:+.0%}); cross-host "
              f"B/step measured {r['bytes_measured']:,.0f}, planner {r['bytes_model']:,.0f}")
    print("extrapolation, 8 GPUs per host, NVLink 450 GB/s + IB 50 GB/s per GPU, exchange time per step:")
    for r in extrapolate({**results["settings"], "exchange": "pooled"}):
        print(f"  {r['hosts']:>4} hosts ({r['gpus']:>5} GPUs), bags of {r['length']:>3}: flat {r['flat_ms']:.3f} ms, "
              f"hierarchical {r['hierarchical_ms']:.3f} ms ({r['speedup']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
