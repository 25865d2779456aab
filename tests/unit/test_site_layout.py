"""Sites without processes (issue 38): the layout and its checks, the config section, which tasks a
site takes, and the wire formats of the outer synchronisation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gmeta_ds.config import config_from_dict
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.engine.outer_sync import BLOCK, decode, encode
from gmeta_ds.engine.sites import describe_sites, site_dir, site_layout
from gmeta_ds.errors import ConfigError


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
