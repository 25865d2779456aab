"""Ranks in network namespaces as 2 emulated hosts x 2 ranks (issue 37 item 4): the topology
comes from the launcher's variables, and the hierarchical pooled and row exchanges equal the flat
ones across a rate-limited link (about 30 s)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

pytestmark = [pytest.mark.distributed]


def test_hierarchical_equals_flat_on_two_emulated_hosts_of_two_ranks(emulated_hosts):
    from topology import launch

    hosts = emulated_hosts(2, "100mbit")
    out = subprocess.run(hosts[0].command(["tc", "qdisc", "show", "dev", hosts[0].interface]),
                         capture_output=True, text=True, timeout=30).stdout
    assert "tbf" in out and "100Mbit" in out, out
    for exchange in ("pooled", "rows"):
        results = launch(hosts, 2, "check", {"rows": 5000, "bags": 64, "length": 8, "exchange": exchange},
                         timeout=240)
        assert [r["check"] for r in results] == ["ok"] * 4, (exchange, results)


def test_the_fixture_leaves_no_namespace_behind():
    """Runs after the test above (file order): its namespaces are gone."""
    if shutil.which("ip") is None:
        pytest.skip("the 'ip' command (iproute2) is not installed")
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    assert os.environ.get("GMETA_EMULATED_PREFIX", "gmtopo") + "_" not in done.stdout
