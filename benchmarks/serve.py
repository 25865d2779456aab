"""Serving throughput and latency: adapt + score per user over HTTP, against the same call in Python.

The model is the demo's (examples/synthetic/config.yaml: MeLU, d = 16, hidden [64, 32],
``mlp.*`` adapted with 2 inner steps; the synthetic data's fields and sizes), exported with
``gmeta-ds export --config`` from its initial weights (speed does not depend on the values).
Each user sends ``--support`` rows with labels (default 20) and ``--candidates`` items (100),
ids drawn at random from each field; the cache is off (``--cache-size 0``) and every user id is
new, so every request adapts.

Measured, for ``adapt`` (support rows) and ``score`` (no support: the meta-initialisation):

- ``direct``: `ServedModel.predict` called in this process on batches of 1 and of 64 users
  (no HTTP): the adaptation core's own users/s and per-batch latency;
- ``http``: ``gmeta-ds serve`` in a subprocess (``--max-batch 64 --max-wait-ms 1``), with 1, 8
  and 64 concurrent clients (asyncio + httpx, at most 8 per client process: httpx's pool slows
  down past that; bodies encoded beforehand), each for ``--seconds`` (default 8): users/s and
  the p50 / p99 of each request's latency.

The client shares the machine's cores with the server: on a 2-core machine the client's own
JSON and HTTP work is part of what limits the HTTP numbers. Results go to
``benchmarks/results/serve.json`` (or ``--out``) and are printed as a table.

Run from the repo root:  python benchmarks/serve.py [--seconds 8] [--clients 1 8 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, bench_env, free_port, machine  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402


def build_export(folder: Path) -> Path:
    """The demo's model with its initial weights, exported as gmeta-ds export --config does."""
    from gmeta_ds.config import load_config
    from gmeta_ds.engine.ds_engine import save_weights
    from gmeta_ds.serving.recipe import export_run
    from gmeta_ds.workloads.ctr import build_data, build_learner

    cfg = load_config(REPO / "examples/synthetic/config.yaml")
    learner = build_learner(cfg, build_data(cfg).fields)
    weights = save_weights(learner.state_dict(), folder / "weights.safetensors")
    return export_run(cfg, weights, folder / "export")


def user_bodies(fields, count: int, support: int, candidates: int, seed: int, adapt: bool) -> list[dict]:
    """``count`` plain JSON request bodies of random ids (one new user id each)."""
    rng = np.random.default_rng(seed)
    bodies = []
    for u in range(count):
        user = {f.name: int(rng.integers(f.num_ids)) for f in fields if f.side == "user"}
        items = [f for f in fields if f.side != "user"]

        def rows(n):
            return [{f.name: int(rng.integers(f.num_ids)) for f in items} for _ in range(n)]

        sup = [{**r, "label": float(rng.random() < 0.3)} for r in rows(support)] if adapt else []
        bodies.append({"user_id": f"bench-{seed}-{u}", "user": user, "support": sup, "candidates": rows(candidates)})
    return bodies


def direct(export: Path, bodies: list[dict], batch: int, seconds: float) -> dict:
    """users/s and per-batch latency of ServedModel.predict on batches of ``batch`` users."""
    from gmeta_ds.serving import load_adapter
    from gmeta_ds.serving.protocol import parse_json

    torch.set_num_threads(1)  # as gmeta-ds serve (--threads 1)
    model = load_adapter(export, cache_size=0)
    users = [parse_json(b, model.fields, 10_000) for b in bodies]
    model.predict(users[:batch])  # warm-up
    times, done, start = [], 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        chunk = [users[(done + i) % len(users)] for i in range(batch)]
        t = time.perf_counter()
        model.predict(chunk)
        times.append(time.perf_counter() - t)
        done += batch
    return {"users_per_s": done / sum(times), "p50_ms": 1000 * statistics.median(times),
            "p99_ms": 1000 * float(np.percentile(times, 99)), "batches": len(times)}


PER_PROCESS = 8  # httpx's pool slows down past ~8 connections in one process: more clients, more processes


async def http_load(url: str, bodies: list[bytes], clients: int, seconds: float) -> dict:
    """``clients`` concurrent loops posting bodies for ``seconds`` (after one warm-up request):
    the latencies (seconds) of the requests they sent and how many failed."""
    import httpx

    latencies: list[float] = []
    errors = 0
    stop = 0.0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(k: int, http) -> None:
        nonlocal errors
        i = k
        while time.perf_counter() < stop:
            t = time.perf_counter()
            reply = await http.post("/v1/score", content=bodies[i % len(bodies)],
                                    headers={"content-type": "application/json"})
            latencies.append(time.perf_counter() - t)
            errors += reply.status_code != 200
            i += clients

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        await http.post("/v1/score", content=bodies[0], headers={"content-type": "application/json"})
        stop = time.perf_counter() + seconds
        await asyncio.gather(*(client(k, http) for k in range(clients)))
    return {"latencies": latencies, "errors": errors}


def _client_process(args: tuple) -> dict:
    url, bodies, clients, seconds = args
    return asyncio.run(http_load(url, bodies, clients, seconds))


def http_run(url: str, bodies: list[bytes], clients: int, seconds: float) -> dict:
    """``clients`` concurrent clients in ceil(clients / `PER_PROCESS`) processes, each on its own
    share of the bodies: users/s (requests answered / ``seconds``) and p50 / p99 latency."""
    from multiprocessing import get_context

    procs = -(-clients // PER_PROCESS)
    shares = [clients // procs + (k < clients % procs) for k in range(procs)]
    jobs = [(url, bodies[k::procs], n, seconds) for k, n in enumerate(shares)]
    with get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_client_process, jobs)
    latencies = [t for p in parts for t in p["latencies"]]
    return {"users_per_s": len(latencies) / seconds, "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * float(np.percentile(latencies, 99)), "requests": len(latencies),
            "errors": sum(p["errors"] for p in parts), "client_processes": procs}


def start_server(export: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gmeta_ds.cli", "serve", str(export), "--port", str(port), "--cache-size", "0",
           "--max-batch", "64", "--max-wait-ms", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=bench_env())
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not become ready in 120 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--support", type=int, default=20)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/serve.json"))
    args = parser.parse_args()
    results: dict = {"machine": machine(), "support": args.support, "candidates": args.candidates,
                     "seconds": args.seconds, "direct": {}, "http": {}}
    with tempfile.TemporaryDirectory() as tmp:
        export = build_export(Path(tmp))
        from gmeta_ds.serving.export import open_export

        fields = open_export(export).fields
        bodies = {mode: user_bodies(fields, 512, args.support, args.candidates, seed, mode == "adapt")
                  for seed, mode in enumerate(("adapt", "score"))}
        for mode, these in bodies.items():
            for batch in (1, 64):
                results["direct"][f"{mode}/batch{batch}"] = direct(export, these, batch, args.seconds)
        port = free_port()
        server = start_server(export, port, Path(tmp) / "server.log")
        try:
            for mode, these in bodies.items():
                encoded = [json.dumps(b).encode() for b in these]
                for clients in args.clients:
                    results["http"][f"{mode}/clients{clients}"] = http_run(
                        f"http://127.0.0.1:{port}", encoded, clients, args.seconds)
        finally:
            server.terminate()
            server.wait(timeout=30)
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'':22} {'users/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for kind in ("direct", "http"):
        for name, r in results[kind].items():
            print(f"{kind + ' ' + name:22} {r['users_per_s']:9.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
