"""Sharded embedding lookups and gradients equal the unsharded twin on 1-4 real ranks."""
from __future__ import annotations

import pytest

from distributed.ranks import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_equals_unsharded(world):
    outputs = run_ranks("sharded_equals_unsharded", world, timeout=180)
    assert all(out.strip().endswith(f"ok {r}") for r, out in enumerate(outputs))


@pytest.mark.parametrize("world", [2, 3])
def test_host_placed_tables_exchange_over_their_own_gloo_group_and_equal_unsharded(world):
    outputs = run_ranks("sharded_equals_unsharded", world, "host", timeout=180)
    assert all(out.strip().endswith(f"ok {r}") for r, out in enumerate(outputs))


@pytest.mark.parametrize("world,ranks_per_host", [(4, 2), (2, 1)])
def test_hierarchical_pooled_exchange_equals_flat_and_sends_one_sum_per_host(world, ranks_per_host):
    outputs = run_ranks("hierarchical_equals_flat", world, str(ranks_per_host), timeout=180)
    assert all(out.strip().endswith(f"ok {r}") for r, out in enumerate(outputs)), outputs


@pytest.mark.parametrize("world,ranks_per_host", [(4, 2), (2, 1)])
def test_hierarchical_row_exchange_equals_flat_and_sends_each_distinct_row_once_per_host(world, ranks_per_host):
    outputs = run_ranks("hierarchical_rows_equal_flat", world, str(ranks_per_host), timeout=180)
    assert all(out.strip().endswith(f"ok {r}") for r, out in enumerate(outputs)), outputs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tables_pooled_on_their_owners_equal_unsharded(world):
    outputs = run_ranks("pooled_equals_unsharded", world, timeout=180)
    assert all(out.strip().endswith(f"ok {r}") for r, out in enumerate(outputs)), outputs


@pytest.mark.parametrize("world,device", [(1, "auto"), (2, "auto"), (3, "host")])
def test_dynamic_tables_equal_their_unsharded_twin(world, device):
    outputs = run_ranks("dynamic_equals_unsharded", world, device, timeout=180)
    assert all(out.strip().endswith(f"ok {r}") for r, out in enumerate(outputs)), outputs


@pytest.mark.parametrize("policy", ["skip", "abort"])
def test_nonfinite_loss_policy_on_two_ranks(policy):
    outputs = run_ranks("nonfinite", 2, policy, timeout=180)
    word = "skipped" if policy == "skip" else "raised"
    assert all(out.strip().endswith(f"{word} {r}") for r, out in enumerate(outputs)), outputs


def test_nonfinite_loss_in_an_accumulated_micro_batch_aborts_before_any_update():
    outputs = run_ranks("nonfinite_accumulated", 2, timeout=180)
    assert all(out.strip().endswith(f"raised {r}") for r, out in enumerate(outputs)), outputs


def test_world_one_zero0_skips_the_one_rank_reduction_bit_for_bit():
    outputs = run_ranks("zero0_world1_without_reduction", 1, timeout=180)
    assert outputs[0].strip().endswith("ok 0"), outputs
