"""The wire of exchanges that pool on the owners: a requester's bags grouped by owner
(`BagRequests`) and the one integer buffer per owner they travel in (`pack_bags`,
`unpack_bags`). The flat exchange (`OwnerPooled.exchange_over`, over any group of ranks) and
the two-level one across hosts (`hierarchical.HierarchicalPooled.exchange`) both speak it.

Per owner w (the members of a group in rank order), the buffer holds ``n_ids[w]`` ids as the
owner's local rows, then ``n_pairs[w]`` codes, then ``n_pairs[w]`` lengths; owners follow one
another. A pair is (bag, owner): its code is bag x n_tables + table (the bag's number in the
requester's lookup, the table's index in its group), its length the number of the bag's ids
that owner holds, which come as one run. Ids and codes travel as int32 when every table of the
group has fewer than 2^31 rows (`owner_pooled.GroupLayout.wire_dtype`), else int64.

Example (2 owners, one table, row i on rank i % 2 as local row i // 2): rank 0's bags
[[4, 9, 6], [9]] are the requests local [2, 3, 4, 4], codes [0, 0, 1], lengths [2, 1, 1],
n_ids [2, 2], n_pairs [1, 2]; the buffer for owner 1 is [4, 4 | 0, 1 | 1, 1].
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class BagRequests(NamedTuple):
    """A requester's bags grouped by owner (or, unpacked on an owner, what each member sent):
    ``local`` (ids as local rows, owner after owner, each pair's ids one run), ``codes`` and
    ``lengths`` (one per (bag, owner) pair, owner after owner), ``n_ids`` and ``n_pairs``
    (per member of the group: its ids and pairs)."""

    local: Tensor
    codes: Tensor
    lengths: Tensor
    n_ids: Tensor
    n_pairs: Tensor

    @property
    def buffer_sizes(self) -> Tensor:
        """Each member's buffer length (ids + codes + lengths)."""
        return self.n_ids + 2 * self.n_pairs


def bag_segments(starts: Tensor, sizes: Tensor) -> Tensor:
    """Positions ``starts[i] + 0 .. sizes[i] - 1`` for every i, concatenated."""
    total = int(sizes.sum())
    first = torch.cumsum(sizes, 0) - sizes
    return torch.arange(total, device=sizes.device) + torch.repeat_interleave(starts - first, sizes,
                                                                              output_size=total)


def pack_bags(requests: BagRequests, dtype: torch.dtype) -> Tensor:
    """One buffer of ``dtype``: per owner, its ids, then its pairs' codes, then their lengths."""
    local, codes, lengths, n_ids, n_pairs = requests
    seg = requests.buffer_sizes
    start = torch.cumsum(seg, 0) - seg
    out = torch.empty(int(seg.sum()), dtype=dtype, device=local.device)
    out[bag_segments(start, n_ids)] = local.to(dtype)
    out[bag_segments(start + n_ids, n_pairs)] = codes.to(dtype)
    out[bag_segments(start + n_ids + n_pairs, n_pairs)] = lengths.to(dtype)
    return out


def unpack_bags(buffer: Tensor, n_ids: Tensor, n_pairs: Tensor) -> BagRequests:
    """The requests in ``buffer`` (`pack_bags`' layout, ``n_ids`` and ``n_pairs`` per sender)."""
    seg = n_ids + 2 * n_pairs
    start = torch.cumsum(seg, 0) - seg
    return BagRequests(buffer[bag_segments(start, n_ids)], buffer[bag_segments(start + n_ids, n_pairs)],
                       buffer[bag_segments(start + n_ids + n_pairs, n_pairs)], n_ids, n_pairs)
