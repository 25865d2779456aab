"""The model contract's checks (docs/api.md, `models.protocol.MetaModel`): the fields a model
names against its tables and the tasks', the shape of its output on a probe batch, and the
torch errors a model breaking the contract raises inside the inner loop, turned into one
`ConfigError` naming the model, the rows' shape and the contract. The model's optional
hooks are read through `model_hooks`."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import functional_call

from gmeta_ds.data.tasks import TaskBatch
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.inner import MODEL_CONTRACT, check_output
from gmeta_ds.models.protocol import model_hooks


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
    fields = list(model_hooks(net).row_fields or [])
    width, dim = rows.shape[-2], rows.shape[-1]
    multi = f" + {width - len(fields)} multi-hot" if width > len(fields) else ""
    named = f" (row_fields {', '.join(fields)}{multi})"
    return (f"one task's rows of shape (N, F, d) = {tuple(rows.shape[1:])}: F = {width} fields"
            f"{named if fields else ''}, d = {dim} (the tables' dim)")


def check_row_fields(net: nn.Module, features: "set[str] | None" = None) -> None:
    """``net.row_fields`` must name distinct features of its tables (``features``; default the
    features of the net's own `EmbeddingCollection`, unchecked without one): a misspelt or
    foreign name would fail deep in the lookup (KeyError) instead of here."""
    hooks = model_hooks(net)
    fields = hooks.row_fields
    if features is None:
        features = set(getattr(hooks.embedding, "by_feature", None) or ())
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
    hooks = model_hooks(net)
    fields = list(hooks.row_fields or [])
    if hooks.embed is not None:  # the net's own lookup reads the ids its way
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
    hooks = model_hooks(net)
    names = hooks.row_fields
    if not names or hooks.embed is not None:  # the net's own lookup reads the ids its way
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


def probe_model(learner: nn.Module, features: list[str], dim: int, where: str) -> None:
    """One forward of the model of ``learner`` (a `MetaLearner`) on a small random batch of the
    shape training will give it, before anything distributed happens: ``model(rows)`` with rows ``(N, F, d)`` (F = the
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
