"""The adaptation core: adapt a batch of users on their support rows and score their candidates,
with the functions training's and evaluation's inner loop run, in one process, without
DeepSpeed or a process group.

Every entry point of the training code that serving calls is in this module (the meta-learner
and its inner loop, the fused lookup, the rows adapted per field, the label kind's link), so
that moving those names means editing this file only.

Adaptation is `gmeta_ds.evaluation.scores.predict`'s, split in two so that its result can be cached
per user: `Adapter.adapt` runs the first-order inner loop (``serving.inner_steps`` steps, the
learned or configured rates) vectorised over the users with `torch.func.vmap` and keeps each
user's adapted parameters (`Adapted`); `Adapter.score` scores candidates with them. The
adapted rows of ``embedding.<field>`` are kept as (ids, rows) of the ids the user's support
holds (the inner loop leaves every other row as it was), and ``meta.support_level``'s shift,
which depends on the support only, as one number.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import vmap

from gmeta_ds.algorithms.base import MetaLearner, embed_batch, embedder
from gmeta_ds.data.tasks import TaskBatch
from gmeta_ds.functional.inner import PREDICTIONS, row_param_name, unique_rows
from gmeta_ds.models.protocol import model_hooks
from gmeta_ds.saved import saved_learner
from gmeta_ds.serving.export import Export
from gmeta_ds.sparse import Jagged


@dataclass
class Padded:
    """B users' rows padded to the longest: ids (B, N, F_single) int64, labels and mask (B, N)
    float32, multi (multi-hot field -> `Jagged` over the B*N rows, padding rows empty)."""

    ids: Tensor
    labels: Tensor
    mask: Tensor
    multi: dict[str, Jagged] = field(default_factory=dict)


@dataclass
class Adapted:
    """One user's adapted parameters: ``dense`` (adapted name -> tensor), ``rows`` (adapted
    row parameter -> (ids, rows) of the ids in the user's support), ``shift`` (a scalar added
    to every logit: ``meta.support_level``, else 0)."""

    dense: dict[str, Tensor]
    rows: dict[str, tuple[Tensor, Tensor]]
    shift: Tensor

    @property
    def nbytes(self) -> int:
        tensors = [*self.dense.values(), *(t for pair in self.rows.values() for t in pair), self.shift]
        return sum(t.numel() * t.element_size() for t in tensors)


def build_learner(export: Export, model: nn.Module | Callable | None) -> MetaLearner:
    """The meta-learner of ``export`` holding its mapped weights: the model is ``model`` (a
    module, or a function of the saved fields), else rebuilt from the export's recipe. A model
    without tables gets the export's tables as they lie in the file (`mapped_tables`), so a
    large table is never allocated, initialised or copied."""
    from gmeta_ds.saved import built_model, check_architecture, fit_dynamic_tables

    net = built_model(model, export.fields) if model is not None else _recipe_model(export)
    if model_hooks(net).embedding is None and any(k.startswith("net.embedding.") for k in export.state):
        net.embedding = mapped_tables(export)
    learner = saved_learner(net, export.meta["algorithm"], export.path / "model.json")
    fit_dynamic_tables(learner, export.state)
    check_architecture(learner, export.state, net, export.path, export.meta.get("model"))
    learner.load_state_dict(export.state, assign=True)
    return learner.eval()


def mapped_tables(export: Export) -> nn.Module:
    """An `EmbeddingCollection` of the export's tables whose static weights are the mapped
    tensors themselves (dynamic tables, small, are built and loaded as usual)."""
    from gmeta_ds.embedding.tables import EmbeddingCollection, feature_tables
    from gmeta_ds.errors import ConfigError
    from gmeta_ds.saved import META, WEIGHTS

    tables = export.meta["tables"]
    prefix = "net.embedding.weights."
    missing = [t.name for t in tables if t.kind == "static" and prefix + t.name not in export.state]
    if missing:  # a model.json edited apart from its weights: refused naming both files, not a KeyError
        held = sorted(k[len(prefix):] for k in export.state if k.startswith(prefix))
        raise ConfigError([(f"{export.path / META}: 'tables' names {', '.join(missing)[:200]}, which {WEIGHTS} does "
                            f"not hold (its tables: {', '.join(held)[:200] or 'none'})")], "gmeta_ds.serving")
    collection = EmbeddingCollection([t for t in tables if t.kind == "dynamic"])
    collection.tables = {t.name: t for t in tables}
    collection.by_feature = feature_tables(tables)
    for t in tables:
        if t.kind == "static":
            collection.weights[t.name] = nn.Parameter(export.state[f"net.embedding.weights.{t.name}"])
    return collection


def _recipe_model(export: Export) -> nn.Module:
    """The zoo model of the export's recipe (``gmeta-ds export --config``)."""
    from gmeta_ds.config import config_from_dict
    from gmeta_ds.errors import ConfigError
    from gmeta_ds.models import build_model

    recipe = export.serving.get("recipe")
    if not isinstance(recipe, dict):
        raise ConfigError([f"{export.path}: this export holds no recipe to rebuild its model from (it was "
                           "saved through the Python API): pass the model, gm.load_adapter(path, model), or "
                           "gmeta-ds serve --model MODULE:FUNCTION"], "gmeta_ds.serving")
    lacking = [key for key in ("model", "embedding", "kind", "oov_id") if key not in recipe]
    if lacking:  # an edited model.json: refused naming the key, not a KeyError
        raise ConfigError([(f"{export.path / 'model.json'}: 'serving.recipe' lacks {', '.join(lacking)}; "
                            "export the run again (gmeta-ds export WEIGHTS OUT --config RUN.yaml --overwrite)")],
                          "gmeta_ds.serving")
    cfg = config_from_dict({"model": recipe["model"], "embedding": recipe["embedding"]}, f"{export.path}/model.json")
    return build_model(cfg.model, export.fields, cfg.embedding, 0, False, kind=recipe["kind"],
                       oov_id=recipe["oov_id"])


class Adapter:
    """Adapt and score for one loaded export (`build_learner`'s learner)."""

    def __init__(self, learner: MetaLearner, inner_steps: int):
        self.learner = learner
        self.net = learner.net
        algorithm = learner.algorithm
        self.inner_steps = inner_steps
        self.inner = learner.inner_loop(inner_steps, first_order=True)
        self.lrs = {n: (lr.detach() if isinstance(lr, Tensor) else lr) for n, lr in learner.learning_rates().items()}
        self.to_pred = PREDICTIONS[algorithm.kind]
        self.lookup = embedder(self.net)
        self.recipe = model_hooks(self.net).recipe  # its side input (the popularity statistic), or None

    def initial(self) -> Adapted:
        """The meta-initialisation as a user's parameters (a user with no support)."""
        params = dict(self.net.named_parameters())
        return Adapted({n: params[n].detach() for n in self.learner.adapted}, {}, torch.zeros(()))

    def adapt(self, support: Padded) -> list[Adapted]:
        """Each user's parameters after the inner loop on its support rows (vectorised)."""
        if self.inner_steps == 0:
            return [self.initial() for _ in range(len(support.ids))]
        batch = TaskBatch(support.ids, support.labels, support.mask, support.ids, support.labels, support.mask,
                          torch.arange(len(support.ids)), support.multi, support.multi)
        with torch.no_grad():
            rows_s, rows_q = embed_batch(self.lookup, batch)
            theta, inputs, _ = self.learner.task_inputs(batch, rows_s, rows_q)
        theta = {n: v.detach() for n, v in theta.items()}
        inner, lrs = self.inner, self.lrs
        query_shift = None if inner.recipe is None else inner.recipe.query_shift

        def one(xs, ys, ms):
            fast, _ = inner.adapt_func(theta, lrs, xs, ys, ms)
            shift = query_shift(inner, theta, fast, xs, ys, ms) if query_shift is not None else ys.sum() * 0
            return fast, shift

        fast, shift = vmap(one)(*inputs)
        fast = {n: v.detach() for n, v in fast.items()}
        return [self._entry(fast, shift.detach()[i], support, i) for i in range(len(support.ids))]

    def _entry(self, fast: dict[str, Tensor], shift: Tensor, support: Padded, i: int) -> Adapted:
        """User ``i``'s `Adapted` out of the batch's adapted parameters."""
        rows = {}
        for j, name in self.learner.adapted_fields.items():
            key = row_param_name(name)
            batch_ids = torch.unique(support.ids[..., j])  # the order `unique_rows` gave the rows
            mine = torch.unique(support.ids[i][support.mask[i] > 0][:, j])
            rows[key] = (mine, fast[key][i, torch.searchsorted(batch_ids, mine)].clone())
        return Adapted({n: fast[n][i].clone() for n in self.learner.adapted}, rows, shift)

    @torch.no_grad()
    def score(self, users: list[Adapted], candidates: Padded) -> Tensor:
        """Predictions (probabilities; ratings for regression) of each user's candidates with
        its adapted parameters: (B, C)."""
        b, c, f = candidates.ids.shape
        flat = self.lookup(candidates.ids.reshape(b * c, f), candidates.multi)
        rows = flat.reshape(b, c, *flat.shape[1:])
        fast = {n: torch.stack([u.dense[n] for u in users]) for n in self.learner.adapted}
        x = rows
        if self.learner.adapted_fields:
            table, index = self._row_inputs(users, candidates.ids, rows)
            fast.update(table)
            x = (rows, index)
        if self.recipe is not None:
            x = (x, self.recipe.side_input(candidates.ids, None))
        shift = torch.stack([u.shift for u in users])
        inner = self.inner
        logits = vmap(lambda fa, s, xq: inner.logits(fa, xq) + s)(fast, shift, x)
        return self.to_pred(logits)

    def _row_inputs(self, users: list[Adapted], ids: Tensor, rows: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """The candidates' rows of adapted fields, deduplicated (`unique_rows`) and per user
        replaced by its adapted rows where its support held the id: ({name: (B, M, d)}, index)."""
        fields = self.learner.adapted_fields
        base, index, _ = unique_rows(ids, ids, rows, rows, fields)
        table = {}
        for j, name in fields.items():
            key = row_param_name(name)
            uniq = torch.unique(ids[..., j])
            per_user = base[key].expand(len(users), *base[key].shape).clone()
            for i, user in enumerate(users):
                if key not in user.rows:
                    continue
                mine, adapted = user.rows[key]
                pos = torch.searchsorted(uniq, mine).clamp(max=len(uniq) - 1)
                hit = uniq[pos] == mine
                per_user[i, pos[hit]] = adapted[hit]
            table[key] = per_user
        return table, index
