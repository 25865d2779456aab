"""The package modules one CTR meta-step passes, and the calls between them (docs/architecture.md).

A tiny synthetic CTR run (MeLU, second-order MAML, 2 micro-batches per meta-step, ZeRO-1,
sharded tables, one process) trains 3 meta-steps through `gmeta_ds.cli.main`; the second
`MetaEngine.meta_step` runs under ``sys.setprofile``, which records every call into gmeta_ds
with its caller (the nearest gmeta_ds frame below it: DeepSpeed's and torch's frames between
are skipped, so ``engine(batch)`` reads as meta_engine -> algorithms.base). Printed: the
modules in order of first entry with their layer (tests/unit/test_layers.py's ``LAYERS``), the
calls between modules, and every call from a lower layer into a higher one (a callback that
climbs; the target is none).

    python benchmarks/step_path.py [--plan auto|row_wise|table_wise|replicated]

Writes ``benchmarks/results/step_path.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_layers import layer_of


def traced_step(plan: str) -> tuple[list[str], dict[tuple[str, str], set[str]]]:
    """(modules in order of first entry, {(caller, callee): {"caller_fn->callee_fn"}}) of the
    second meta-step of a tiny run with embedding.plan ``plan``."""
    from gmeta_ds import meta_engine
    from gmeta_ds.cli import main

    order: list[str] = []
    calls: dict[tuple[str, str], set[str]] = {}

    def profile(frame, event, arg):
        callee = frame.f_globals.get("__name__", "")
        if event != "call" or not callee.startswith("gmeta_ds."):
            return
        if callee not in order:
            order.append(callee)
        back = frame.f_back
        while back is not None and not back.f_globals.get("__name__", "").startswith("gmeta_ds."):
            back = back.f_back
        if back is not None and back.f_globals["__name__"] != callee:
            key = (back.f_globals["__name__"], callee)
            calls.setdefault(key, set()).add(f"{back.f_code.co_name}->{frame.f_code.co_name}")

    real = meta_engine.MetaEngine.meta_step

    def meta_step(self, batches):
        if self.step != 1:  # the first meta-step also resolves what is looked up once
            return real(self, batches)
        sys.setprofile(profile)
        try:
            return real(self, batches)
        finally:
            sys.setprofile(None)

    meta_engine.MetaEngine.meta_step = meta_step
    cfg = {"model": {"embed_dim": 4, "hidden": [8]}, "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
           "data": {"synthetic": {"num_users": 60, "num_items": 40, "max_interactions": 25}},
           "embedding": {"sharding": "sharded", "plan": plan},
           "train": {"meta_steps": 3, "progress": False}, "eval": {"enabled": False},
           "deepspeed": str(ROOT / "ds_configs" / "zero1.json")}
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "run.yaml"
        path.write_text(yaml.safe_dump({"output_dir": str(Path(work) / "run"), **cfg}))
        if main(["train", "--config", str(path)]) != 0:
            raise SystemExit("the run failed")
    meta_engine.MetaEngine.meta_step = real
    return order, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="auto", choices=["auto", "row_wise", "table_wise", "replicated"])
    args = ap.parse_args()
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29530")})
    order, calls = traced_step(args.plan)
    up = [f"{a} (L{layer_of(a)}) -> {b} (L{layer_of(b)}): {', '.join(sorted(f))}"
          for (a, b), f in calls.items() if layer_of(b) > layer_of(a)]
    print(f"one CTR meta-step (embedding.plan {args.plan}): {len(order)} package modules, in order of first entry")
    for m in order:
        print(f"  L{layer_of(m)}  {m}")
    print("calls between modules (caller -> callee):")
    for (a, b), f in calls.items():
        print(f"  {a} -> {b}: {', '.join(sorted(f))}")
    print(f"calls up the layers: {len(up)}" + "".join(f"\n  {u}" for u in up))
    out = ROOT / "benchmarks" / "results" / "step_path.json"
    out.write_text(json.dumps({"plan": args.plan, "modules": order, "layers": [layer_of(m) for m in order],
                               "calls": {f"{a} -> {b}": sorted(f) for (a, b), f in calls.items()},
                               "calls_up": up}, indent=1) + "\n")


if __name__ == "__main__":
    main()
