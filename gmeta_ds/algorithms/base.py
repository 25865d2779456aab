"""What every meta-learning algorithm shares: choosing the adapted parameters, the fused
embedding lookup, and the contract ``outer_loss(...) -> MetaOutput``.

Contract: ``MetaOutput.loss`` is one scalar whose gradient with respect to the meta-parameters
is the algorithm's meta-gradient, so every algorithm goes through the same
``engine.backward(loss)`` and DeepSpeed performs the outer reduction across micro-batches
and ranks (it averages, so the micro-batch loss is a mean over its tasks).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gmeta_ds.data.tasks import TaskBatch
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.inner import InnerLoop, LearningRates, Params, TaskOutputs, run_tasks


@dataclass
class MetaOutput:
    """One micro-batch's result. loss: scalar to backpropagate; the rest are detached:
    query_loss / support_loss: mean over tasks (support before adaptation);
    task_query_loss: (T,) per task, for diagnostics."""

    loss: Tensor
    query_loss: Tensor
    support_loss: Tensor
    task_query_loss: Tensor


def match_adapted(net: nn.Module, patterns: list[str]) -> list[str]:
    """Names of ``net``'s parameters matched by any glob in ``patterns`` (``meta.adapt``).

    Embedding tables are looked up before the inner loop, so adapting them would have no
    effect: patterns that match them are rejected instead of being silently ignored.
    """
    names = [n for n, _ in net.named_parameters()]
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    problems = []
    tables = [n for n in chosen if n.startswith("embedding.")]
    if tables:
        problems.append(f"meta.adapt: {patterns!r} matches embedding tables ({', '.join(tables)}); "
                        "only dense decision layers can be adapted, e.g. ['mlp.*']")
    if not chosen:
        problems.append(f"meta.adapt: {patterns!r} matches no parameter; parameters are: "
                        f"{', '.join(names)}")
    if problems:
        raise ConfigError(problems)
    return chosen


class MetaAlgorithm:
    """Base: adapt the matched parameters for ``inner_steps`` SGD steps of ``inner_lr``.

    Subclasses set ``first_order`` and may override `learning_rates`, `init_learner` and
    `outer_loss`.
    """

    first_order = False

    def __init__(self, inner_steps: int, inner_lr: float, adapt: list[str], vectorize: bool):
        self.inner_steps = inner_steps
        self.inner_lr = inner_lr
        self.adapt = list(adapt)
        self.vectorize = vectorize

    def init_learner(self, learner: "MetaLearner") -> None:
        """Add algorithm-owned meta-parameters to the learner (none by default)."""

    def learning_rates(self, learner: "MetaLearner") -> LearningRates:
        return {n: self.inner_lr for n in learner.adapted}

    def inner_loop(self, net: nn.Module, steps: int | None = None,
                   first_order: bool | None = None) -> InnerLoop:
        return InnerLoop(net, steps or self.inner_steps,
                         self.first_order if first_order is None else first_order)

    def run(self, learner: "MetaLearner", support: tuple, query: tuple,
            query_fast=lambda f: f) -> TaskOutputs:
        params = dict(learner.net.named_parameters())
        theta: Params = {n: params[n] for n in learner.adapted}
        return run_tasks(self.inner_loop(learner.net), theta, self.learning_rates(learner),
                         support, query, self.vectorize, query_fast)

    def outer_loss(self, learner: "MetaLearner", support: tuple, query: tuple) -> MetaOutput:
        """Default (MAML family): the mean query loss after adaptation."""
        out = self.run(learner, support, query)
        return _output(out.query_loss.mean(), out)


def _output(loss: Tensor, out: TaskOutputs) -> MetaOutput:
    return MetaOutput(loss, out.query_loss.detach().mean(), out.support_loss.mean(),
                      out.query_loss.detach())


def embed_batch(lookup, batch: TaskBatch) -> tuple[Tensor, Tensor]:
    """One fused lookup of support and query ids with ``lookup`` (ids (N, F) -> (N, F, d)):
    (T, S, F) + (T, Q, F) -> rows (T, S, F, d), (T, Q, F, d)."""
    t, s, f = batch.support_ids.shape
    ids = torch.cat([batch.support_ids.reshape(-1, f), batch.query_ids.reshape(-1, f)])
    rows = lookup(ids)
    return rows[: t * s].reshape(t, s, f, -1), rows[t * s:].reshape(t, -1, f, rows.shape[-1])


class MetaLearner(nn.Module):
    """The dense module handed to DeepSpeed: the model plus algorithm-owned meta-parameters.

    ``forward(batch)`` looks up support and query ids in one fused call, then runs the
    algorithm; it returns a `MetaOutput`.
    """

    def __init__(self, net: nn.Module, algorithm: MetaAlgorithm):
        super().__init__()
        self.net = net
        self.algorithm = algorithm
        self.adapted = match_adapted(net, algorithm.adapt)
        algorithm.init_learner(self)

    def forward(self, batch: TaskBatch, rows: tuple[Tensor, Tensor] | None = None) -> MetaOutput:
        """``rows``: support and query rows looked up outside (sharded tables); by default the
        net's own embedding module looks them up."""
        rows_s, rows_q = rows if rows is not None else embed_batch(self.net.embed, batch)
        support = (rows_s, batch.support_y, batch.support_mask)
        query = (rows_q, batch.query_y, batch.query_mask)
        return self.algorithm.outer_loss(self, support, query)
