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
`choose_row_topology` does the same for the deduplicated row exchange (`row_cross_host_bytes`:
hierarchical divides flat's bytes by the ids' overlap between the ranks of a host), asking for
at least `ROW_GAIN` times fewer bytes, about where it broke even on emulated hosts (its extra
hop inside the host costs part of a step).
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


def cross_host_bytes(kind: str, topology: Topology, dim: int, mean_length: float,
                     id_bytes: int = 4) -> tuple[float, float]:
    """Expected bytes per bag that cross hosts (ids out, partial sums back, their gradients out
    again) when a table pooled on its owners exchanges flat and hierarchically: what
    `sharding.owner_pooled` sends. Ids (``id_bytes`` each: int32 on the wire while the rows fit
    in it) leave the host either way, for the (H - 1) / H of them owned elsewhere, with a code
    and a length (8 B) per (bag, remote owner) pair; flat sends back one partial sum and its
    gradient (8d B) per remote owner holding part of the bag, hierarchical one per remote host.
    Row-wise, ids spread evenly: n(1 - (1 - 1/n)^L) of n owners (hosts) hold part of a bag of L
    ids; table-wise: one owner."""
    hosts, world = topology.hosts, topology.world
    if kind == "table_wise":
        remote = (hosts - 1) / hosts
        ids = id_bytes * mean_length * remote + 8 * remote
        return ids + remote * 8 * dim, ids + remote * 8 * dim
    owners = world * (1 - (1 - 1 / world) ** mean_length) * (world - topology.ranks_per_host) / world
    host_parts = hosts * (1 - (1 - 1 / hosts) ** mean_length) * (hosts - 1) / hosts
    ids = id_bytes * mean_length * (hosts - 1) / hosts + 8 * owners
    return ids + owners * 8 * dim, ids + host_parts * 8 * dim


def choose_topology(mode: str, topology: Topology, pooled: list[tuple]) -> tuple[str, tuple]:
    """``flat`` or ``hierarchical`` for ``mode`` (``embedding.exchange_topology``: flat, hierarchical or auto) and the estimate it was
    chosen by: (flat, hierarchical) expected cross-host bytes per bag summed over ``pooled``
    ((plan kind, dim, mean bag length[, bytes per id on the wire]) of each table pooled on its
    owners; length 1 where unknown)."""
    flat = hier = 0.0
    for kind, dim, length, *id_bytes in pooled:
        f, h = cross_host_bytes(kind, topology, dim, length, *id_bytes)
        flat, hier = flat + f, hier + h
    if mode != "auto":
        return mode, (flat, hier)
    multi = topology.hosts > 1 and topology.ranks_per_host > 1
    return ("hierarchical" if multi and pooled and hier < flat else "flat"), (flat, hier)


# The hierarchical row exchange's extra hop and the gateway's unique cost 6-19% of a step on one
# host, and its gateways get less of a slow link than the flat all-to-all: measured on 2 x 2 at
# 100 Mbit/s and 1 Gbit/s (docs/performance.md), it lost at overlap 1.09 (0.85x-0.88x) and won
# at 1.34 (1.08x-1.11x), breaking even near 1.24: auto asks for 1.25.
ROW_GAIN = 1.25


def host_overlap(distinct_ratio: float, host_distinct_ratio: float | None) -> float:
    """The ids' overlap between the ranks of a host: R ranks' distinct ids over the distinct ids
    of their union, from the distinct ids per id of one rank's micro-batch and of R of them
    together (`sparse.BagStats`); 1 (no overlap) when the host's ratio is unknown."""
    if not host_distinct_ratio:
        return 1.0
    return max(1.0, distinct_ratio / host_distinct_ratio)


def row_cross_host_bytes(topology: Topology, dim: int, mean_length: float, distinct_ratio: float = 1.0,
                         overlap: float = 1.0) -> tuple[float, float]:
    """Expected bytes per bag that cross hosts in the deduplicated row exchange, flat and
    hierarchical: each distinct id (``mean_length x distinct_ratio`` per bag) owned on another
    host ((W - R) / W of them) sends its id (8 B), gets its row and sends its gradient (8d B);
    hierarchically once per host instead of once per rank: flat's divided by ``overlap``."""
    remote = (topology.world - topology.ranks_per_host) / topology.world
    flat = mean_length * distinct_ratio * remote * (8 + 8 * dim)
    return flat, flat / overlap


def choose_row_topology(mode: str, topology: Topology,
                        tables: list[tuple[int, float, float, float]]) -> tuple[str, tuple]:
    """``flat`` or ``hierarchical`` for the row exchange of ``tables`` ((dim, mean bag length,
    distinct ratio, host overlap) each) and its estimate: (flat, hierarchical) cross-host bytes
    per bag summed over them, and their ratio (the overlap over all of them)."""
    flat = hier = 0.0
    for dim, length, ratio, overlap in tables:
        f, h = row_cross_host_bytes(topology, dim, length, ratio, overlap)
        flat, hier = flat + f, hier + h
    estimate = (flat, hier, flat / hier if hier else 1.0)
    if mode != "auto":
        return mode, estimate
    multi = topology.hosts > 1 and topology.ranks_per_host > 1
    return ("hierarchical" if multi and tables and hier * ROW_GAIN <= flat else "flat"), estimate
