"""A meta-step's calls go down the layers (docs/architecture.md): while a learner runs its
micro-batch (fused lookup, inner loop, outer loss) and its backward, no function of the package
is called from a module on a lower layer than its own (no callback climbs back up), and nothing
is looked up by name once the first micro-batch ran; a whole `MetaEngine.meta_step` passes at
most 15 package modules (issue 48's target; benchmarks/step_path.py traces the CLI's)."""
from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_batch, tiny_melu
from test_layers import layer_of

from gmeta_ds.algorithms import ALGORITHMS, MetaLearner


def _package_calls(run) -> set[tuple[str, str, str]]:
    """(caller module, callee module, callee function) of every call into gmeta_ds while
    ``run()`` runs; the caller is the nearest gmeta_ds frame below (torch's in between skipped)."""
    calls = set()

    def profile(frame, event, arg):
        callee = frame.f_globals.get("__name__", "")
        if event != "call" or not callee.startswith("gmeta_ds."):
            return
        back = frame.f_back
        while back is not None and not back.f_globals.get("__name__", "").startswith("gmeta_ds."):
            back = back.f_back
        if back is not None and back.f_globals["__name__"] != callee:
            calls.add((back.f_globals["__name__"], callee, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("vectorize", [True, False], ids=["vmap", "loop"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_a_learners_step_calls_only_down_the_layers(algorithm, vectorize):
    learner = MetaLearner(tiny_melu(), ALGORITHMS[algorithm](2, 0.3, ["mlp.*"], vectorize, "binary"))
    batch = tiny_batch()
    learner(batch).loss.backward()  # the first micro-batch resolves what the algorithm names once
    calls = _package_calls(lambda: learner(batch).loss.backward())
    assert any(callee == "gmeta_ds.functional.inner" for _, callee, _ in calls)  # the trace saw the inner loop
    assert not [c for c in calls if c[1] == "gmeta_ds.registry"], "a micro-batch looked a name up in the registry"
    up = sorted(f"{a} (L{layer_of(a)}) calls {b}.{fn} (L{layer_of(b)})" for a, b, fn in calls
                if layer_of(b) > layer_of(a))
    assert not up, "calls up the layers:\n" + "\n".join(up)


class _OneProcessEngine:
    """What a meta-step uses of a DeepSpeed engine, on one process under ZeRO-0 in fp32:
    forward, backward, step (plain SGD), and the settings `ds_engine.MicroStep` reads."""

    device = torch.device("cpu")

    def __init__(self, learner):
        self.module = learner
        self.optimizer = torch.optim.SGD(learner.parameters(), lr=0.1)

    def __call__(self, batch, rows):
        return self.module(batch, rows)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()

    def no_sync(self):
        return contextlib.nullcontext()

    def zero_optimization_stage(self):
        return 0

    def fp16_enabled(self):
        return False

    def bfloat16_enabled(self):
        return False


@pytest.mark.parametrize("plan", ["auto", "row_wise"])
def test_a_meta_step_passes_at_most_15_package_modules_every_call_going_down(plan):
    """Issue 48's target for `MetaEngine.meta_step` after the first (sharded tables, fused
    lookup, inner loop, outer backward, dense and sparse steps): at most 15 package modules,
    none called from a lower layer. Nothing the engine decides once (`MetaEngine.micro_step`)
    or the data layer measured when it made the batch (`TaskBatch.padding_efficiency`) is
    asked again per step. In process, tiny synthetic tasks (~1 s)."""
    from gmeta_ds.config import config_from_dict
    from gmeta_ds.meta_engine import MetaEngine
    from gmeta_ds.workloads.ctr import build_data, build_learner, build_sharded

    cfg = config_from_dict({"model": {"embed_dim": 4, "hidden": [8]},
                            "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
                            "data": {"synthetic": {"num_users": 40, "num_items": 30, "max_interactions": 20}},
                            "embedding": {"sharding": "sharded", "plan": plan}})
    data = build_data(cfg)
    sharded = build_sharded(cfg, data, 0, 1)
    learner = build_learner(cfg, data.fields, with_tables=False, train=data.train)
    steps = SimpleNamespace(world_size=1, tasks_per_micro_batch=4, grad_accum_steps=2, tasks_per_meta_step=8)
    meta = MetaEngine(_OneProcessEngine(learner), sharded, [], steps, {}, 0, cfg.seed)
    first, second = meta.batches(data.train, 0), meta.batches(data.train, 1)
    meta.meta_step(first)  # the first meta-step resolves what is decided once
    calls = _package_calls(lambda: meta.meta_step(second))
    modules = {m for caller, callee, _ in calls for m in (caller, callee)}
    assert {"gmeta_ds.functional.inner", "gmeta_ds.embedding.optim"} <= modules  # the trace saw the whole step
    assert len(modules) <= 15, f"{len(modules)} package modules:\n" + "\n".join(sorted(modules))
    up = sorted(f"{a} (L{layer_of(a)}) calls {b}.{fn} (L{layer_of(b)})" for a, b, fn in calls
                if layer_of(b) > layer_of(a))
    assert not up, "calls up the layers:\n" + "\n".join(up)
