"""Sharded embedding lookups and gradients equal the unsharded twin on 1-4 real ranks."""
from __future__ import annotations

import pytest

from distributed.ranks import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_equals_unsharded(world):
    outputs = run_ranks("sharded_equals_unsharded", world, timeout=180)
    assert all(out.strip().endswith(f"ok {r}") for r, out in enumerate(outputs))


@pytest.mark.parametrize("policy", ["skip", "abort"])
def test_nonfinite_loss_policy_on_two_ranks(policy):
    outputs = run_ranks("nonfinite", 2, policy, timeout=180)
    word = "skipped" if policy == "skip" else "raised"
    assert all(out.strip().endswith(f"{word} {r}") for r, out in enumerate(outputs)), outputs
