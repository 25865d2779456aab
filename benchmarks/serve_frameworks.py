"""The two serving fronts' own CPU per call, without the model (issue 51's gRPC target: why it is missed).

``gmeta-ds serve`` answers OIP v2 over HTTP (uvicorn: httptools on uvloop, `ScoringASGI`) and over
gRPC (grpc.aio on the same uvloop event loop). Here each front runs alone in a process pinned to
core 0 with a handler that answers a fixed reply at once (the size of a 100-candidate answer):
an ASGI app reading the body, and a grpc.aio ``ModelInfer`` returning a ModelInferResponse,
both on uvloop as in the server. The load is benchmarks/serve_grpc.py's: the same 512 users'
requests, serialised beforehand (OIP v2 JSON over HTTP/1.1 keep-alive, ModelInfer with
``raw_input_contents``), ``--clients`` concurrent clients in one generator process on core 1.
Printed and written to ``benchmarks/results/serve_frameworks.json``: calls/s, the server's CPU
per call in all and per thread (the event loop's thread, grpc's poller and event-engine threads),
the generator's CPU per call; rounds alternate the fronts.

Run from the repo root:  python benchmarks/serve_frameworks.py [--seconds 5] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, free_port, machine
from serve import build_export, core_split, http_run, oip_body, request_bytes, user_bodies
from serve_grpc import MODEL, grpc_run, infer_request

FRONTS = ("http", "grpc")


def fixed_reply():
    """A ModelInferResponse of 100 raw FP32 scores, and the OIP v2 JSON answer of the same."""
    import numpy as np

    from gmeta_ds.serving.proto import grpc_predict_v2_pb2 as pb

    reply = pb.ModelInferResponse(model_name=MODEL, model_version="1", id="bench")
    reply.outputs.add(name="scores", datatype="FP32", shape=[100])
    reply.raw_output_contents.append(np.full(100, 0.5, "<f4").tobytes())
    answer = {"model_name": MODEL, "model_version": "1", "id": "bench",
              "outputs": [{"name": "scores", "datatype": "FP32", "shape": [100], "data": [0.5] * 100}]}
    return reply, json.dumps(answer).encode()


def serve_grpc(port: int) -> None:
    """grpc.aio answering ModelInfer with the fixed reply, on uvloop (as gmeta-ds serve runs it)."""
    import grpc
    import uvloop

    from gmeta_ds.serving.proto import grpc_predict_v2_pb2_grpc as pb_grpc

    reply, _ = fixed_reply()

    class Service(pb_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request, context):  # the protocol's name
            return reply

    async def main():
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Service(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


def serve_http(port: int) -> None:
    """uvicorn (httptools, uvloop) with an ASGI app reading the body and answering the fixed JSON."""
    import uvicorn

    _, body = fixed_reply()
    head = {"type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send(head)
        await send({"type": "http.response.body", "body": body})

    print("ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of ``pid``: the main thread as ``event loop``, others by their name."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # a thread that ended
            continue
        name = "event loop" if tid == str(pid) else stat[stat.index("(") + 1:stat.rindex(")")]
        ticks = stat.rsplit(")", 1)[1].split()
        out[f"{name} {tid}"] = (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK")
    return out


def run_front(front: str, requests: list[bytes], clients: int, seconds: float, cores) -> dict:
    """One front alone on the server's cores under ``clients`` clients: calls/s, CPU per call."""
    port = free_port()
    pin = ",".join(map(str, sorted(cores[0] or os.sched_getaffinity(0))))
    server = subprocess.Popen([sys.executable, __file__, "--serve", front, str(port), pin], cwd=REPO,
                              stdout=subprocess.PIPE)
    try:
        assert server.stdout.readline().strip() == b"ready", f"the bare {front} server did not start"
        time.sleep(1.0)  # uvicorn prints before it listens
        before = thread_cpu(server.pid)
        run = (grpc_run if front == "grpc" else http_run)(port, requests, clients, seconds, cores[1])
        after = thread_cpu(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    calls = max(run["requests"], 1)
    threads = {_kind(name): 0.0 for name in after}
    for name, cpu in after.items():
        threads[_kind(name)] += 1000 * (cpu - before.get(name, 0.0)) / calls
    return {"calls_per_s": run["users_per_s"], "p99_ms": run["p99_ms"], "errors": run["errors"],
            "server_cpu_ms_per_call": sum(threads.values()), "threads_cpu_ms_per_call": threads,
            "client_cpu_ms_per_call": run["client_cpu_ms_per_request"]}


def _kind(thread: str) -> str:
    """A thread's name without its id: grpc's several event-engine threads add up."""
    return thread.rsplit(" ", 1)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--out", default=None, help="default benchmarks/results/serve_frameworks.json")
    parser.add_argument("--serve", nargs=3, metavar=("FRONT", "PORT", "CORES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:  # the bare server's own process, pinned to the server's cores
        front, port, pin = args.serve
        os.sched_setaffinity(0, {int(core) for core in pin.split(",")})
        (serve_grpc if front == "grpc" else serve_http)(int(port))
        return 0
    cores = core_split(True)
    with tempfile.TemporaryDirectory() as tmp:
        from gmeta_ds.serving.export import open_export

        bodies = user_bodies(open_export(build_export(Path(tmp))).fields, 512, 20, 100, 0, True)
    requests = {"http": [request_bytes(0, json.dumps(oip_body(b)).encode(), f"/v2/models/{MODEL}/infer")
                         for b in bodies],
                "grpc": [infer_request(b, True).SerializeToString() for b in bodies]}
    runs: dict[str, list] = {front: [] for front in FRONTS}
    for round_ in range(args.rounds):
        for front in FRONTS if round_ % 2 == 0 else FRONTS[::-1]:
            runs[front].append(run_front(front, requests[front], args.clients, args.seconds, cores))
    results = {"machine": {**machine(), "load_avg_at_end": os.getloadavg()}, "clients": args.clients,
               "seconds": args.seconds, "server_cores": sorted(cores[0] or []),
               "client_cores": sorted(cores[1] or []), "runs": runs,
               "summary": {front: {key: statistics.median(r[key] for r in these)
                                   for key in ("calls_per_s", "server_cpu_ms_per_call", "client_cpu_ms_per_call")}
                           for front, these in runs.items()}}
    Path(args.out or REPO / "benchmarks/results/serve_frameworks.json").write_text(json.dumps(results, indent=1) + "\n")
    for front, these in runs.items():
        for r in these:
            threads = ", ".join(f"{k} {v:.3f}" for k, v in r["threads_cpu_ms_per_call"].items() if v)
            print(f"{front:5} {r['calls_per_s']:7.0f} calls/s  server {r['server_cpu_ms_per_call']:.3f} ms/call "
                  f"({threads})  generator {r['client_cpu_ms_per_call']:.3f} ms/call  errors {r['errors']}")
    print(f"load average at the end {results['machine']['load_avg_at_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
