"""Item popularity as a logit offset of any CTR model (``model.item_popularity: true``).

The model's output becomes ``model(rows) + weight * s(item) + bias``: ``s`` is the item's
popularity statistic from the **training users only**, the same one the popularity baseline
ranks by (gmeta_ds/evaluation/baselines.py, `item_statistics`): binary labels
``s = logit((clicks + m * p) / (shown + m))`` (p the training click rate, m =
``model.popularity_prior``), ratings ``s = (sum of ratings + m * mean) / (count + m)``.
Items never seen in training and the OOV id (log sources: 0) get the global ``logit(p)``
(the mean rating). ``weight`` (initialised to 1) and ``bias`` (0) are dense parameters of the
model (``popularity.weight``, ``popularity.bias``): the outer loop learns them, and
``meta.adapt`` may name them (``popularity.*``; ``popularity.bias`` adapted is a per-user
offset, as in the baseline). So the rest of the model only has to learn each user's deviation
from popularity. With ``model.popularity_feature`` the statistic also enters the model's input:
``s * feature`` (``popularity.feature``, a learned row of ``embed_dim``, zeros at start) is
added to the item field's row (`PopularityOffset.with_feature`), so the layers can combine the
item's popularity with the user's features; `net_logits` is the whole forward.

No leakage. The counts are fitted on the training tasks (`fit`), never on validation or test
users. While training (meta-training and the non-meta baseline) a row's own interaction is
left out of its item's counts and of the global rate (``labels`` given: clicks - y, shown - 1), so a training user's
offset never encodes its own label, as a held-out user's never does. Evaluation uses the full
counts.

The counts are buffers (``popularity.shown``, ``.total``, ``.mean``, ``.rows``), saved
and loaded with the model; identical on every rank (every rank builds the same training
tasks). They index static item ids; an item field with raw ids (dynamic tables) is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from gmeta_ds.data.popularity import EPS, item_column, item_statistics, shrunk_score
from gmeta_ds.data.tasks import TaskSet
from gmeta_ds.sparse import FieldSpec, single_fields
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.inner import Params
from gmeta_ds.models.protocol import model_hooks

OFFSET_PREFIX = "popularity."  # parameter names of a model's item-popularity offset
NEWTON_STEPS = 20  # map_offset on binary labels (converged to 1e-6 from 0 on real supports)


def map_offset(z: Tensor, y: Tensor, mask: Tensor, prior: float, kind: str = "binary") -> Tensor:
    """The scalar b maximising sum_rows loglik(y | z + b) - prior * b^2 / 2 over the rows
    where ``mask`` is 1 (the popularity baseline's per-user offset, gmeta_ds/evaluation/baselines.py):
    binary labels `NEWTON_STEPS` Newton steps from 0, ratings (Gaussian) the closed form
    sum(y - z) / (rows + prior). Differentiable and vmap-compatible."""
    if kind == "regression":
        return ((y - z) * mask).sum() / (mask.sum() + prior)
    b = torch.zeros((), dtype=z.dtype, device=z.device)
    for _ in range(NEWTON_STEPS):
        p = torch.sigmoid(z + b)
        grad = ((y - p) * mask).sum() - prior * b
        hess = (p * (1.0 - p) * mask).sum() + prior
        b = b + grad / hess
    return b


class PopularityOffset(nn.Module):
    """``forward(s) = weight * s + bias`` on a statistic from `statistic` (same shape)."""

    def __init__(self, fields: list[FieldSpec], kind: str = "binary", prior: float = 10.0,
                 oov_id: int | None = 0, feature_dim: int = 0):
        super().__init__()
        self.column = item_column(fields)
        item = single_fields(fields)[self.column]
        if item.raw:
            raise ConfigError([(f"model.item_popularity: the item field {item.name!r} keeps raw ids "
                                "(data.raw_ids, a dynamic table); popularity needs a static item vocabulary")])
        if kind not in ("binary", "regression"):
            raise ConfigError([f"model.item_popularity: labels {kind!r} are neither binary nor regression"])
        self.kind, self.prior, self.oov_id = kind, float(prior), oov_id
        size = max(1, item.num_ids)
        self.register_buffer("shown", torch.zeros(size))
        self.register_buffer("total", torch.zeros(size))
        # The global mean label and the number of training rows (1-d: DeepSpeed broadcasts no 0-d tensor).
        self.register_buffer("mean", torch.full((1,), 0.5))
        self.register_buffer("rows", torch.zeros(1))
        self.weight = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))
        if feature_dim:  # model.popularity_feature: the statistic enters the model's input too
            self.feature = nn.Parameter(torch.zeros(feature_dim))

    def fit(self, train: TaskSet) -> PopularityOffset:
        """Counts from every interaction of the training tasks ``train`` (support and query)."""
        count, total, mean = item_statistics(train, self.column, oov_id=self.oov_id)
        size = len(self.shown)
        count, total = count[:size], total[:size]  # ids beyond the vocabulary: none in training
        with torch.no_grad():
            self.shown.zero_()[: len(count)] = torch.from_numpy(count).to(self.shown.dtype)
            self.total.zero_()[: len(total)] = torch.from_numpy(total).to(self.total.dtype)
            self.mean.fill_(mean)
            self.rows.fill_(train.num_interactions)
        return self

    def statistic(self, ids: Tensor, labels: Tensor | None = None) -> Tensor:
        """The popularity statistic of each row: ids (..., F_single) -> (...). ``labels`` (...):
        the rows are training rows, each left out of its own item's counts."""
        items = ids[..., self.column].long()
        known = (items >= 0) & (items < len(self.shown))
        items = torch.where(known, items, torch.zeros_like(items))
        shown = torch.where(known, self.shown[items], torch.zeros_like(self.shown[items]))
        total = torch.where(known, self.total[items], torch.zeros_like(self.total[items]))
        mean = self.mean
        if labels is not None:  # leave-one-out: only rows whose item was counted, and the global mean
            own = (shown > 0).to(shown.dtype)
            shown = shown - own
            total = total - own * labels.to(total.dtype)
            mean = (mean * self.rows - own * labels) / (self.rows - own).clamp(min=1.0)
        if self.kind == "binary":
            mean = mean.clamp(EPS, 1.0 - EPS)
        return shrunk_score(total, shown, self.prior, mean, self.kind)

    def side_input(self, ids: Tensor, labels: Tensor | None = None) -> Tensor:
        """The recipe's per-row side input (`models.protocol.TaskRecipeSource`): `statistic`."""
        return self.statistic(ids, labels)

    def task_recipe(self, settings, prefix: str) -> PopularityRecipe:
        """The inner loop's hooks (`PopularityRecipe`) for an algorithm's ``settings``: its
        ``offset_first`` and ``support_level`` priors."""
        return PopularityRecipe(self, prefix, settings.offset_first, settings.support_level)

    def forward(self, statistic: Tensor) -> Tensor:
        return self.weight * statistic + self.bias

    def with_feature(self, rows: Tensor, statistic: Tensor, feature: Tensor | None = None) -> Tensor:
        """``rows`` (..., F, d) with ``statistic * feature`` (``feature``: this offset's own, or
        an adapted copy) added to the item field's row (``model.popularity_feature``): the
        model's layers see the item's popularity next to the user's features. Unchanged when
        the offset has no feature."""
        feature = getattr(self, "feature", None) if feature is None else feature
        if feature is None:
            return rows
        c = self.column  # the item field's position among the rows (single-hot fields first)
        item = rows[..., c, :] + statistic.unsqueeze(-1).to(rows.dtype) * feature
        return torch.cat([rows[..., :c, :], item.unsqueeze(-2), rows[..., c + 1:, :]], dim=-2)


@dataclass(frozen=True)
class PopularityRecipe:
    """The popularity recipe's hooks in the inner loop (`functional.inner.TaskRecipe`): the
    offset added to the model's logits (and with ``model.popularity_feature`` the statistic in
    the item row); ``offset_prior`` (meta.offset_first λ, needs ``popularity.bias`` adapted):
    before the inner steps each task's offset bias moves to the MAP of its support
    (`offset_first`); ``level_prior`` (meta.support_level λ): after them a task's logits are
    shifted by one constant so that their mean over its support equals that of the popularity
    offset plus the task's MAP offset (`level_shift`). None = off. The task's labels are
    binary (Newton on the log-likelihood) or ratings (closed form): ``inner.kind``."""

    offset: PopularityOffset
    prefix: str = OFFSET_PREFIX
    offset_prior: float | None = None
    level_prior: float | None = None

    @property
    def before_steps(self):
        return None if self.offset_prior is None else self.offset_first

    @property
    def query_shift(self):
        return None if self.level_prior is None else self.level_shift

    def model_inputs(self, rows: Tensor, side: Tensor, own: Params) -> Tensor:
        """model.popularity_feature: the statistic enters the item row (no-op without it)."""
        return self.offset.with_feature(rows, side, own.get("feature"))

    def model_output(self, out: Tensor, side: Tensor, own: Params) -> Tensor:
        """The model's output plus the offset at the statistic ``side`` (its parameters from
        ``own`` when they adapt)."""
        return out + functional_call(self.offset, own, (side.to(out.dtype),))

    def offset_first(self, inner, fast: Params, x, y: Tensor, mask: Tensor) -> Params:
        """``fast`` with ``popularity.bias`` moved by the per-task offset the popularity baseline
        fits (gmeta_ds/evaluation/baselines.py), relative to the model's own logits z at ``fast``: b
        maximises sum_support loglik(y | z + b) - λ b^2 / 2 (binary: `NEWTON_STEPS` Newton
        steps from 0; regression: sum of residuals / (rows + λ)). So the user's level is
        explained before the inner steps, which then adapt the rest on what is left."""
        key = self.prefix + "bias"
        z = inner.logits(fast, x).detach() if inner.first_order else inner.logits(fast, x)
        b = map_offset(z, y, mask, float(self.offset_prior), inner.kind)
        if inner.first_order:
            b = b.detach()
        out = dict(fast)
        out[key] = fast[key] + b.to(fast[key].dtype)
        return out

    def level_shift(self, inner, theta: Params, fast: Params, x, y: Tensor, mask: Tensor) -> Tensor:
        """``meta.support_level``: the constant added to a task's adapted logits. With r the
        popularity offset at ``theta`` (weight * s + bias) on the support rows and b the task's
        MAP offset on them (prior precision λ, `map_offset`), it is mean_support(r + b) minus
        mean_support of the adapted logits: the adapted model ranks a task's items, the
        popularity statistic shrunk by the prior sets its level. Only support rows are used;
        the reference (r + b) carries no gradient."""
        statistic = x[1]
        own = {n[len(self.prefix):]: v.detach() for n, v in theta.items() if n.startswith(self.prefix)}
        own.pop("feature", None)
        ref = functional_call(self.offset, own, (statistic.to(y.dtype),)).detach()
        ref = ref + map_offset(ref, y, mask, float(self.level_prior), inner.kind)
        z = inner.logits(fast, x)
        n = mask.sum().clamp(min=1.0)
        return ((ref - z) * mask).sum() / n


def check_settings(offset: nn.Module | None, settings, adapted: list[str]) -> None:
    """The algorithm ``settings`` this recipe reads against the model's offset (``offset``:
    its recipe, None without one) and the ``adapted`` names: meta.support_level needs the
    offset, meta.offset_first the offset's bias adapted."""
    if settings.support_level is not None and offset is None:
        raise ConfigError(["meta.support_level: sets each task's level from the item-popularity "
                           "offset; set model.item_popularity: true"])
    if settings.offset_first is not None and OFFSET_PREFIX + "bias" not in adapted:
        raise ConfigError(["meta.offset_first: sets each task's popularity.bias before the inner steps, "
                           "so it needs model.item_popularity: true and popularity.bias adapted "
                           f"(meta.adapt, e.g. \"popularity.*\"); adapted: {', '.join(adapted)}"])


def offset_of(net: nn.Module) -> PopularityOffset | None:
    """``net``'s item-popularity offset (its recipe, read through `model_hooks`), or None."""
    recipe = model_hooks(net).recipe
    return recipe if isinstance(recipe, PopularityOffset) else None


def fit(net: nn.Module, train: TaskSet) -> None:
    """Fit ``net``'s popularity counts on the training tasks (no-op without them)."""
    pop = offset_of(net)
    if pop is not None:
        pop.fit(train)


def statistic(net: nn.Module, ids: Tensor, labels: Tensor | None = None) -> Tensor | None:
    """`PopularityOffset.statistic` of ``net``'s offset, or None when it has none."""
    pop = offset_of(net)
    return None if pop is None else pop.statistic(ids, labels)


def net_logits(net: nn.Module, rows: Tensor, ids: Tensor, labels: Tensor | None = None) -> Tensor:
    """``net``'s logits of looked-up ``rows`` (N, F, d) of ids ``ids`` (N, F_single) with its
    popularity offset, and its popularity feature in the item row (``model.popularity_feature``);
    ``labels``: training rows, each left out of its own item's counts."""
    pop = offset_of(net)
    if pop is None:
        return net(rows)
    s = pop.statistic(ids, labels)
    out = net(pop.with_feature(rows, s))
    return out + pop(s.to(out.dtype))


