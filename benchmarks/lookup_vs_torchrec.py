"""Sharded embedding lookups, gmeta_ds vs TorchRec, side by side (issue 20).

Purpose: ms per training step and bytes sent per rank per step of gmeta_ds's
`ShardedEmbeddingCollection` (row-wise and table-wise) next to TorchRec's `EmbeddingBagCollection`
sharded by `DistributedModelParallel` (table-wise with fbgemm's fused table-batched kernel and a
fused optimizer; data-parallel, whose dense gradients DDP all-reduces), on the same ids.

Method: one launch of 2 ranks (gloo on 127.0.0.1, 1 thread per rank). Per rank and feature 64
bags; ids Zipf(1.1) over a seeded permutation of each table's rows (4 distinct batches, cycled).
Workloads: ``multi-hot`` 8 tables of 10,000 x 16, bags of 50 ids; ``large`` 1 table of
1,000,000 x 32, bags of 50; ``single-hot`` 8 tables of 10,000 x 16, 1 id per bag; each with SGD
and Adagrad (lr 0.05). A step: forward of every feature, backward of a fixed weighted sum of the
pooled outputs, the row update (gmeta_ds: ``.step()``; TorchRec: fused into backward). Before
timing, every implementation's pooled output is compared with an unsharded
``torch.nn.EmbeddingBag`` holding the same initial rows (max abs diff printed). Then --rounds
rounds; in each, every implementation runs --steps steps (the order rotates per round), each
rank times them after a barrier and the slower rank's ms/step counts. Reported: median ms/step,
and the median over rounds of each implementation's ratio to TorchRec table-wise in that round;
the same for CPU ms/step (the rank's process CPU time, every thread, the larger rank's), which
other jobs on the cores disturb far less than wall time.
Bytes per rank per step: gmeta_ds's `CommStats` (payload sent to the other rank), and for every
implementation the bytes the rank wrote to its sockets during one step (``wchar`` of
/proc/self/io: gloo payload plus its headers; nothing else writes while a step runs).

TorchRec is not a gmeta_ds dependency; it lives in an environment of its own. fbgemm-gpu-cpu
1.8.0 is the release built for torch 2.13 (1.9.0 is built for 2.14 and fails to load its
libraries on 2.13); torchrec 1.8.0 goes in with --no-deps (its metadata names the CUDA
fbgemm-gpu), and gmeta_ds comes from the checkout (benchmarks/common.py puts it on sys.path)::

    python3.11 -m venv /work/trec-venv
    /work/trec-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu  # or a local wheel
    echo "torch==2.13.0+cpu" > /tmp/c.txt
    /work/trec-venv/bin/pip install -c /tmp/c.txt fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics==1.0.3 \\
        pyre-extensions iopath tqdm numpy packaging
    /work/trec-venv/bin/pip install --no-deps torchrec==1.8.0
    /work/trec-venv/bin/python benchmarks/lookup_vs_torchrec.py [--rounds 5] [--steps 5]

With the project's own venv (no TorchRec): ``python benchmarks/lookup_vs_torchrec.py --skip-torchrec``.
--workloads/--optimizers pick a subset. gmeta_ds is imported from PYTHONPATH when set there (to time
a committed tree while the work tree changes: ``git archive HEAD gmeta_ds | tar -x -C /tmp/head``,
then ``PYTHONPATH=/tmp/head``); the JSON records where it came from. Writes
``benchmarks/results/lookup_vs_torchrec.json``. On 2 shared cores the ms are indicative (the
JSON keeps every round and the load average); bytes and the equality checks are exact.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LaunchFailure, machine, rank_main, run_ranks  # first: OMP_WAIT_POLICY, sys.path

# isort: split

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import gmeta_ds
from gmeta_ds.embedding.plan import plan_tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import TableConfig, init_rows
from gmeta_ds.sparse import Jagged

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "lookup_vs_torchrec.json"
BAGS, ZIPF, LR, SEED, BATCHES, WORLD = 64, 1.1, 0.05, 7, 4, 2
WORKLOADS = {  # name: (tables, rows, dim, ids per bag)
    "multi-hot 8 x 10,000 x 16": (8, 10_000, 16, 50),
    "large 1 x 1,000,000 x 32": (1, 1_000_000, 32, 50),
    "single-hot 8 x 10,000 x 16": (8, 10_000, 16, 1),
}
OPTIMIZERS = ("sgd", "adagrad")
BASELINE = "TorchRec table-wise"


@dataclass(frozen=True)
class Variant:
    """One gmeta_ds implementation: the plan of every table, keyword arguments of the
    `ShardedEmbeddingCollection` constructor and of its forward call. Add a variant (e.g. a
    pooled exchange) by adding an entry to `GMETA_VARIANTS`."""

    name: str
    plan: str
    build: dict = field(default_factory=dict)
    call: dict = field(default_factory=dict)
    exchange: str = "rows"  # every table's `TableConfig.exchange`: rows | pooled


GMETA_VARIANTS = (
    Variant("gmeta_ds row-wise", "row_wise"),
    Variant("gmeta_ds table-wise", "table_wise"),
    Variant("gmeta_ds row-wise pooled", "row_wise", exchange="pooled"),
    Variant("gmeta_ds table-wise pooled", "table_wise", exchange="pooled"),
)
TORCHREC_VARIANTS = (("TorchRec table-wise", "table_wise"), ("TorchRec data-parallel", "data_parallel"))


# ------------------------------------------------------------------ workload
def table_configs(workload: str, optimizer: str) -> list[TableConfig]:
    n, rows, dim, _ = WORKLOADS[workload]
    return [TableConfig(f"t{i}", rows, dim, (f"f{i}",), pooling="sum", optimizer=optimizer, lr=LR)
            for i in range(n)]


def zipf_batches(tables: list[TableConfig], per_bag: int, rank: int) -> list[dict[str, Jagged]]:
    """`BATCHES` batches {feature: Jagged} of `BAGS` fixed-length bags, this rank's own draws:
    popularity rank k ~ Zipf(ZIPF) on 1..rows, id = perm[k - 1] (the permutation shared by ranks)."""
    out = [{} for _ in range(BATCHES)]
    offsets = torch.arange(0, BAGS * per_bag + 1, per_bag)
    for i, t in enumerate(tables):
        perm = torch.randperm(t.num_rows, generator=torch.Generator().manual_seed(SEED * 1000 + i))
        probs = torch.arange(1, t.num_rows + 1, dtype=torch.float64).pow(-ZIPF)
        g = torch.Generator().manual_seed(SEED * 1000 + 100 * rank + i + 1)
        ranks = torch.multinomial(probs, BATCHES * BAGS * per_bag, replacement=True, generator=g)
        for b, chunk in enumerate(perm[ranks].view(BATCHES, -1)):
            out[b][t.features[0]] = Jagged(chunk.clone(), offsets, one_per_sample=per_bag == 1)
    return out


def reference(tables: list[TableConfig], batch: dict[str, Jagged]) -> dict[str, torch.Tensor]:
    """Pooled outputs of unsharded ``nn.EmbeddingBag``s holding the initial rows."""
    out = {}
    for t in tables:
        bag = torch.nn.EmbeddingBag.from_pretrained(init_rows(t, SEED, torch.arange(t.num_rows)), mode="sum")
        j = batch[t.features[0]]
        out[t.features[0]] = bag(j.values, j.offsets[:-1])
    return out


def wchar() -> int:
    """Bytes this process has written with write()/writev()/send() (sockets included)."""
    line = next(ln for ln in Path("/proc/self/io").read_text().splitlines() if ln.startswith("wchar:"))
    return int(line.split()[1])


# ------------------------------------------------------------------ implementations
class GmetaImpl:
    def __init__(self, variant: Variant, tables: list[TableConfig], rank: int):
        self.name, self.call = variant.name, variant.call
        tables = [dataclasses.replace(t, exchange=variant.exchange) for t in tables]
        plan = plan_tables(tables, WORLD, {t.name: variant.plan for t in tables})
        self.coll = ShardedEmbeddingCollection(plan, rank, seed=SEED, **variant.build)

    def prepare(self, batch: dict[str, Jagged]) -> dict[str, Jagged]:
        return batch

    def pooled(self, batch) -> dict[str, torch.Tensor]:
        return self.coll.forward(batch, **self.call)

    def step(self, batch, weights) -> None:
        out = self.pooled(batch)
        sum((out[f] * w).sum() for f, w in weights.items()).backward()
        self.coll.step()

    def counted_step(self, batch, weights) -> dict:
        """One step; its `CommStats` payload."""
        self.coll.stats.reset()
        self.step(batch, weights)
        return {"bytes_sent": self.coll.stats.total_sent(), "stages": self.coll.stats.as_dict()}


class TorchRecImpl:
    """`EmbeddingBagCollection` sharded by `DistributedModelParallel` with every table
    ``table_wise`` (fused kernel, optimizer fused into backward) or ``data_parallel`` (dense
    kernel; DDP all-reduces the dense gradients, then a torch optimizer steps)."""

    def __init__(self, name: str, kind: str, tables: list[TableConfig], rank: int):
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.distributed.embedding_types import EmbeddingComputeKernel
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.types import ShardingType
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        self.name, self.features = name, [t.features[0] for t in tables]
        cpu = torch.device("cpu")
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=t.num_rows, embedding_dim=t.dim,
                                                         name=t.name, feature_names=list(t.features))
                                      for t in tables], device=cpu)
        opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[tables[0].optimizer]
        kw = {"lr": LR, "eps": 1e-10} if opt is torch.optim.Adagrad else {"lr": LR}
        if kind == "table_wise":
            apply_optimizer_in_backward(opt, ebc.parameters(), kw)
        sharding, kernel = {"table_wise": (ShardingType.TABLE_WISE, EmbeddingComputeKernel.FUSED),
                            "data_parallel": (ShardingType.DATA_PARALLEL, EmbeddingComputeKernel.DENSE)}[kind]
        constraints = {t.name: ParameterConstraints(sharding_types=[sharding.value], compute_kernels=[kernel.value])
                       for t in tables}
        sharder = EmbeddingBagCollectionSharder()
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=WORLD, compute_device="cpu"),
                                           constraints=constraints)
        plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
        self.model = DistributedModelParallel(ebc, device=cpu, plan=plan, sharders=[sharder])
        self.plan = str(plan)
        self._load({t.name: init_rows(t, SEED, torch.arange(t.num_rows)) for t in tables})
        # data-parallel: an in-backward optimizer is not applied to DP tables (rows stay put), so
        # a dense optimizer steps after DDP's all-reduce
        self.dense = opt(self.model.parameters(), **kw) if kind == "data_parallel" else None

    def _load(self, rows: dict[str, torch.Tensor]) -> None:
        """Copy the initial rows into this rank's shards (a plain tensor or a ShardedTensor)."""
        with torch.no_grad():
            for key, value in self.model.state_dict().items():
                name = key.split(".")[-2]
                if name not in rows:
                    continue
                full = rows[name]
                if hasattr(value, "local_shards"):
                    for shard in value.local_shards():
                        (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                        shard.tensor.copy_(full[r:r + h, c:c + w])
                elif hasattr(value, "to_local"):
                    raise NotImplementedError(f"{key}: DTensor shards")
                else:
                    value.copy_(full)

    def prepare(self, batch: dict[str, Jagged]):
        """The batch as one KeyedJaggedTensor."""
        from torchrec import KeyedJaggedTensor

        lengths = torch.cat([batch[f].offsets.diff() for f in self.features])
        return KeyedJaggedTensor.from_lengths_sync(self.features, torch.cat([batch[f].values for f in self.features]),
                                                   lengths)

    def pooled(self, batch) -> dict[str, torch.Tensor]:
        return self.model(batch).to_dict()

    def step(self, batch, weights) -> None:
        out = self.pooled(batch)
        sum((out[f] * w).sum() for f, w in weights.items()).backward()
        if self.dense is not None:
            self.dense.step()
            self.dense.zero_grad(set_to_none=True)

    def counted_step(self, batch, weights) -> dict:
        self.step(batch, weights)
        return {}


# ------------------------------------------------------------------ rank worker
def max_diff(pooled, batch, expected: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        out = pooled(batch)
    return max(float((out[f] - expected[f]).abs().max()) for f in expected)


def build_impls(tables, rank: int, torchrec: bool) -> list:
    impls = [GmetaImpl(v, tables, rank) for v in GMETA_VARIANTS]
    if torchrec:
        impls += [TorchRecImpl(name, kind, tables, rank) for name, kind in TORCHREC_VARIANTS]
    return impls


def one_config(workload: str, optimizer: str, rank: int, rounds: int, steps: int, torchrec: bool) -> dict:
    tables = table_configs(workload, optimizer)
    batches = zipf_batches(tables, WORKLOADS[workload][3], rank)
    g = torch.Generator().manual_seed(SEED + rank)
    weights = {t.features[0]: torch.randn(BAGS, t.dim, generator=g) for t in tables}
    impls = build_impls(tables, rank, torchrec)
    inputs = {impl.name: [impl.prepare(b) for b in batches] for impl in impls}
    ref = reference(tables, batches[0])
    res = {impl.name: {} for impl in impls}
    for impl in impls:  # equality, before any update
        res[impl.name]["max_abs_diff"] = max_diff(impl.pooled, inputs[impl.name][0], ref)
    for impl in impls:  # one step each: bytes (and warm-up)
        dist.barrier()
        before = wchar()
        extra = impl.counted_step(inputs[impl.name][0], weights)
        res[impl.name].update(wire_bytes=wchar() - before, **extra)
        dist.barrier()
    first = impls[0]
    with torch.no_grad():
        after = first.pooled(inputs[first.name][0])
    for impl in impls:  # the same update? (outputs after the step vs the first implementation's)
        res[impl.name]["after_step_diff_vs_first"] = max_diff(impl.pooled, inputs[impl.name][0], after)
        res[impl.name]["step_moved_outputs_by"] = max_diff(impl.pooled, inputs[impl.name][0], ref)
    for r in range(rounds):
        for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            for s in range(steps):
                impl.step(inputs[impl.name][(s + 1) % BATCHES], weights)
            res[impl.name].setdefault("cpu_ms", []).append(1e3 * (time.process_time() - cpu) / steps)
            res[impl.name].setdefault("ms", []).append(1e3 * (time.perf_counter() - start) / steps)
    if torchrec:
        res["torchrec_plans"] = {i.name: i.plan for i in impls if isinstance(i, TorchRecImpl)}
    return res


def bench_worker(rounds: str, steps: str, torchrec: str, workloads: str, optimizers: str) -> dict:
    rank = dist.get_rank()
    return {f"{w} | {o}": one_config(w, o, rank, int(rounds), int(steps), torchrec == "1")
            for w in workloads.split(";") for o in optimizers.split(",")}


# ------------------------------------------------------------------ main
def summarize(ranks: list[dict]) -> dict:
    out = {}
    for config in ranks[0]:
        if config == "rank":
            continue
        per = [r[config] for r in ranks]
        names = [n for n in per[0] if n != "torchrec_plans"]
        slow = {n: [max(ms) for ms in zip(*(p[n]["ms"] for p in per))] for n in names}  # slower rank per round
        cpu = {n: [max(ms) for ms in zip(*(p[n]["cpu_ms"] for p in per))] for n in names}
        entry = {}
        for n in names:
            e = {"ms_per_step": statistics.median(slow[n]), "ms_per_round": slow[n],
                 "cpu_ms_per_step": statistics.median(cpu[n]), "cpu_ms_per_round": cpu[n],
                 "max_abs_diff": max(p[n]["max_abs_diff"] for p in per),
                 f"after_step_diff_vs_{names[0]}": max(p[n]["after_step_diff_vs_first"] for p in per),
                 "step_moved_outputs_by": min(p[n]["step_moved_outputs_by"] for p in per),
                 "wire_bytes_per_rank": [p[n]["wire_bytes"] for p in per]}
            if "bytes_sent" in per[0][n]:
                e["commstats_bytes_sent_per_rank"] = [p[n]["bytes_sent"] for p in per]
                e["commstats_stages_rank0"] = per[0][n]["stages"]
            if BASELINE in slow:
                e["ratio_vs_torchrec_table_wise"] = statistics.median(a / b for a, b in zip(slow[n], slow[BASELINE]))
                e["cpu_ratio_vs_torchrec_table_wise"] = statistics.median(a / b for a, b in zip(cpu[n], cpu[BASELINE]))
            entry[n] = e
        if "torchrec_plans" in per[0]:
            entry["torchrec_plans_rank0"] = per[0]["torchrec_plans"]
        out[config] = entry
    return out


def print_table(summary: dict) -> None:
    print(f"\n{'workload | optimizer':<38} {'implementation':<24} {'ms/step':>8} {'vs TR-TW':>8} "
          f"{'CPU ms':>7} {'vs TR-TW':>8} {'CommStats B/rank':>17} {'wire B/rank':>13} {'max|diff|':>10} "
          f"{'after step':>10}")
    for config, entry in summary.items():
        for n, e in entry.items():
            if n.startswith("torchrec_plans"):
                continue
            ratio = f"{e['ratio_vs_torchrec_table_wise']:.2f}x" if "ratio_vs_torchrec_table_wise" in e else "-"
            cpu = f"{e['cpu_ratio_vs_torchrec_table_wise']:.2f}x" if "cpu_ratio_vs_torchrec_table_wise" in e else "-"
            cs = e.get("commstats_bytes_sent_per_rank")
            cs = f"{max(cs):,}" if cs else "-"
            print(f"{config:<38} {n:<24} {e['ms_per_step']:>8.2f} {ratio:>8} {e['cpu_ms_per_step']:>7.2f} {cpu:>8} {cs:>17} "
                  f"{max(e['wire_bytes_per_rank']):>13,} {e['max_abs_diff']:>10.2e} "
                  f"{next(v for k, v in e.items() if k.startswith('after_step_diff')):>10.2e}")
    print("CPU ms: the rank's process CPU time per step (every thread: gloo's too), the larger rank's; "
          "max|diff|: pooled outputs vs unsharded nn.EmbeddingBag before any update; after step: "
          f"vs {GMETA_VARIANTS[0].name} after one step (same update); B/rank: max over ranks")


def torchrec_versions() -> dict | None:
    try:
        from importlib.metadata import version

        import fbgemm_gpu
        import torchrec  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: run without it
        print(f"TorchRec unavailable ({type(e).__name__}: {e}); gmeta_ds only", file=sys.stderr)
        return None
    return {"torchrec": version("torchrec"), "fbgemm_gpu": fbgemm_gpu.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per implementation per round")
    ap.add_argument("--skip-torchrec", action="store_true", help="gmeta_ds only (e.g. in the project venv)")
    ap.add_argument("--workloads", nargs="+", choices=[w.split()[0] for w in WORKLOADS],
                    default=[w.split()[0] for w in WORKLOADS])
    ap.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    workloads = ";".join(w for w in WORKLOADS if w.split()[0] in args.workloads)
    start = time.perf_counter()
    versions = None if args.skip_torchrec else torchrec_versions()
    try:
        ranks = run_ranks(__file__, "bench", WORLD, str(args.rounds), str(args.steps), "1" if versions else "0",
                          workloads, ",".join(args.optimizers), timeout=args.timeout)
    except LaunchFailure as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    summary = summarize(ranks)
    print_table(summary)
    params = {**vars(args), "world": WORLD, "bags_per_feature_per_rank": BAGS, "zipf_exponent": ZIPF, "lr": LR,
              "distinct_batches": BATCHES, "threads_per_rank": 1, "backend": "gloo",
              "workloads": {k: dict(zip(("tables", "rows", "dim", "ids_per_bag"), v)) for k, v in WORKLOADS.items()},
              "gmeta_variants": [vars(v) for v in GMETA_VARIANTS], "torchrec": versions,
              "gmeta_ds_from": str(Path(gmeta_ds.__file__).parent)}
    runtime = time.perf_counter() - start
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "parameters": params, "results": summary,
                                   "runtime_s": runtime}, indent=2) + "\n")
    print(f"\ntotal {runtime:.0f}s; wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    worker = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--worker" else None
    sys.exit(rank_main({"bench": bench_worker}, worker, sys.argv[3:]) if worker else main())
