"""Does ZeRO-3 fit where ZeRO-2 does not? A memory limit per rank (a cgroup around each rank)
under which ZeRO-2 runs out of memory and ZeRO-3 trains to the same loss as without a limit.

Workload: ``hf_memory.py``'s (``gmeta-ds train`` on ``examples/hf_fewshot/config.yaml``, a few
meta-steps, evaluation off), by default its ``state`` case: BERT 1024 x 6 (~77M parameters),
head-only adaptation, 1-shot 1-query episodes, 1 inner step, 2 episodes per micro-batch per
rank; ZeRO-3 with the body split (``meta.split_body`` auto). The W ranks are started here,
not by a launcher, each a ``gmeta-ds train`` process with the torchrun environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) placed in its own memory
cgroup (v1 or v2; needs root or a delegated cgroup) before it execs: swap is off in it, and
a limit, when set, is that rank's whole budget (the kernel's OOM killer ends the rank past it).

Runs, in this order:

1. ``zero3-ref``: ZeRO-3, no limit (the reference loss and checksum);
2. ``zero2-ref``: ZeRO-2, no limit (run when no ``--limit-mib`` is given, to choose it, or with
   ``--zero2-reference``);
3. ``zero2-limited``: ZeRO-2 under the limit;
4. ``zero3-limited``: ZeRO-3 under the limit.

Default limit: halfway between the unconstrained ZeRO-3 and ZeRO-2 resident peaks (VmHWM of
the larger rank of each, over the whole run: `resident_peak`); when ZeRO-3's peak is not below ZeRO-2's no limit can separate them: that is
reported (verdict false, with the numbers) and the limited runs are skipped.

Per run and rank: exit code, the cgroup's OOM-kill count, its peak usage (v1
``memory.max_usage_in_bytes``, v2 ``memory.peak``; both count page cache the rank first
touched, nothing is dropped: a reported number, not a correction), ``peak_rss_mib_per_rank``
from summary.json, and the run's ``final_query_loss`` and ``dense_checksum``. Verdict: ZeRO-2
was OOM-killed or failed under the limit, and ZeRO-3 completed under it with the reference's
final query loss (relative difference < 1e-5) and dense checksum (< 1e-6).

    sudo python benchmarks/zero3_fit.py [--world 2] [--limit-mib M] [--steps 3] [--timeout 1800]
        [--case state] [--ds2 ds_configs/zero2.json] [--ds3 ds_configs/zero3.json]
    (-> benchmarks/results/zero3_fit.json)
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, REPO, bench_env, free_port, machine
from hf_memory import CASES, train_args

RESULTS = REPO / "benchmarks" / "results" / "zero3_fit.json"
MIB = 2**20
PEER_GRACE_S = 30.0  # after one rank fails, how long its peers get to notice before they are killed
LOSS_RTOL, CHECKSUM_RTOL = 1e-5, 1e-6


class CgroupError(RuntimeError):
    """No memory cgroup can be created here (no controller, not root, not delegated)."""


class MemoryCgroup:
    """One child memory cgroup (v1 or v2) holding one rank: limit (with no swap), peak usage,
    OOM kills; `remove` kills what is left in it and deletes it.

    Created under this process's own memory cgroup when that can have children (v1 always;
    v2 when its subtree has the memory controller), else under the hierarchy's root."""

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version

    @staticmethod
    def hierarchy() -> tuple[int, Path]:
        """(cgroup version, mount point of the memory controller)."""
        v2 = Path("/sys/fs/cgroup")
        controllers = v2 / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            return 2, v2
        v1 = Path("/sys/fs/cgroup/memory")
        if (v1 / "memory.limit_in_bytes").exists():
            return 1, v1
        raise CgroupError("no cgroup memory controller found (neither cgroup v2 with 'memory' in "
                          "/sys/fs/cgroup/cgroup.controllers nor cgroup v1 at /sys/fs/cgroup/memory)")

    @staticmethod
    def _own(version: int, mount: Path) -> Path | None:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, controllers, rel = line.split(":", 2)
            if (version == 2 and hid == "0") or (version == 1 and "memory" in controllers.split(",")):
                own = mount / rel.lstrip("/")
                return own if own.is_dir() else None  # another cgroup namespace: not visible here
        return None

    @classmethod
    def create(cls, name: str, limit_bytes: int | None) -> MemoryCgroup:
        version, mount = cls.hierarchy()
        limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
        own = cls._own(version, mount)
        problems = []
        for parent in dict.fromkeys(p for p in (own, mount) if p is not None):
            if version == 2:
                control = parent / "cgroup.subtree_control"
                if "memory" not in control.read_text().split():
                    try:
                        control.write_text("+memory")
                    except OSError as exc:  # EBUSY: the parent holds processes; EACCES: not ours
                        problems.append(f"{control}: +memory: {exc.strerror}")
                        continue
            path = parent / name
            try:
                path.mkdir()
            except OSError as exc:
                problems.append(f"mkdir {path}: {exc.strerror}")
                continue
            group = cls(path, version)
            if not (path / limit_file).exists():
                group.remove()
                problems.append(f"{path}: no {limit_file} (memory controller not enabled there)")
                continue
            try:
                group._limit(limit_bytes)
            except OSError as exc:
                group.remove()
                problems.append(f"{path}: setting the limit: {exc.strerror}")
                continue
            return group
        hint = "" if os.geteuid() == 0 else " (not root: run as root or in a delegated cgroup)"
        raise CgroupError(f"cannot create memory cgroup {name!r}{hint}: " + "; ".join(problems))

    def _limit(self, limit_bytes: int | None) -> None:
        if self.version == 1:  # memory first: memsw (memory + swap) may not go below it
            if limit_bytes is not None:
                (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                if (self.path / "memory.memsw.limit_in_bytes").exists():  # swap accounting on
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            (self.path / "memory.swappiness").write_text("0")
        else:
            if limit_bytes is not None:
                (self.path / "memory.max").write_text(str(limit_bytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")

    def enter(self) -> None:
        """Move the calling process in (a ``preexec_fn``: runs in the child before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def procs(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def current_bytes(self) -> int | None:
        text = self._read("memory.usage_in_bytes" if self.version == 1 else "memory.current")
        return int(text) if text else None

    def peak_bytes(self) -> int | None:
        text = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        return int(text) if text else None

    def limit_bytes(self) -> int | None:
        text = self._read("memory.limit_in_bytes" if self.version == 1 else "memory.max")
        return None if text is None or text.strip() == "max" else int(text)

    def _counter(self, file: str, key: str) -> int | None:
        text = self._read(file) or ""
        values = [int(ln.split()[1]) for ln in text.splitlines() if ln.split()[:1] == [key]]
        return values[0] if values else None

    def oom_kills(self) -> int | None:
        """Processes the OOM killer ended in this cgroup (None: the kernel does not count them)."""
        return self._counter("memory.oom_control" if self.version == 1 else "memory.events", "oom_kill")

    def limit_hits(self) -> int | None:
        """Times usage reached the limit (v1 ``memory.failcnt``, v2 ``max`` events)."""
        if self.version == 1:  # with swap accounting the memory + swap counter is the one that fails
            counts = [int(t) for t in map(self._read, ("memory.failcnt", "memory.memsw.failcnt")) if t]
            return max(counts) if counts else None
        return self._counter("memory.events", "max")

    def stats(self) -> dict:
        peak = self.peak_bytes()
        return {"cgroup": str(self.path), "peak_mib": None if peak is None else peak / MIB,
                "oom_kills": self.oom_kills(), "limit_hits": self.limit_hits()}

    def remove(self) -> None:
        """Kill every process still in the cgroup, then delete it (retrying while it empties)."""
        deadline = time.monotonic() + 30.0
        while True:
            for pid in self.procs():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise CgroupError(f"cannot remove {self.path}: {exc.strerror}") from exc
                time.sleep(0.2)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and anything it started
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def launch(name: str, argv: list[str], world: int, limit_mib: float | None, timeout: float,
           work: Path) -> dict:
    """``gmeta-ds *argv`` on ``world`` ranks, each in its own memory cgroup (``limit_mib`` each,
    or none). Kills every rank on timeout, and the peers of a failed rank after
    `PEER_GRACE_S`; always removes the cgroups. Returns the run's record."""
    limit = None if limit_mib is None else int(limit_mib * MIB)
    port, groups, procs, logs = str(free_port()), [], [], []
    record = {"run": name, "world": world, "limit_mib": limit_mib, "timed_out": False,
              "peers_killed_after_failure": False}
    start = time.monotonic()
    try:
        for rank in range(world):
            group = MemoryCgroup.create(f"gmeta_fit_{os.getpid()}_{name}_r{rank}", limit)
            groups.append(group)
            env = bench_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            logs.append(work / f"{name}_rank{rank}.log")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen([str(BIN / "gmeta-ds"), *argv], cwd=REPO, env=env,
                                              stdout=log, stderr=subprocess.STDOUT,
                                              # no threads here: preexec_fn is safe
                                              preexec_fn=group.enter,  # noqa: PLW1509
                                              start_new_session=True))
        deadline, failed_at = start + timeout, None
        sampled = [0] * world  # max of usage samples: the peak where the kernel keeps none
        while any(p.poll() is None for p in procs):
            sampled = [max(s, g.current_bytes() or 0) for s, g in zip(sampled, groups)]
            now = time.monotonic()
            if now > deadline:
                record["timed_out"] = True
                break
            if failed_at is None and any(p.returncode for p in procs if p.returncode is not None):
                failed_at = now
            if failed_at is not None and now - failed_at > PEER_GRACE_S:
                record["peers_killed_after_failure"] = True
                break
            time.sleep(0.5)
        _kill(procs)
        record["wall_s"] = time.monotonic() - start
        record["exit_codes"] = [p.returncode for p in procs]  # negative: killed by that signal
        record["ranks"] = [{**g.stats(), "sampled_peak_mib": s / MIB} for g, s in zip(groups, sampled)]
    finally:
        _kill(procs)
        for group in groups:
            group.remove()
    for rank, (r, log) in enumerate(zip(record["ranks"], logs)):
        r["rank"], r["exit_code"] = rank, record["exit_codes"][rank]
        r["log_tail"] = log.read_text(errors="replace")[-1500:] if r["exit_code"] else ""
    record["oom_kills"] = sum(r["oom_kills"] or 0 for r in record["ranks"])
    record["cgroup_peak_mib_per_rank"] = [r["peak_mib"] if r["peak_mib"] is not None else r["sampled_peak_mib"]
                                          for r in record["ranks"]]
    record["completed"] = not record["timed_out"] and all(c == 0 for c in record["exit_codes"])
    summary_path = next(Path(a.split("=", 1)[1]) / "summary.json" for a in argv if a.startswith("output_dir="))
    summary = json.loads(summary_path.read_text()) if record["completed"] and summary_path.exists() else {}
    record["final_query_loss"] = summary.get("final_query_loss")
    record["dense_checksum"] = summary.get("dense_checksum")
    record["zero_stage"] = summary.get("ds_config", {}).get("zero_optimization", {}).get("stage")
    record["split_body"] = summary.get("split_body")
    record["parameters"] = summary.get("parameters")
    record["peak_rss_mib_per_rank"] = summary.get("peak_rss_mib_per_rank")
    return record


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), 1e-30)


def resident_peak(run: dict) -> float:
    """The largest rank's resident peak over its whole life (VmHWM: training, the final
    gather, saving and evaluation). What the OOM killer weighs is resident memory: the
    cgroup's own peak also counts page cache, which the kernel reclaims before killing (a
    limit between two cgroup peaks let ZeRO-2 run through on reclaimed cache)."""
    return max(r["vmhwm_mib"] for r in run["peak_rss_mib_per_rank"])


def verdict(runs: dict, limit_mib: float | None, limit_source: str) -> dict:
    z3, z2 = runs.get("zero3-ref"), runs.get("zero2-ref")
    v: dict = {"limit_mib": limit_mib, "limit_source": limit_source}
    if z2 is not None and z2["completed"] and z3["completed"]:
        p3, p2 = resident_peak(z3), resident_peak(z2)
        v["zero3_ref_peak_mib"], v["zero2_ref_peak_mib"] = p3, p2
        v["zero3_peak_below_zero2"] = p3 < p2
    lim2, lim3 = runs.get("zero2-limited"), runs.get("zero3-limited")
    if not z3["completed"]:
        v["problem"] = "the unconstrained ZeRO-3 reference did not complete"
    elif lim2 is None or lim3 is None:
        v["problem"] = f"limited runs skipped (limit: {limit_source})"
    else:
        v["zero2_oom_killed"] = lim2["oom_kills"] > 0
        v["zero2_failed_under_limit"] = not lim2["completed"]
        v["zero3_completed_under_limit"] = lim3["completed"] and lim3["oom_kills"] == 0
        v["loss_rel_diff"] = _rel(lim3["final_query_loss"], z3["final_query_loss"])
        v["checksum_rel_diff"] = _rel(lim3["dense_checksum"], z3["dense_checksum"])
        v["same_loss"] = v["loss_rel_diff"] is not None and v["loss_rel_diff"] < LOSS_RTOL
        v["same_checksum"] = v["checksum_rel_diff"] is not None and v["checksum_rel_diff"] < CHECKSUM_RTOL
    keys = ("zero2_failed_under_limit", "zero3_completed_under_limit", "same_loss", "same_checksum")
    v["fits"] = all(v.get(k) is True for k in keys) and v.get("zero3_peak_below_zero2", True) is True
    return v


def table(runs: dict) -> list[str]:
    lines = [("| run | ZeRO | limit (MiB) | exit codes | OOM kills | cgroup peak per rank (MiB) | "
              "VmHWM per rank (MiB) | final query loss | dense checksum | wall (s) |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs.values():
        hwm = "-" if not r["peak_rss_mib_per_rank"] else " / ".join(
            f"{x['training_vmhwm_mib']:.0f}" for x in r["peak_rss_mib_per_rank"])
        loss = "-" if r["final_query_loss"] is None else f"{r['final_query_loss']:.7f}"
        check = "-" if r["dense_checksum"] is None else f"{r['dense_checksum']:.9g}"
        limit = "-" if r["limit_mib"] is None else f"{r['limit_mib']:.0f}"
        peaks = " / ".join(f"{p:.0f}" for p in r["cgroup_peak_mib_per_rank"])
        codes = f"{r['exit_codes']}" + (" (timed out)" if r["timed_out"] else "")
        lines.append(f"| {r['run']} | {r['zero_stage'] or r['requested_stage']} | {limit} | {codes} | "
                     f"{r['oom_kills']} | {peaks} | {hwm} | {loss} | {check} | {r['wall_s']:.0f} |")
    return lines


def write_results(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")  # written whole, then renamed: readers never see half
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--limit-mib", type=float, default=None,
                        help="memory limit per rank (default: halfway between the unconstrained "
                             "ZeRO-3 and ZeRO-2 resident peaks)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--case", default="state", choices=list(CASES))
    parser.add_argument("--ds2", default=str(REPO / "ds_configs" / "zero2.json"), help="ZeRO-2 DeepSpeed JSON")
    parser.add_argument("--ds3", default=str(REPO / "ds_configs" / "zero3.json"), help="ZeRO-3 DeepSpeed JSON")
    parser.add_argument("--zero2-reference", action="store_true",
                        help="also run ZeRO-2 without a limit when --limit-mib is given")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    args = parser.parse_args()
    MemoryCgroup.hierarchy()  # fail early, before any run, when there is no controller
    ds = {"zero2": str(Path(args.ds2).resolve()), "zero3": str(Path(args.ds3).resolve())}
    runs: dict = {}

    def one(name: str, variant: str, limit: float | None) -> dict:
        argv = train_args(args.case, variant, args.world, args.steps, Path(tmp) / name, ds[variant])
        print(f"--- {name}: {variant}, {args.world} ranks, limit "
              f"{'none' if limit is None else f'{limit:.0f} MiB'}", flush=True)
        r = launch(name, argv, args.world, limit, args.timeout, Path(tmp))
        r["requested_stage"] = int(variant[-1])
        r["command"] = ["gmeta-ds", *argv]
        runs[name] = r
        print(json.dumps({k: v for k, v in r.items() if k not in ("ranks", "command")}), flush=True)
        for rank in r["ranks"]:
            if rank["exit_code"]:
                print(f"rank {rank['rank']} exit {rank['exit_code']}, log tail:\n{rank['log_tail'][-600:]}")
        return r

    with tempfile.TemporaryDirectory(prefix="zero3_fit_") as tmp:
        one("zero3-ref", "zero3", None)
        limit, source = args.limit_mib, "--limit-mib"
        if args.limit_mib is None or args.zero2_reference:
            one("zero2-ref", "zero2", None)
        if limit is None:
            z3, z2 = runs["zero3-ref"], runs["zero2-ref"]
            if z3["completed"] and z2["completed"]:
                p3, p2 = resident_peak(z3), resident_peak(z2)
                if p3 < p2:
                    limit, source = (p3 + p2) / 2, f"halfway between ZeRO-3's {p3:.0f} and ZeRO-2's {p2:.0f} MiB"
                else:
                    source = (f"none: ZeRO-3's unconstrained resident peak {p3:.0f} MiB is not below "
                              f"ZeRO-2's {p2:.0f} MiB, so no limit separates them")
            else:
                source = "none: an unconstrained reference run did not complete"
            print(f"limit: {source}", flush=True)
        if limit is not None:
            print(f"limit per rank: {limit:.0f} MiB ({source})", flush=True)
            one("zero2-limited", "zero2", limit)
            one("zero3-limited", "zero3", limit)
    v = verdict(runs, limit, source)
    print("\n".join(table(runs)))
    print("verdict: " + json.dumps(v))
    write_results(args.out, {"machine": machine(), "case": args.case, "world": args.world, "steps": args.steps,
                   "cgroup_version": MemoryCgroup.hierarchy()[0],
                   "ds_configs": {k: {"path": p, "json": json.loads(Path(p).read_text())} for k, p in ds.items()},
                   "verdict": v, "runs": list(runs.values())})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
