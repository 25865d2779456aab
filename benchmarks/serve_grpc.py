"""OIP v2 over gRPC against HTTP, on one ``gmeta-ds serve --grpc-port`` (``serve.py --protocol``).

The same users (serve.py's `user_bodies`: one new user each, ``--support`` rows adapting,
``--candidates`` items scored, the cache off) sent over each route of one server process:

- ``http v1``: ``POST /v1/score``, plain JSON (serve.py's HTTP figures);
- ``http v2``: ``POST /v2/models/melu/infer``, the OIP v2 JSON form (`serve.oip_body`);
- ``grpc raw``: ModelInfer with each input in ``raw_input_contents``, as tritonclient.grpc sends by
  default (INT64 ids, FP32 labels, little-endian), the scores back raw;
- ``grpc typed``: ModelInfer with typed ``contents`` (``int64_contents``, ``fp32_contents``).

Before timing, each route's scores for the same users must equal the ``http v2`` answer's
(to 1e-5); else exit 1. The gRPC load generator is one separate process (serve.py's core
split: the server on all cores but the last, the generator on the last) of ``clients``
grpc.aio channels, one HTTP/2 connection each (a local subchannel pool: grpc would otherwise
share one connection between channels), each sending its next request, serialised beforehand
as the HTTP generator's are, as soon as the last one's answer has come back. Rounds alternate
the routes (reversed every other round: a shared machine's load drifts); printed as medians
over the rounds with their min-max spread, and each gRPC route's users/s over ``http v2``'s and
``http v1``'s, the ratio taken within each round. Written to ``benchmarks/results/serve_grpc.json``.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from common import REPO, free_port, machine
from serve import (
    batch_totals,
    build_export,
    core_split,
    http_run,
    oip_body,
    process_cpu_s,
    request_bytes,
    start_command,
    user_bodies,
)

MODEL = "melu"  # the demo export's name
METHOD = "/inference.GRPCInferenceService/ModelInfer"
ROUTES = ("http v1", "http v2", "grpc raw", "grpc typed")


def infer_request(body: dict, raw: bool):
    """`serve.oip_body`'s tensors as a ModelInferRequest: ``raw_input_contents`` (tritonclient.grpc's
    default) or typed ``contents``; the user id a string parameter."""
    from gmeta_ds.serving.proto import grpc_predict_v2_pb2 as pb

    oip = oip_body(body)
    request = pb.ModelInferRequest(model_name=MODEL, id=oip["id"])
    request.parameters["user_id"].string_param = oip["parameters"]["user_id"]
    for tensor in oip["inputs"]:
        out = request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        dtype, field = (np.float32, "fp32_contents") if tensor["datatype"] == "FP32" else (np.int64, "int64_contents")
        if raw:
            request.raw_input_contents.append(np.asarray(tensor["data"], dtype).tobytes())
        else:
            getattr(out.contents, field).extend(tensor["data"])
    return request


def route_requests(port: int, bodies: list[dict]) -> dict[str, list[bytes]]:
    """Each route's requests, serialised once: whole HTTP/1.1 requests, or ModelInferRequest bytes."""
    return {"http v1": [request_bytes(port, json.dumps(b).encode()) for b in bodies],
            "http v2": [request_bytes(port, json.dumps(oip_body(b)).encode(), f"/v2/models/{MODEL}/infer")
                        for b in bodies],
            "grpc raw": [infer_request(b, True).SerializeToString() for b in bodies],
            "grpc typed": [infer_request(b, False).SerializeToString() for b in bodies]}


def score_mismatches(port: int, grpc_port: int, bodies: list[dict]) -> list[str]:
    """Each route's scores for ``bodies`` against the ``http v2`` answer's: what differs past 1e-5."""
    import grpc
    import httpx

    from gmeta_ds.serving.proto import grpc_predict_v2_pb2_grpc as pb_grpc

    problems = []
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for body in bodies:
            url = f"http://127.0.0.1:{port}"
            reference = np.asarray(httpx.post(f"{url}/v2/models/{MODEL}/infer", json=oip_body(body),
                                              timeout=60).json()["outputs"][0]["data"])
            raw = stub.ModelInfer(infer_request(body, True), timeout=60)
            typed = stub.ModelInfer(infer_request(body, False), timeout=60)
            scores = {"http v1": httpx.post(f"{url}/v1/score", json=body, timeout=60).json()["scores"],
                      "grpc raw": np.frombuffer(raw.raw_output_contents[0], "<f4"),
                      "grpc typed": typed.outputs[0].contents.fp32_contents}
            for route, got in scores.items():
                got = np.asarray(got)
                if got.shape != reference.shape:
                    problems.append(f"{route} {body['user_id']}: {got.shape[0]} scores, http v2 {reference.shape[0]}")
                elif not np.allclose(got, reference, rtol=0, atol=1e-5):
                    problems.append(f"{route} {body['user_id']}: scores {got[:3]}... against http v2's "
                                    f"{reference[:3]}...: max difference {np.abs(got - reference).max():.2e}, "
                                    "expected at most 1e-5")
    return problems


async def grpc_load(address: str, requests: list[bytes], clients: int, seconds: float) -> dict:
    """``clients`` grpc.aio channels (one connection each), each calling ModelInfer with its next
    pre-serialised request as soon as the last answer came, for ``seconds`` (after one warm-up
    call each): the latencies, the calls that failed, and this process's CPU seconds."""
    import grpc

    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(clients)]
    calls = [channel.unary_unary(METHOD) for channel in channels]  # no (de)serialiser: bytes in, bytes out
    await asyncio.gather(*(call(requests[0], timeout=60) for call in calls))
    latencies: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def client(k: int, call) -> None:
        nonlocal errors
        i = k
        while time.perf_counter() < stop:
            t = time.perf_counter()
            try:
                await call(requests[i % len(requests)], timeout=60)
            except grpc.aio.AioRpcError:
                errors += 1
            latencies.append(time.perf_counter() - t)
            i += clients

    cpu = time.process_time()
    await asyncio.gather(*(client(k, call) for k, call in enumerate(calls)))
    cpu = time.process_time() - cpu
    await asyncio.gather(*(channel.close() for channel in channels))
    return {"latencies": latencies, "errors": errors, "cpu_s": cpu}


def _grpc_process(args: tuple) -> dict:
    """The gRPC load generator's process, pinned to ``cores`` when given (plain asyncio: grpc.aio
    runs its own poller, not on uvloop)."""
    address, requests, clients, seconds, cores = args
    if cores:
        os.sched_setaffinity(0, cores)
    return asyncio.run(grpc_load(address, requests, clients, seconds))


def grpc_run(grpc_port: int, requests: list[bytes], clients: int, seconds: float, cores: set[int] | None) -> dict:
    """serve.py's `http_run` for gRPC: users/s, p50 / p99, the generator's CPU per request."""
    from multiprocessing import get_context

    with get_context("spawn").Pool(1) as pool:
        out = pool.apply(_grpc_process, ((f"127.0.0.1:{grpc_port}", requests, clients, seconds, cores),))
    latencies = out["latencies"]
    return {"users_per_s": len(latencies) / seconds, "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * float(np.percentile(latencies, 99)), "requests": len(latencies),
            "errors": out["errors"], "client_cpu_ms_per_request": 1000 * out["cpu_s"] / max(len(latencies), 1)}


def measured(route: str, ports: tuple[int, int], pid: int, requests: list[bytes], clients: int, seconds: float,
             cores: set[int] | None) -> dict:
    """One route's run at ``clients``, with the server's CPU per user answered and its mean batch."""
    port, grpc_port = ports
    users0, batches0 = batch_totals(f"http://127.0.0.1:{port}")
    cpu0 = process_cpu_s(pid)
    if route.startswith("grpc"):
        out = grpc_run(grpc_port, requests, clients, seconds, cores)
    else:
        out = http_run(port, requests, clients, seconds, cores)
    cpu = process_cpu_s(pid) - cpu0
    users1, batches1 = batch_totals(f"http://127.0.0.1:{port}")
    users, batches = users1 - users0, batches1 - batches0
    return {**out, "server_cpu_ms_per_user": 1000 * cpu / max(users, 1), "mean_batch": users / max(batches, 1)}


def compare(args) -> int:
    """``serve.py --protocol grpc|both``: the routes in alternated rounds on one server; exit 1
    when a route's scores differ from the OIP v2 JSON answer's."""
    routes = [r for r in ROUTES if args.protocol == "both" or r.startswith("grpc")]
    server_cores, client_cores = core_split(not args.no_pin)
    results: dict = {"machine": machine(), "support": args.support, "candidates": args.candidates,
                     "seconds": args.seconds, "rounds": args.rounds, "server_cores": sorted(server_cores or []),
                     "client_cores": sorted(client_cores or []), "runs": {}}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        export = build_export(Path(tmp))
        from gmeta_ds.serving.export import open_export

        bodies = user_bodies(open_export(export).fields, 512, args.support, args.candidates, 0, True)
        port, grpc_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "gmeta_ds.cli", "serve", str(export), "--port", str(port), "--grpc-port",
               str(grpc_port), "--cache-size", "0", "--max-batch", "64", "--max-wait-ms", "1"]
        server = start_command(cmd, port, Path(tmp) / "server.log", server_cores)
        try:
            problems = score_mismatches(port, grpc_port, bodies[:16])
            if problems:
                print("the routes' scores differ, nothing timed:\n" + "\n".join(problems))
                return 1
            requests = route_requests(port, bodies)
            for round_ in range(args.rounds):
                order = routes if round_ % 2 == 0 else routes[::-1]
                for clients in args.clients:
                    for route in order:
                        run = measured(route, (port, grpc_port), server.pid, requests[route], clients, args.seconds,
                                       client_cores)
                        results["runs"].setdefault(f"{route}/clients{clients}", []).append(run)
        finally:
            server.terminate()
            server.wait(timeout=30)
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    results["summary"] = summary(results["runs"], routes, args.clients)
    Path(args.out or REPO / "benchmarks/results/serve_grpc.json").write_text(json.dumps(results, indent=1) + "\n")
    report(results)
    return 0


def summary(runs: dict, routes: list[str], concurrencies: list[int]) -> dict:
    """Per route and concurrency: each number's median over the rounds, users/s min and max, and
    for a gRPC route the median of its per-round users/s over each HTTP route's."""
    out = {}
    for clients in concurrencies:
        for route in routes:
            these = runs[f"{route}/clients{clients}"]
            row = {k: statistics.median(r[k] for r in these)
                   for k in ("users_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_user", "mean_batch", "errors")}
            row["users_per_s_min"] = min(r["users_per_s"] for r in these)
            row["users_per_s_max"] = max(r["users_per_s"] for r in these)
            for base in (b for b in routes if route.startswith("grpc") and b.startswith("http")):
                ratios = [g["users_per_s"] / h["users_per_s"] for g, h in zip(these, runs[f"{base}/clients{clients}"])]
                row[f"x {base}"] = statistics.median(ratios)
                row[f"x {base} per round"] = ratios
            out[f"{route}/clients{clients}"] = row
    return out


def report(results: dict) -> None:
    """The table: medians over the rounds, the users/s spread, and the gRPC/HTTP ratios."""
    print(f"server cores {results['server_cores'] or 'any'}, load generator cores {results['client_cores'] or 'any'}, "
          f"{results['rounds']} rounds, load average at the end {results['machine']['load_avg_at_end']}")
    print(f"{'':22} {'users/s':>9} {'min-max':>13} {'p50 ms':>8} {'p99 ms':>8} {'srv CPU ms/user':>15} "
          f"{'batch':>6} {'errors':>6} {'x http v2':>9} {'x http v1':>9}")
    for name, r in results["summary"].items():
        ratios = "".join(f" {r[k]:9.2f}" if k in r else f" {'':9}" for k in ("x http v2", "x http v1"))
        print(f"{name:22} {r['users_per_s']:9.1f} {r['users_per_s_min']:6.0f}-{r['users_per_s_max']:<6.0f} "
              f"{r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['server_cpu_ms_per_user']:15.2f} {r['mean_batch']:6.1f} "
              f"{r['errors']:6.0f}{ratios}")
