"""Every call of the user's model gets the documented 3-D rows (N, F, d) (docs/api.md, the
model contract; issue 33): training (vmap and loop paths, adapted embedding rows, the
popularity offset and feature), evaluation with and without adaptation, and the non-meta
baseline. The model here relies on that shape: `nn.MultiheadAttention` over the field rows
(an AutoInt layer) accepts only 2-D or 3-D input. In-process, tiny, no process group."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import click_log
from torch import nn

import gmeta_ds as gm
from gmeta_ds.api import MetaEngine
from gmeta_ds.evaluation.baselines import finetune_predict
from gmeta_ds.evaluation.scores import MetricWarning, plain_logits, train_baseline
from gmeta_ds.models.popularity import PopularityOffset, net_logits

DIM = 4
# Under vmap, CPU flash attention runs through torch's slow fallback (issue 33 measures it).
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def _log(users: int = 20) -> pd.DataFrame:
    return click_log(users, 0, items=20)


KEYS = {"task_key": "user", "item_key": "item", "label": "click", "user_features": ["age"],
        "multi_hot": {"tags": "|"}, "label_kind": "binary", "threshold": 0.5, "query_size": 3, "seed": 1}


class AutoInt(nn.Module):
    """One self-attention layer over the F field rows: rows (N, F, d) -> (N,). Refuses any
    other rank of input, as a user's model written against the contract may."""

    def __init__(self, fields: int = 3):
        super().__init__()
        self.row_fields = ["age", "item"]
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.out = nn.Linear(fields * DIM, 1)

    def forward(self, rows):
        assert rows.dim() == 3, f"model called with rows of shape {tuple(rows.shape)}, expected (N, F, d)"
        h, _ = self.attn(rows, rows, rows, need_weights=False)
        return self.out(torch.relu(h + rows).flatten(start_dim=1)).squeeze(-1)


@pytest.fixture(scope="module")
def data():
    return gm.build_tasks(_log(), **KEYS)


def _model(data, popularity: bool = False) -> AutoInt:
    torch.manual_seed(0)
    model = AutoInt()
    model.embedding = gm.EmbeddingCollection(gm.tables_for(data.fields, DIM), seed=0)
    if popularity:  # the offset and its feature in the item row (model.popularity_feature)
        model.popularity = PopularityOffset(data.fields, feature_dim=DIM).fit(data.train)
    return model


def _engine(learner) -> MetaEngine:
    """A MetaEngine over a learner with its own tables, without DeepSpeed or a process group."""
    plan = SimpleNamespace(world_size=1, tasks_per_micro_batch=2, grad_accum_steps=1)
    return MetaEngine(SimpleNamespace(module=learner), None, [], plan, {}, 0, 0)


@pytest.mark.parametrize("algorithm, vectorize, adapt, popularity", [
    ("fomaml", True, ["out.*"], False),
    ("fomaml", False, ["out.*", "embedding.item"], False),
    ("fomaml", True, ["out.*", "embedding.item", "popularity.*"], True),
    ("reptile", False, ["out.*"], True),
    ("metasgd", True, ["out.*"], False),  # second order: through out.* only
])
def test_training_and_evaluation_call_the_model_with_3d_rows(data, algorithm, vectorize, adapt, popularity):
    model = _model(data, popularity)
    # CPU flash attention has no double backward (a torch limit, not the contract): first order,
    # or second order through the layers after the attention only.
    learner = gm.meta_learner(model, algorithm, inner_steps=1, adapt=adapt, vectorize=vectorize)
    optimizer = torch.optim.SGD(learner.parameters(), lr=0.1)
    out = learner(gm.collate(data.train, [0, 1, 2]))  # one meta-step
    out.loss.backward()
    optimizer.step()
    assert torch.isfinite(out.loss)
    engine = _engine(learner)
    with pytest.warns(MetricWarning):  # the few test users
        adapted = engine.evaluate(data.test, tasks_per_batch=2)
    with pytest.warns(MetricWarning):
        plain = engine.evaluate(data.test, inner_steps=0)
    assert adapted["query_rows"] == plain["query_rows"] > 0
    assert plain["logloss"] == plain["logloss_no_adapt"]


def test_the_baseline_trains_and_fine_tunes_on_3d_rows(data):
    net = train_baseline(_model(data), data.train, epochs=1, batch_size=16, lr=0.01, seed=0)
    baseline = gm.meta_learner(net, "fomaml", adapt=["out.*"])
    out = finetune_predict(baseline, data.test, lr=0.1, steps=1, tasks_per_batch=2)
    assert len(out["adapted"]) == len(out["plain"]) > 0 and np.isfinite(out["adapted"]).all()


def test_folding_the_tasks_changes_no_logit(data):
    """The unadapted logits of T tasks, folded into one (T·Q, F, d) call, equal one call per task."""
    net = _model(data, popularity=True)
    batch = gm.collate(data.test, [0, 1])
    rows = net.embedding.lookup_fields(batch.query_ids.reshape(-1, 2), net.row_fields,
                                       batch.query_multi).reshape(2, batch.query_ids.shape[1], 3, DIM)
    with torch.no_grad():
        folded = plain_logits(net, rows, batch.query_ids)
        each = torch.stack([net_logits(net, rows[i], batch.query_ids[i]) for i in range(2)])
    torch.testing.assert_close(folded, each)


class ColumnOut(AutoInt):
    """Breaks the contract: (N, 1) logits."""

    def forward(self, rows):
        return super().forward(rows).unsqueeze(-1)


def test_evaluation_without_adaptation_refuses_an_n_by_1_output(data):
    """The unadapted call checks the output as training does: (N, 1) would broadcast silently."""
    model = ColumnOut()
    model.embedding = gm.EmbeddingCollection(gm.tables_for(data.fields, DIM), seed=0)
    engine = _engine(gm.meta_learner(model, "fomaml", adapt=["out.*"]))
    with pytest.raises(gm.ConfigError, match=r"model output: model\(rows\) returned shape \(\d+, 1\)"):
        engine.evaluate(data.test, inner_steps=0)
