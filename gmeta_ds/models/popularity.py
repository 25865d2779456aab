"""Item popularity as a logit offset of any CTR model (``model.item_popularity: true``).

The model's output becomes ``model(rows) + weight * s(item) + bias``: ``s`` is the item's
popularity statistic from the **training users only**, the same one the popularity baseline
ranks by (gmeta_ds/baselines.py, `item_statistics`): binary labels
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

import torch
from torch import Tensor, nn

from gmeta_ds.data.popularity import EPS, item_column, item_statistics, shrunk_score
from gmeta_ds.data.tasks import TaskSet
from gmeta_ds.sparse import FieldSpec, single_fields
from gmeta_ds.errors import ConfigError


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


def fit(net: nn.Module, train: TaskSet) -> None:
    """Fit ``net``'s popularity counts on the training tasks (no-op without them)."""
    pop = getattr(net, "popularity", None)
    if pop is not None:
        pop.fit(train)


def statistic(net: nn.Module, ids: Tensor, labels: Tensor | None = None) -> Tensor | None:
    """`PopularityOffset.statistic` of ``net``'s offset, or None when it has none."""
    pop = getattr(net, "popularity", None)
    return None if pop is None else pop.statistic(ids, labels)


def net_logits(net: nn.Module, rows: Tensor, ids: Tensor, labels: Tensor | None = None) -> Tensor:
    """``net``'s logits of looked-up ``rows`` (N, F, d) of ids ``ids`` (N, F_single) with its
    popularity offset, and its popularity feature in the item row (``model.popularity_feature``);
    ``labels``: training rows, each left out of its own item's counts."""
    s = statistic(net, ids, labels)
    if s is None:
        return net(rows)
    out = net(net.popularity.with_feature(rows, s))
    return out + net.popularity(s.to(out.dtype))


