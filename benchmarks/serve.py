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
  and 64 concurrent clients, each for ``--seconds`` (default 8): users/s and the p50 / p99 of
  each request's latency, the server process's CPU time per user answered (/proc) and its mean
  batch. The load generator is one separate process of raw asyncio keep-alive HTTP/1.1
  connections (uvloop when installed) writing requests serialised beforehand and reading each
  response by its Content-Length; its own CPU per request is reported (some 0.03 ms: the
  server, not the generator, is what is measured).

On 2+ cores the server (and the direct calls, so that the two compare on the same CPU) is
pinned to all cores but the last and the generator to the last (``--no-pin``: no pinning);
the table prints each HTTP run's users/s as a fraction of the direct call's at 64 users.
Results go to ``benchmarks/results/serve.json`` (or ``--out``) and are printed as a table.

``--protocol grpc|both`` instead compares OIP v2 over gRPC (raw and typed tensors) with the
HTTP routes on one ``gmeta-ds serve --grpc-port``, in alternated rounds, after checking that
every route scores the same users alike (benchmarks/serve_grpc.py; ``serve_grpc.json``).

``--startup-rows N`` instead measures start-up: the demo's export with an item table of N rows
(random), the seconds from starting ``gmeta-ds serve`` to its first ready answer (imports, the
SHA-256 of every file, the mapping, a warm-up adaptation) and its resident memory against the
export's size (``benchmarks/results/serve_startup.json``).

Run from the repo root:  python benchmarks/serve.py [--seconds 8] [--clients 1 8 64]
                         python benchmarks/serve.py --protocol both [--rounds 3]
                         python benchmarks/serve.py --startup-rows 10000000
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


def big_export(folder: Path, rows: int) -> Path:
    """The demo's export with an item table of ``rows`` rows (random), for the start-up check."""
    import dataclasses

    from gmeta_ds.saved import write_model
    from gmeta_ds.serving.adapter import build_learner
    from gmeta_ds.serving.export import open_export, serving_section

    small = open_export(build_export(folder))
    meta = small.meta
    fields = [dataclasses.replace(f, num_ids=rows) if f.name == "item_id" else f for f in meta["fields"]]
    tables = [dataclasses.replace(t, num_rows=rows) if "item_id" in t.features else t for t in meta["tables"]]
    name = next(t.name for t in tables if "item_id" in t.features)
    state = {k: v.clone() for k, v in small.state.items()}
    state[f"net.embedding.weights.{name}"] = torch.randn(rows, state[f"net.embedding.weights.{name}"].shape[1])
    learner = build_learner(small, None)
    section = serving_section(small.name, small.serving["inner_steps"], small.serving["recipe"])
    return write_model(folder / "big", state, learner.net, fields, tables, {}, learner.algorithm, section)


def startup(export: Path, log: Path) -> dict:
    """Seconds from starting ``gmeta-ds serve`` to its first ready answer and its resident
    memory (anonymous and file-backed) against the export's size."""
    port = free_port()
    start = time.perf_counter()
    server = start_server(export, port, log)
    ready = time.perf_counter() - start
    try:
        status = dict(ln.split(":", 1) for ln in Path(f"/proc/{server.pid}/status").read_text().splitlines())
        mib = {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}
    finally:
        server.terminate()
        server.wait(timeout=30)
    size = sum(f.stat().st_size for f in export.iterdir()) / 2**20
    return {"ready_s": ready, "rss_mib": mib["VmRSS"], "rss_anon_mib": mib["RssAnon"], "rss_file_mib": mib["RssFile"],
            "export_mib": size}


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


def oip_body(body: dict) -> dict:
    """A plain JSON body (`user_bodies`) as its OIP v2 request: one INT64 tensor per field and
    part (the demo's fields are integer ids), the labels FP32, the user id a parameter."""
    inputs = [{"name": f"user.{k}", "shape": [1], "datatype": "INT64", "data": [v]} for k, v in body["user"].items()]
    for part in ("support", "candidates"):
        rows = body[part]
        for name in (rows[0] if rows else {}):
            datatype = "FP32" if name == "label" else "INT64"
            inputs.append({"name": f"{part}.{name}", "shape": [len(rows)], "datatype": datatype,
                           "data": [r[name] for r in rows]})
    return {"id": body["user_id"], "parameters": {"user_id": body["user_id"]}, "inputs": inputs}


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


def request_bytes(port: int, body: bytes, path: str = "/v1/score") -> bytes:
    """One whole HTTP/1.1 request (keep-alive) posting ``body``, serialised once beforehand."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def exchange(reader, writer, request: bytes) -> bool:
    """Send one pre-serialised request and read its response (its Content-Length): whether it was a 200."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    at = lower.index(b"content-length:") + 15
    await reader.readexactly(int(lower[at:lower.index(b"\r\n", at)]))
    return head.startswith(b"HTTP/1.1 200")


async def http_load(port: int, requests: list[bytes], clients: int, seconds: float) -> dict:
    """``clients`` keep-alive connections, each sending its next request as soon as the last one's
    answer is read, for ``seconds`` (after one warm-up request each): the latencies (seconds),
    how many failed, and this process's CPU seconds over the timed part."""
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(clients)]
    await asyncio.gather(*(exchange(r, w, requests[0]) for r, w in connections))
    latencies: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def client(k: int, reader, writer) -> None:
        nonlocal errors
        i = k
        while time.perf_counter() < stop:
            t = time.perf_counter()
            ok = await exchange(reader, writer, requests[i % len(requests)])
            latencies.append(time.perf_counter() - t)
            errors += not ok
            i += clients

    cpu = time.process_time()
    await asyncio.gather(*(client(k, r, w) for k, (r, w) in enumerate(connections)))
    cpu = time.process_time() - cpu
    for _, writer in connections:
        writer.close()
    return {"latencies": latencies, "errors": errors, "cpu_s": cpu}


def _client_process(args: tuple) -> dict:
    """The load generator's process: pinned to ``cores`` when given, on uvloop when installed."""
    port, requests, clients, seconds, cores = args
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    return run(http_load(port, requests, clients, seconds))


def http_run(port: int, requests: list[bytes], clients: int, seconds: float, cores: set[int] | None) -> dict:
    """``clients`` concurrent clients in one separate process (raw asyncio connections, requests
    serialised beforehand: a few tens of microseconds of its CPU per request): users/s (requests
    answered / ``seconds``), p50 / p99 latency and the generator's own CPU per request."""
    from multiprocessing import get_context

    with get_context("spawn").Pool(1) as pool:
        out = pool.apply(_client_process, ((port, requests, clients, seconds, cores),))
    latencies = out["latencies"]
    return {"users_per_s": len(latencies) / seconds, "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * float(np.percentile(latencies, 99)), "requests": len(latencies),
            "errors": out["errors"], "client_cpu_ms_per_request": 1000 * out["cpu_s"] / max(len(latencies), 1)}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batch_totals(url: str) -> tuple[float, float]:
    """(users, batches) the server has run, from its /metrics."""
    import httpx

    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    value = {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln.startswith("gmeta_serve_batch_users_")}
    return value["gmeta_serve_batch_users_sum"], value["gmeta_serve_batch_users_count"]


def measured_http(port: int, pid: int, requests: list[bytes], clients: int, seconds: float,
                  cores: set[int] | None) -> dict:
    """`http_run`, with the server's CPU per user answered and its mean batch size."""
    url = f"http://127.0.0.1:{port}"
    users0, batches0 = batch_totals(url)
    cpu0 = process_cpu_s(pid)
    out = http_run(port, requests, clients, seconds, cores)
    cpu = process_cpu_s(pid) - cpu0
    users1, batches1 = batch_totals(url)
    users, batches = users1 - users0, batches1 - batches0
    return {**out, "server_cpu_ms_per_user": 1000 * cpu / max(users, 1), "mean_batch": users / max(batches, 1)}


def core_split(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(the server's cores, the load generator's): all but the last, and the last, when pinning
    on 2+ cores (so that the generator's CPU never counts as the server's); else (None, None)."""
    cores = sorted(os.sched_getaffinity(0))
    return (set(cores[:-1]), {cores[-1]}) if pin and len(cores) > 1 else (None, None)


def start_server(export: Path, port: int, log: Path, cores: set[int] | None = None) -> subprocess.Popen:
    """``gmeta-ds serve`` (cache off, batches of up to 64 users, 1 ms wait) pinned to ``cores``, once ready."""
    cmd = [sys.executable, "-m", "gmeta_ds.cli", "serve", str(export), "--port", str(port), "--cache-size", "0",
           "--max-batch", "64", "--max-wait-ms", "1"]
    return start_command(cmd, port, log, cores)


def start_command(cmd: list[str], port: int, log: Path, cores: set[int] | None = None) -> subprocess.Popen:
    """The server ``cmd`` starts (``gmeta-ds serve``, or another OIP v2 server: benchmarks/serve_kserve.py)
    pinned to ``cores``, once its ``/v2/health/ready`` on ``port`` answers 200."""
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=bench_env(),
                            preexec_fn=pin)
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server ({cmd[2]}) exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server ({cmd[2]}) did not become ready in 120 s")


def load_arguments(doc: str) -> argparse.ArgumentParser:
    """A parser with the load's options (seconds per measurement, concurrencies, rows per user),
    shared with benchmarks/serve_kserve.py."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--support", type=int, default=20)
    parser.add_argument("--candidates", type=int, default=100)
    return parser


def main() -> int:
    parser = load_arguments(__doc__)
    parser.add_argument("--out", default=None, help="default benchmarks/results/serve.json "
                        "(serve_startup.json with --startup-rows, serve_grpc.json with --protocol grpc|both)")
    parser.add_argument("--protocol", choices=("http", "grpc", "both"), default="http",
                        help="grpc / both: OIP v2 over gRPC (and HTTP's routes) on one gmeta-ds serve --grpc-port, "
                        "in alternated rounds (benchmarks/serve_grpc.py)")
    parser.add_argument("--rounds", type=int, default=3, help="with --protocol grpc|both: rounds of the routes")
    parser.add_argument("--startup-rows", type=int, default=0,
                        help="only the start-up check, on an item table of this many rows (e.g. 10000000)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the server (and the direct calls) to "
                        "all cores but the last and the load generator to the last")
    args = parser.parse_args()
    if args.startup_rows:
        with tempfile.TemporaryDirectory() as tmp:
            result = {"machine": machine(), "rows": args.startup_rows,
                      **startup(big_export(Path(tmp), args.startup_rows), Path(tmp) / "server.log")}
        print(json.dumps(result, indent=1))
        Path(args.out or REPO / "benchmarks/results/serve_startup.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.protocol != "http":
        from serve_grpc import compare

        return compare(args)
    server_cores, client_cores = core_split(not args.no_pin)
    results: dict = {"machine": machine(), "support": args.support, "candidates": args.candidates,
                     "seconds": args.seconds, "server_cores": sorted(server_cores or []),
                     "client_cores": sorted(client_cores or []), "direct": {}, "http": {}}
    with tempfile.TemporaryDirectory() as tmp:
        export = build_export(Path(tmp))
        from gmeta_ds.serving.export import open_export

        fields = open_export(export).fields
        bodies = {mode: user_bodies(fields, 512, args.support, args.candidates, seed, mode == "adapt")
                  for seed, mode in enumerate(("adapt", "score"))}
        results["direct"] = direct_runs(export, bodies, args.seconds, server_cores)
        port = free_port()
        server = start_server(export, port, Path(tmp) / "server.log", server_cores)
        try:
            for mode, these in bodies.items():
                requests = [request_bytes(port, json.dumps(b).encode()) for b in these]
                for clients in args.clients:
                    results["http"][f"{mode}/clients{clients}"] = measured_http(
                        port, server.pid, requests, clients, args.seconds, client_cores)
        finally:
            server.terminate()
            server.wait(timeout=30)
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    Path(args.out or REPO / "benchmarks/results/serve.json").write_text(json.dumps(results, indent=1) + "\n")
    report(results)
    return 0


def direct_runs(export: Path, bodies: dict, seconds: float, cores: set[int] | None) -> dict:
    """`direct` for each mode on batches of 1 and 64 users, on the server's cores."""
    every = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        return {f"{mode}/batch{batch}": direct(export, these, batch, seconds)
                for mode, these in bodies.items() for batch in (1, 64)}
    finally:
        os.sched_setaffinity(0, every)


def report(results: dict) -> None:
    """The table: each run, and each HTTP run's users/s as a fraction of the direct call's at 64 users."""
    print(f"server cores {results['server_cores'] or 'any'}, load generator cores {results['client_cores'] or 'any'}")
    print(f"{'':22} {'users/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'server CPU ms/user':>19} {'mean batch':>10} "
          f"{'client CPU ms/req':>17} {'x direct64':>10}")
    for kind in ("direct", "http"):
        for name, r in results[kind].items():
            extra = ""
            if kind == "http":
                base = results["direct"][f"{name.split('/')[0]}/batch64"]["users_per_s"]
                extra = (f" {r['server_cpu_ms_per_user']:19.2f} {r['mean_batch']:10.1f} "
                         f"{r['client_cpu_ms_per_request']:17.3f} {r['users_per_s'] / base:10.2f}")
            print(f"{kind + ' ' + name:22} {r['users_per_s']:9.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f}{extra}")


if __name__ == "__main__":
    sys.exit(main())
