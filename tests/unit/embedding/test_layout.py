"""Each strategy's placement is its tables' layouts: the ids it sends go to the owner and local
row the layout states, the layout's global ids are a bijection onto every rank's shard, and a
table's checkpoint entries (`Sharding.state` / `load_state`) come back at any world size."""
from __future__ import annotations

import pytest
import torch

from gmeta_ds.embedding.layout import Copies, HashedIds, RowBlock, RowModulo, WholeTable
from gmeta_ds.embedding.plan import plan_tables, with_topology
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.sharding.base import Request
from gmeta_ds.embedding.tables import TableConfig
from gmeta_ds.embedding.topology import Topology
from gmeta_ds.sparse import Jagged

TABLES = [TableConfig("mod", 103, 4, ("mod",), optimizer="adagrad"),
          TableConfig("blk", 57, 4, ("blk",), optimizer="adam"),
          TableConfig("whole", 40, 4, ("whole",), optimizer="sgd"),
          TableConfig("copy", 9, 4, ("copy",), optimizer="rowwise_adagrad"),
          TableConfig("pool", 77, 4, ("pool",), optimizer="adagrad", exchange="pooled"),
          TableConfig("pblk", 31, 4, ("pblk",), optimizer="adam", exchange="pooled"),
          TableConfig("pwhole", 20, 4, ("pwhole",), optimizer="sgd", exchange="pooled"),
          TableConfig("dyn", 0, 4, ("dyn",), kind="dynamic", capacity=300, admit_after=1, optimizer="adagrad")]
KINDS = {"mod": "row_wise", "blk": "row_wise", "whole": "table_wise", "copy": "replicated",
         "pool": "row_wise", "pblk": "row_wise", "pwhole": "table_wise"}
STRATEGY = {"mod": "row_wise", "blk": "row_wise", "whole": "table_wise", "copy": "replicated",
            "pool": "owner_pooled", "pblk": "owner_pooled", "pwhole": "owner_pooled", "dyn": "dynamic"}


def collections(world: int, row_owner: str = "modulo", hierarchical: bool = False):
    """Rank 0 .. world - 1's collections of one plan, built in this process (nothing crosses
    ranks: the strategies are called directly). ``row_owner`` applies to every row-wise table
    but ``mod``, always modulo."""
    plan = plan_tables(TABLES, world, KINDS, row_owner=row_owner)
    if row_owner == "block":  # "mod" stays modulo, so one plan holds both row-wise layouts
        modulo = plan_tables(TABLES, world, KINDS, row_owner="modulo")
        plan.tables["mod"] = modulo.tables["mod"]
    if hierarchical:
        plan = with_topology(plan, Topology(world, 2), "hierarchical")
    return [ShardedEmbeddingCollection(plan, rank, seed=3) for rank in range(world)]


class Recorder:
    """A stand-in `RowExchange`: what a strategy's input_dist adds, per table."""

    def __init__(self):
        self.added = {}

    def add(self, strategy, name, ids, owners, local, counts=None):
        self.added[name] = (ids, owners, local)


def test_plans_get_the_layout_of_their_kind():
    emb = collections(3, "block")[0]
    kinds = {name: type(p.layout) for name, p in emb.plan.tables.items()}
    assert kinds == {"mod": RowModulo, "blk": RowBlock, "whole": WholeTable, "copy": Copies, "pool": RowBlock,
                     "pblk": RowBlock, "pwhole": WholeTable, "dyn": HashedIds}
    assert {name: s.names for name, s in emb.strategies.items()} == {
        kind: tuple(n for n in emb.plan.tables if STRATEGY[n] == kind) for kind in set(STRATEGY.values())}
    for name, strategy in emb.strategy.items():  # the strategy routes with the plan's layout
        assert strategy.layout(name) is emb.plan.tables[name].layout


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("row_owner", ["modulo", "block"])
def test_every_static_layout_is_a_bijection_onto_the_shards(world, row_owner):
    """Global ids of rank r route to r, as local rows 0 .. n-1, and the shard has those n rows
    (initial rows of those ids); every id of the table is on exactly one rank (replicated: on all)."""
    embs = collections(world, row_owner)
    for name, p in embs[0].plan.tables.items():
        if p.kind == "dynamic":
            assert all(e.shards[name].shape[0] == p.layout.local_rows(r) == p.table.capacity + 1
                       for r, e in enumerate(embs))
            continue
        seen = []
        for rank, emb in enumerate(embs):
            mine = p.layout.global_ids(rank)
            assert emb.shards[name].shape[0] == len(mine) == p.layout.local_rows(rank), name
            if p.kind == "replicated":
                assert torch.equal(mine, torch.arange(p.table.num_rows))
                continue
            owners, local = p.layout.route(mine)
            assert torch.all(owners == rank) and torch.equal(local, torch.arange(len(mine))), name
            seen.append(mine)
        if p.kind != "replicated":
            assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(p.table.num_rows)), name


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("row_owner", ["modulo", "block"])
def test_row_strategies_send_each_id_where_its_layout_says(world, row_owner):
    """input_dist of row-wise, table-wise and dynamic tables adds each id with the owner and
    local row of the table's layout, and each owner's shard holds that id's initial row there."""
    embs = collections(world, row_owner)
    ids = {name: torch.randint(0, max(p.table.num_rows, 1), (60,), generator=torch.Generator().manual_seed(1))
           for name, p in embs[0].plan.tables.items()}
    ids["dyn"] = torch.randint(-2**50, 2**50, (60,), generator=torch.Generator().manual_seed(2))
    exchange = Recorder()
    for name in ("mod", "blk", "whole", "dyn"):
        request = Request(ids[name], torch.arange(60), torch.ones(60, dtype=torch.long))
        embs[0].strategy[name].input_dist(name, request, exchange)
        sent, owners, local = exchange.added[name]
        want_owners, want_local = embs[0].plan.tables[name].layout.route(ids[name])
        assert torch.equal(owners, want_owners) and torch.equal(local, want_local), name
        if name == "dyn":
            continue
        reference = collections(1, row_owner)[0].shards[name].detach()  # world 1: every initial row
        for owner, row, gid in zip(owners.tolist(), local.tolist(), sent.tolist()):
            assert torch.equal(embs[owner].shards[name].detach()[row], reference[gid]), (name, gid)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("row_owner", ["modulo", "block"])
def test_tables_pooled_on_their_owners_send_each_id_where_its_layout_says(world, row_owner):
    """The owner-pooled exchange routes a group of row-wise (modulo and block) and table-wise
    tables like their layouts: each owner gets, in bag order, the local rows its layout gives."""
    emb = collections(world, row_owner)[0]
    strategy = emb.strategy["pool"]
    sent = {}

    def record(layout, requests):
        sent.update(local=requests.local, n_ids=requests.n_ids)
        return torch.zeros(len(requests.codes), 4), requests.codes

    strategy.exchange = record
    g = torch.Generator().manual_seed(world)
    bags = {f: Jagged(torch.randint(0, emb.plan.tables[f].table.num_rows, (30,), generator=g),
                      torch.tensor([0, 4, 4, 13, 30])) for f in ("pool", "pblk")}
    strategy.pool(bags)
    values = torch.cat([bags[f].values for f in ("pool", "pblk")])
    owners, local = zip(*(emb.plan.tables[f].layout.route(bags[f].values) for f in ("pool", "pblk")))
    owners, local = torch.cat(owners), torch.cat(local)
    per_owner = torch.split(sent["local"], sent["n_ids"].tolist())
    for rank in range(world):
        assert torch.equal(per_owner[rank], local[owners == rank]), rank
    assert len(values) == len(sent["local"])


def fill(embs):
    """Distinct rows and optimizer state on every rank (one sparse step of each table's optimizer),
    ~100 admitted ids per rank's dynamic shard."""
    for rank, emb in enumerate(embs):
        g = torch.Generator().manual_seed(10 + rank)
        ids = torch.randint(-2**40, 2**40, (200,), generator=g)
        mine = ids[emb.plan.tables["dyn"].layout.owners(ids) == rank]
        emb.strategy["dyn"].admit("dyn", mine, torch.ones_like(mine))
        for name, shard in emb.shards.items():
            copies = emb.plan.tables[name].kind == "replicated"  # replicas stay equal, as in training
            with torch.no_grad():
                shard.add_(torch.randn(shard.shape, generator=torch.Generator().manual_seed(9) if copies else g))
            if shard.shape[0]:
                torch.nn.functional.embedding(torch.arange(0, shard.shape[0], 2), shard, sparse=True).pow(2).sum().backward()
                emb.optimizers[name].step()
                shard.grad = None


def by_id(embs) -> dict[str, dict[int, tuple]]:
    """Per table: global id -> (row, each optimizer state row), over every rank (replicated: rank 0)."""
    out = {}
    for name, p in embs[0].plan.tables.items():
        rows = {}
        for rank, emb in enumerate(embs if p.kind != "replicated" else embs[:1]):
            shard = emb.shards[name].detach()
            state = emb.optimizers[name].state[emb.shards[name]]
            per_row = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() and v.shape[0] == shard.shape[0]}
            if p.kind == "dynamic":
                index = emb.dynamic[name]
                pairs = zip(index.keys.tolist(), index.rows.tolist())
            else:
                pairs = enumerate(p.layout.global_ids(rank).tolist())
                pairs = [(gid, row) for row, gid in pairs]
            for gid, row in pairs:
                rows[gid] = (shard[row], {k: v[row] for k, v in per_row.items()})
        out[name] = rows
    return out


@pytest.mark.parametrize("old,new", [(2, 2), (2, 3), (3, 1), (1, 2)])
@pytest.mark.parametrize("row_owner", ["modulo", "block"])
def test_state_comes_back_by_global_id_for_every_strategy(old, new, row_owner):
    """Each strategy's `state()` entries, loaded by the strategy at another world size, give
    every id its row and optimizer state back (row-wise, table-wise, replicated, dynamic,
    pooled on the owner, and pooled across hosts); the static entries are the on-disk names."""
    saved = collections(old, row_owner)
    fill(saved)
    files = [{k: v.clone() for k, v in e.state().items()} for e in saved]
    assert {k for k in files[0] if k.startswith("table.whole.")} == {"table.whole.ids", "table.whole.rows"}
    assert {k for k in files[0] if k.startswith("table.mod.")} == {
        "table.mod.ids", "table.mod.rows", "table.mod.row_state.sum", "table.mod.scalar_state.step"}
    loaded = collections(new, row_owner, hierarchical=new % 2 == 0)
    if new % 2 == 0:
        assert loaded[0].strategy["pool"].__class__.__name__ == "HierarchicalPooled"
    for emb in loaded:
        emb.load_state(files)
    before, after = by_id(saved), by_id(loaded)
    for name, rows in before.items():
        assert rows.keys() == after[name].keys(), name
        for gid, (row, state) in rows.items():
            assert torch.equal(after[name][gid][0], row), (name, gid)
            assert state.keys() == after[name][gid][1].keys()
            assert all(torch.equal(after[name][gid][1][k], v) for k, v in state.items()), (name, gid)
    if old == new:  # the same world: the files written again are the files read
        for a, b in zip(files, (e.state() for e in loaded)):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
