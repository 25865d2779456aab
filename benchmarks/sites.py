"""Meta-learning across two sites over an emulated wide-area link (issue 38 item 4).

Two sites, one rank each, as two network namespaces (`emulated_cluster`, prefix ``gmsite``)
whose link is limited by tbf (``--rates``, default 100mbit and 10mbit each way). Every run is
``gmeta-ds train`` on the demo configuration (examples/synthetic/config.yaml; no baseline, no
few-shot curve: only the held-out AUC is scored) at the same number of meta-steps:

- ``synchronous``: 2 ranks as one site (sites.count 1), every meta-step's reduction and
  table exchange over the link;
- ``H=1`` .. ``H=200``: sites.count 2, the outer synchronisation every H meta-steps (DiLoCo's
  outer Nesterov step, lr 0.7, momentum 0.9), fp32 deltas; H=50 also with int8 and bf16 deltas,
  and H in {10, 50, 200} (H=50 also int8) with plain averaging (outer lr 1, no momentum);
- ``one site alone``: 1 rank with half the tasks per meta-step (its site's share), no link.

Per run: tasks/s over the training loop (site 0's metrics.jsonl windows, startup, final
synchronisation and evaluation excluded), cross-site bytes per task by our counter
(`Sites.sent`, both sites: summary.json's ``sites``) and as the kernel counted them on the two
inter-site veths (tx_bytes before/after, headers and everything else included: synchronous
training's traffic too), held-out AUC (site 0's summary ``eval.auc``).

    python benchmarks/sites.py [--meta-steps 1200] [--lock /path/bench.lock]   # root, ~25 min
    python benchmarks/sites.py --plot        # docs/img/sites_auc_bytes.png from the saved JSON
    python benchmarks/sites.py --table       # the saved JSON's table

``--lock``: a file every run holds an exclusive flock on (other benchmarks on the machine wait).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch; puts the checkout on sys.path)
from emulated_cluster import emulated_cluster, rank_env, wait_all  # noqa: E402

PREFIX, SUBNET, PORT = "gmsite", 38, 29538
CONFIG = common.REPO / "examples" / "synthetic" / "config.yaml"
RESULTS = common.REPO / "benchmarks" / "results" / "sites.json"
CHART = common.REPO / "docs" / "img" / "sites_auc_bytes.png"
COMMON = ("eval.baseline=false", "eval.few_shot=[]", "eval.steps_curve=[]", "train.progress=false")
TASKS_PER_STEP = 64  # the demo's meta.tasks_per_meta_step (all sites together)
PLAIN = ("sites.outer_lr=1.0", "sites.outer_momentum=0.0", "sites.nesterov=false")  # outer step: the mean (default)
DILOCO = ("sites.outer_lr=0.7", "sites.outer_momentum=0.9", "sites.nesterov=true")  # DiLoCo's outer step
RUNS = (  # name, ranks, overrides
    ("synchronous", 2, ()),
    ("H=1", 2, ("sites.count=2", "sites.sync_every=1", *DILOCO)),
    ("H=10", 2, ("sites.count=2", "sites.sync_every=10", *DILOCO)),
    ("H=50", 2, ("sites.count=2", "sites.sync_every=50", *DILOCO)),
    ("H=200", 2, ("sites.count=2", "sites.sync_every=200", *DILOCO)),
    ("H=50 int8", 2, ("sites.count=2", "sites.sync_every=50", "sites.delta_dtype=int8", *DILOCO)),
    ("H=50 bf16", 2, ("sites.count=2", "sites.sync_every=50", "sites.delta_dtype=bf16", *DILOCO)),
    *((f"H={h}{' int8' * q} plain averaging", 2, ("sites.count=2", f"sites.sync_every={h}", *PLAIN,
                                                   *(("sites.delta_dtype=int8",) * q)))
      for h, q in ((10, 0), (50, 0), (200, 0), (50, 1))),
)
ALONE = ("one site alone", 1, (f"meta.tasks_per_meta_step={TASKS_PER_STEP // 2}",))


@contextlib.contextmanager
def locked(path: str | None):
    """An exclusive flock on ``path`` (flock(1)'s lock: shared with `flock path command`)."""
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def train_argv(out: Path, steps: int, overrides, config: Path = CONFIG, extra=()) -> list[str]:
    """The CLI call of one rank (``extra``: --set overrides of every run, after the run's own)."""
    sets = [*COMMON, f"output_dir={out}", f"train.meta_steps={steps}", *overrides, *extra]
    return [sys.executable, "-P", "-m", "gmeta_ds.cli", "train", "--config", str(config), "--overwrite",
            *[x for s in sets for x in ("--set", s)]]


def start(hosts, argv: list[str], out: Path, per_host: int = 1, port: int = PORT) -> list[subprocess.Popen]:
    """``per_host`` ranks per host (numbered host by host), each logging to ``out``.rank<r>.log."""
    procs = []
    for rank in range(len(hosts) * per_host):
        log = open(out.parent / f"{out.name}.rank{rank}.log", "w")
        procs.append(subprocess.Popen(hosts[rank // per_host].command(argv), env=rank_env(hosts, per_host, rank, port),
                                      cwd=common.REPO, stdout=log, stderr=subprocess.STDOUT, text=True))
        log.close()
    return procs


def launch(hosts, argv: list[str], out: Path, timeout: float, per_host: int = 1, port: int = PORT) -> list[int]:
    """Run ``argv`` on every host (``per_host`` ranks each); the bytes each host sent on its link meanwhile."""
    before = [h.tx_bytes() for h in hosts]
    procs = start(hosts, argv, out, per_host, port)
    wait_all(procs, timeout)
    after = [h.tx_bytes() for h in hosts]
    failed = [r for r, p in enumerate(procs) if p.returncode]
    if failed:
        tail = (out.parent / f"{out.name}.rank{failed[0]}.log").read_text()[-3000:]
        raise RuntimeError(f"{out.name}: rank(s) {failed} failed\n{tail}")
    return [a - b for a, b in zip(after, before)]


def train_seconds(out: Path) -> float:
    """The training loop's seconds on site 0's rank 0: the sum of metrics.jsonl's windows."""
    seconds, done = 0.0, 0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "tasks_per_s" in record:
            seconds += (record["tasks"] - done) / record["tasks_per_s"]
            done = record["tasks"]
    return seconds


def trainer_bytes(out: Path, ranks: int) -> float:
    """Bytes the ranks of a one-site run sent to each other by the trainer's counters (rank 0's
    dense reduction + table exchanges over metrics.jsonl's windows, times the ranks: the
    counters of synchronous training, which `Sites.sent` does not see)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return ranks * sum(r.get("dense_allreduce_bytes", 0) + r.get("embedding_comm_bytes", 0) for r in records)


def result(name: str, rate: str | None, out: Path, wire: list[int]) -> dict:
    """One run's numbers from its summaries (site 0's, and site 1's for its byte counter)."""
    summary = json.loads((out / "summary.json").read_text())
    sites = summary.get("sites", {})
    tasks = sites.get("tasks_seen_all_sites", summary["tasks_seen"])
    if sites:
        other = json.loads((out / "sites" / "site-1" / "summary.json").read_text())["sites"]["cross_site_bytes_site"]
        counted = sites["cross_site_bytes_site"] + other
    else:
        counted = trainer_bytes(out, summary["world_size"])
    seconds = train_seconds(out)
    return {"run": name, "rate": rate or "none", "sites": sites.get("count", 1), "sync_every": sites.get("sync_every"),
            "delta_dtype": sites.get("delta_dtype"), "meta_steps": summary["meta_steps"], "tasks": tasks,
            "train_s": seconds, "tasks_per_s": tasks / seconds, "counter_bytes_per_task": counted / tasks,
            "wire_bytes_per_task": sum(wire) / tasks if wire else 0.0, "wire_bytes": wire,
            "synchronisations": sites.get("synchronisations"), "auc": summary.get("eval", {}).get("auc"),
            "elapsed_s": summary["elapsed_s"]}


def run(spec, rate: str | None, steps: int, root: Path, lock: str | None, timeout: float,
        config: Path = CONFIG, extra=()) -> dict:
    """One benchmark run: two ranks over the emulated link at ``rate``, or one rank alone."""
    name, ranks, overrides = spec
    out = root / f"{name.replace(' ', '_').replace('=', '')}_{rate or 'alone'}"
    argv = train_argv(out, steps, overrides, config, extra)
    with locked(lock):
        if ranks == 1:
            env = {**common.bench_env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(common.free_port()), "OMP_NUM_THREADS": "1"}
            common.run_group(argv, timeout, name, env=env)
            wire = []
        else:
            with emulated_cluster(2, rate, prefix=PREFIX, subnet=SUBNET) as hosts:
                wire = launch(hosts, argv, out, timeout)
    return result(name, rate, out, wire)


def table(runs: list[dict]) -> str:
    """The runs as a markdown table (ratios against synchronous training over the same link)."""
    sync = {r["rate"]: r for r in runs if r["run"] == "synchronous"}
    lines = ["| link | run | tasks/s | x sync | bytes/task, our counters | bytes/task, veths | x fewer bytes "
             "(counters / veths) | held-out AUC |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        base = sync.get(r["rate"])
        speed = f"{r['tasks_per_s'] / base['tasks_per_s']:.2f}" if base else "-"
        fewer = "-"
        if base and r["wire_bytes_per_task"] and r is not base:
            fewer = (f"{base['counter_bytes_per_task'] / r['counter_bytes_per_task']:,.0f} / "
                     f"{base['wire_bytes_per_task'] / r['wire_bytes_per_task']:,.0f}")
        lines.append(f"| {r['rate']} | {r['run']} | {r['tasks_per_s']:,.0f} | {speed} | "
                     f"{r['counter_bytes_per_task']:,.0f} | {r['wire_bytes_per_task']:,.0f} | {fewer} "
                     f"| {'-' if r['auc'] is None else format(r['auc'], '.4f')} |")
    return "\n".join(lines)


def plot(data: dict, path: Path = CHART) -> None:
    """AUC against the veths' cross-site bytes per task (log x), one point per run over 100mbit
    (over 10mbit the same weights and bytes: the same point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    runs = [r for r in data["runs"] if r["rate"] == "100mbit"]
    groups = (("synchronous", "*", lambda r: r["sites"] == 1),
              ("2 sites, DiLoCo outer step (lr 0.7, Nesterov 0.9)", "o", lambda r: "plain" not in r["run"]),
              ("2 sites, plain averaging", "s", lambda r: "plain" in r["run"]))
    for label, marker, member in groups:
        chosen = [r for r in runs if member(r)]
        runs = [r for r in runs if not member(r)]
        ax.scatter([r["wire_bytes_per_task"] for r in chosen], [r["auc"] for r in chosen], marker=marker, s=50,
                   label=label)
        for r in chosen:
            ax.annotate(r["run"].replace(" plain averaging", ""), (r["wire_bytes_per_task"], r["auc"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    for r in data["runs"]:
        if r["rate"] == "none":
            ax.axhline(r["auc"], color="grey", linestyle=":", label=f"{r['run']} (half the tasks)")
    ax.set_xscale("log")
    ax.set_xlabel("cross-site bytes per task (both inter-site veths)")
    ax.set_ylabel("held-out AUC")
    ax.set_title(f"Two sites over an emulated link, demo configuration, {data['meta_steps']} meta-steps")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def saved_runs(path: str, steps: int) -> list[dict]:
    """The runs already in ``path`` at ``steps`` meta-steps (``--runs`` replaces only its own)."""
    saved = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    return saved.get("runs", []) if saved.get("meta_steps") == steps else []


def ordered(runs: list[dict]) -> list[dict]:
    """Runs in the order of `RUNS` (then the one-site run), faster link first."""
    names = [s[0] for s in (*RUNS, ALONE)]
    return sorted(runs, key=lambda r: (names.index(r["run"]), r["rate"] == "10mbit"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meta-steps", type=int, default=1200, help="the demo's default")
    parser.add_argument("--rates", nargs="+", default=["100mbit", "10mbit"])
    parser.add_argument("--runs", nargs="+", help="only these runs (names as in the table; the others' results in "
                        "--out are kept)")
    parser.add_argument("--lock", help="a file to hold a flock on during each run")
    parser.add_argument("--work", default="/tmp/gmsite_runs", help="the runs' output folders")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--config", default=str(CONFIG), help="another run config (e.g. a communication-bound one)")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                        help="a --set override of every run (repeatable)")
    parser.add_argument("--plot", action="store_true", help="only draw the chart from --out")
    parser.add_argument("--table", action="store_true", help="only print the table of --out")
    args = parser.parse_args()
    if args.plot or args.table:
        data = json.loads(Path(args.out).read_text())
        return plot(data) if args.plot else print(table(data["runs"]))
    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    chosen = [s for s in (*RUNS, ALONE) if not args.runs or s[0] in args.runs]
    runs = saved_runs(args.out, args.meta_steps) if args.runs else []
    for spec in chosen:
        for rate in (args.rates if spec[1] > 1 else [None]):
            started = time.perf_counter()
            new = run(spec, rate, args.meta_steps, root, args.lock, args.timeout, Path(args.config), args.sets)
            runs = [r for r in runs if (r["run"], r["rate"]) != (new["run"], new["rate"])] + [new]
            print(json.dumps({**new, "wall_s": round(time.perf_counter() - started, 1)}), flush=True)
            config = Path(args.config).resolve()
            shown = str(config.relative_to(common.REPO)) if config.is_relative_to(common.REPO) else str(config)
            Path(args.out).write_text(json.dumps({"meta_steps": args.meta_steps, "config": shown,
                                                  "overrides": [*COMMON, *args.sets], "runs": ordered(runs)},
                                                 indent=2) + "\n")
    print(table(ordered(runs)))
    return None


if __name__ == "__main__":
    main()
