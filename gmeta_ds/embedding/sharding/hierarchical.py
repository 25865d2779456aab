"""Pooling on the owner across hosts in two levels: the strategy of pooled tables when the plan
says ``exchange_topology: hierarchical`` (`plan.with_topology`).

The flat exchange (`owner_pooled`) sends every (bag, owner) pair's ids to its owner and gets
one partial sum back per (bag, remote owner): with H hosts of R ranks, up to R vectors per bag
cross each host boundary. Here (TorchRec's table-wise-row-wise idea, for sums pooled on the
owners) rank (h, l) talks across hosts only to its gateways (h', l), the same local index on
every other host (`engine.hosts.TopologyGroups.inter`), and inside its host to its R peers:

1. inter input_dist — the requests for the owners of host h' (`bags.BagRequests`: ids as local
   rows, with each (bag, owner) pair's code and length, in `bags.pack_bags`' buffers) go to
   gateway (h', l) in one all-to-all over the inter-host group (sizes first: ids and pairs per
   owner);
2. intra exchange — each gateway forwards what it received to the owners of its host (the
   flat exchange, `OwnerPooled.exchange_over`, over the intra-host group, the received pairs
   put in order of owner), which pool and send back one partial sum per pair;
3. the gateway adds the partial sums of one requester's bag over its host's owners;
4. inter output_dist — one vector per (bag, host) goes back to the requester, which adds the
   hosts' vectors of each bag (then mean pooling divides, as in the flat exchange).

Ids cross hosts once either way; partial sums (and their gradients) cross once per (bag,
remote host) instead of once per (bag, remote owner): at most 1/R of the flat bytes. Backward
is autograd's reverse of the same all-to-alls and sums. Tables exchanging over a group of their
own (host tables next to NCCL) keep the flat exchange.
"""
from __future__ import annotations

import torch
from torch import Tensor

from gmeta_ds.embedding.comm import Link, all_to_all
from gmeta_ds.embedding.sharding.bags import BagRequests, bag_segments, pack_bags, unpack_bags
from gmeta_ds.embedding.sharding.owner_pooled import GroupLayout, OwnerPooled


class HierarchicalPooled(OwnerPooled):
    """`OwnerPooled` whose exchange crosses hosts once per host pair (see the module docstring)."""

    def exchange(self, layout: GroupLayout, requests: BagRequests) -> tuple[Tensor, Tensor]:
        """One vector per (bag, owning host), and the code of each (its bag x n_tables)."""
        ctx, tiers = self.ctx, self.ctx.tiers
        if tiers is None or ctx.groups[layout.names[0]] is not None:
            return super().exchange(layout, requests)
        hosts = ctx.plan.topology.hosts
        inter = Link(tiers.inter, hosts, tiers.host, tuple(h != tiers.host for h in range(hosts)))
        received, recv_sizes = _to_gateways(ctx, layout, inter, requests)
        merged, per_source = self._pool_in_host(layout, received, recv_sizes)
        keys, per_host = _bags_per_host(requests.codes, requests.n_pairs, len(layout.names),
                                        ctx.plan.topology.ranks_per_host, hosts)
        back = all_to_all(merged, per_source, per_host, ctx.stats, inter.rank, "inter_output_dist", inter.group,
                          inter.remote)
        return back, keys * len(layout.names)

    def _pool_in_host(self, layout: GroupLayout, received: BagRequests,
                      recv_sizes: Tensor) -> tuple[Tensor, list[int]]:
        """Steps 2-3 on a gateway: the received pairs (in (source host, owner) order) pooled by
        their owners inside the host, then summed per (source host, bag). Returns the sums in
        (source, bag) order and how many go to each source host."""
        ctx, tiers = self.ctx, self.ctx.tiers
        ids, codes, lengths = received.local, received.codes, received.lengths
        ranks = len(recv_sizes)  # one row per (source host, owner)
        per_host = ctx.plan.topology.ranks_per_host
        hosts = ranks // per_host
        slot = torch.repeat_interleave(torch.arange(ranks, device=codes.device), recv_sizes[:, 1].to(codes.device),
                                       output_size=len(codes))
        order = torch.argsort(slot % per_host, stable=True)  # pairs in order of owner inside the host
        starts = torch.cumsum(lengths, 0) - lengths
        forwarded = BagRequests(
            ids.index_select(0, bag_segments(starts.index_select(0, order), lengths.index_select(0, order))),
            codes.index_select(0, order), lengths.index_select(0, order),
            recv_sizes[:, 0].view(hosts, per_host).sum(0), recv_sizes[:, 1].view(hosts, per_host).sum(0))
        intra = Link(tiers.intra, per_host, tiers.local, (False,) * per_host)
        partial = self.exchange_over(layout, forwarded, intra, "intra_")
        partial = partial.index_select(0, torch.argsort(order).to(partial.device))
        return _sum_per_source(partial, codes, slot, len(layout.names), per_host, hosts)


def _to_gateways(ctx, layout: GroupLayout, inter: Link, requests: BagRequests) -> tuple[BagRequests, Tensor]:
    """Step 1: each host's requests to this rank's gateway there. Returns what this rank
    received as a gateway, and the sizes per (source host, owner) ((H R, 2): ids, pairs)."""
    per_host = len(requests.n_ids) // inter.size
    sizes = torch.stack([requests.n_ids, requests.n_pairs], dim=1)  # (W, 2), owner-major = host-major
    splits = [per_host] * inter.size
    recv_sizes = all_to_all(sizes, splits, splits, ctx.stats, inter.rank, "inter_input_dist", inter.group,
                            inter.remote)
    send = pack_bags(requests, layout.wire_dtype)
    send_splits = requests.buffer_sizes.view(inter.size, per_host).sum(1).tolist()
    recv_splits = (recv_sizes[:, 0] + 2 * recv_sizes[:, 1]).view(inter.size, per_host).sum(1).tolist()
    payload = all_to_all(send, send_splits, recv_splits, ctx.stats, inter.rank, "inter_input_dist", inter.group,
                         inter.remote)
    return unpack_bags(payload.long(), recv_sizes[:, 0], recv_sizes[:, 1]), recv_sizes


def _sum_per_source(partial: Tensor, codes: Tensor, slot: Tensor, n_tables: int, per_host: int,
                    hosts: int) -> tuple[Tensor, list[int]]:
    """Step 3: the partial sums of one source host's bag added up; in (source, bag) order, and
    how many go to each source host."""
    bag = torch.div(codes, n_tables, rounding_mode="floor")
    span = int(bag.max()) + 1 if len(bag) else 1
    keys, inverse = torch.unique(torch.div(slot, per_host, rounding_mode="floor") * span + bag, return_inverse=True)
    merged = partial.new_zeros(len(keys), partial.shape[1]).index_add(0, inverse.to(partial.device), partial)
    per_source = torch.bincount(torch.div(keys, span, rounding_mode="floor"), minlength=hosts).tolist()
    return merged, per_source


def _bags_per_host(pair_code: Tensor, n_pairs: Tensor, n_tables: int, per_host: int,
                   hosts: int) -> tuple[Tensor, list[int]]:
    """The requester's side of step 4: the bag of each vector that comes back, in the
    gateways' (host, bag) order, and how many each host sends."""
    owner = torch.repeat_interleave(torch.arange(len(n_pairs), device=pair_code.device), n_pairs.to(pair_code.device),
                                    output_size=len(pair_code))
    bag = torch.div(pair_code, n_tables, rounding_mode="floor")
    span = int(bag.max()) + 1 if len(bag) else 1
    keys = torch.unique(torch.div(owner, per_host, rounding_mode="floor") * span + bag)
    per_host_counts = torch.bincount(torch.div(keys, span, rounding_mode="floor"), minlength=hosts).tolist()
    return keys % span, per_host_counts
