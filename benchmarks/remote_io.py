"""Task-store build rate from where logs live (issue 52): the same log built from local disk,
from a local S3 server (moto on 127.0.0.1, a thread of the parent process) and as a Delta table
(local, and on the same S3 server), side by side.

``gmeta-ds data synthesize``'s generator writes a log of ``--size`` interactions as Parquet
shards; the same files go to a bucket, and the same rows into a Delta table (local and on S3).
Each build runs in a fresh subprocess into a fresh cache folder (a build, never a reuse) and
reports wall time, interactions/s and peak RSS (VmHWM, reset after the imports where Linux
allows it). Rounds alternate the sources, each round in a rotated order, so drift on a shared
machine falls on every source alike; the table gives each source's median and its rate against
the local build of the same round. The local and S3 copies of the same files must build the
same store (`store_read.store_identity`), else the script fails; the Delta table holds the same
rows in the order deltalake's writer chose (not always the shards' order), so its store may
differ from the plain log's. moto serves S3 from Python on the same
cores: a real store's latency and bandwidth differ.

Results go to ``benchmarks/results/remote_io.json``.
Run from the repo root:  python benchmarks/remote_io.py [--size 300000] [--rounds 3]
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

import common  # noqa: F401 - OMP_WAIT_POLICY and the checkout on sys.path, before torch
from common import REPO, machine

RESULTS = REPO / "benchmarks" / "results" / "remote_io.json"
SCHEMA = {"task_key": "user_id", "item_key": "item_id", "label": "rating", "timestamp": "timestamp",
          "user_features": ["age", "gender"], "item_features": ["category"], "multi_hot": {"tags": "|"}}
KEYS = {"access_key": "bench", "secret_key": "bench-secret", "region": "us-east-1"}
SOURCES = ("local", "s3", "delta_local", "delta_s3")
BUCKET = "logs"


def worker(path: str, cache: str, options: str) -> dict:
    """In a fresh process: build the store of ``path`` into ``cache``; time, peak RSS, content."""
    from gmeta_ds.config import DataConfig, SchemaConfig
    from gmeta_ds.data.builder import build_tasks
    from gmeta_ds.data.store_read import store_identity

    cfg = DataConfig(source="table", path=path, schema=SchemaConfig(**SCHEMA), cache_dir=cache,
                     storage_options=json.loads(options))
    out = {"baseline_rss_mb": status_mb("VmRSS")}
    try:  # VmHWM back to the current RSS (Linux >= 4.0): the peak of the build, imports aside
        Path("/proc/self/clear_refs").write_text("5")
        out["peak_reset"] = True
    except OSError:
        out["peak_reset"] = False
    t = time.perf_counter()
    data = build_tasks(cfg, 0)
    out["s"], out["peak_mb"] = time.perf_counter() - t, status_mb("VmHWM")
    out["built"] = "cache" not in data.stats
    out["interactions"] = int(data.stats["interactions_read"])
    out["content"] = store_identity(data)["content"]
    return out


def status_mb(key: str) -> float:
    """A /proc/self/status memory line (VmRSS, VmHWM) in MB."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def start_s3():
    """moto's S3 server on a free loopback port, in a thread of this process (the builds run in
    their own processes; this one waits); (server, endpoint)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{server.get_host_and_port()[1]}"


def stage(log: Path, tmp: Path, endpoint: str) -> dict[str, tuple[str, dict]]:
    """The log's shards in a bucket, its rows as a Delta table locally and that table's folder
    in the bucket; source -> (data.path, data.storage_options)."""
    import boto3
    import deltalake
    import pyarrow.parquet as pq

    options = {"endpoint_override": endpoint, **KEYS}
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEYS["access_key"],
                          aws_secret_access_key=KEYS["secret_key"], region_name=KEYS["region"])
    client.create_bucket(Bucket=BUCKET)
    for f in sorted(log.glob("*.parquet")):
        client.upload_file(str(f), BUCKET, f"clicks/{f.name}")
    deltalake.write_deltalake(str(tmp / "delta"), pq.ParquetDataset(sorted(str(f) for f in log.glob("*.parquet"))).read())
    for f in sorted(p for p in (tmp / "delta").rglob("*") if p.is_file()):  # the same table's files and log
        client.upload_file(str(f), BUCKET, f"delta/{f.relative_to(tmp / 'delta')}")
    return {"local": (str(log), {}), "s3": (f"s3://{BUCKET}/clicks/", options),
            "delta_local": (str(tmp / "delta"), {}), "delta_s3": (f"s3://{BUCKET}/delta", options)}


def build_once(path: str, options: dict, cache: Path) -> dict:
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1"}
    proc = subprocess.run([sys.executable, __file__, "--worker", path, str(cache), json.dumps(options)],
                          check=False, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode:
        raise RuntimeError(f"build of {path} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["built"], f"{path}: the store was reused, not built"
    return out


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per source: median s, interactions/s, peak MB, and the median of the per-round rate
    against the same round's local build."""
    out = {}
    for source, rounds in runs.items():
        rates = [r["interactions"] / r["s"] for r in rounds]
        vs_local = [(r["interactions"] / r["s"]) / (loc["interactions"] / loc["s"])
                    for r, loc in zip(rounds, runs["local"])]
        out[source] = {"median_s": statistics.median(r["s"] for r in rounds),
                       "interactions_per_s": statistics.median(rates),
                       "vs_local": statistics.median(vs_local), "vs_local_rounds": vs_local,
                       "peak_mb": max(r["peak_mb"] for r in rounds),
                       "peak_above_imports_mb": max(r["peak_mb"] - r["baseline_rss_mb"] for r in rounds)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=300_000, help="interactions in the log")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs=3, metavar=("PATH", "CACHE", "OPTIONS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    from gmeta_ds.data.parquet_log import synthesize_log

    server, endpoint = start_s3()
    try:
        with tempfile.TemporaryDirectory(prefix="remote-io-") as folder:
            tmp = Path(folder)
            log = synthesize_log(tmp / "log", args.size, shards=args.shards, seed=0)
            sources = stage(tmp / "log", tmp, endpoint)
            runs: dict[str, list[dict]] = {s: [] for s in SOURCES}
            for r in range(args.rounds):
                order = SOURCES[r % len(SOURCES):] + SOURCES[:r % len(SOURCES)]
                for source in order:
                    path, options = sources[source]
                    runs[source].append(build_once(path, options, tmp / f"cache-{source}-{r}"))
                    print(f"round {r + 1}: {source:12s} {runs[source][-1]['s']:6.2f} s", flush=True)
    finally:
        server.stop()
    for pair in (("local", "s3"), ("delta_local", "delta_s3")):  # the same files, the same store
        contents = {run["content"] for source in pair for run in runs[source]}
        assert len(contents) == 1, f"{' and '.join(pair)} built different stores: {sorted(contents)}"
    result = {"machine": machine(), "size": args.size, "interactions": log["rows"], "log_mb": log["mb"],
              "shards": args.shards, "rounds": args.rounds, "sources": summarise(runs), "runs": runs,
              "note": "moto serves S3 from Python on the same (shared, noisy) cores; builds in fresh subprocesses"}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{log['rows']} interactions ({log['mb']:.1f} MB Parquet, {args.shards} shards), "
          f"{args.rounds} alternated rounds, median:")
    print(f"{'source':12s} {'build s':>8s} {'interactions/s':>15s} {'vs local':>9s} {'peak RSS MB':>12s}")
    for source, s in result["sources"].items():
        print(f"{source:12s} {s['median_s']:8.2f} {s['interactions_per_s']:15.0f} {s['vs_local']:8.2f}x "
              f"{s['peak_mb']:12.0f}")
    print(f"wrote {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
