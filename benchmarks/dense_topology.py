"""A hierarchical dense reduction from DeepSpeed on an emulated cluster? (issue 37 item 3)

DeepSpeed 0.19's topology-aware options for the dense side are ZeRO++'s: ``zero_hpz_partition_size``
(hpZ: a secondary copy of the ZeRO-3 parameter partitions inside groups of that many consecutive
ranks, so the backward all-gather stays inside the host) and ``zero_quantized_gradients`` (qgZ:
the gradient reduce-scatter as an int4 all-to-all inside the host, then across hosts, through
its CUDA ``QuantizerBuilder`` op), both for ZeRO stage 3. This runs a dense MLP (no embedding
tables: all of its traffic is DeepSpeed's) under ZeRO-2, ZeRO-3, ZeRO-3 + hpZ and ZeRO-3 + qgZ
on H emulated hosts x R ranks (`emulated_cluster`, the launcher's variables as in
`topology.py`, gloo on the CPU accelerator) and reports per variant steps/s (median of
``reps`` repetitions of ``steps`` steps, the variants interleaved), the bytes that left each
host per step (the tx counter of the host's interface: everything crossing hosts, measured by
the kernel, not estimated) and the loss after the timed steps, or the exact error a variant
stops with.

    python benchmarks/dense_topology.py [--rate 100mbit] [--prefix gmh37 --subnet 37]
    (-> benchmarks/results/dense_topology.json)

Root only (namespaces). ``--worker`` is the per-rank entry point.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (sets OMP_WAIT_POLICY before torch; puts the checkout on sys.path)
from emulated_cluster import PREFIX, emulated_cluster  # noqa: E402
from topology import launch  # noqa: E402

SETTINGS = dict(width=512, layers=4, batch=16, steps=4, warmup=1, reps=3)
VARIANTS = {
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero3_hpz": {"stage": 3, "zero_hpz_partition_size": "ranks_per_host"},
    "zero3_qgz": {"stage": 3, "zero_quantized_gradients": True},
}


def _config(variant: dict, ranks_per_host: int, s: dict) -> dict:
    zero = {k: (ranks_per_host if v == "ranks_per_host" else v) for k, v in variant.items()}
    # ds_configs/zero3.json's settings: nothing persists or is prefetched, and a parameter gathered
    # in forward is released and gathered again in backward (the gather hpZ keeps in the host)
    zero.update(reduce_bucket_size=10_000_000, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                stage3_max_live_parameters=10_000_000, stage3_max_reuse_distance=0)
    return {"train_micro_batch_size_per_gpu": s["batch"], "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": zero, "steps_per_print": 10 ** 9}


def _host_tx_bytes() -> int:
    """Bytes the host's (namespace's) non-loopback interfaces have sent: what left the host."""
    total = 0
    for iface in Path("/sys/class/net").iterdir():
        if iface.name != "lo":
            total += int((iface / "statistics" / "tx_bytes").read_text())
    return total


def _engine(name: str, s: dict):
    import deepspeed
    import torch
    from torch import nn

    from gmeta_ds.engine.dist import env_world, skip_deepspeed_shm_op

    skip_deepspeed_shm_op()
    torch.manual_seed(0)
    layers = [m for _ in range(s["layers"]) for m in (nn.Linear(s["width"], s["width"]), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(s["width"], 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(VARIANTS[name], env_world()[2], s))
    return engine


def _steps(engine, s: dict, rank: int, n: int) -> float:
    import torch

    loss = torch.zeros(())
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(s["batch"], s["width"], generator=g)
        loss = (engine(x) - x[:, :1]).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return float(loss)


def _timed(engine, s: dict, rank: int) -> tuple[float, int, float]:
    """Seconds of ``steps`` steps (the slowest rank's), bytes that left this host, last loss."""
    import torch
    import torch.distributed as dist

    _steps(engine, s, rank, s["warmup"])
    dist.barrier()
    tx, start = _host_tx_bytes(), time.perf_counter()
    loss = _steps(engine, s, rank, s["steps"])
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start])
    sent = _host_tx_bytes() - tx
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), sent, loss


def worker(s: dict) -> None:
    """One rank: every variant that starts, timed interleaved; the error of those that do not."""
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]  # the CPU accelerator's "devices per node" (qgZ)
    import deepspeed

    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    engines, result = {}, {"rank": rank}
    for name in VARIANTS:
        try:
            engines[name] = _engine(name, s)
            _steps(engines[name], s, rank, 1)
        except Exception as exc:  # noqa: BLE001  (reported: which variant does not run here, and why)
            engines.pop(name, None)
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        dist.barrier()
    times = {name: [] for name in engines}
    sent = {name: [] for name in engines}
    for _ in range(s["reps"]):
        for name, engine in engines.items():
            seconds, tx, loss = _timed(engine, s, rank)
            times[name].append(seconds)
            sent[name].append(tx / s["steps"])
            result.setdefault(name, {})["loss"] = loss
    for name in engines:
        result[name].update(steps_per_s=s["steps"] / statistics.median(times[name]),
                            host_tx_bytes_per_step=statistics.median(sent[name]), step_s=times[name])
    print(json.dumps(result), flush=True)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("dense",))
    parser.add_argument("--settings", default=json.dumps(SETTINGS))
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--prefix", default=PREFIX)
    parser.add_argument("--subnet", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "dense_topology.json"))
    args = parser.parse_args()
    settings = {**SETTINGS, **json.loads(args.settings)}
    if args.worker:
        return worker(settings)
    with emulated_cluster(2, args.rate, args.prefix, args.subnet) as hosts:
        results = launch(hosts, 2, "dense", settings, timeout=600, script=__file__)
    params = settings["layers"] * (settings["width"] + 1) * settings["width"] + settings["width"] + 1
    out = {"settings": settings, "rate": args.rate, "parameters": params, "ranks": results}
    print(json.dumps(out, indent=2))
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return None


if __name__ == "__main__":
    main()
