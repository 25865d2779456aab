"""A two-level model of the pooled exchange (issue 37 item 5): checked against the emulated
runs of benchmarks/topology.py, then extrapolated to 128 hosts x 8 GPUs.

One step of a rank (lookup of B bags of L ids in T row-wise tables pooled on their owners,
backward, sparse step) on H hosts of R ranks, each host's link to the others carrying b_net
bytes/s each way (shared by its R ranks), links inside a host b_nvl per rank:

    T(mode) = T_host(mode) + R X(mode) / b_net + C(mode) a_net      (emulated: a_net in T_host)

  T_host   the step on one host (compute and the intra-host exchange), measured: the 1 x 4 run
           of the same mode (hierarchical on one host does the gateway's extra work)
  X        bytes a rank sends across hosts per step (ids out; partial sums back and their
           gradients out again), `gmeta_ds.embedding.topology.cross_host_bytes` per bag x T B
           (16 B per id as the planner's estimate: the counters see 4-5)
  C        inter-host collectives per step (flat: 4 all-to-alls over W ranks, (W - R) remote
           peers each; hierarchical: 4 over H gateways, H - 1 remote peers)

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (puts the checkout on sys.path)
from gmeta_ds.embedding.topology import Topology, cross_host_bytes, row_cross_host_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "topology.json"
RATES = {"1gbit": 1e9 / 8, "100mbit": 1e8 / 8}
# Published figures: NVLink 4 (H100 SXM) 450 GB/s per GPU each way; InfiniBand NDR 400 Gbit/s,
# one NIC per GPU (50 GB/s per rank, 400 GB/s per host); latencies per message ~2 us and ~5 us.
NVL = {"bw": 450e9, "alpha": 2e-6}
IB = {"bw_per_rank": 50e9, "alpha": 5e-6}


def step_bytes(topology: Topology, s: dict, run: dict | None = None) -> dict[str, float]:
    """Cross-host bytes per rank and step, flat and hierarchical (the planner's estimate; for
    the row exchange from the run's measured distinct ratio and ids' overlap in a host)."""
    if run is not None and run.get("exchange") == "rows":
        flat, hier = row_cross_host_bytes(topology, s["dim"], s["length"], run["distinct_ratio"], run["id_overlap"])
    else:
        flat, hier = cross_host_bytes("row_wise", topology, s["dim"], s["length"])
    return {"flat": flat * s["tables"] * s["bags"], "hierarchical": hier * s["tables"] * s["bags"]}


def _host_run(runs: list[dict], run: dict) -> dict | None:
    """The one-host run of the same exchange and table size (its steps give T_host)."""
    return next((r for r in runs if r["hosts"] == 1 and r.get("exchange", "pooled") == run.get("exchange", "pooled")
                 and r.get("rows") == run.get("rows")), None)


def check(results: dict) -> list[dict]:
    """Predicted vs measured steps/s of every emulated run (the 1 x 4 run gives T_host)."""
    runs = results["runs"]
    rows = []
    for run in runs:
        host = _host_run(runs, run)
        if run["rate"] not in RATES or host is None:
            continue
        s = {**results["settings"], "rows": run.get("rows", results["settings"]["rows"])}
        topology = Topology(run["hosts"] * run["ranks_per_host"], run["ranks_per_host"])
        for how in ("flat", "hierarchical"):
            measured_x, model_x = run[how]["cross_host_bytes_per_step"], step_bytes(topology, s, run)[how]
            t_host = 1 / host[how]["steps_per_s"]
            predicted = 1 / (t_host + topology.ranks_per_host * model_x / RATES[run["rate"]])
            rows.append({"run": f"{run.get('exchange', 'pooled')} {run['hosts']} x {run['ranks_per_host']} at "
                                f"{run['rate']} ({s['rows']:,} rows)", "exchange": how,
                         "measured": run[how]["steps_per_s"], "predicted": predicted,
                         "error": predicted / run[how]["steps_per_s"] - 1,
                         "bytes_measured": measured_x, "bytes_model": model_x})
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
              f"({r['error']:+.0%}); cross-host B/step measured {r['bytes_measured']:,.0f}, "
              f"planner {r['bytes_model']:,.0f}")
    print("extrapolation, 8 GPUs per host, NVLink 450 GB/s + IB 50 GB/s per GPU, exchange time per step:")
    for r in extrapolate({**results["settings"], "exchange": "pooled"}):
        print(f"  {r['hosts']:>4} hosts ({r['gpus']:>5} GPUs), bags of {r['length']:>3}: flat {r['flat_ms']:.3f} ms, "
              f"hierarchical {r['hierarchical_ms']:.3f} ms ({r['speedup']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
