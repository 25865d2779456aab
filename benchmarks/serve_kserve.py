"""KServe's ModelServer against ``gmeta-ds serve``, side by side, on the same export and load.

The choice docs/serving.md's "Deploying on KServe" rests on: the same model served two ways,

- ``gmeta-ds serve`` (its own OIP v2 front: `gmeta_ds.serving.server`), and
- ``python -m gmeta_ds.serving.kserve_model`` (the same batcher and model behind KServe's
  ``ModelServer`` and its own OIP v2 front), as KServe starts it (its request logging on) and
  with its logging off (``--enable_latency_logging false --configure_logging false``),

each sent the same OIP v2 JSON requests (``POST /v2/models/melu/infer``, one new user per
request adapting on ``--support`` rows and scoring ``--candidates``; the cache off) by the load
generator of benchmarks/serve.py (one separate process, keep-alive connections), at 1, 8 and
64 concurrent clients. The server is pinned to all cores but the last, the generator to the
last (serve.py's `core_split`), one server at a time, the servers in turn for ``--rounds``
rounds (default 2: a shared machine's load drifts). Printed, as medians over the rounds:
users/s, p50 / p99 latency, the server's CPU per user answered, and each KServe run's users/s as
a fraction of ``gmeta-ds serve``'s at the same concurrency; every run is written to
``benchmarks/results/serve_kserve.json``.

Needs the ``kserve`` extra in the interpreter that runs it (``pip install -e ".[kserve]"``;
it pins other versions than the dev extra, so a virtualenv of its own)::

    /tmp/kserve_venv/bin/python benchmarks/serve_kserve.py --seconds 8
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, free_port, machine
from serve import (
    build_export,
    core_split,
    http_run,
    load_arguments,
    oip_body,
    process_cpu_s,
    request_bytes,
    start_command,
    user_bodies,
)

QUIET = ["--enable_latency_logging", "false", "--configure_logging", "false"]


def commands(export: Path, port: int) -> dict[str, list[str]]:
    """Each server's command line (cache off, batches of up to 64 users, 1 ms wait)."""
    knobs = {"cache_size": "0", "max_batch": "64", "max_wait_ms": "1"}
    kserve = [sys.executable, "-m", "gmeta_ds.serving.kserve_model", "--model_dir", str(export),
              "--http_port", str(port), "--grpc_port", str(free_port()),
              *(arg for k, v in knobs.items() for arg in (f"--{k}", v))]
    return {"gmeta-ds serve": [sys.executable, "-m", "gmeta_ds.cli", "serve", str(export), "--port", str(port),
                               *(arg for k, v in knobs.items() for arg in (f"--{k.replace('_', '-')}", v))],
            "kserve": kserve, "kserve quiet": kserve + QUIET}


def oip_json(body: dict) -> bytes:
    """A plain JSON body (serve.py's `user_bodies`) as its OIP v2 request (`serve.oip_body`), serialised."""
    return json.dumps(oip_body(body)).encode()


def measure(name: str, cmd: list[str], port: int, bodies: list[dict], args, cores, client_cores, tmp: Path) -> dict:
    """One server's runs at each concurrency: serve.py's `http_run`, with the server's CPU per user."""
    requests = [request_bytes(port, oip_json(b), "/v2/models/melu/infer") for b in bodies]
    log = tmp / f"{name.replace(' ', '_')}.log"
    server = start_command(cmd, port, log, cores)
    runs = {}
    try:
        for clients in args.clients:
            cpu0 = process_cpu_s(server.pid)
            try:
                out = http_run(port, requests, clients, args.seconds, client_cores)
            except Exception as exc:  # a connection the server dropped: say which, with its log's end
                raise RuntimeError(f"{name} at {clients} clients: {exc!r}; its log ends:\n"
                                   f"{log.read_text()[-3000:]}") from exc
            out["server_cpu_ms_per_user"] = 1000 * (process_cpu_s(server.pid) - cpu0) / max(out["requests"], 1)
            runs[f"clients{clients}"] = out
    finally:
        server.terminate()
        server.wait(timeout=30)
    return runs


def main() -> int:
    parser = load_arguments(__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="each server measured this many times, in turn")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/serve_kserve.json"))
    args = parser.parse_args()
    cores, client_cores = core_split(True)
    results: dict = {"machine": machine(), "support": args.support, "candidates": args.candidates,
                     "seconds": args.seconds, "server_cores": sorted(cores or []),
                     "client_cores": sorted(client_cores or []), "servers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        export = build_export(Path(tmp))
        from gmeta_ds.serving.export import open_export

        bodies = user_bodies(open_export(export).fields, 512, args.support, args.candidates, 0, True)
        for _ in range(args.rounds):  # the servers in turn, each round: drift in the load hits all of them
            for name, cmd in commands(export, port := free_port()).items():
                runs = measure(name, cmd, port, bodies, args, cores, client_cores, Path(tmp))
                for clients, run in runs.items():
                    results["servers"].setdefault(name, {}).setdefault(clients, []).append(run)
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    report(results)
    return 0


def median_run(runs: list[dict]) -> dict:
    """Each number's median over a server's rounds at one concurrency."""
    return {k: statistics.median(r[k] for r in runs) for k in ("users_per_s", "p50_ms", "p99_ms",
                                                                 "server_cpu_ms_per_user", "errors")}


def report(results: dict) -> None:
    """The table: each server at each concurrency (medians over the rounds), and its users/s
    against gmeta-ds serve's."""
    print(f"server cores {results['server_cores'] or 'any'}, load generator cores {results['client_cores'] or 'any'}")
    print(f"{'':32} {'users/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'server CPU ms/user':>19} {'errors':>7} "
          f"{'x gmeta-ds serve':>16}")
    base = {clients: median_run(runs) for clients, runs in results["servers"]["gmeta-ds serve"].items()}
    for name, by_clients in results["servers"].items():
        for clients, runs in by_clients.items():
            r = median_run(runs)
            ratio = r["users_per_s"] / base[clients]["users_per_s"]
            print(f"{name + ' ' + clients:32} {r['users_per_s']:9.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
                  f"{r['server_cpu_ms_per_user']:19.2f} {r['errors']:7.0f} {ratio:16.2f}")


if __name__ == "__main__":
    sys.exit(main())
