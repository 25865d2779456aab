"""The fused single-hot lookup equals the per-feature path bit for bit on 1-3 real ranks
(rows, averaged gradients, sparse optimizer updates, communication counters)."""
from __future__ import annotations

import pytest

from distributed.ranks import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world, dedup, bad_ids", [(1, "dedup", "error"), (2, "dedup", "error"),
                                                   (2, "no-dedup", "hash"), (3, "dedup", "hash")])
def test_fused_lookup_equals_per_feature_path(world, dedup, bad_ids):
    outputs = run_ranks("fused_lookup", world, dedup, bad_ids, timeout=180,
                        module="distributed.lookup_workers")
    assert all(out.strip().endswith(f"ok {r}") for r, out in enumerate(outputs)), outputs
