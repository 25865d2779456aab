"""The run's hosts, from the launcher or from the config, and their process groups.

Hosts come from ``embedding.hosts`` when set (one machine can then pretend to be several: W
ranks as N hosts of W / N), else from the launcher: ``LOCAL_WORLD_SIZE`` (torchrun) or
``LOCAL_SIZE`` (deepspeed) ranks per host, checked against ``LOCAL_RANK`` and the node rank
(``GROUP_RANK`` from torchrun, ``NODE_RANK`` / ``CROSS_RANK`` from others) where they are set,
since the exchange assumes ranks numbered host by host. Every check raises `ConfigError`
naming the key or variable, on every rank alike, before any collective.

`topology_groups` creates the intra-host and inter-host groups once, every rank calling
``new_group`` for every group in the same order (torch requires it), each with the run's
collective timeout.
"""
from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch.distributed as dist

from gmeta_ds.embedding.topology import Topology
from gmeta_ds.engine.dist import env_world
from gmeta_ds.errors import ConfigError

NODE_RANK_VARIABLES = ("GROUP_RANK", "NODE_RANK", "CROSS_RANK")


def resolve_topology(hosts: int, world: int, required: bool = True, sites: int = 1) -> Topology | None:
    """The `Topology` of ``world`` ranks: ``hosts`` of them (``embedding.hosts``; 0: the
    launcher's local world size, one host without a launcher). Launcher values that make no
    regular topology (unequal hosts, ranks not numbered host by host) are an error when the
    topology is ``required`` (a topology-aware exchange was asked for), else None: the flat
    exchange runs as before, without cross-host counters.

    With ``sites`` > 1 (``sites.count``) ``world`` is one site's ranks and the hosts are the
    run's, shared by the sites: a site is whole hosts (``embedding.hosts`` N: N / sites each;
    the launcher's: the site's ranks over its hosts' ranks), or a host holds whole sites (one
    host per site)."""
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 0:
        raise ConfigError([f"embedding.hosts: expected an integer >= 0 (0: the launcher's hosts), got {hosts!r}"])
    if hosts:
        return _given_hosts(hosts, world, sites)
    if "RANK" not in os.environ:
        return Topology(world, world)
    rank, env_size, local = env_world()
    if env_size != world * sites:
        return Topology(world, world)  # planning for another world (validate --world-size): one host
    if sites > 1 and local >= world:
        return Topology(world, world)  # the site lies within one host
    name = "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in os.environ else "LOCAL_SIZE"
    if world % local:
        if not required:
            return None
        what = f"a site's {world} ranks" if sites > 1 else f"WORLD_SIZE={world}"
        raise ConfigError([f"environment variable {name}={local}: hosts of unequal size are not supported "
                           f"({what} is not a multiple); set embedding.hosts"])
    topology = Topology(world, local)
    try:
        _check_numbering(topology, rank, first=rank - rank % world)
    except ConfigError:
        if required:
            raise
        return None
    return topology


def _given_hosts(hosts: int, world: int, sites: int) -> Topology:
    """``embedding.hosts`` (the run's hosts) as the topology of one site's ``world`` ranks."""
    run = f"{hosts} hosts"
    if sites > 1:
        if hosts % sites and sites % hosts:
            raise ConfigError([f"embedding.hosts: {hosts} hosts cannot hold {sites} sites (sites.count) of whole "
                               "hosts (expected hosts a multiple of the sites, or sites a multiple of the hosts)"])
        run = f"{hosts} hosts over {sites} sites ({max(1, hosts // sites)} per site)"
        hosts = max(1, hosts // sites)
    if world % hosts:
        raise ConfigError([f"embedding.hosts: {run} cannot share {world} ranks evenly (world size "
                           f"{world} is not a multiple of {hosts})"])
    return Topology(world, world // hosts)


def _check_numbering(topology: Topology, rank: int, first: int = 0) -> None:
    """Ranks must be numbered host by host: LOCAL_RANK and the node rank, where the launcher
    set them, must match RANK's place in the topology (of the site whose first rank is
    ``first``: its hosts come after the earlier sites' hosts)."""
    problems = []
    own = rank - first
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit() and int(local) != topology.local_of(own):
        problems.append(f"environment variables RANK={rank} and LOCAL_RANK={local}: expected ranks numbered "
                        f"host by host ({topology.describe()}: local rank {topology.local_of(own)})")
    host = first // topology.ranks_per_host + topology.host_of(own)
    for name in NODE_RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.isdigit() and int(value) != host:
            problems.append(f"environment variables RANK={rank} and {name}={value}: expected ranks numbered "
                            f"host by host ({topology.describe()}: host {host})")
            break
    if problems:
        raise ConfigError(problems)


class TopologyGroups(NamedTuple):
    """This rank's intra-host group and inter-host (gateway) group, with its place in each."""

    intra: object
    inter: object
    local: int
    host: int


def topology_groups(topology: Topology, rank: int, timeout_s: int | None = None) -> TopologyGroups:
    """Create every host's group, then every local index's group across hosts (every rank
    calls ``new_group`` for all of them, in this order), with ``timeout_s`` (None: the default
    group's, `dist.inherit_timeout`); returns this rank's two."""
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    intra = [dist.new_group(topology.host_ranks(h), timeout=timeout) for h in range(topology.hosts)]
    inter = [dist.new_group(topology.gateway_ranks(r), timeout=timeout) for r in range(topology.ranks_per_host)]
    host, local = topology.host_of(rank), topology.local_of(rank)
    return TopologyGroups(intra[host], inter[local], local, host)
