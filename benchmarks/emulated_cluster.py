"""An emulated cluster on one machine: H "hosts" as network namespaces, each joined to a hub by
a veth pair whose two ends are rate-limited (``tc qdisc ... tbf rate R``), so traffic between
hosts crosses a link of R bit/s each way while ranks of one host talk over its loopback.

    hub namespace: bridge <P>br --+-- <P>h0 (veth, tbf R) <-> <P>e0 in namespace <P>_0 (10.233.S.1)
                                  +-- <P>h1 (veth, tbf R) <-> <P>e1 in namespace <P>_1 (10.233.S.2) ...

Root only (namespaces, veths, qdiscs); nothing is added to the machine's own namespace, and
everything is removed on exit (also on errors), as are leftovers of the same prefix at start
(a killed run). The prefix (default ``gmtopo``, or the GMETA_EMULATED_PREFIX environment
variable) keeps two users of one machine apart. netem is not available in every kernel; tbf is, and is all this needs.

CLI (a quick check of the links): ``python benchmarks/emulated_cluster.py --hosts 2 --rate 100mbit``
creates the cluster, measures the rate of a TCP stream from host 0 to host 1 and inside host 0
(`measure_rate`), prints them and removes the cluster again.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
from dataclasses import dataclass

# Name prefix of the namespaces and links: one per user of the machine (GMETA_EMULATED_PREFIX,
# at most 9 characters: interface names end in e<host> / h<host> / br within 15).
PREFIX = os.environ.get("GMETA_EMULATED_PREFIX", "gmtopo")
SUBNET = "10.233"


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, its interface (for GLOO_SOCKET_IFNAME) and address."""

    namespace: str
    interface: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def tx_bytes(self) -> int:
        """Bytes this host has sent on its link so far (the kernel's counter, headers included)."""
        return int(subprocess.run(self.command(["cat", f"/sys/class/net/{self.interface}/statistics/tx_bytes"]),
                                  capture_output=True, text=True, timeout=30, check=True).stdout)


def rank_env(hosts: list[Host], ranks_per_host: int, rank: int, port: int) -> dict:
    """The launcher's variables for ``rank`` of ``len(hosts) x ranks_per_host`` ranks (numbered
    host by host; the store on host 0 at ``port``; gloo over the rank's host interface)."""
    host = hosts[rank // ranks_per_host]
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(hosts) * ranks_per_host),
            "LOCAL_RANK": str(rank % ranks_per_host), "LOCAL_WORLD_SIZE": str(ranks_per_host),
            "GROUP_RANK": str(rank // ranks_per_host), "MASTER_ADDR": hosts[0].address, "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": host.interface, "OMP_NUM_THREADS": "1"}


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list:
    """Each process's ``communicate()`` (all within ``timeout`` seconds in all); whatever still
    runs at the end (a timeout, an error) is killed."""
    import time

    deadline = time.monotonic() + timeout
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return outs


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def why_not_available() -> str | None:
    """Why an emulated cluster cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc qdiscs)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"the '{tool}' command (iproute2) is not installed"
    return None


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace whose name starts with ``prefix`` (their veths go with them)."""
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    gone = [n for n in names if n.startswith(prefix + "_")]
    for name in gone:
        _ip("netns", "del", name, check=False)
    return gone


def _limit(namespace: str, link: str, rate: str) -> None:
    """Egress of ``link`` limited to ``rate`` (tbf: a 64 KiB bucket, 50 ms of queue)."""
    subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", link, "root", "tbf",
                    "rate", rate, "burst", "64kb", "latency", "50ms"], check=True, capture_output=True,
                   timeout=30)


def _build(hosts: int, rate: str | None, prefix: str, subnet: int) -> list[Host]:
    hub = f"{prefix}_hub"
    _ip("netns", "add", hub)
    _ip("-n", hub, "link", "add", f"{prefix}br", "type", "bridge")
    _ip("-n", hub, "link", "set", f"{prefix}br", "up")
    made = []
    for h in range(hosts):
        ns, inner, outer = f"{prefix}_{h}", f"{prefix}e{h}", f"{prefix}h{h}"
        address = f"{SUBNET}.{subnet}.{h + 1}"
        _ip("netns", "add", ns)
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "netns", hub)
        _ip("-n", hub, "link", "set", outer, "master", f"{prefix}br")
        _ip("-n", hub, "link", "set", outer, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if rate:
            _limit(ns, inner, rate)
            _limit(hub, outer, rate)
        made.append(Host(ns, inner, address))
    return made


@contextlib.contextmanager
def emulated_cluster(hosts: int, rate: str | None = None, prefix: str = PREFIX, subnet: int = 1):
    """H hosts (`Host`) whose links to each other carry ``rate`` (tc syntax: "1gbit",
    "100mbit"; None: unlimited) each way; removed on exit, leftovers of ``prefix`` first."""
    reason = why_not_available()
    if reason:
        raise RuntimeError(f"emulated cluster: {reason}")
    remove_leftovers(prefix)
    try:
        yield _build(hosts, rate, prefix, subnet)
    finally:
        remove_leftovers(prefix)


_SINK = ("import socket,sys; s=socket.create_server((sys.argv[1], 29411)); c=s.accept()[0]\n"
         "while c.recv(1 << 20): pass")
_SOURCE = ("import socket,sys,time; c=socket.create_connection((sys.argv[1], 29411), timeout=30); "
           "b=bytes(1 << 20); t=time.perf_counter()\nfor _ in range(int(sys.argv[2])): c.sendall(b)\n"
           "c.close(); print(int(sys.argv[2]) * 8 / (time.perf_counter() - t))")


def measure_rate(sender: Host, receiver: Host, megabytes: int = 8) -> float:
    """Mbit/s of one TCP stream of ``megabytes`` MiB from ``sender`` to ``receiver``."""
    import sys
    import time

    sink = subprocess.Popen(receiver.command([sys.executable, "-c", _SINK, receiver.address]))
    try:
        time.sleep(0.5)
        out = subprocess.run(sender.command([sys.executable, "-c", _SOURCE, receiver.address, str(megabytes)]),
                             capture_output=True, text=True, timeout=120, check=True).stdout
        return float(out) * 1.048576
    finally:
        sink.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate", default="100mbit")
    args = parser.parse_args()
    with emulated_cluster(args.hosts, args.rate) as hosts:
        for host in hosts:
            print(host)
        print(f"host 0 -> host {len(hosts) - 1}: {measure_rate(hosts[0], hosts[-1]):,.0f} Mbit/s")
        print(f"inside host 0: {measure_rate(hosts[0], hosts[0], 64):,.0f} Mbit/s")
    print("removed:", not remove_leftovers())


if __name__ == "__main__":
    main()
