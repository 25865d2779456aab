"""The hosts of a run and the choice of a flat or a hierarchical pooled exchange (pure, no communication).

Ranks are laid out host by host, as torchrun and the deepspeed launcher number them (rank =
node rank x ranks per host + local rank): host h holds ranks h R .. h R + R - 1. A `Topology`
says which peers are on another host (the traffic counters count their bytes as cross-host,
`comm.CommStats`) and which ranks meet in the two levels of the hierarchical exchange
(`sharding.hierarchical`): the ranks of one host (intra-host) and the ranks of one local index
across hosts (inter-host, the "gateways": rank (h, l) talks to (h', l) only).

`choose_topology` picks ``hierarchical`` for ``embedding.exchange_topology: auto`` when the run
has more than one host of more than one rank and the expected cross-host bytes per bag of the
tables pooled on their owners (`cross_host_bytes`) are fewer that way; ``flat`` otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """``world`` ranks on ``world // ranks_per_host`` hosts of ``ranks_per_host`` ranks each."""

    world: int
    ranks_per_host: int

    def __post_init__(self) -> None:
        if self.ranks_per_host < 1 or self.world % self.ranks_per_host:
            raise ValueError(f"{self.world} ranks cannot be split into hosts of {self.ranks_per_host} ranks")

    @property
    def hosts(self) -> int:
        return self.world // self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_host

    def host_ranks(self, host: int) -> list[int]:
        """The ranks of host ``host`` (its intra-host group), in local order."""
        return list(range(host * self.ranks_per_host, (host + 1) * self.ranks_per_host))

    def gateway_ranks(self, local: int) -> list[int]:
        """The ranks of local index ``local`` on every host (their inter-host group), by host."""
        return list(range(local, self.world, self.ranks_per_host))

    def remote(self, rank: int) -> tuple[bool, ...]:
        """For every rank of the world: whether it is on another host than ``rank``."""
        return tuple(self.host_of(r) != self.host_of(rank) for r in range(self.world))

    def describe(self) -> str:
        return f"{self.hosts} host(s) x {self.ranks_per_host} rank(s)"


def cross_host_bytes(kind: str, topology: Topology, dim: int, mean_length: float) -> tuple[float, float]:
    """Expected bytes per bag that cross hosts (ids out, partial sums back, their gradients out
    again) when a table pooled on its owners exchanges flat and hierarchically. Ids (with their
    (bag, owner) codes: 16 B per id) leave the host either way, for the (H - 1) / H of them
    owned elsewhere; flat sends back one partial sum and its gradient (8d B) per remote owner
    holding part of the bag, hierarchical one per remote host. Row-wise, ids spread evenly:
    n(1 - (1 - 1/n)^L) of n owners (hosts) hold part of a bag of L ids; table-wise: one owner."""
    hosts, world = topology.hosts, topology.world
    ids = 16 * mean_length * (hosts - 1) / hosts
    if kind == "table_wise":
        remote = (hosts - 1) / hosts
        return ids + remote * 8 * dim, ids + remote * 8 * dim
    owners = world * (1 - (1 - 1 / world) ** mean_length) * (world - topology.ranks_per_host) / world
    host_parts = hosts * (1 - (1 - 1 / hosts) ** mean_length) * (hosts - 1) / hosts
    return ids + owners * 8 * dim, ids + host_parts * 8 * dim


def choose_topology(mode: str, topology: Topology, pooled: list[tuple[str, int, float]]) -> tuple[str, tuple]:
    """``flat`` or ``hierarchical`` for ``mode`` (``embedding.exchange_topology``: flat, hierarchical or auto) and the estimate it was
    chosen by: (flat, hierarchical) expected cross-host bytes per bag summed over ``pooled``
    ((plan kind, dim, mean bag length) of each table pooled on its owners; length 1 where unknown)."""
    flat = hier = 0.0
    for kind, dim, length in pooled:
        f, h = cross_host_bytes(kind, topology, dim, length)
        flat, hier = flat + f, hier + h
    if mode != "auto":
        return mode, (flat, hier)
    multi = topology.hosts > 1 and topology.ranks_per_host > 1
    return ("hierarchical" if multi and pooled and hier < flat else "flat"), (flat, hier)
