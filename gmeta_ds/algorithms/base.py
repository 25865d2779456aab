"""What every meta-learning algorithm shares: choosing the adapted parameters, the fused
embedding lookup, and the contract ``outer_loss(...) -> MetaOutput``. A `MetaAlgorithm`
receives data (the inner loop, rates, parameters, the tasks' tensors), never the learner;
`MetaLearner` reads the model's hooks (`models.protocol.model_hooks`) and calls it.

Contract: ``MetaOutput.loss`` is one scalar whose gradient with respect to the meta-parameters
is the algorithm's meta-gradient, so every algorithm goes through the same
``engine.backward(loss)`` and DeepSpeed performs the outer reduction across micro-batches
and ranks (it averages, so the micro-batch loss is a mean over its tasks).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import Tensor, nn

from gmeta_ds.data.tasks import TaskBatch
from gmeta_ds.sparse import Jagged
from gmeta_ds.errors import ConfigError
from gmeta_ds.algorithms.contract import (  # noqa: F401 - the contract checks, re-exported here
    CONTRACT_ERRORS, PROBE_ROWS, check_id_columns, check_row_fields, check_task_fields, model_contract, probe_model)
from gmeta_ds.functional.inner import (
    ROW_PREFIX, InnerLoop, InnerSettings, LearningRates, Params, TaskOutputs, TaskRecipe, row_param_name,
    run_tasks, supervised_tasks, unique_rows)
from gmeta_ds.functional.compiled import CompiledTasks
from gmeta_ds.functional.split import BodySplit, HeadModule, body_features
from gmeta_ds.models import popularity
from gmeta_ds.models.protocol import EMBEDDING_ATTR, model_hooks


HALF = (torch.bfloat16, torch.float16)
NET_PREFIX = "net."  # the model's names in the learner's state dict (`MetaLearner.net`)
EMBEDDING_PREFIX = f"{NET_PREFIX}{EMBEDDING_ATTR}."  # those of the model's own tables


@dataclass
class MetaOutput:
    """One micro-batch's result. loss: scalar to backpropagate; the rest are detached:
    query_loss / support_loss: mean over tasks (support before adaptation);
    task_query_loss: (T,) per task, for diagnostics.

    Args:
        loss: the scalar the engine backpropagates.
        query_loss: the mean query loss over the tasks (detached).
        support_loss: the mean support loss before adaptation (detached).
        task_query_loss: (T,) each task's query loss (detached).
    """

    loss: Tensor
    query_loss: Tensor
    support_loss: Tensor
    task_query_loss: Tensor


def adapt_candidates(net: nn.Module) -> tuple[list[str], list[str]]:
    """What ``meta.adapt`` globs may select: (dense parameter names, single-hot field names).

    Candidates are the dense parameters (e.g. ``mlp.0.weight``) and, per feature field, its
    looked-up rows (``embedding.<field>``, see functional/inner.py). Whole tables
    (``embedding.weights.*``) are never candidates: they are looked up before the inner loop.
    """
    dense = [n for n, _ in net.named_parameters() if not n.startswith(ROW_PREFIX)]
    return dense, list(model_hooks(net).row_fields or [])


def _candidate_names(net: nn.Module) -> list[str]:
    """`adapt_candidates` as the names the globs match (rows as ``embedding.<field>``)."""
    dense, fields = adapt_candidates(net)
    return dense + [row_param_name(f) for f in fields]


def shown_candidates(net: nn.Module) -> str:
    """The adapt candidates of ``net`` as one line (the first 12), for error messages."""
    candidates = _candidate_names(net)
    more = f", ... ({len(candidates) - 12} more)" if len(candidates) > 12 else ""
    return ", ".join(candidates[:12]) + more


def unmatched_patterns(net: nn.Module, patterns: list[str]) -> list[str]:
    """The ``patterns`` that select no adapt candidate of ``net`` (a typo, or a glob of
    another model)."""
    names = _candidate_names(net)
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]


def match_adapted(net: nn.Module, patterns: list[str]) -> tuple[list[str], dict[int, str]]:
    """What ``meta.adapt`` globs select: (dense parameter names, {field position: field name})
    among `adapt_candidates`."""
    dense, fields = adapt_candidates(net)
    matches = lambda n: any(fnmatch.fnmatchcase(n, p) for p in patterns)  # noqa: E731
    chosen = [n for n in dense if matches(n)]
    rows = {j: f for j, f in enumerate(fields) if matches(row_param_name(f))}
    if not chosen and not rows:
        raise ConfigError([f"meta.adapt: {patterns!r} matches nothing; candidates are: "
                           f"{shown_candidates(net)}"])
    return chosen, rows


def _optional_prior(key: str, value, kind: str) -> "float | None":
    """A per-task offset prior (None, or a number >= 0, for binary or rating labels)."""
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and value >= 0):
        raise ConfigError([f"{key}: {value!r} must be null or a number >= 0"])
    if kind not in ("binary", "regression"):
        raise ConfigError([f"{key}: fits a per-task offset for binary or regression labels, not {kind!r}"])
    return float(value)


@dataclass(frozen=True, kw_only=True)
class AlgorithmSettings:
    """Everything an algorithm is built from, by keyword, once (`MetaAlgorithm.from_settings`):
    the run config's ``meta`` section, `gmeta_ds.meta_learner`'s arguments and a saved model's
    ``model.json`` all go through it."""

    inner_steps: int
    inner_lr: float
    adapt: list[str]
    vectorize: bool
    kind: str = "binary"
    split_body: "bool | str" = "auto"
    inner_lr_scale: "dict[str, float] | None" = None
    inner_loss_prior: float = 0.0
    offset_first: "float | None" = None
    support_level: "float | None" = None
    rank_weight: float = 0.0
    warmup_steps: int = 0
    init_weight: float = 0.0


class MetaAlgorithm:
    """Base: adapt the matched parameters for ``inner_steps`` SGD steps of ``inner_lr``.

    Subclasses set ``first_order`` and may override `learning_rates`, `meta_parameters` and
    `outer_loss`. The methods take data (parameters, rates, tasks' tensors, the model's hooks),
    never the `MetaLearner`, which calls them. `gmeta_ds.meta_learner` builds one from a name.

    Args:
        inner_steps: SGD steps on each task's support set (``meta.inner_steps``).
        inner_lr: their learning rate (``meta.inner_lr``).
        adapt: globs over the parameter names (and ``embedding.<field>``) the inner loop adapts.
        vectorize: run a micro-batch's tasks under vmap (True) or one by one (False).
        kind: the labels: ``binary`` (BCE on logits), ``regression`` (MSE) or ``multiclass``.
        split_body: run the non-adapted body once per micro-batch: True, False or ``"auto"``.
        inner_lr_scale: glob over adapted names -> multiplier of ``inner_lr`` (first match);
            None: x1 everywhere.
        inner_loss_prior: rows added to the support loss's divisor, >= 0 (0: the mean).
        offset_first: the prior λ of the per-task popularity offset set before the inner
            steps (binary or regression); None: off.
        support_level: the prior λ of the level shift after the inner steps; None: off.
        rank_weight: weight of the pairwise ranking term of the query loss, >= 0.
        warmup_steps: first meta-steps trained without adaptation, >= 0.
        init_weight: weight of the unadapted model's loss added to the outer loss, >= 0.

    Raises:
        ConfigError: a negative prior or weight, a ranking loss on labels without an order, or
            an offset prior on labels other than binary or regression, naming the ``meta.*`` key.
    """

    first_order = False
    # meta.compile: the vmap path under torch.compile (`functional.compiled.CompiledTasks`), set
    # from outside by whoever builds the algorithm (`build_algorithm`, `gm.meta_learner`); None: eager.
    compiled: CompiledTasks | None = None

    def __init__(self, inner_steps: int, inner_lr: float, adapt: list[str], vectorize: bool,
                 kind: str = "binary", split_body: "bool | str" = "auto",
                 inner_lr_scale: "dict[str, float] | None" = None, inner_loss_prior: float = 0.0,
                 offset_first: "float | None" = None, support_level: "float | None" = None,
                 rank_weight: float = 0.0, warmup_steps: int = 0, init_weight: float = 0.0):
        self.inner_steps = inner_steps
        self.inner_lr = inner_lr
        self.adapt = list(adapt)
        # meta.inner_lr_scale: glob over adapted names -> multiplier of inner_lr (first match)
        self.inner_lr_scale = dict(inner_lr_scale or {})
        # meta.inner_loss_prior: support loss = sum / (rows + prior) (`InnerLoop.support_loss`)
        if not inner_loss_prior >= 0.0:
            raise ConfigError([f"meta.inner_loss_prior: {inner_loss_prior!r} must be a number >= 0"])
        self.inner_loss_prior = float(inner_loss_prior)
        # meta.rank_weight: the query loss's pairwise ranking term (`InnerLoop.query_loss`)
        if not (isinstance(rank_weight, (int, float)) and rank_weight >= 0.0):
            raise ConfigError([f"meta.rank_weight: {rank_weight!r} must be a number >= 0"])
        if rank_weight and kind not in ("binary", "regression"):
            raise ConfigError([f"meta.rank_weight: orders a task's rows by their labels; labels of kind "
                               f"{kind!r} have no order (binary or regression only)"])
        self.rank_weight = float(rank_weight)
        # meta.warmup_steps: the first meta-steps train without adaptation (`supervised_loss`);
        # ``warming_up`` is set for each meta-step by the engine that counts them
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError([f"meta.warmup_steps: {warmup_steps!r} must be an integer >= 0"])
        self.warmup_steps = warmup_steps
        # meta.init_weight: the unadapted model's loss on every row, added to the outer loss
        if isinstance(init_weight, bool) or not (isinstance(init_weight, (int, float)) and init_weight >= 0.0):
            raise ConfigError([f"meta.init_weight: {init_weight!r} must be a number >= 0"])
        self.init_weight = float(init_weight)
        self.warming_up = False
        # meta.offset_first: the prior λ of the per-task offset set before the inner steps
        # (`InnerLoop.offset_first`); meta.support_level: that of `InnerLoop.level_shift`
        self.offset_first = _optional_prior("meta.offset_first", offset_first, kind)
        self.support_level = _optional_prior("meta.support_level", support_level, kind)
        self.vectorize = vectorize
        self.kind = kind  # "binary" (click, BCE) or "regression" (rating, MSE)
        self.split_body = split_body  # meta.split_body: auto | true | false (`engine.parallelize`)
        # the inner loop's own settings, built once (`inner_loop`)
        self.inner = InnerSettings(steps=inner_steps, first_order=self.first_order, kind=kind,
                                   support_prior=self.inner_loss_prior, rank_weight=self.rank_weight)

    @classmethod
    def from_settings(cls, settings: AlgorithmSettings) -> "MetaAlgorithm":
        """The algorithm of ``settings`` (every field by keyword)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})

    def settings(self) -> AlgorithmSettings:
        """This algorithm's `AlgorithmSettings` (what `from_settings` rebuilds it from)."""
        return AlgorithmSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(AlgorithmSettings)})

    def meta_parameters(self, *, params: Params, adapted: list[str], rows: list[str],
                        embed_dim) -> dict[str, nn.Module]:
        """Algorithm-owned meta-parameters for the learner, by attribute name (none by default):
        ``params`` the model's parameters, ``adapted`` the adapted ones' names, ``rows`` the
        adapted rows' names (``embedding.<field>``), ``embed_dim`` the model's (or None).

        Args:
            params: the model's parameters by name.
            adapted: the names of the adapted dense parameters.
            rows: the names of the adapted rows (``embedding.<field>``).
            embed_dim (int | None): the model's embedding dimension, or None when it states none.

        Returns:
            Attribute name -> module the learner holds (and DeepSpeed trains); {} here.
        """
        return {}

    def rate(self, name: str) -> float:
        """The inner learning rate of the adapted ``name``: ``inner_lr`` times the multiplier of
        the first ``inner_lr_scale`` glob that matches it (x1 when none does).

        Args:
            name: an adapted parameter's (or row's) name.

        Returns:
            Its inner learning rate.
        """
        scales = (s for p, s in self.inner_lr_scale.items() if fnmatch.fnmatchcase(name, p))
        return self.inner_lr * next(scales, 1.0)

    def learning_rates(self, names: list[str], owned: "dict[str, nn.Module] | None" = None) -> LearningRates:
        """The inner learning rate of each adapted name in ``names``; ``owned``: the learner's
        algorithm-owned modules (`meta_parameters`).

        Args:
            names: the adapted names (`MetaLearner.adapted_names`).
            owned: the learner's algorithm-owned modules; not read here.

        Returns:
            Name -> its rate (`rate`).
        """
        return {n: self.rate(n) for n in names}

    def inner_loop(self, net: nn.Module, *, row_fields: dict[int, str], recipe: TaskRecipe | None = None,
                   split: BodySplit | None = None, steps: int | None = None,
                   first_order: bool | None = None) -> InnerLoop:
        """The inner loop on ``net`` (adapted rows of ``row_fields``, the model's ``recipe``), or
        on the head of the body ``split``, whose inputs are the body's features; ``steps`` and
        ``first_order`` override this algorithm's (evaluation adapts first order).

        Args:
            net: the single-device model.
            row_fields: field position -> name of the fields whose looked-up rows adapt.
            recipe: the model's inner-loop hooks (the popularity offset); None: none.
            split: a body split whose head alone runs in the inner loop; None: the whole net.
            steps: inner steps; None: ``inner_steps``.
            first_order: detach the inner gradients; None: this algorithm's ``first_order``.

        Returns:
            The `InnerLoop`.
        """
        module, prefix = (net, "") if split is None else (HeadModule(net, split), HeadModule.PREFIX)
        settings = self.inner
        if steps is not None or first_order is not None:
            settings = dataclasses.replace(settings, steps=settings.steps if steps is None else steps,
                                           first_order=settings.first_order if first_order is None else first_order)
        return InnerLoop(module=module, settings=settings, row_fields=row_fields, prefix=prefix, recipe=recipe)

    def run(self, inner: InnerLoop, lrs: LearningRates, theta: Params, support: tuple, query: tuple,
            detach_query: bool = False) -> TaskOutputs:
        """The T tasks of a micro-batch (with a body split their inputs are features);
        ``detach_query``: the query loss at the adapted params detached (first order, Reptile).

        Args:
            inner: the inner loop (`inner_loop`).
            lrs: adapted name -> inner learning rate (`learning_rates`).
            theta: the adapted meta-parameters by name (dense parameters and rows).
            support: the support inputs (x, labels (T, S), mask (T, S)) of the T tasks.
            query: the query inputs (x, labels (T, Q), mask (T, Q)).
            detach_query: detach the query loss's graph from the adapted parameters.

        Returns:
            The `TaskOutputs`: (T,) query and support losses and the adapted parameters.
        """
        if self.compiled is not None and self.vectorize:
            return self.compiled(inner, theta, lrs, support, query, detach_query)
        return run_tasks(inner, theta, lrs, support, query, self.vectorize, detach_query)

    def supervised_loss(self, inner: InnerLoop, theta: Params, support: tuple, query: tuple) -> MetaOutput:
        """A warm-up meta-step (``meta.warmup_steps``): no inner loop, the unadapted model's
        loss over every row of the tasks (support and query), as the non-meta baseline trains;
        its gradient is plain supervised training's, through the same engine and optimizers.

        Args:
            inner: the inner loop, whose model and loss are used (no step is taken).
            theta: the meta-parameters by name, as the model's.
            support: the support inputs (x, labels (T, S), mask (T, S)) of the T tasks.
            query: the query inputs (x, labels (T, Q), mask (T, Q)).

        Returns:
            The `MetaOutput`; its loss is the mean over every row.
        """
        loss, support_loss, query_loss = supervised_tasks(inner, theta, support, query, self.vectorize)
        return MetaOutput(loss.mean(), query_loss.detach().mean(), support_loss.detach().mean(),
                          query_loss.detach())

    def anchored_loss(self, inner: InnerLoop, lrs: LearningRates, theta: Params, support: tuple,
                      query: tuple) -> MetaOutput:
        """`outer_loss`, plus ``init_weight`` x `supervised_loss` when that is set: the
        unadapted model is asked to predict every row of its tasks too, so meta-training cannot
        trade the initialisation's own ranking for adaptability.

        Args:
            inner: passed to `outer_loss` and `supervised_loss`.
            lrs: passed to `outer_loss`.
            theta: the adapted meta-parameters, the same for both losses.
            support: the tasks' support inputs, for both losses.
            query: the tasks' query inputs, for both losses.

        Returns:
            The `MetaOutput` of `outer_loss`, its loss with the anchor added.
        """
        out = self.outer_loss(inner, lrs, theta, support, query)
        if not self.init_weight:
            return out
        anchor = self.supervised_loss(inner, theta, support, query)
        return dataclasses.replace(out, loss=out.loss + self.init_weight * anchor.loss)

    def outer_loss(self, inner: InnerLoop, lrs: LearningRates, theta: Params, support: tuple,
                   query: tuple) -> MetaOutput:
        """Default (MAML family): the mean query loss after adaptation. ``theta``: the
        meta-parameters that adapt (dense parameters and deduplicated rows).

        Args:
            inner: the inner loop (`inner_loop`).
            lrs: adapted name -> inner learning rate.
            theta: the adapted meta-parameters by name.
            support: the support inputs (x, labels (T, S), mask (T, S)) of the T tasks.
            query: the query inputs (x, labels (T, Q), mask (T, Q)).

        Returns:
            The `MetaOutput`; its loss is the mean query loss after adaptation.
        """
        out = self.run(inner, lrs, theta, support, query)
        return meta_output(out.query_loss.mean(), out)


def meta_output(loss: Tensor, out: TaskOutputs) -> MetaOutput:
    return MetaOutput(loss, out.query_loss.detach().mean(), out.support_loss.mean(),
                      out.query_loss.detach())


def fused_ids(batch: TaskBatch) -> tuple[Tensor, dict[str, Jagged]]:
    """The ids of one fused lookup of support and query: single-valued ids (T*S + T*Q, F_single)
    and each multi-hot feature's bags (support's, then query's)."""
    f = batch.support_ids.shape[-1]
    ids = torch.cat([batch.support_ids.reshape(-1, f), batch.query_ids.reshape(-1, f)])
    multi = {name: concat_jagged(bags, batch.query_multi[name]) for name, bags in batch.support_multi.items()}
    return ids, multi


def split_rows(rows: Tensor, batch: TaskBatch) -> tuple[Tensor, Tensor]:
    """The rows (N, F, d) of a `fused_ids` lookup back into support (T, S, F, d) and query
    (T, Q, F, d)."""
    t, s, _ = batch.support_ids.shape
    width = rows.shape[1]
    return rows[: t * s].reshape(t, s, width, -1), rows[t * s:].reshape(t, -1, width, rows.shape[-1])


def embed_batch(lookup, batch: TaskBatch) -> tuple[Tensor, Tensor]:
    """One fused lookup of support and query ids with a module's own ``lookup(ids (N, F_single),
    multi) -> (N, F, d)`` (`embedder`): rows (T, S, F, d), (T, Q, F, d). Tables outside the
    module (sharded) are looked up by their owner between `fused_ids` and `split_rows`."""
    return split_rows(lookup(*fused_ids(batch)), batch)


def embedder(net: nn.Module):
    """The net's lookup ``(ids (N, F_single), multi) -> rows (N, F, d)``: its own ``embed``,
    else its ``embedding`` collection (`EmbeddingCollection`) over its ``row_fields``."""
    hooks = model_hooks(net)
    if hooks.embed is not None:
        return hooks.embed
    collection = hooks.embedding
    if collection is None:
        raise RuntimeError(f"{type(net).__name__} has no embedding tables (no `embed` method and no "
                           "`embedding` collection): its tables are sharded, so pass looked-up rows")
    return lambda ids, multi: collection.lookup_fields(ids, list(hooks.row_fields), multi)


def concat_jagged(a: Jagged, b: Jagged) -> Jagged:
    """The bags of ``a`` followed by those of ``b``."""
    return Jagged(torch.cat([a.values, b.values]), torch.cat([a.offsets, b.offsets[1:] + a.offsets[-1]]))


class MetaLearner(nn.Module):
    """The dense module handed to DeepSpeed: the model plus algorithm-owned meta-parameters.

    ``forward(batch)`` looks up support and query ids in one fused call, then runs the
    algorithm; it returns a `MetaOutput`.

    How the training forward runs is plain state set from outside, before an engine wraps the
    learner (`gmeta_ds.engine.parallelize`), never decided here: ``active_split``, the model's
    body split (`functional.split`) that runs the body once on every task's rows and the inner
    loop on the head only (None: the whole model in the inner loop); ``runner``, a callable
    ``runner(learner, batch, rows) -> MetaOutput`` that `forward` runs instead of `meta_forward`
    (None: `meta_forward`).

    Args:
        net: the single-device model (`gmeta_ds.models.protocol`'s contract).
        algorithm: the `MetaAlgorithm` that adapts and scores it.

    Raises:
        ConfigError: an ``adapt`` or ``inner_lr_scale`` glob that matches nothing, or
            settings the model cannot take (its ``row_fields``, its popularity offset).
    """

    batch_type: ClassVar[type] = TaskBatch  # the micro-batch `forward` takes (the engine checks its input by it)
    active_split: BodySplit | None = None
    runner: Callable[[MetaLearner, TaskBatch, tuple | None], MetaOutput] | None = None

    def __init__(self, net: nn.Module, algorithm: MetaAlgorithm):
        super().__init__()
        self.net = net
        self.algorithm = algorithm
        self.adapted, self.adapted_fields = match_adapted(net, algorithm.adapt)
        names = self.adapted_names()
        unmatched = [p for p in algorithm.inner_lr_scale if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if unmatched:
            raise ConfigError([f"meta.inner_lr_scale: {unmatched!r} matches no adapted parameter; adapted: "
                               f"{', '.join(names)}"])
        hooks = model_hooks(net)
        popularity.check_settings(hooks.recipe, algorithm.settings(), names)
        check_row_fields(net)
        owned = algorithm.meta_parameters(params=dict(net.named_parameters()), adapted=self.adapted,
                                          rows=names[len(self.adapted):], embed_dim=hooks.embed_dim)
        for name, module in owned.items():
            setattr(self, name, module)

    def adapted_names(self) -> list[str]:
        """Names of everything the inner loop adapts: dense parameters, then field rows."""
        return self.adapted + [row_param_name(f) for f in self.adapted_fields.values()]

    def learning_rates(self) -> LearningRates:
        """The algorithm's inner learning rate of every adapted name (with its own modules:
        every child of this learner but the net)."""
        owned = {n: m for n, m in self.named_children() if n != "net"}
        return self.algorithm.learning_rates(self.adapted_names(), owned)

    def inner_loop(self, steps: int | None = None, first_order: bool | None = None,
                   split: BodySplit | None = None) -> InnerLoop:
        """The algorithm's inner loop on the net with its adapted rows and its recipe's hooks
        (`MetaAlgorithm.inner_loop`); ``split``: on that body split's head.

        Args:
            steps: inner steps; None: the algorithm's.
            first_order: detach the inner gradients; None: the algorithm's.
            split: a body split whose head alone adapts; None: the whole net.

        Returns:
            The `InnerLoop`.
        """
        recipe = model_hooks(self.net).task_recipe(self.algorithm.settings())
        return self.algorithm.inner_loop(self.net, row_fields=self.adapted_fields, recipe=recipe, split=split,
                                         steps=steps, first_order=first_order)

    def task_inputs(self, batch: TaskBatch, rows_s: Tensor, rows_q: Tensor,
                    training: bool = False) -> tuple[Params, tuple, tuple]:
        """theta (adapted meta-parameters), support and query tuples for the inner loop. With
        a recipe (the item-popularity offset, ``net.popularity``) each input is (x, side input:
        the statistic); ``training``: the batch's users are in the popularity counts, so each
        row is left out of its own item's counts (models/popularity.py).

        Args:
            batch: the micro-batch of T tasks.
            rows_s: the support rows (T, S, F, d).
            rows_q: the query rows (T, Q, F, d).
            training: the batch's users are counted in the popularity statistic.

        Returns:
            The adapted meta-parameters by name (theta), then the support and the query,
            each as (x, labels, mask).
        """
        params = dict(self.net.named_parameters())
        theta = {n: params[n] for n in self.adapted}
        xs, xq = rows_s, rows_q
        if self.adapted_fields:
            table_rows, index_s, index_q = unique_rows(batch.support_ids, batch.query_ids, rows_s,
                                                       rows_q, self.adapted_fields)
            theta.update(table_rows)
            xs, xq = (rows_s, index_s), (rows_q, index_q)
        recipe = model_hooks(self.net).recipe
        if recipe is not None:
            xs = (xs, recipe.side_input(batch.support_ids, batch.support_y if training else None))
            xq = (xq, recipe.side_input(batch.query_ids, batch.query_y if training else None))
        return theta, (xs, batch.support_y, batch.support_mask), (xq, batch.query_y, batch.query_mask)

    def forward(self, batch: TaskBatch, rows: tuple[Tensor, Tensor] | None = None) -> MetaOutput:
        """``rows``: support and query rows looked up outside (sharded tables); by default the
        net's own embedding module looks them up. Runs `meta_forward`, or the ``runner`` set
        from outside.

        Args:
            batch: the micro-batch of T tasks.
            rows: support (T, S, F, d) and query (T, Q, F, d) rows; None: looked up here.

        Returns:
            The `MetaOutput`.
        """
        if self.runner is not None:
            return self.runner(self, batch, rows)
        return self.meta_forward(batch, rows)

    def meta_forward(self, batch: TaskBatch, rows: tuple[Tensor, Tensor] | None) -> MetaOutput:
        """The algorithm's outer loss on one micro-batch (MeLU inputs: looked-up rows).

        Args:
            batch: the micro-batch of T tasks.
            rows: support and query rows looked up outside; None: by the net's own tables.

        Returns:
            The `MetaOutput`.

        Raises:
            ConfigError: the batch's id columns do not match the model's ``row_fields``.
        """
        if rows is None:
            check_id_columns(self.net, batch)
        rows_s, rows_q = rows if rows is not None else embed_batch(embedder(self.net), batch)
        theta, support, query = self.task_inputs(batch, rows_s, rows_q, training=True)
        first = not getattr(self, "_contract_checked", False)
        with model_contract(self.net, rows_s, buffers=first):
            out = self.outer_loss(theta, support, query)
        self._contract_checked = True  # the buffers' check passed once: not per step
        return out

    def outer_loss(self, theta: Params, support: tuple, query: tuple) -> MetaOutput:
        """The algorithm's outer loss. With half-precision parameters (DeepSpeed bf16 / fp16)
        the adapted fast weights, their inner-loop updates and every loss stay float32 (an
        inner step of lr x grad is often below bf16's resolution of a weight) while the
        model's matrix products run in the parameters' dtype under autocast.

        Args:
            theta: the adapted meta-parameters by name.
            support: the support inputs (x, labels, mask) (`task_inputs`).
            query: the query inputs (x, labels, mask).

        Returns:
            The `MetaOutput` (a warm-up step's `MetaAlgorithm.supervised_loss`, else
            `MetaAlgorithm.anchored_loss`).
        """
        first = next(iter(theta.values()))
        inner, lrs = self.inner_loop(split=self.active_split), self.learning_rates()
        algorithm = self.algorithm
        run = (lambda theta, s, q: algorithm.supervised_loss(inner, theta, s, q)) if algorithm.warming_up \
            else (lambda theta, s, q: algorithm.anchored_loss(inner, lrs, theta, s, q))
        if first.dtype not in HALF:
            return run(theta, *self.split_inputs(support, query))
        with torch.autocast(device_type=first.device.type, dtype=first.dtype):
            return run({n: p.float() for n, p in theta.items()}, *self.split_inputs(support, query))

    def split_inputs(self, support: tuple, query: tuple) -> tuple[tuple, tuple]:
        """With an active body split, the support and query inputs replaced by the body's
        features (one body call on every task's rows); else as they are.

        Args:
            support: the support inputs (x, labels, mask).
            query: the query inputs (x, labels, mask).

        Returns:
            (support, query), x replaced by the body's features under a split.
        """
        split = self.active_split
        if split is None:
            return support, query
        if model_hooks(self.net).recipe is None:
            fs, fq = body_features(split.body, support[0], query[0])
            return (fs, *support[1:]), (fq, *query[1:])
        (xs, stat_s), (xq, stat_q) = support[0], query[0]  # the recipe's side input bypasses the body
        fs, fq = body_features(split.body, xs, xq)
        return ((fs, stat_s), *support[1:]), ((fq, stat_q), *query[1:])
