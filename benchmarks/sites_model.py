"""The scaling model's inter-site term (issue 38): what a meta-step costs when a run spans sites
joined by a link of R bytes/s per direction and one-way latency L.

    synchronous training over the link:     T = max(T_all, B_step / R) + n_step L
    local outer steps, a sync every H:      T = T_site + (B_sync / R + W) / H,   W = n_sync L + D

  T_all   a meta-step of the ranks of all sites as one cluster (no slow link)
  T_site  a site's meta-step with nothing crossing sites (compute, its own collectives)
  B_step  bytes a site sends across per synchronous meta-step: its share of the dense
          reduction, 2 (S-1)/S 4P, and the all-to-alls' bytes bound for the other site's ranks
  B_sync  bytes a site sends across per synchronisation (`engine/outer_sync.py`): the dense
          change, 2 (S-1)/S 4P in fp32 (an all-reduce), (S-1) 2P in bf16, (S-1) (P + 4P/256) in
          int8 (all-gathers), and the rows some site touched since the last one, ids + values,
          (S-1) U (4 + d b) per table (U: distinct rows a site's H meta-steps touch)
  W       a synchronisation's fixed cost: n collectives crossing the link (per synchronisation
          2 all-gathers, the payloads' lengths and the payloads: every table's ids and rows, and
          the dense change in bf16/int8, plus the dense all-reduce in fp32; per synchronous meta-step the
          dense reduce-scatter + all-gather, 4 all-to-alls per micro-batch, the small
          all-reduces) times L, and D, the wait for the slower site plus the synchronisation's
          own work

Synchronous training's traffic is spread over the step (the all-to-alls of every micro-batch,
the gradient reduction) and overlaps the other ranks' compute, so a step is the longer of the
two; the outer synchronisation blocks every rank, so it adds. Checked against
benchmarks/sites.py's emulated runs (`check`), calibrated on three of them: T_site the H=200
run over 100 Mbit/s (its B/R removed), T_all the synchronous run over 100 Mbit/s
(compute-bound: its bytes take 8 of its 74 ms per step at that rate), W the H=1 run over 100
Mbit/s (L ~ 0 on veths and a bridge, so W is D: the wait and the work); every other run is
predicted from its measured bytes (the busier veth's). On the emulated link a synchronisation
costs max(B_sync / R, W), not the sum: tbf's 64 KB bucket lets the first bytes through at once
and the faster site's transfer runs while it waits for the slower one (``overlap``). A real
link has no bucket and L > 0: the extrapolation (`extrapolate`, called from
benchmarks/scaling_model.py: two sites of 512 GPUs over a 10 and 100 Gbit/s link) adds them.

    python benchmarks/sites_model.py      # the check on benchmarks/results/sites.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from comm_model import expected_unique, zipf_probs

RESULTS = Path(__file__).resolve().parent / "results" / "sites.json"
TASKS_PER_STEP = 64          # the demo's tasks per meta-step, all sites together
SYNC_COLLECTIVES_STEP = 9    # dense reduce-scatter + all-gather, 4 all-to-alls, 3 small all-reduces


def sync_collectives(dtype: str) -> int:
    """Collectives crossing sites per synchronisation: one all-gather of the payloads' lengths
    and one of the payloads (every table's touched rows, and the dense fragment in bf16/int8),
    plus the all-reduce of an fp32 dense fragment (`OuterSync.synchronise`)."""
    return 3 if dtype == "fp32" else 2


def step_time(t_site: float, bytes_dir: float, rate: float, fixed: float, every: int | None,
              overlap: bool = False) -> float:
    """Seconds per meta-step: ``bytes_dir`` sent per direction and ``fixed`` seconds (W; for
    synchronous training n_step L) per synchronisation every ``every`` (H) meta-steps; ``every``
    None: synchronous training (``t_site`` is then T_all). ``overlap``: the emulated link's
    max(B/R, W) instead of B/R + W."""
    if every is None:
        return max(t_site, bytes_dir / rate) + fixed
    link = bytes_dir / rate
    return t_site + (max(link, fixed) if overlap else link + fixed) / every


def _rate(text: str) -> float:
    """tc's rate ("100mbit") in bytes/s (tc's mbit = 10^6 bit)."""
    return float(text.replace("gbit", "e9").replace("mbit", "e6")) / 8


def _measured(run: dict) -> tuple[float, float]:
    """(seconds per meta-step, bytes per direction per meta-step: the busier veth) of a run."""
    steps = run["meta_steps"]
    return run["train_s"] / steps, max(run["wire_bytes"]) / steps


def calibrate(runs: list[dict]) -> dict:
    """T_site from the H=200 run over 100mbit, T_all from the synchronous run, W from H=1."""
    by = {(r["run"], r["rate"]): r for r in runs}
    t, b = _measured(by[("H=200", "100mbit")])
    t_all, b_all = _measured(by[("synchronous", "100mbit")])
    t_site = t - b / _rate("100mbit")
    return {"t_site_s": t_site, "t_all_s": t_all, "fixed_s": _measured(by[("H=1", "100mbit")])[0] - t_site,
            "sync_link_s_100mbit": b_all / _rate("100mbit"),
            "calibration_runs": ["H=200 100mbit", "synchronous 100mbit", "H=1 100mbit"]}


def check(runs: list[dict]) -> dict:
    """Predicted against measured tasks/s of every emulated two-site run."""
    cal = calibrate(runs)
    rows = []
    for r in runs:
        if r["rate"] == "none":
            continue
        t, b = _measured(r)
        every = None if r["sites"] == 1 else r["sync_every"]
        base, fixed = (cal["t_all_s"], 0.0) if every is None else (cal["t_site_s"], cal["fixed_s"])
        pred = step_time(base, b * (every or 1), _rate(r["rate"]), fixed, every, overlap=True)
        rows.append({"run": r["run"], "rate": r["rate"], "measured_tasks_per_s": TASKS_PER_STEP / t,
                     "predicted_tasks_per_s": TASKS_PER_STEP / pred, "error": t / pred - 1,
                     "link_ms_per_step": b / _rate(r["rate"]) * 1e3,
                     "role": "calibration" if f"{r['run']} {r['rate']}" in cal["calibration_runs"] else "check"})
    held = [abs(x["error"]) for x in rows if x["role"] == "check"]
    return {"calibration": cal, "rows": rows, "max_abs_error": max(held) if held else None}


def sync_bytes(dense_params: int, tables: list[tuple[int, float]], dtype: str, sites: int = 2) -> float:
    """B_sync: bytes a site sends across per synchronisation; ``tables``: (dim, distinct rows
    touched by a site since the last synchronisation) per sharded table."""
    dense = {"fp32": 2 * (sites - 1) / sites * 4 * dense_params, "bf16": (sites - 1) * 2 * dense_params,
             "int8": (sites - 1) * (dense_params + 4 * dense_params / 256)}[dtype]
    value = {"fp32": 4, "bf16": 2, "int8": 1}[dtype]
    rows = sum((sites - 1) * touched * (4 + dim * value + 4 * (dtype == "int8")) for dim, touched in tables)
    return dense + rows


def extrapolate(t_site: float, t_all: float, step_bytes: float, touched, dense_params: int, links: dict,
                latency: float, every=(1, 10, 50, 200), dtypes=("fp32", "int8")) -> list[dict]:
    """Step times of two sites over each inter-site link: synchronous (``t_all``: both sites as
    one cluster; ``step_bytes`` per direction per meta-step) and every H in ``every``
    (``t_site``: one site's step; ``touched(H)``: the (dim, distinct rows) per table a site
    touches in H meta-steps)."""
    rows = []
    for link, rate in links.items():
        sync = step_time(t_all, step_bytes, rate, SYNC_COLLECTIVES_STEP * latency, None)
        rows.append({"link": link, "run": "synchronous", "step_ms": sync * 1e3, "cross_site_ms": (sync - t_site) * 1e3,
                     "bytes_per_step": step_bytes, "speedup": 1.0})
        for h in every:
            for dtype in dtypes:
                b = sync_bytes(dense_params, touched(h), dtype)
                t = step_time(t_site, b, rate, sync_collectives(dtype) * latency, h)
                rows.append({"link": link, "run": f"H={h} {dtype}", "step_ms": t * 1e3,
                             "cross_site_ms": (t - t_site) * 1e3, "bytes_per_step": b / h, "speedup": sync / t})
    return rows


def gpu_two_sites(facts: dict, args, gpu_step, a2a_bytes, ib: dict, site_world: int = 512) -> list[dict]:
    """`extrapolate` for two sites of ``site_world`` GPUs (weak, InfiniBand ``ib`` inside) over
    10 / 100 Gbit/s, with the scaling model's ``gpu_step`` and ``a2a_bytes`` (passed in:
    benchmarks/scaling_model.py imports this module)."""
    world, ids = 2 * site_world, site_world * args.weak_tasks * facts["ids_per_task"]
    t_site, t_all = (gpu_step(facts, w, args.weak_tasks, args.gpu_task_us * 1e-6, args.gpu_fixed_ms * 1e-3,
                              ib)["total"] for w in (site_world, world))
    a2a = sum(a2a_bytes(facts, world, args.weak_tasks))  # per rank; site_world of its world - 1 peers elsewhere
    step_bytes = 4.0 * facts["dense_params"] + a2a * site_world * site_world / (world - 1)
    probs = [(dim, zipf_probs(rows)) for rows, dim in facts["sharded_tables"]]
    touched = lambda h: [(dim, expected_unique(int(h * ids), p)) for dim, p in probs]  # distinct rows in H steps
    return extrapolate(t_site, t_all, step_bytes, touched, facts["dense_params"],
                       {"10gbit": 1.25e9, "100gbit": 12.5e9}, args.inter_site_latency_ms * 1e-3)


def two_sites(models: dict, args, gpu_step, a2a_bytes, ib: dict) -> dict:
    """`gpu_two_sites` for each of the scaling model's ``models``, printed (synchronous, H=50)."""
    rows = {m: gpu_two_sites(f, args, gpu_step, a2a_bytes, ib) for m, f in models.items()}
    print(f"\ntwo sites x 512 GPUs, weak, {args.inter_site_latency_ms:g} ms one-way: " + "; ".join(
        f"{m} {r['link']} {r['run']} {r['step_ms']:.1f} ms x{r['speedup']:.1f}" for m, rs in rows.items()
        for r in rs if r["run"] in ("synchronous", "H=50 fp32", "H=50 int8")))
    return rows


def main() -> int:
    runs = json.loads(RESULTS.read_text())["runs"]
    out = check(runs)
    cal = out["calibration"]
    print(f"T_site {cal['t_site_s'] * 1e3:.1f} ms, T_all {cal['t_all_s'] * 1e3:.1f} ms (its bytes take "
          f"{cal['sync_link_s_100mbit'] * 1e3:.1f} ms at 100mbit), W {cal['fixed_s'] * 1e3:.1f} ms "
          f"(from {', '.join(cal['calibration_runs'])})")
    print(f"{'run':>26} {'link':>8} {'role':>11} {'measured':>9} {'model':>9} {'error':>7} {'link ms/step (B/R)':>18}")
    for r in out["rows"]:
        print(f"{r['run']:>26} {r['rate']:>8} {r['role']:>11} {r['measured_tasks_per_s']:>9,.0f} "
              f"{r['predicted_tasks_per_s']:>9,.0f} {r['error']:>+7.1%} {r['link_ms_per_step']:>18.2f}")
    print(f"max |error| over the held-out runs: {out['max_abs_error']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
