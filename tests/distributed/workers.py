"""Worker functions run on every rank by `ranks.run_ranks` (in the warm test pool, tests/pool.py,
between a gloo ``init_process_group`` and a barrier)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from gmeta_ds.embedding.plan import ShardingPlan, TablePlan, plan_tables, with_topology
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import EmbeddingCollection, TableConfig
from gmeta_ds.embedding.topology import Topology
from gmeta_ds.sparse import Jagged

TABLES = [
    TableConfig("a", 37, 4, ("a_multi", "a_single"), pooling="sum"),
    TableConfig("b", 23, 4, ("b_mean",), pooling="mean"),
    TableConfig("c", 11, 4, ("c_seq",), pooling="none"),
    TableConfig("d", 7, 4, ("d_rep",), pooling="sum"),
    TableConfig("e", 29, 3, ("e_dim3",), pooling="sum"),
]


def mixed_plan(world: int, device: str = "auto") -> ShardingPlan:
    kinds = {"a": ("row_wise", "modulo"), "b": ("row_wise", "block"), "c": ("table_wise", "modulo"),
             "d": ("replicated", "modulo"), "e": ("row_wise", "block")}
    plans = {t.name: TablePlan(dataclasses.replace(t, device=device), kinds[t.name][0], world,
                               kinds[t.name][1], owner=world - 1)
             for t in TABLES}
    return ShardingPlan(plans, world)


def features(rank: int, world: int) -> dict[str, Jagged]:
    """Different ids per rank, duplicates, empty bags; rank 0 asks table a only for rows it owns."""
    g = torch.Generator().manual_seed(100 + rank)

    def jag(rows: int, n: int, max_len: int, multiple_of: int = 1) -> Jagged:
        lengths = torch.randint(0, max_len + 1, (n,), generator=g)
        values = torch.randint(0, rows // multiple_of, (int(lengths.sum()),), generator=g) * multiple_of
        return Jagged(values, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))

    only_own = world if rank == 0 else 1
    return {"a_multi": jag(37, 6, 4, only_own), "a_single": Jagged.single(torch.tensor([5, 5, 2, 36])),
            "b_mean": jag(23, 5, 3), "c_seq": jag(11, 4, 3), "d_rep": jag(7, 3, 2), "e_dim3": jag(29, 5, 2)}


def loss_of(out: dict, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return sum((v * torch.randn(v.shape, generator=g)).sum() for _, v in sorted(out.items()))


def compare_with_twin(sharded: ShardedEmbeddingCollection, twin: EmbeddingCollection,
                      feats: dict[str, Jagged]) -> None:
    """Forward of every feature, then row gradients averaged over ranks at their owners, and
    the initial rows, equal the unsharded twin's."""
    rank, world, plan = sharded.rank, sharded.world, sharded.plan
    out_s, out_u = sharded(feats), twin(feats)
    for name in feats:
        torch.testing.assert_close(out_s[name], out_u[name], msg=f"forward {name}")
    loss_of(out_s, rank).backward()
    loss_of(out_u, rank).backward()
    sharded.finish_gradients()
    for name, weight in twin.weights.items():
        ref = weight.grad.clone()
        dist.all_reduce(ref)
        ref /= world
        shard = sharded.shards[name]
        ids = plan.tables[name].layout.global_ids(rank)
        assert shard.shape == (len(ids), plan.tables[name].table.dim), name
        got = shard.grad.to_dense() if shard.grad is not None else torch.zeros_like(shard)
        torch.testing.assert_close(got, ref[ids], msg=f"gradient {name}")
        torch.testing.assert_close(shard.detach(), weight.detach()[ids], msg=f"init {name}")


def sharded_equals_unsharded(device: str = "auto") -> None:
    """``device: host`` puts every table on the host with an exchange over its own gloo group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = mixed_plan(world, device)
    sharded = ShardedEmbeddingCollection(plan, rank, seed=5)
    if world > 1:
        own_group = {g is not None for g in sharded.groups.values()}
        assert own_group == {device == "host"}, sharded.groups
    twin = EmbeddingCollection(TABLES, seed=5)
    compare_with_twin(sharded, twin, features(rank, world))
    assert abs(sharded.checksum() - sum(w.double().sum().item() for w in twin.weights.values())) < 1e-9
    full = sharded.gather_tables()
    assert (full == {}) == (rank != 0)
    everywhere = sharded.gather_tables(everywhere=True)
    for name, weight in twin.weights.items():
        torch.testing.assert_close(everywhere[name], weight.detach(), msg=f"all-gather {name}")
        if rank == 0:
            torch.testing.assert_close(full[name], weight.detach(), msg=f"gather {name}")
    stats = sharded.stats.as_dict()
    if world > 1:
        assert stats["input_dist"]["collectives"] == 4 and stats["output_dist"]["collectives"] == 2, stats
        assert stats["output_dist_backward"]["collectives"] == 2, stats
    else:
        assert stats == {}, stats
    print("ok", rank)


POOLED_TABLES = [
    TableConfig("a", 37, 4, ("a_multi", "a_single"), pooling="sum", exchange="pooled"),
    TableConfig("b", 23, 4, ("b_mean",), pooling="mean", exchange="pooled"),
    TableConfig("c", 11, 4, ("c_seq",), pooling="none"),
    TableConfig("d", 7, 4, ("d_rep",), pooling="sum"),
    TableConfig("e", 29, 3, ("e_dim3",), pooling="sum", exchange="pooled"),
    TableConfig("f", 41, 4, ("f_rows",), pooling="mean", exchange="rows"),
    TableConfig("g", 19, 5, ("g_alone",), pooling="sum", exchange="pooled", optimizer="sgd"),
    # a group of table-wise tables only (owners by feature), of different sizes, one mean
    TableConfig("h", 13, 6, ("h_multi", "h_too"), pooling="sum", exchange="pooled", optimizer="sgd"),
    TableConfig("i", 17, 6, ("i_mean",), pooling="mean", exchange="pooled", optimizer="sgd"),
    TableConfig("j", 15, 6, ("j_multi",), pooling="sum", exchange="pooled", optimizer="sgd"),
]


def pooled_features(rank: int, world: int) -> dict[str, Jagged]:
    """`features` plus the bags of the table-wise pooled group, a rows-exchanged table's and
    a table's of its own, with an empty bag on every rank."""
    feats = features(rank, world)
    g = torch.Generator().manual_seed(300 + rank)
    for name, rows, n in (("h_multi", 13, 5), ("h_too", 13, 3), ("i_mean", 17, 4), ("j_multi", 15, 6)):
        lengths = torch.randint(0, 5, (n,), generator=g)
        lengths[rank % n] = 0  # an empty bag on every rank
        feats[name] = Jagged(torch.randint(0, rows, (int(lengths.sum()),), generator=g),
                             torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    feats["f_rows"] = feats["b_mean"]
    feats["g_alone"] = Jagged(torch.tensor([18, 3, 3, 7, 0]) if rank == 0 else torch.tensor([5, 6]),
                              torch.tensor([0, 2, 2, 5]) if rank == 0 else torch.tensor([0, 2]))
    return feats


def pooled_equals_unsharded() -> None:
    """Tables pooled on their owners (row-wise modulo and block, table-wise, sum and mean,
    a single-hot feature, empty bags; groups of one sharding mode and a mixed one) next to
    tables exchanged as rows: forward, averaged row gradients and the fused single-hot + bags
    lookup equal the unsharded twin, and the pooled tables' output_dist carries one partial
    sum per (remote owner, bag) holding part of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kinds = {"a": "row_wise", "b": "table_wise", "c": "table_wise", "d": "replicated", "e": "table_wise",
             "f": "row_wise", "g": "row_wise", "h": "table_wise", "i": "table_wise", "j": "table_wise"}
    plan = plan_tables(POOLED_TABLES, world, kinds, row_owner="block" if world == 3 else "modulo")
    assert {n for n, p in plan.tables.items() if p.exchange == "pooled"} == {"a", "b", "e", "g", "h", "i", "j"}
    if world > 1:  # the table-wise group's features are not in order of owner
        owners = [plan.tables[t].owner for t in "hhij"]
        assert owners != sorted(owners), owners
    sharded, twin = ShardedEmbeddingCollection(plan, rank, seed=5), EmbeddingCollection(POOLED_TABLES, seed=5)
    feats = pooled_features(rank, world)
    compare_with_twin(sharded, twin, feats)
    # output_dist: one partial sum (d floats) per (bag, remote owner holding part of the bag)
    pooled_only = {n: j for n, j in feats.items() if sharded.by_feature[n].name in sharded.pooled}
    expected = 0
    for feature, jagged in pooled_only.items():
        table = sharded.by_feature[feature]
        pairs = torch.unique(jagged.segment_ids() * world + plan.tables[table.name].layout.owners(jagged.values))
        expected += 4 * table.dim * int((pairs % world != rank).sum())
    sharded.stats.reset()
    sharded(pooled_only)
    received = sharded.stats.as_dict().get("output_dist", {}).get("bytes_received", 0)
    assert received == expected, (sharded.stats.as_dict(), expected)
    # a model's fused lookup: single-hot fields of row-exchanged tables next to a pooled bag,
    # and (falling back to the per-feature path) a single-hot field of a pooled table
    bags = {"b_mean": feats["b_mean"]}
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 7, (bags["b_mean"].num_samples, 2), generator=g)
    for fields in (["d_rep", "f_rows"], ["a_single", "f_rows"]):
        torch.testing.assert_close(sharded.lookup_fields(ids, fields, bags), twin.lookup_fields(ids, fields, bags),
                                   msg=f"lookup_fields {fields}")
    print("ok", rank)


DYNAMIC_TABLES = [
    TableConfig("u", 0, 4, ("u_single", "u_bag"), kind="dynamic", capacity=40, admit_after=2),
    TableConfig("v", 0, 4, ("v_seq",), pooling="none", kind="dynamic", capacity=6, eviction="lfu",
                optimizer="sgd"),
    TableConfig("s", 31, 4, ("s_single",)),
]


def dynamic_equals_unsharded(device: str = "auto") -> None:
    """Dynamic tables (ids anywhere in int64, admission by count, eviction) next to a static
    one: every rank's lookups equal the unsharded twin loaded with the gathered state, row
    gradients arrive averaged at the owners, and three rounds keep occupancy within capacity."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tables = [dataclasses.replace(t, device=device) for t in DYNAMIC_TABLES]
    plan = plan_tables(tables, world, {"s": "row_wise"})
    sharded = ShardedEmbeddingCollection(plan, rank, seed=9)
    g = torch.Generator().manual_seed(50 + rank)
    common = torch.tensor([2**62 + 1, -5, 77])  # every rank looks these up
    for round_ in range(3):
        u_ids = torch.cat([common, torch.randint(-2**63, 2**63 - 1, (5,), generator=g)])
        feats = {"u_single": Jagged.single(u_ids),
                 "u_bag": Jagged(torch.cat([common[:2], u_ids[3:5]]), torch.tensor([0, 1, 4])),
                 "v_seq": Jagged(torch.randint(0, 12, (4,), generator=g) * 1000, torch.tensor([0, 2, 4])),
                 "s_single": Jagged.single(torch.randint(0, 31, (3,), generator=g))}
        out_s = sharded(feats)
        twin = EmbeddingCollection(tables, seed=9)
        twin.load_state_dict(sharded.gather_state(everywhere=True))
        out_u = twin(feats)
        for name in feats:
            torch.testing.assert_close(out_s[name], out_u[name], msg=f"round {round_} forward {name}")
        if round_ == 0:  # 77: once per rank (-5 twice): admitted at world >= 2 only
            admitted = bool(twin.dynamic["u"].ids.eq(77).any())
            assert admitted == (world >= 2), (world, twin.dynamic["u"].ids)
        loss_of(out_s, rank).backward()
        loss_of(out_u, rank).backward()
        sharded.finish_gradients()
        for name in ("u", "v"):
            index, shard = sharded.dynamic[name], sharded.shards[name]
            ref_rows = twin.dynamic[name].rows.grad.clone()
            ref_defaults = twin.dynamic[name].defaults.grad.clone()
            dist.all_reduce(ref_rows)
            dist.all_reduce(ref_defaults)
            got = shard.grad.to_dense()
            position = torch.searchsorted(twin.dynamic[name].ids, index.keys)
            torch.testing.assert_close(got[index.rows], ref_rows[position] / world, msg=f"gradient {name}")
            torch.testing.assert_close(got[0], ref_defaults[rank] / world, msg=f"default gradient {name}")
            assert index.occupancy <= index.capacity
        sharded.step()
    rows_here = sum(int(index.occupancy) + 1 for index in sharded.dynamic.values())
    assert rows_here > 2
    totals = sharded._sum_on_host([float(sharded.dynamic["v"].counters["evictions"])])
    if world == 1:
        assert totals[0] > 0  # 12 distinct ids through 6 rows
    twin_sum = sum(float(t.double().sum()) / (world if k.endswith(".defaults") else 1)
                   for k, t in sharded.gather_state(everywhere=True).items() if not k.endswith(".ids"))
    assert abs(sharded.checksum() - twin_sum) < 1e-9
    print("ok", rank)


def tiny_engine(stage: int, gas: int):
    """A DeepSpeed engine (ZeRO ``stage``, ``gas`` micro-batches of 3 tasks per rank) on a
    tiny MeLU meta-learned by first-step MAML, seeded identically on every rank."""
    from helpers import tiny_melu

    from gmeta_ds.algorithms import MetaLearner, build_algorithm
    from gmeta_ds.config import MetaConfig
    from gmeta_ds.engine import ds_engine
    from gmeta_ds.engine.dist import skip_deepspeed_shm_op

    skip_deepspeed_shm_op()
    torch.manual_seed(0)
    learner = MetaLearner(tiny_melu(), build_algorithm(MetaConfig(algorithm="maml", inner_steps=1), "binary"))
    ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": gas,
          "train_batch_size": 3 * gas * dist.get_world_size(), "zero_optimization": {"stage": stage},
          "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    return ds_engine.initialize(learner, ds)


def nonfinite(policy: str) -> None:
    """A NaN label in one task on rank 1: ``skip`` drops the meta-step on every rank (no
    parameter moves, the next finite step trains); ``abort`` raises on every rank, naming the
    meta-step, the rank and its task ids."""
    from helpers import tiny_batch

    from gmeta_ds.engine import ds_engine
    from gmeta_ds.meta_engine import NonFiniteLoss, step_micro_batches

    rank = dist.get_rank()
    engine = tiny_engine(stage=2, gas=1)
    before = ds_engine.checksums(engine.module)
    bad = tiny_batch(seed=rank)
    if rank == 1:
        bad.support_y[1, 0] = float("nan")
    if policy == "abort":
        try:
            step_micro_batches(engine, None, [], [bad], step=6, nonfinite="abort")
        except NonFiniteLoss as exc:
            assert "meta-step 7: non-finite outer loss on rank 1 (tasks [0, 1, 2])" in str(exc), str(exc)
            print("raised", rank)
            return
        raise AssertionError("no NonFiniteLoss")
    stats = step_micro_batches(engine, None, [], [bad], step=6, nonfinite="skip")
    assert stats.skipped and ds_engine.checksums(engine.module) == before
    stats = step_micro_batches(engine, None, [], [tiny_batch(seed=10 + rank)], step=7, nonfinite="skip")
    assert not stats.skipped and ds_engine.checksums(engine.module) != before
    print("skipped", rank)


def nonfinite_accumulated() -> None:
    """Two micro-batches per rank, a NaN label in rank 0's first: the one check per
    meta-step (after the last backward, before any update) raises on every rank naming
    rank 0 and that micro-batch's tasks, and no parameter has moved."""
    from helpers import tiny_batch

    from gmeta_ds.engine import ds_engine
    from gmeta_ds.meta_engine import NonFiniteLoss, step_micro_batches

    rank = dist.get_rank()
    engine = tiny_engine(stage=1, gas=2)
    good = [tiny_batch(seed=10 + rank), tiny_batch(seed=20 + rank)]
    step_micro_batches(engine, None, [], good, step=0)
    before = ds_engine.checksums(engine.module)
    bad = [tiny_batch(seed=rank), tiny_batch(seed=30 + rank)]
    if rank == 0:
        bad[0].support_y[1, 0] = float("nan")
    try:
        step_micro_batches(engine, None, [], bad, step=1)
    except NonFiniteLoss as exc:
        assert "meta-step 2: non-finite outer loss on rank 0 (tasks [0, 1, 2])" in str(exc), str(exc)
        assert "rank 1" not in str(exc), str(exc)
        assert ds_engine.checksums(engine.module) == before
        print("raised", rank)
        return
    raise AssertionError("no NonFiniteLoss")


def zero0_world1_without_reduction() -> None:
    """At world 1 under ZeRO-0 (fp32) the meta-step skips DeepSpeed's one-rank gradient
    all-reduce (``engine.no_sync``): the trained weights equal, bit for bit, those of the same
    steps with the reduction."""
    from unittest import mock

    from helpers import tiny_batch

    from gmeta_ds.engine import ds_engine
    from gmeta_ds.meta_engine import step_micro_batches

    states = []
    for skip_reduction in (True, False):
        engine = tiny_engine(stage=0, gas=2)
        initial = {k: v.clone() for k, v in engine.module.state_dict().items()}
        assert ds_engine.reduction_is_identity(engine)
        calls = []
        original = engine.allreduce_gradients
        with mock.patch.object(ds_engine, "reduction_is_identity", return_value=skip_reduction), \
                mock.patch.object(engine, "allreduce_gradients",
                                  side_effect=lambda *a, **k: (calls.append(1), original(*a, **k))):
            for step in range(3):
                step_micro_batches(engine, None, [], [tiny_batch(seed=2 * step), tiny_batch(seed=2 * step + 1)], step=step)
        assert (len(calls) == 0) == skip_reduction, (skip_reduction, len(calls))
        states.append({k: v.clone() for k, v in engine.module.state_dict().items()})
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert any(not torch.equal(states[0][k], initial[k]) for k in initial)  # it trained
    print("ok", dist.get_rank())


# ---- the pool's own tests (tests/distributed/test_pool.py) ----------------------------------
def hang() -> None:
    """Never returns: the pool must kill it at the job's timeout."""
    import time

    time.sleep(3600)


def fail_on_rank(rank: str) -> None:
    """Rank ``rank`` raises; the others wait for it in a barrier that never completes."""
    if dist.get_rank() == int(rank):
        raise RuntimeError(f"rank {rank} failed on purpose")
    dist.barrier()


def leave_traces(marker: str) -> None:
    """Changes a job may make to its process: the pool must undo them before the next job."""
    import os

    print("seen", os.environ.get("GMETA_POOL_MARK", "unset"), os.getcwd(), dist.get_rank())
    os.environ["GMETA_POOL_MARK"] = marker
    os.chdir("/")


def hierarchical_equals_flat(ranks_per_host: str) -> None:
    """Tables pooled on their owners, exchanged hierarchically on the world as hosts of
    ``ranks_per_host`` ranks: forward and averaged row gradients equal the unsharded twin (and
    so the flat exchange), and the partial sums that cross hosts are one per (bag, remote host
    holding part of it), where the flat exchange sends one per (bag, remote owner)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = Topology(world, int(ranks_per_host))
    kinds = {"a": "row_wise", "b": "table_wise", "c": "table_wise", "d": "replicated", "e": "row_wise",
             "f": "row_wise", "g": "row_wise", "h": "table_wise", "i": "table_wise", "j": "table_wise"}
    base = plan_tables(POOLED_TABLES, world, kinds, row_owner="modulo")
    flat = ShardedEmbeddingCollection(with_topology(base, topology, "flat"), rank, seed=5)
    sharded = ShardedEmbeddingCollection(with_topology(base, topology, "hierarchical"), rank, seed=5)
    assert {type(s).__name__ for s in sharded.strategies.values()} >= {"HierarchicalPooled"}, sharded.strategies
    feats = pooled_features(rank, world)
    compare_with_twin(sharded, EmbeddingCollection(POOLED_TABLES, seed=5), feats)
    pooled_only = {n: j for n, j in feats.items() if sharded.by_feature[n].name in sharded.pooled}
    expected = {"flat": 0, "hierarchical": 0}
    for feature, jagged in pooled_only.items():
        table = sharded.by_feature[feature]
        owners = base.tables[table.name].layout.owners(jagged.values)
        for how, where in (("flat", owners), ("hierarchical", owners // topology.ranks_per_host)):
            pairs = torch.unique(jagged.segment_ids() * world + where) % world
            host = pairs // topology.ranks_per_host if how == "flat" else pairs
            expected[how] += 4 * table.dim * int((host != topology.host_of(rank)).sum())
    for how, coll, stage in (("flat", flat, "output_dist"), ("hierarchical", sharded, "inter_output_dist")):
        coll.stats.reset()
        out = coll(pooled_only)
        for name, jagged in pooled_only.items():
            assert out[name].shape == (jagged.num_samples, coll.by_feature[name].dim), name
        got = coll.stats.as_dict()
        sent = got[stage].get("cross_host_bytes_sent", 0)
        # the sums this rank's owners (flat) or gateways (hierarchical) send are what the others receive
        total = torch.tensor([sent, expected[how]])
        dist.all_reduce(total)
        assert total[0] == total[1], (how, total, got)
    print("ok", rank)


def _remote_distinct_rows(plan: ShardingPlan, topology: Topology, requesters: list[int]) -> int:
    """Bytes of the rows that owners on other hosts send to ``requesters`` (one rank: the flat
    exchange; the ranks of one host: the hierarchical one) when each distinct (table, id) they
    ask for together crosses once: 4 d B each, over every table exchanged by rows."""
    world = plan.world_size
    host = topology.host_of(requesters[0])
    asked = {}
    for rank in requesters:
        for feature, jagged in features(rank, world).items():
            table = next(t for t in TABLES if feature in t.features)
            if plan.tables[table.name].kind != "replicated":
                asked.setdefault(table.name, []).append(jagged.values)
    total = 0
    for name, parts in asked.items():
        ids = torch.cat(parts).unique()
        owners = plan.tables[name].layout.owners(ids)
        total += 4 * plan.tables[name].table.dim * int((owners // topology.ranks_per_host != host).sum())
    return total


def hierarchical_rows_equal_flat(ranks_per_host: str) -> None:
    """The deduplicated row exchange through the host's gateways, on the world as hosts of
    ``ranks_per_host`` ranks: forward bit for bit the flat exchange's, averaged row gradients the
    unsharded twin's, and the rows crossing hosts one per distinct (table, id) of a host (flat:
    of a rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = Topology(world, int(ranks_per_host))
    base = mixed_plan(world)
    flat = ShardedEmbeddingCollection(with_topology(base, topology, "flat"), rank, seed=5)
    hier = ShardedEmbeddingCollection(with_topology(base, topology, "hierarchical"), rank, seed=5)
    assert hier.plan.hierarchical_rows and hier.ctx.tiers is not None and not flat.plan.hierarchical_rows
    feats = features(rank, world)
    compare_with_twin(hier, EmbeddingCollection(TABLES, seed=5), feats)
    out_f, out_h = flat(feats), hier(feats)
    assert all(torch.equal(out_h[n], out_f[n]) for n in feats), "forward differs from the flat exchange"
    loss_of(out_f, rank).backward()
    flat.finish_gradients()
    for name, shard in flat.shards.items():
        if shard.grad is not None:
            torch.testing.assert_close(hier.shards[name].grad.to_dense(), shard.grad.to_dense(), msg=name)
    expected = {"flat": _remote_distinct_rows(base, topology, [rank])}
    if topology.local_of(rank) == 0:  # one gateway per host counts the host's rows once
        expected["hierarchical"] = _remote_distinct_rows(base, topology, topology.host_ranks(topology.host_of(rank)))
    for how, coll, stage in (("flat", flat, "output_dist"), ("hierarchical", hier, "inter_output_dist")):
        coll.stats.reset()
        coll(feats)
        got = coll.stats.as_dict()
        total = torch.tensor([got[stage].get("cross_host_bytes_sent", 0), expected.get(how, 0)])
        dist.all_reduce(total)
        assert total[0] == total[1], (how, total, got)
        assert sum(v.get("cross_host_bytes_sent", 0) for k, v in got.items() if k.startswith("intra")) == 0
    print("ok", rank)
