"""The deduplicated row exchange across hosts in two levels: what `RowExchange` runs for a group
of tables when the plan says ``row_exchange_topology: hierarchical`` (`plan.with_topology`).

The flat exchange sends each rank's distinct ids to their owners: an id that R ranks of one
host all ask for crosses the host boundary R times, and so do its row and its gradient. Here
rank (h, l) sends the requests for owners of local index l' to its host peer (h, l'), which
deduplicates the host's requests and sends each distinct id to its owner (h', l') over the
inter-host group of local index l' (`engine.hosts.TopologyGroups.inter`: the owner is that
gateway's peer on host h'), so every distinct id a host asks for crosses to its owner's host
once:

1. intra input_dist — ids in order of (owner's local index, owner's host, table), with their
   per-(host, table) counts, over the intra-host group;
2. dedup — the gateway's unique of (owner host, table, local row) keys over what its host's
   ranks sent;
3. inter input_dist — the distinct ids (and their per-table counts) to the owners;
4. lookup on the owner (`RowExchange._lookup`), inter output_dist of the rows back;
5. intra output_dist — the gateway gives every requester the rows it asked for (an index by the
   unique's inverse) and the requester puts them back in its own order.

The rows are the owner's, bit for bit, as in the flat exchange. Backward is autograd's reverse:
the gateway adds its host's gradients of one row (the index's backward) before they cross, and
the owner receives one gradient per (row, requesting host) instead of per (row, requesting
rank). Cross-host bytes of ids, rows and gradients: the flat exchange's divided by the ids'
overlap between the ranks of a host (their distinct ids summed over the distinct ids of their
union). Groups whose tables count occurrences (dynamic tables: admission depends on the order
ids arrive in) or exchange over a group of their own keep the flat exchange.
"""
from __future__ import annotations

import torch
from torch import Tensor

from gmeta_ds.embedding.comm import Link, all_to_all


def applies(ctx, name: str, counts: Tensor | None) -> bool:
    """Whether the group of table ``name`` takes the hierarchical row exchange: a plan that asks
    for it, this rank's topology groups, no occurrence counts, the default process group."""
    return (ctx.tiers is not None and ctx.plan.hierarchical_rows and counts is None
            and ctx.groups[name] is None)


def links(ctx) -> tuple[Link, Link]:
    """This rank's intra-host and inter-host (gateway) links."""
    tiers, topology = ctx.tiers, ctx.plan.topology
    per_host, hosts = topology.ranks_per_host, topology.hosts
    return (Link(tiers.intra, per_host, tiers.local, (False,) * per_host),
            Link(tiers.inter, hosts, tiers.host, tuple(h != tiers.host for h in range(hosts))))


def hierarchical_rows(ctx, n_tables: int, send_ids: Tensor, per_owner: Tensor, lookup) -> Tensor:
    """Rows of ``send_ids`` (local rows in order of (owner rank, table), ``per_owner`` of each
    (owner, table)) fetched through this host's gateways; ``lookup(local ids, table index)``
    gives an owner's rows. Returns the rows in ``send_ids``' order (see the module docstring)."""
    intra, inter = links(ctx)
    hosts, per_host = inter.size, intra.size
    order, to_gateway = _gateway_order(per_owner, hosts, per_host, n_tables)
    recv_counts = all_to_all(to_gateway, [hosts * n_tables] * per_host, [hosts * n_tables] * per_host, ctx.stats,
                             intra.rank, "intra_input_dist", intra.group, intra.remote)
    send_splits = to_gateway.view(per_host, -1).sum(1).tolist()
    recv_splits = recv_counts.view(per_host, -1).sum(1).tolist()
    received = all_to_all(send_ids.index_select(0, order), send_splits, recv_splits, ctx.stats, intra.rank,
                          "intra_input_dist", intra.group, intra.remote)
    distinct, inverse, per_target = _deduplicate(received, recv_counts, hosts * n_tables)
    rows = _through_owners(ctx, inter, distinct, per_target, n_tables, lookup)
    back = all_to_all(rows.index_select(0, inverse), recv_splits, send_splits, ctx.stats, intra.rank,
                      "intra_output_dist", intra.group, intra.remote)
    return back.index_select(0, torch.argsort(order))


def _gateway_order(per_owner: Tensor, hosts: int, per_host: int, n_tables: int) -> tuple[Tensor, Tensor]:
    """The order that puts ids sorted by (owner, table) into (owner's local index, owner's
    host, table) order, and the counts in that order ((R x H x T,): what each host peer gets
    per (owner host, table))."""
    segments = torch.arange(hosts * per_host * n_tables, device=per_owner.device)
    owner, table = torch.div(segments, n_tables, rounding_mode="floor"), segments % n_tables
    key = ((owner % per_host) * hosts + torch.div(owner, per_host, rounding_mode="floor")) * n_tables + table
    seg_of_id = torch.repeat_interleave(segments, per_owner, output_size=int(per_owner.sum()))
    order = torch.argsort(key.index_select(0, seg_of_id), stable=True)
    return order, per_owner.view(hosts, per_host, n_tables).transpose(0, 1).reshape(-1)


def _deduplicate(ids: Tensor, counts: Tensor, targets: int) -> tuple[Tensor, Tensor, Tensor]:
    """A gateway's received ids (each peer's, in (owner host, table) order of ``counts``:
    (R x targets,)) deduplicated by (owner host, table, id): the distinct ids in that order,
    each received id's index into them, and the distinct ids per (owner host, table)."""
    slot = torch.arange(len(counts), device=ids.device) % targets
    target = torch.repeat_interleave(slot, counts.to(ids.device), output_size=len(ids))
    span = int(ids.max()) + 1 if len(ids) else 1
    keys, inverse = torch.unique(target * span + ids, return_inverse=True)
    per_target = torch.bincount(torch.div(keys, span, rounding_mode="floor"), minlength=targets)
    return keys % span, inverse, per_target


def _through_owners(ctx, inter: Link, ids: Tensor, per_target: Tensor, n_tables: int, lookup) -> Tensor:
    """Steps 3-4: the gateway's distinct ids to their owners over the inter-host group, looked
    up there, their rows back (in the order sent)."""
    hosts = inter.size
    recv_per = all_to_all(per_target, [n_tables] * hosts, [n_tables] * hosts, ctx.stats, inter.rank,
                          "inter_input_dist", inter.group, inter.remote)
    send_splits = per_target.view(hosts, n_tables).sum(1).tolist()
    recv_splits = recv_per.view(hosts, n_tables).sum(1).tolist()
    asked = all_to_all(ids, send_splits, recv_splits, ctx.stats, inter.rank, "inter_input_dist", inter.group,
                       inter.remote)
    table = torch.repeat_interleave(torch.arange(n_tables, device=asked.device).repeat(hosts), recv_per,
                                    output_size=len(asked))
    rows = lookup(asked, table)
    return all_to_all(rows, recv_splits, send_splits, ctx.stats, inter.rank, "inter_output_dist", inter.group,
                      inter.remote)
