"""Sites without processes (issue 38): the layout and its checks, the config section, which tasks a
site takes, and the wire formats of the outer synchronisation."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from gmeta_ds.cli import main
from gmeta_ds.config import config_from_dict
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.embedding.topology import Topology
from gmeta_ds.engine.hosts import resolve_topology
from gmeta_ds.engine.outer_sync import BLOCK, decode, encode
from gmeta_ds.engine.sites import describe_sites, site_dir, site_layout
from gmeta_ds.errors import ConfigError
from gmeta_ds.run.run_log import StepWindow


def test_the_layout_numbers_ranks_site_by_site():
    sites = site_layout(2, 5, 8, 4)
    assert (sites.site, sites.site_rank, sites.size) == (1, 1, 4)
    assert site_layout(2, 1, 2, 2).site == 1  # one host holding two sites of one rank


@pytest.mark.parametrize("count,world,local,expected", [
    (3, 4, 4, "sites.count: 3 sites cannot share WORLD_SIZE=4 ranks evenly"),
    (2, 12, 4, "sites.count: 2 sites of 6 rank(s) would cut hosts of 4 ranks unevenly"),
])
def test_a_layout_that_cuts_ranks_or_hosts_unevenly_is_refused(count, world, local, expected):
    with pytest.raises(ConfigError) as raised:
        site_layout(count, 0, world, local)
    assert expected in str(raised.value)


@pytest.mark.parametrize("sites,expected", [
    ({"count": 0}, "sites.count: 0 must be an integer >= 1"),
    ({"count": 2, "sync_every": 0}, "sites.sync_every: 0 must be an integer >= 1"),
    ({"count": 2, "outer_lr": 0}, "sites.outer_lr: 0.0 must be > 0"),
    ({"count": 2, "outer_momentum": 1.0}, "sites.outer_momentum: 1.0 must be in [0, 1)"),
    ({"count": 2, "nesterov": True}, "sites.nesterov: true needs sites.outer_momentum > 0"),
    ({"count": 2, "delta_dtype": "int4"}, "sites.delta_dtype: 'int4' is not one of fp32, bf16, int8"),
    ({"sync_every": 5}, "sites.sync_every: set, but sites.count is 1"),
    ({"count": 2000}, "sites.count"),
])
def test_bad_sites_settings_name_the_key(sites, expected):
    with pytest.raises(ConfigError) as raised:
        config_from_dict({"sites": sites})
    assert expected in str(raised.value)


def test_the_task_of_a_text_run_has_no_sites():
    with pytest.raises(ConfigError, match="sites are for task: ctr"):
        config_from_dict({"task": "text", "sites": {"count": 2}})


def test_a_site_takes_the_same_tasks_at_any_number_of_its_ranks():
    """Site s takes block s of each meta-step's tasks, however many ranks share it; the sites
    together take the one-site run's batch."""
    lengths = np.random.default_rng(0).integers(1, 50, size=200)

    def site_tasks(site: int, ranks: int, gas: int, step: int) -> set[int]:
        return {int(t) for r in range(ranks)
                for mb in MetaBatchSampler(200, 4, gas, ranks, r, 7, lengths, part=(site, 2)).micro_batches(step)
                for t in mb}

    for step in (0, 3, 11):
        one = [site_tasks(s, 1, 4, step) for s in range(2)]
        two = [site_tasks(s, 2, 2, step) for s in range(2)]
        assert one == two and not one[0] & one[1]
        whole = set(MetaBatchSampler(200, 4, 4, 2, 0, 7, lengths).global_batch(step).tolist())
        assert one[0] | one[1] == whole


def test_int8_and_bf16_deltas_round_within_their_precision():
    x = torch.randn(4 * BLOCK) * torch.logspace(-3, 1, 4 * BLOCK)
    back = decode(encode(x, "int8", rows=False), "int8", rows=False)
    blocks = x.reshape(-1, BLOCK).abs().amax(dim=1, keepdim=True) / 127
    assert ((back - x).reshape(-1, BLOCK).abs() <= blocks / 2 + 1e-12).all()
    rows = torch.randn(10, 16)
    back_rows = decode(encode(rows, "int8", rows=True), "int8", rows=True)
    assert ((back_rows - rows).abs() <= rows.abs().amax(dim=1, keepdim=True) / 254 + 1e-7).all()
    assert torch.equal(decode(encode(rows, "fp32", rows=True), "fp32", rows=True), rows)
    assert torch.allclose(decode(encode(rows, "bf16", rows=True), "bf16", rows=True), rows, rtol=1e-2)
    assert encode(x, "int8", rows=False)[0].dtype == torch.int8


def test_validate_says_where_the_sites_write():
    settings = config_from_dict({"sites": {"count": 2, "sync_every": 10}}).sites
    line = describe_sites(settings, 4)
    assert "2 sites x 2 rank(s)" in line and "every 10 meta-steps" in line and "outer SGD lr 1, momentum 0;" in line
    assert site_dir("runs/x", 1).endswith("runs/x/sites/site-1")


# ---------------------------------------------------------------- sites over hosts (issue 50 item 3)
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "NODE_RANK",
            "CROSS_RANK")


def test_a_sites_hosts_are_the_runs_hosts_shared_by_the_sites(monkeypatch):
    """``world`` is one site's ranks; the hosts (embedding.hosts, or what validate takes from a
    hostfile) are the run's: a site is whole hosts, or a host holds whole sites."""
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    assert resolve_topology(2, 1, sites=2) == Topology(1, 1)  # 2 hosts x 1 slot: a host per site
    assert resolve_topology(2, 2, sites=2) == Topology(2, 2)  # 2 x 2: one host of 2 ranks, not 2 x 1
    assert resolve_topology(4, 2, sites=2) == Topology(2, 1)  # 4 x 1: each site 2 hosts of 1 rank
    assert resolve_topology(1, 2, sites=2) == Topology(2, 2)  # one host holds both sites
    with pytest.raises(ConfigError, match=r"embedding.hosts: 3 hosts cannot hold 2 sites \(sites.count\) of whole"):
        resolve_topology(3, 2, sites=2)
    # under the launcher: 4 hosts x 1 rank (NODE_RANK is the run's), rank 3 is site 1's second host
    monkeypatch.setenv("RANK", "3"), monkeypatch.setenv("WORLD_SIZE", "4"), monkeypatch.setenv("LOCAL_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0"), monkeypatch.setenv("NODE_RANK", "3")
    assert resolve_topology(0, 2, sites=2) == Topology(2, 1)
    monkeypatch.setenv("NODE_RANK", "1")
    with pytest.raises(ConfigError, match=r"RANK=3 and NODE_RANK=1: expected ranks numbered host by host "
                                          r"\(2 host\(s\) x 1 rank\(s\): host 3\)"):
        resolve_topology(0, 2, sites=2)
    monkeypatch.setenv("LOCAL_SIZE", "2"), monkeypatch.setenv("LOCAL_RANK", "1")  # 2 x 2: a site is a host
    assert resolve_topology(0, 2, sites=2) == Topology(2, 2)


def test_validate_plans_two_sites_on_a_two_host_hostfile(tmp_path, capsys):
    """What launch/multinode_no_ssh.sh runs first: 2 hosts x 1 slot, sites.count 2 (refused
    before: the hostfile's 2 hosts were applied to one site's single rank)."""
    for hosts in ("node0 slots=1\nnode1 slots=1\n", "node0 slots=2\nnode1 slots=2\n"):
        (tmp_path / "hostfile").write_text(hosts)
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump({
            "output_dir": str(tmp_path / "out"), "model": {"embed_dim": 4, "hidden": [8]},
            "meta": {"tasks_per_micro_batch": 2, "tasks_per_meta_step": 8},
            "data": {"synthetic": {"num_users": 60, "num_items": 40, "max_interactions": 25}},
            "embedding": {"sharding": "sharded", "exchange_topology": "auto"}, "sites": {"count": 2},
            "deepspeed": "ds_configs/zero1.json"}))
        assert main(["validate", "--config", str(config), "--hostfile", str(tmp_path / "hostfile")]) == 0
        out = capsys.readouterr().out
        ranks = hosts[12]
        assert f"sites on the hostfile's hosts: site 0: node0; site 1: node1 (each site 1 host(s) x {ranks} " \
               "rank(s))" in out
        assert "2 host(s)" not in out and "config OK" in out


def test_a_sites_metrics_line_counts_the_runs_tasks_and_its_own():
    """metrics.jsonl of a site: ``tasks`` / ``tasks_per_s`` are the run's (every site takes its
    block of each meta-step), ``site_tasks`` / ``site_tasks_per_s`` the site's (was: the site's
    under the run's name, half the run's on 2 sites)."""
    step = SimpleNamespace(skipped=False, padding_efficiency=1.0, query_loss=0.5, support_loss=0.6)
    window = StepWindow(4, 1, 0, sites=2)  # this site's 4 tasks per meta-step, of the run's 8
    for _ in range(3):
        window.add(step)
    record = window.record(3)
    assert (record["tasks"], record["site_tasks"]) == (24, 12)
    assert record["tasks_per_s"] == pytest.approx(2 * record["site_tasks_per_s"])
    one = StepWindow(4, 1, 0)
    one.add(step)
    assert one.record(1)["tasks"] == 4 and "site_tasks_per_s" not in one.record(1)
