"""meta.compile (gmeta_ds/functional/compiled.py): the vectorized inner loop and query loss under
torch.compile give eager's outer gradients (second order included), bound their graphs over
micro-batches of other lengths, and fall back to eager with one warning when compiling fails.

The graphs are compiled with the ``aot_eager`` backend: AOTAutograd traces the inner
``torch.func.grad`` and the outer backward exactly as for inductor, without inductor's C++
build (tens of seconds per graph on 2 shared cores; benchmarks/inner_loop.py --compiled
measures inductor itself, and checks its gradients against eager's before timing). 1-11 s
each (the first pays Dynamo's one-off start), 49 s for the file at a load average of 2. With the
static buckets' four tests (backend "eager": padding and graph counts, not inductor; 11 s of
it), 68 s for the file at a load average of 1.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import gmeta_ds as gm
from gmeta_ds.algorithms import FOMAML, MAML, Reptile, set_compile
from gmeta_ds.algorithms.base import MetaLearner
from gmeta_ds.config import EmbeddingConfig, config_from_dict
from gmeta_ds.embedding.tables import EmbeddingCollection
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional import compiled as compiled_module
from gmeta_ds.functional.compiled import CompiledTasks, bucket_edge, use_temporary_cache
from gmeta_ds.models.base import field_tables
from gmeta_ds.models.dcn_v2 import DCNv2
from tests.helpers import FIELDS, tiny_batch, tiny_melu

# micro-batches of other support and query lengths, as padding to each batch's longest task makes them
SHAPES = [(6, 4), (7, 4), (9, 5), (5, 3)]


def _batches():
    return [tiny_batch(support=s, query=q, seed=i) for i, (s, q) in enumerate(SHAPES)]


def _outer_grads(algorithm, batches, model=tiny_melu):
    """Each batch's loss and outer gradients of every learner parameter, from one learner."""
    torch.manual_seed(0)
    learner = MetaLearner(model(), algorithm)
    results = []
    for batch in batches:
        learner.zero_grad(set_to_none=True)
        loss = learner(batch).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in learner.named_parameters()
                                        if p.grad is not None}))
    return results


def _compiled(cls, adapt, backend="aot_eager", steps=2, **kwargs):
    algorithm = cls(inner_steps=steps, inner_lr=0.3, adapt=adapt, vectorize=True)
    algorithm.compiled = CompiledTasks(backend=backend, **kwargs)
    return algorithm


# second order through two inner steps; the first-order ones and adapted rows through one (a
# graph half as long to trace)
@pytest.mark.parametrize("cls,adapt,steps", [
    (MAML, ["mlp.*"], 2), (FOMAML, ["mlp.*"], 1), (Reptile, ["mlp.*"], 1),
    (MAML, ["mlp.*", "embedding.item_id"], 1)],
    ids=["maml-second-order", "fomaml", "reptile", "maml-adapted-rows"])
def test_compiled_outer_gradients_equal_eager(cls, adapt, steps):
    batches = _batches()[:2]  # a second length: the graph's row dimensions are symbolic
    eager = _outer_grads(cls(inner_steps=steps, inner_lr=0.3, adapt=adapt, vectorize=True), batches)
    algorithm = _compiled(cls, adapt, steps=steps)
    compiled = _outer_grads(algorithm, batches)
    assert algorithm.compiled.failure is None and algorithm.compiled.graphs == 1  # both lengths, one graph
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled):
        assert torch.allclose(loss_c, loss_e, atol=1e-6)
        assert grads_c.keys() == grads_e.keys() and "net.embedding.weights.item_id" in grads_c
        for name in grads_e:
            assert torch.allclose(grads_c[name], grads_e[name], atol=1e-5, rtol=0), name


def test_bucket_edges_pad_by_under_a_quarter():
    assert [bucket_edge(n) for n in (0, 4, 5, 8, 9, 11, 17, 75, 81, 96, 97)] == [4, 4, 5, 8, 10, 12, 20, 80, 96, 96, 112]
    assert all(n <= bucket_edge(n) < 1.25 * n for n in range(5, 2000))


# (support, query, seed): 3 lengths in 2 buckets of (support, query, distinct item ids): (12, 5, 12) twice, (10, 4, 10)
BUCKETED = [(11, 5, 2), (12, 5, 3), (9, 4, 0)]


@pytest.mark.parametrize("cls", [MAML, Reptile], ids=["maml-second-order", "reptile"])
def test_static_buckets_give_eager_gradients_with_one_graph_per_bucket(cls):
    # Dynamo's own graphs run eagerly (backend "eager"): what is tested is the padding, and the
    # graphs' count; inductor's gradients are checked by the test above and by the benchmarks
    batches = [tiny_batch(support=s, query=q, seed=i) for s, q, i in BUCKETED]
    adapt = ["mlp.*", "embedding.item_id"]  # adapted rows: their table padded too, fast rows cut back
    eager = _outer_grads(cls(inner_steps=1, inner_lr=0.3, adapt=adapt, vectorize=True), batches)
    algorithm = _compiled(cls, adapt, backend="eager", steps=1, static=True)
    compiled = _outer_grads(algorithm, batches)
    assert algorithm.compiled.failure is None and algorithm.compiled.graphs == 2
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled):
        assert torch.allclose(loss_c, loss_e, atol=1e-6)
        assert grads_c.keys() == grads_e.keys()
        for name in grads_e:
            assert torch.allclose(grads_c[name], grads_e[name], atol=1e-5, rtol=0), name


def test_a_model_that_specialises_the_row_dimensions_gets_static_buckets_not_a_graph_per_length():
    # DCN-v2's concatenation specialises the marked row dimensions: a graph per length until the
    # bound (the demo's ~16 lengths went eager after 7 graphs); from the second graph, buckets
    def dcn():
        return DCNv2(FIELDS, 3, hidden=[4], embedding=EmbeddingCollection(field_tables(FIELDS, 3, EmbeddingConfig()), 0))

    batches = [tiny_batch(support=s, query=4, seed=i) for i, s in enumerate((9, 11, 13, 14))]
    want = _outer_grads(MAML(inner_steps=1, inner_lr=0.3, adapt=["mlp.*"], vectorize=True), batches, dcn)
    algorithm = _compiled(MAML, ["mlp.*"], backend="eager", steps=1)
    got = _outer_grads(algorithm, batches, dcn)
    # lengths 9 and 11 one graph each, then static: 13 and 14 share the bucket of edge 14
    assert algorithm.compiled.failure is None and algorithm.compiled.static and algorithm.compiled.graphs == 3
    for (loss_g, grads_g), (loss_w, grads_w) in zip(got, want):
        assert torch.allclose(loss_g, loss_w, atol=1e-6)
        assert all(torch.allclose(grads_g[n], grads_w[n], atol=1e-5, rtol=0) for n in grads_w)


def test_micro_batches_of_other_lengths_compile_a_bounded_number_of_graphs():
    batches = _batches() + _batches()[:2]  # 4 lengths (support, query and adapted rows), then again
    marked = _compiled(MAML, ["mlp.*", "embedding.item_id"], backend="eager")  # the default: marked
    _outer_grads(marked, batches)
    assert marked.compiled.graphs == 1 and marked.compiled.failure is None
    # Dynamo's automatic dynamic shapes: a static graph for the first lengths, then one where the
    # support's row dimension is symbolic, then the query's: later lengths reuse it
    automatic = _compiled(MAML, ["mlp.*"], backend="eager", mark_dynamic=False)
    _outer_grads(automatic, batches)
    assert automatic.compiled.graphs == 3 and automatic.compiled.failure is None


def test_past_the_bound_the_runner_goes_eager_with_one_warning():
    algorithm = _compiled(MAML, ["mlp.*"], backend="eager", mark_dynamic=False, max_graphs=1)
    with pytest.warns(RuntimeWarning, match=r"meta.compile: 2 graphs compiled, more than 1") as seen:
        _outer_grads(algorithm, _batches())
    assert len([w for w in seen if "meta.compile" in str(w.message)]) == 1
    assert algorithm.compiled.graphs == 2


def test_a_failing_compiler_falls_back_to_eager_results_with_one_warning_naming_the_reason():
    def broken(graph, example_inputs):
        raise RuntimeError("No working C++ compiler found (test)\nmore lines")

    algorithm = MAML(inner_steps=2, inner_lr=0.3, adapt=["mlp.*"], vectorize=True)
    algorithm.compiled = CompiledTasks(backend=broken)
    batches = _batches()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _outer_grads(algorithm, batches)
    messages = [str(w.message) for w in seen if "meta.compile" in str(w.message)]
    assert messages == [("meta.compile: torch.compile failed (RuntimeError: No working C++ compiler found "
                         "(test)); the meta-step runs eager from here")]
    want = _outer_grads(MAML(inner_steps=2, inner_lr=0.3, adapt=["mlp.*"], vectorize=True), batches)
    for (loss_g, grads_g), (loss_w, grads_w) in zip(got, want):
        assert torch.equal(loss_g, loss_w) and all(torch.equal(grads_g[n], grads_w[n]) for n in grads_w)


def test_the_models_own_error_is_raised_not_swallowed_as_a_compile_failure():
    class Wide(torch.nn.Module):  # (N, 2) logits: the model contract's error, from eager too
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(9, 2)

        def forward(self, rows):
            return self.mlp(rows.flatten(1))

    learner = gm.meta_learner(Wide(), "maml", adapt=["mlp.*"], vectorize=True)
    learner.algorithm.compiled = CompiledTasks(backend="aot_eager")
    theta = dict(learner.net.named_parameters())
    batch = tiny_batch()
    rows = torch.randn(3, 6, 3, 3), torch.randn(3, 4, 3, 3)
    inner = learner.inner_loop()
    with pytest.raises(ConfigError, match="model output"):
        learner.algorithm.run(inner, learner.learning_rates(), theta,
                              (rows[0], batch.support_y, batch.support_mask),
                              (rows[1], batch.query_y, batch.query_mask))


def test_meta_compile_accepts_true_false_auto_and_names_itself_otherwise(monkeypatch):
    with pytest.raises(ConfigError, match=r"meta.compile: 'yes' is not one of true, false, auto"):
        config_from_dict({"meta": {"compile": "yes"}})
    with pytest.raises(ConfigError, match=r"meta.compile: expected bool or str, got 1"):
        config_from_dict({"meta": {"compile": 1}})
    assert config_from_dict({"meta": {"compile": True}}).meta.compile is True
    with pytest.raises(ConfigError, match=r"compile: 'fast' is not True"):
        gm.meta_learner(tiny_melu(), compile="fast")
    # auto is eager (measured: docs/performance.md); true compiles; the loop path cannot
    assert gm.meta_learner(tiny_melu()).algorithm.compiled is None
    monkeypatch.setattr(compiled_module, "BACKEND", "aot_eager")
    assert isinstance(gm.meta_learner(tiny_melu(), compile=True).algorithm.compiled, CompiledTasks)
    with pytest.warns(RuntimeWarning, match="meta.vectorize resolved to false"):
        loop = set_compile(MAML(1, 0.1, ["mlp.*"], vectorize=False), True)
    assert loop.compiled is None


def test_the_compile_cache_is_never_in_the_home_folder(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = use_temporary_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder
    assert not Path(folder).resolve().is_relative_to(Path.home().resolve())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    assert use_temporary_cache() == "/tmp/elsewhere"


def test_a_compiled_training_prints_its_compile_time_once_and_records_it(tmp_path, monkeypatch, capsys):
    from gmeta_ds.cli import main
    from tests.unit.test_second_run import tiny_config

    monkeypatch.setattr(compiled_module, "BACKEND", "aot_eager")
    runs = {}
    for name, setting in (("eager", False), ("compiled", True)):
        path = tiny_config(tmp_path / name)
        cfg = yaml.safe_load(path.read_text())
        cfg["meta"].update(compile=setting, vectorize=True)
        path.write_text(yaml.safe_dump(cfg))
        assert main(["train", "--config", str(path)]) == 0
        runs[name] = path.parent / "run"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("meta.compile:")]
    assert len(lines) == 1 and "compiled in" in lines[0]
    eager, compiled = (json.loads((runs[n] / "summary.json").read_text()) for n in ("eager", "compiled"))
    assert eager["compile"] == {"enabled": False}
    assert compiled["compile"]["enabled"] and compiled["compile"]["graphs"] >= 1
    assert compiled["compile"]["eager_fallback"] is None and compiled["compile"]["compile_s"] > 0
    records = [json.loads(line) for line in (runs["compiled"] / "metrics.jsonl").read_text().splitlines()]
    assert all(r["compile_s"] == compiled["compile"]["compile_s"] for r in records if "step" in r)
    assert compiled["dense_checksum"] == pytest.approx(eager["dense_checksum"], rel=1e-5)
