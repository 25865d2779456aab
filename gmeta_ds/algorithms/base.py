"""What every meta-learning algorithm shares: choosing the adapted parameters, the fused
embedding lookup, and the contract ``outer_loss(...) -> MetaOutput``.

Contract: ``MetaOutput.loss`` is one scalar whose gradient with respect to the meta-parameters
is the algorithm's meta-gradient, so every algorithm goes through the same
``engine.backward(loss)`` and DeepSpeed performs the outer reduction across micro-batches
and ranks (it averages, so the micro-batch loss is a mean over its tasks).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from gmeta_ds.data.tasks import TaskBatch
from gmeta_ds.sparse import Jagged
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.inner import (
    LOSSES, MODEL_CONTRACT, InnerLoop, LearningRates, Params, TaskOutputs, check_output,
    run_tasks)
from gmeta_ds.functional.rows import ROW_PREFIX, row_param_name, unique_rows
from gmeta_ds.functional.split import BodySplit, HeadModule, body_features


HALF = (torch.bfloat16, torch.float16)


@dataclass
class MetaOutput:
    """One micro-batch's result. loss: scalar to backpropagate; the rest are detached:
    query_loss / support_loss: mean over tasks (support before adaptation);
    task_query_loss: (T,) per task, for diagnostics."""

    loss: Tensor
    query_loss: Tensor
    support_loss: Tensor
    task_query_loss: Tensor


def adapt_candidates(net: nn.Module) -> tuple[list[str], list[str]]:
    """What ``meta.adapt`` globs may select: (dense parameter names, single-hot field names).

    Candidates are the dense parameters (e.g. ``mlp.0.weight``) and, per feature field, its
    looked-up rows (``embedding.<field>``, see functional/rows.py). Whole tables
    (``embedding.weights.*``) are never candidates: they are looked up before the inner loop.
    """
    dense = [n for n, _ in net.named_parameters() if not n.startswith(ROW_PREFIX)]
    return dense, list(getattr(net, "row_fields", []))


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


# Torch errors that a model breaking the contract (docs/api.md) raises inside the inner loop,
# and what they mean for the model: (a words of torch's message, the explanation).
CONTRACT_ERRORS = (
    ("mutate a captured tensor", "forward updates a tensor in place that is not its input (a buffer: a "
     "counter, BatchNorm's running statistics in training mode...)"),
    ("shapes cannot be multiplied", "the rows' shape is not what the model's layers expect"),
    ("size mismatch", "the rows' shape is not what the model's layers expect"),
    ("must match the size", "the rows' shape is not what the model's layers expect"),
    ("vmap", "forward does something torch.func.vmap cannot vectorize over tasks (data-dependent Python "
     "control flow, .item(), in-place updates)"),
)


def _buffer_versions(net: nn.Module) -> dict[str, int]:
    return {n: b._version for n, b in net.named_buffers()}


def _rows_text(rows: Tensor, net: nn.Module) -> str:
    """One task's rows, described for a contract error: (N, F, d) and what F and d are."""
    if rows.dim() < 3:
        return f"rows of shape {tuple(rows.shape[1:])}"
    fields = list(getattr(net, "row_fields", []))
    width, dim = rows.shape[-2], rows.shape[-1]
    multi = f" + {width - len(fields)} multi-hot" if width > len(fields) else ""
    named = f" (row_fields {', '.join(fields)}{multi})"
    return (f"one task's rows of shape (N, F, d) = {tuple(rows.shape[1:])}: F = {width} fields"
            f"{named if fields else ''}, d = {dim} (the tables' dim)")


def check_row_fields(net: nn.Module, features: "set[str] | None" = None) -> None:
    """``net.row_fields`` must name distinct features of its tables (``features``; default the
    features of the net's own `EmbeddingCollection`, unchecked without one): a misspelt or
    foreign name would fail deep in the lookup (KeyError) instead of here."""
    fields = getattr(net, "row_fields", None)
    if features is None:
        features = set(getattr(getattr(net, "embedding", None), "by_feature", None) or ())
    if fields is None or not features:
        return
    if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
        raise ConfigError([f"model.row_fields: {fields!r} must be a list of field names (str)"])
    unknown = [f for f in fields if f not in features]
    twice = sorted({f for f in fields if list(fields).count(f) > 1})
    if unknown or twice:
        what = f"{unknown!r} are not features of the tables" if unknown else f"{twice!r} appear twice"
        raise ConfigError([f"model.row_fields: {what}; the tables' features are: "
                           f"{', '.join(sorted(features))} "
                           "(row_fields names the single-hot fields in the order of the tasks' id columns: "
                           "[f.name for f in gm.single_fields(data.fields)])"])


def check_id_columns(net: nn.Module, batch: TaskBatch) -> None:
    """The batch's single-hot id columns must be as many as ``net.row_fields`` names."""
    fields = list(getattr(net, "row_fields", None) or [])
    if getattr(net, "embed", None) is not None:  # the net's own lookup reads the ids its way
        return
    width = batch.support_ids.shape[-1]
    if fields and width != len(fields):
        raise ConfigError([f"model.row_fields: names {len(fields)} field(s) ({', '.join(fields)}) but "
                           f"the tasks have {width} single-hot id column(s); row_fields must name them "
                           "all, in order ([f.name for f in gm.single_fields(data.fields)])"])


@contextmanager
def model_contract(net: nn.Module, rows: Tensor, buffers: bool = True):
    """Run the inner loop of ``net`` on ``rows`` (T, N, F, d) and turn what a model that breaks
    the contract causes into a `ConfigError` naming the contract: the known torch errors of
    `CONTRACT_ERRORS` (the original chained), and with ``buffers`` a buffer updated in place
    during the call (which the loop path would do silently, so the vmap and loop paths would
    disagree). ``buffers`` costs two dicts of buffer version counters per call: a training
    loop checks them on its first call only (a forward's code is the same every step)."""
    before = _buffer_versions(net) if buffers else {}
    try:
        yield
    except RuntimeError as err:
        if type(err) is not RuntimeError:  # torch's own subclasses (out of memory, a dead peer) stay
            raise
        text = str(err)
        changed = [n for n, v in _buffer_versions(net).items() if before.get(n) != v] if buffers else []
        why = next((w for key, w in CONTRACT_ERRORS if key in text.lower()), None)
        if changed:
            why = f"forward updated buffer(s) {', '.join(changed)} in place"
        if why is None:
            raise
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        raise ConfigError([f"model: {type(net).__name__}(rows) failed on {_rows_text(rows, net)}: {why} "
                           f"(torch: {first}); {MODEL_CONTRACT}"]) from err
    if not buffers:
        return
    changed = [n for n, v in _buffer_versions(net).items() if before.get(n) != v]
    if changed:
        raise ConfigError([f"model: {type(net).__name__}.forward updated buffer(s) {', '.join(changed)} in "
                           f"place; {MODEL_CONTRACT} (keep such state out of forward: e.g. LayerNorm, or "
                           "BatchNorm in eval mode)"])


def check_task_fields(net: nn.Module, fields, where: str) -> None:
    """``net.row_fields`` against the tasks' single-hot fields (``fields``: the `FieldSpec`
    list of a `TaskSet`): the same names in the same order, else a `ConfigError` naming the
    missing, foreign or misplaced fields (local: before any lookup or collective)."""
    names = getattr(net, "row_fields", None)
    if not names or getattr(net, "embed", None) is not None:  # the net's own lookup reads the ids its way
        return
    single = [f.name for f in fields if not getattr(f, "multi_hot", False)]
    names = list(names)
    if names == single:
        return
    missing = [f for f in single if f not in names]
    foreign = [f for f in names if f not in single]
    what = []
    if missing:
        what.append(f"misses the tasks' field(s) {', '.join(missing)}")
    if foreign:
        what.append(f"names {', '.join(foreign)}, which the tasks do not have")
    if not what:
        what.append(f"lists the fields in another order ({', '.join(names)})")
    raise ConfigError([f"model.row_fields {' and '.join(what)}; the tasks' single-hot fields are, in order: "
                       f"{', '.join(single)} (build the model with row_fields = [f.name for f in "
                       "gm.single_fields(data.fields)])"], where)


PROBE_ROWS = 3  # rows per probe task: small, and unlikely to equal F or d by accident


def probe_model(learner: "MetaLearner", features: list[str], dim: int, where: str) -> None:
    """One forward of the model on a small random batch of the shape training will give it,
    before anything distributed happens: ``model(rows)`` with rows ``(N, F, d)`` (F = the
    tables' ``features``, d = their ``dim``), its output shape, and with ``vectorize`` the
    same call under `torch.func.vmap` over two tasks. A wrong signature, a field the model
    does not expect, a table/model dim mismatch, an ``(N, 1)`` output or a forward that vmap
    cannot vectorize becomes one `ConfigError` naming the model, the shape and the contract,
    instead of a traceback at the first meta-step (callers skip a learner ZeRO-3 has already
    partitioned: its parameters are not here). Parameters are read, never changed;
    buffers are cloned (a forward that updates them in place is refused by training's own
    check); the global RNG is left as it was."""
    net = learner.net
    params = dict(net.named_parameters())
    floats = [p for p in params.values() if p.is_floating_point()]
    if not features or not floats or any(p.is_meta for p in floats):
        return  # no CTR rows to make, or parameters not materialised here
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.randn(2, PROBE_ROWS, len(features), dim, generator=generator).to(floats[0].device, floats[0].dtype)
    state = {**params, **{n: b.clone() for n, b in net.named_buffers()}}
    shape = (f"rows of shape (N, F, d) = {tuple(rows.shape[1:])}: F = {len(features)} fields "
             f"({', '.join(features)}), d = {dim} (the tables' dim)")
    with torch.no_grad():
        out = _probe_call(net, state, rows[0], shape, where)
        changed = [n for n, b in net.named_buffers() if not torch.equal(b, state[n])]
        if changed:
            raise ConfigError([f"model: {type(net).__name__}.forward updated buffer(s) {', '.join(changed)} in "
                               f"place; {MODEL_CONTRACT} (keep such state out of forward: e.g. LayerNorm, or "
                               "BatchNorm in eval mode)"], where)
        if not isinstance(out, Tensor):
            raise ConfigError([f"model: {type(net).__name__}(rows) returned {type(out).__name__}, not a tensor; "
                               f"{MODEL_CONTRACT}"], where)
        try:
            check_output(out, rows[0], learner.algorithm.kind)
        except ConfigError as err:
            raise ConfigError(err.problems, where) from None
        if getattr(learner.algorithm, "vectorize", False):
            _probe_vmap(net, state, rows, where)


def _probe_call(net: nn.Module, state: dict, rows: Tensor, shape: str, where: str):
    """``net(rows)`` through ``state``; a wrong signature or a shape torch refuses is a
    `ConfigError` naming the rows' fields and dim."""
    name = type(net).__name__
    try:
        return functional_call(net, state, (rows,))
    except TypeError as err:
        raise ConfigError([f"model: {name}(rows) raised TypeError: {err}; {MODEL_CONTRACT}"], where) from None
    except RuntimeError as err:
        why = next((w for key, w in CONTRACT_ERRORS if key in str(err).lower()), None)
        if why is None or type(err) is not RuntimeError:
            raise
        first = str(err).strip().splitlines()[0]
        raise ConfigError([f"model: {name}(rows) failed on {shape}: {why}: a field the model does not "
                           f"expect, or a model built for another dim (torch: {first}); "
                           f"{MODEL_CONTRACT}"], where) from None


def _probe_vmap(net: nn.Module, state: dict, rows: Tensor, where: str) -> None:
    """The same call under `torch.func.vmap` over the tasks of ``rows`` (T, N, F, d)."""
    from torch.func import vmap

    try:
        vmap(lambda r: functional_call(net, state, (r,)))(rows)
    except RuntimeError as err:
        if type(err) is not RuntimeError:
            raise
        first = str(err).strip().splitlines()[0]
        raise ConfigError([f"model: {type(net).__name__}(rows) runs alone but not under torch.func.vmap over "
                           f"tasks (torch: {first}): make forward vectorizable (docs/api.md, 'Writing a "
                           "model that vectorizes'), or pass vectorize=False to gm.meta_learner "
                           "(a loop over tasks, slower)"], where) from None


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


class MetaAlgorithm:
    """Base: adapt the matched parameters for ``inner_steps`` SGD steps of ``inner_lr``.

    Subclasses set ``first_order`` and may override `learning_rates`, `init_learner` and
    `outer_loss`.
    """

    first_order = False

    def __init__(self, inner_steps: int, inner_lr: float, adapt: list[str], vectorize: bool,
                 kind: str = "binary", split_body: "bool | str" = "auto",
                 inner_lr_scale: "dict[str, float] | None" = None, inner_loss_prior: float = 0.0,
                 offset_first: "float | None" = None, support_level: "float | None" = None):
        self.inner_steps = inner_steps
        self.inner_lr = inner_lr
        self.adapt = list(adapt)
        # meta.inner_lr_scale: glob over adapted names -> multiplier of inner_lr (first match)
        self.inner_lr_scale = dict(inner_lr_scale or {})
        # meta.inner_loss_prior: support loss = sum / (rows + prior) (`InnerLoop.support_loss`)
        if not inner_loss_prior >= 0.0:
            raise ConfigError([f"meta.inner_loss_prior: {inner_loss_prior!r} must be a number >= 0"])
        self.inner_loss_prior = float(inner_loss_prior)
        # meta.offset_first: the prior λ of the per-task offset set before the inner steps
        # (`InnerLoop.offset_first`); meta.support_level: that of `InnerLoop.level_shift`
        self.offset_first = _optional_prior("meta.offset_first", offset_first, kind)
        self.support_level = _optional_prior("meta.support_level", support_level, kind)
        self.vectorize = vectorize
        self.kind = kind  # "binary" (click, BCE) or "regression" (rating, MSE)
        self.split_body = split_body  # meta.split_body: auto | true | false (`MetaLearner.prepare_engine`)

    @classmethod
    def from_settings(cls, settings: AlgorithmSettings) -> "MetaAlgorithm":
        """The algorithm of ``settings`` (every field by keyword)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})

    def settings(self) -> AlgorithmSettings:
        """This algorithm's `AlgorithmSettings` (what `from_settings` rebuilds it from)."""
        return AlgorithmSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(AlgorithmSettings)})

    def init_learner(self, learner: "MetaLearner") -> None:
        """Add algorithm-owned meta-parameters to the learner (none by default)."""

    def rate(self, name: str) -> float:
        """The inner learning rate of the adapted ``name``: ``inner_lr`` times the multiplier of
        the first ``inner_lr_scale`` glob that matches it (x1 when none does)."""
        scales = (s for p, s in self.inner_lr_scale.items() if fnmatch.fnmatchcase(name, p))
        return self.inner_lr * next(scales, 1.0)

    def learning_rates(self, learner: "MetaLearner") -> LearningRates:
        return {n: self.rate(n) for n in learner.adapted_names()}

    def inner_loop(self, learner: "MetaLearner", steps: int | None = None,
                   first_order: bool | None = None, head: bool = False) -> InnerLoop:
        """The inner loop on the whole model, or (``head``) on the head of the learner's active
        body split, whose inputs are the body's features (`MetaLearner.outer_loss`)."""
        split = learner.active_split if head else None
        module, prefix = (learner.net, "") if split is None else (HeadModule(learner.net, split), HeadModule.PREFIX)
        return InnerLoop(module, self.inner_steps if steps is None else steps,
                         self.first_order if first_order is None else first_order,
                         loss_fn=LOSSES[self.kind], row_fields=learner.adapted_fields, prefix=prefix,
                         offset=getattr(learner.net, "popularity", None),
                         support_prior=self.inner_loss_prior, offset_prior=self.offset_first,
                         kind=self.kind, level_prior=self.support_level)

    def run(self, learner: "MetaLearner", theta: Params, support: tuple, query: tuple,
            query_fast=lambda f: f) -> TaskOutputs:
        """The T tasks of a micro-batch; with an active body split their inputs are features."""
        return run_tasks(self.inner_loop(learner, head=True), theta, self.learning_rates(learner),
                         support, query, self.vectorize, query_fast)

    def outer_loss(self, learner: "MetaLearner", theta: Params, support: tuple,
                   query: tuple) -> MetaOutput:
        """Default (MAML family): the mean query loss after adaptation. ``theta``: the
        meta-parameters that adapt (dense parameters and deduplicated rows)."""
        out = self.run(learner, theta, support, query)
        return _output(out.query_loss.mean(), out)


def _output(loss: Tensor, out: TaskOutputs) -> MetaOutput:
    return MetaOutput(loss, out.query_loss.detach().mean(), out.support_loss.mean(),
                      out.query_loss.detach())


def embed_batch(lookup, batch: TaskBatch) -> tuple[Tensor, Tensor]:
    """One fused lookup of support and query ids with ``lookup(ids (N, F_single), multi) ->
    (N, F, d)``: (T, S, ·) + (T, Q, ·) -> rows (T, S, F, d), (T, Q, F, d)."""
    t, s, f = batch.support_ids.shape
    ids = torch.cat([batch.support_ids.reshape(-1, f), batch.query_ids.reshape(-1, f)])
    multi = {name: concat_jagged(bags, batch.query_multi[name]) for name, bags in batch.support_multi.items()}
    rows = lookup(ids, multi)
    width = rows.shape[1]
    return rows[: t * s].reshape(t, s, width, -1), rows[t * s:].reshape(t, -1, width, rows.shape[-1])


def embedder(net: nn.Module):
    """The net's lookup ``(ids (N, F_single), multi) -> rows (N, F, d)``: its own ``embed``,
    else its ``embedding`` collection (`EmbeddingCollection`) over its ``row_fields``."""
    embed = getattr(net, "embed", None)
    if embed is not None:
        return embed
    collection = getattr(net, "embedding", None)
    if collection is None:
        raise RuntimeError(f"{type(net).__name__} has no embedding tables (no `embed` method and no "
                           "`embedding` collection): its tables are sharded, so pass looked-up rows")
    return lambda ids, multi: collection.lookup_fields(ids, list(net.row_fields), multi)


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
    """

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
        if algorithm.support_level is not None and getattr(net, "popularity", None) is None:
            raise ConfigError(["meta.support_level: sets each task's level from the item-popularity "
                               "offset; set model.item_popularity: true"])
        if algorithm.offset_first is not None and "popularity.bias" not in names:
            raise ConfigError(["meta.offset_first: sets each task's popularity.bias before the inner steps, "
                               "so it needs model.item_popularity: true and popularity.bias adapted "
                               f"(meta.adapt, e.g. \"popularity.*\"); adapted: {', '.join(names)}"])
        check_row_fields(net)
        algorithm.init_learner(self)

    def adapted_names(self) -> list[str]:
        """Names of everything the inner loop adapts: dense parameters, then field rows."""
        return self.adapted + [row_param_name(f) for f in self.adapted_fields.values()]

    def task_inputs(self, batch: TaskBatch, rows_s: Tensor, rows_q: Tensor,
                    training: bool = False) -> tuple[Params, tuple, tuple]:
        """theta (adapted meta-parameters), support and query tuples for the inner loop. With
        an item-popularity offset (``net.popularity``) each input is (x, statistic);
        ``training``: the batch's users are in the popularity counts, so each row is left out
        of its own item's counts (models/popularity.py)."""
        params = dict(self.net.named_parameters())
        theta = {n: params[n] for n in self.adapted}
        xs, xq = rows_s, rows_q
        if self.adapted_fields:
            table_rows, index_s, index_q = unique_rows(batch.support_ids, batch.query_ids, rows_s,
                                                       rows_q, self.adapted_fields)
            theta.update(table_rows)
            xs, xq = (rows_s, index_s), (rows_q, index_q)
        popularity = getattr(self.net, "popularity", None)
        if popularity is not None:
            xs = (xs, popularity.statistic(batch.support_ids, batch.support_y if training else None))
            xq = (xq, popularity.statistic(batch.query_ids, batch.query_y if training else None))
        return theta, (xs, batch.support_y, batch.support_mask), (xq, batch.query_y, batch.query_mask)

    def forward(self, batch: TaskBatch, rows: tuple[Tensor, Tensor] | None = None) -> MetaOutput:
        """``rows``: support and query rows looked up outside (sharded tables); by default the
        net's own embedding module looks them up. Runs `meta_forward`, or the ``runner`` set
        from outside."""
        if self.runner is not None:
            return self.runner(self, batch, rows)
        return self.meta_forward(batch, rows)

    def meta_forward(self, batch: TaskBatch, rows: tuple[Tensor, Tensor] | None) -> MetaOutput:
        """The algorithm's outer loss on one micro-batch (MeLU inputs: looked-up rows)."""
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
        model's matrix products run in the parameters' dtype under autocast."""
        first = next(iter(theta.values()))
        if first.dtype not in HALF:
            return self.algorithm.outer_loss(self, theta, *self.split_inputs(support, query))
        with torch.autocast(device_type=first.device.type, dtype=first.dtype):
            return self.algorithm.outer_loss(self, {n: p.float() for n, p in theta.items()},
                                             *self.split_inputs(support, query))

    def split_inputs(self, support: tuple, query: tuple) -> tuple[tuple, tuple]:
        """With an active body split, the support and query inputs replaced by the body's
        features (one body call on every task's rows); else as they are."""
        split = self.active_split
        if split is None:
            return support, query
        if getattr(self.net, "popularity", None) is None:
            fs, fq = body_features(split.body, support[0], query[0])
            return (fs, *support[1:]), (fq, *query[1:])
        (xs, stat_s), (xq, stat_q) = support[0], query[0]  # the statistic bypasses the body
        fs, fq = body_features(split.body, xs, xq)
        return ((fs, stat_s), *support[1:]), ((fq, stat_q), *query[1:])
