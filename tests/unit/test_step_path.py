"""A meta-step's calls go down the layers (docs/architecture.md): while a learner runs its
micro-batch (fused lookup, inner loop, outer loss) and its backward, no function of the package
is called from a module on a lower layer than its own (no callback climbs back up), and nothing
is looked up by name once the first micro-batch ran."""
from __future__ import annotations

import sys

import pytest
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
