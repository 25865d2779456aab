"""The run's hosts (from the launcher or `embedding.hosts`), their checks, and the planner's
choice of a flat or hierarchical pooled exchange (issue 37 items 1-2; no process group)."""
from __future__ import annotations

import pytest

from gmeta_ds.config import config_from_dict
from gmeta_ds.embedding.plan import plan_tables, with_topology
from gmeta_ds.embedding.tables import TableConfig
from gmeta_ds.embedding.topology import (Topology, choose_row_topology, choose_topology, cross_host_bytes,
                                         host_overlap, row_cross_host_bytes)
from gmeta_ds.engine.hosts import resolve_topology
from gmeta_ds.errors import ConfigError
from gmeta_ds.sparse import BagStats

LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "NODE_RANK",
            "CROSS_RANK")


@pytest.fixture
def launcher(monkeypatch):
    """Set launcher variables (the others removed)."""
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))
    return set_env


def test_hosts_come_from_the_override_the_launcher_or_default_to_one(launcher):
    assert resolve_topology(0, 4) == Topology(4, 4)  # no launcher: one host
    assert resolve_topology(2, 4) == Topology(4, 2)
    launcher(RANK=3, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, GROUP_RANK=1)
    assert resolve_topology(0, 4) == Topology(4, 2)
    assert resolve_topology(4, 4) == Topology(4, 1)  # the override wins


def test_bad_hosts_are_config_errors_naming_the_key_or_variable(launcher):
    with pytest.raises(ConfigError, match=r"embedding.hosts: 3 hosts cannot share 4 ranks"):
        resolve_topology(3, 4)
    launcher(RANK=2, WORLD_SIZE=6, LOCAL_RANK=2, LOCAL_SIZE=4)
    with pytest.raises(ConfigError, match="LOCAL_SIZE=4: hosts of unequal size"):
        resolve_topology(0, 6)
    assert resolve_topology(0, 6, required=False) is None  # flat: runs as before, no topology
    launcher(RANK=2, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2)
    with pytest.raises(ConfigError, match="RANK=2 and LOCAL_RANK=1: expected ranks numbered host by host"):
        resolve_topology(0, 4)
    assert resolve_topology(0, 4, required=False) is None
    launcher(LOCAL_RANK=0, NODE_RANK=0)
    with pytest.raises(ConfigError, match="RANK=2 and NODE_RANK=0"):
        resolve_topology(0, 4)
    with pytest.raises(ConfigError) as err:
        config_from_dict({"embedding": {"sharding": "sharded", "hosts": -1, "exchange_topology": "ring"}})
    assert "embedding.hosts: expected an integer >= 0" in str(err.value)
    assert "embedding.exchange_topology: 'ring' is not one of flat, hierarchical, auto" in str(err.value)


def test_topology_places_ranks_host_by_host():
    t = Topology(6, 3)
    assert (t.hosts, t.host_of(4), t.local_of(4)) == (2, 1, 1)
    assert t.host_ranks(1) == [3, 4, 5] and t.gateway_ranks(2) == [2, 5]
    assert t.remote(1) == (False, False, False, True, True, True)
    with pytest.raises(ValueError):
        Topology(6, 4)


def test_hierarchical_crosses_hosts_with_one_sum_per_host_and_auto_picks_it_only_on_several_hosts():
    flat, hier = cross_host_bytes("row_wise", Topology(16, 8), 64, 200.0)
    ids = cross_host_bytes("row_wise", Topology(16, 8), 0, 200.0)[0]  # ids and (bag, owner) codes
    assert (hier - ids) * 8 == pytest.approx(flat - ids, rel=0.01)  # every owner holds part: 1/R
    # what owner_pooled sends per bag of 3 ids on 2 hosts x 2: the remote ids (int32), a code and a
    # length per (bag, remote owner) pair, one sum and its gradient per remote owner (flat) or host
    owners = 4 * (1 - 0.75 ** 3) / 2
    host_parts = 2 * (1 - 0.5 ** 3) / 2
    assert cross_host_bytes("row_wise", Topology(4, 2), 8, 3.0) == pytest.approx(
        (4 * 1.5 + 8 * owners + 64 * owners, 4 * 1.5 + 8 * owners + 64 * host_parts))
    assert cross_host_bytes("row_wise", Topology(4, 2), 8, 3.0, id_bytes=8)[0] == pytest.approx(
        8 * 1.5 + 8 * owners + 64 * owners)  # int64 ids past 2^31 rows
    assert cross_host_bytes("table_wise", Topology(4, 2), 8, 3.0)[0] == cross_host_bytes("table_wise", Topology(4, 2),
                                                                                        8, 3.0)[1]
    pooled = [("row_wise", 16, 10.0)]
    assert choose_topology("auto", Topology(4, 2), pooled)[0] == "hierarchical"
    assert choose_topology("auto", Topology(4, 4), pooled)[0] == "flat"  # one host
    assert choose_topology("auto", Topology(4, 1), pooled)[0] == "flat"  # one rank per host: no gain
    assert choose_topology("auto", Topology(4, 2), [])[0] == "flat"  # nothing pooled on owners
    assert choose_topology("hierarchical", Topology(4, 4), pooled)[0] == "hierarchical"


def test_the_plan_prints_its_topology_and_the_estimate():
    tables = [TableConfig("a", 100, 8, ("a",), exchange="pooled"), TableConfig("b", 5000, 8, ("b",))]
    plan = plan_tables(tables, 4, {})
    assert "topology" not in plan.describe() and not plan.hierarchical
    chosen = with_topology(plan, Topology(4, 2), "auto", {"a": BagStats(20.0)})
    assert chosen.hierarchical
    line = chosen.describe().splitlines()[-1]
    assert line.startswith("  topology: 2 host(s) x 2 rank(s), hierarchical pooled exchange (est. cross-host ")
    assert "B per bag flat" in line
    assert "flat row exchange" in line  # b: unknown overlap, so nothing to gain
    rows = with_topology(plan, Topology(4, 2), "auto", {"a": BagStats(20.0), "b": BagStats(10.0, 0.5, 0.3)})
    assert rows.hierarchical_rows and not chosen.hierarchical_rows
    assert rows.describe().splitlines()[-1].endswith("hierarchical row exchange (est. cross-host 180 B per bag flat, "
                                                     "108 B hierarchical, ids' overlap in a host 1.67)")


def test_the_row_exchange_divides_flat_bytes_by_the_overlap_and_auto_asks_for_a_gain():
    assert host_overlap(0.5, None) == 1.0 and host_overlap(0.5, 0.25) == 2.0 and host_overlap(0.5, 0.6) == 1.0
    flat, hier = row_cross_host_bytes(Topology(8, 2), 16, 10.0, 0.5, 2.0)
    assert flat == pytest.approx(10 * 0.5 * 6 / 8 * (8 + 8 * 16)) and hier == flat / 2
    assert choose_row_topology("auto", Topology(4, 2), [(16, 10.0, 0.5, 1.5)])[0] == "hierarchical"
    assert choose_row_topology("auto", Topology(4, 2), [(16, 10.0, 0.5, 1.2)])[0] == "flat"  # < ROW_GAIN 1.25
    assert choose_row_topology("auto", Topology(4, 4), [(16, 10.0, 0.5, 1.5)])[0] == "flat"  # one host
    assert choose_row_topology("auto", Topology(4, 1), [(16, 10.0, 0.5, 1.5)])[0] == "flat"
    assert choose_row_topology("hierarchical", Topology(4, 2), [])[0] == "hierarchical"
