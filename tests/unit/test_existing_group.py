"""`engine.dist.existing_group`: a default process group started before `gm.initialize` (the
user's own ``init_process_group``, Accelerate's ``Accelerator()``) gives the ranks, gets what
DeepSpeed needs from the environment, and a backend that does not fit the host's device is a
`ConfigError` naming both (a one-rank gloo group on 127.0.0.1, in process; the 2-rank training on
such a group: tests/launch/test_api_existing_group.py)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from gmeta_ds.engine.dist import existing_group, free_port
from gmeta_ds.errors import ConfigError


@pytest.fixture
def started_group(monkeypatch):
    """A one-rank gloo group started the way a harness does (tcp://, no launcher variables);
    the timeouts `existing_group` gives later groups are restored after."""
    c10d = dist.distributed_c10d
    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_no_group_is_none():
    assert not dist.is_initialized()
    assert existing_group(30) is None


def test_a_started_group_gives_its_ranks_and_deepspeed_its_local_rank(started_group):
    assert existing_group(45) == (0, 1)
    assert os.environ["LOCAL_RANK"] == "0"  # DeepSpeed's engine reads it; a harness sets none
    assert dist.group.WORLD is started_group  # used, not started again
    assert dist.distributed_c10d.default_pg_timeout.total_seconds() == 45  # the groups DeepSpeed adds


def test_a_group_whose_backend_does_not_fit_the_device_is_named(started_group, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, the group on gloo
    with pytest.raises(ConfigError, match=r"the existing process group's backend is 'cpu:gloo,cuda:gloo', but "
                                          r"cuda tensors on this host need 'nccl': start it with "
                                          r"init_process_group\(backend='nccl'\)"):
        existing_group(30)
    assert "LOCAL_RANK" not in os.environ  # refused before anything was changed


def test_sites_are_refused_on_a_started_group(started_group):
    """``sites.count`` > 1 starts its own groups from the launcher's rendezvous: not in a process
    (gmeta_ds.cli.main called by a script) whose group is already up."""
    from gmeta_ds.config import config_from_dict
    from gmeta_ds.config.deepspeed import resolve_ds_config
    from gmeta_ds.engine.sites import site_run

    cfg = config_from_dict({"sites": {"count": 2}, "deepspeed": {"optimizer": {"type": "Adam"}},
                            "meta": {"tasks_per_micro_batch": 2, "tasks_per_meta_step": 8}})
    ds_config, plan = resolve_ds_config(cfg, 4)
    with pytest.raises(ConfigError, match="sites.count: 2 sites start their own process groups, but this "
                                          "process has one already; start gmeta-ds train as its own process"):
        site_run(cfg, ds_config, plan, (0, 4, 4))
