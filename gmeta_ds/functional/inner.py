"""The functional inner loop: adapt a dict of parameters on one task's support set.

Parameters are plain dicts ``{name: tensor}`` handed to `torch.func.functional_call`, so the
module itself is never modified (no monkey-patching, no clone-per-task). Two interchangeable
ways run the T tasks of a micro-batch:

- `vmap_tasks`: one vectorized computation over the task dimension (`torch.func.vmap`,
  gradients with `torch.func.grad_and_value`);
- `loop_tasks`: a per-task Python loop with `torch.autograd.grad` — the fallback when the
  vectorized batch would not fit in memory, and the reference the vmap path is tested against.

Second order: inner gradients stay in the graph (``create_graph``), so the outer backward
differentiates through the inner loop. First order: inner gradients are detached, so
``phi = theta - lr * g.detach()`` and d(phi)/d(theta) = I — exactly FOMAML's meta-gradient.

Adapted embedding rows (``meta.adapt: ["embedding.<field>"]``; `unique_rows`, `compose_rows`):
the rows of an adapted field are deduplicated over the micro-batch: ``E_f`` (M_f, d) holds one
row per distinct id, taken from the fused lookup (so the outer gradient reaches the table).
Each task adapts its own copy of ``E_f`` on its support loss; its support and query rows are
then ``E_f[index]``, so an item seen in the support is adapted in the query too, and rows the
task never saw stay as they were. Inputs of one task become ``(rows, index)``: rows (N, F, d)
from the lookup, index (N, F) into ``E_f`` for adapted fields.

Example: field 1 adapted, support ids [[3, 7], [4, 7]], query ids [[3, 9]] ->
E_1 = rows of ids [7, 9] (M=2); index[:, 1] = [0, 0 | 1]; the query row of id 9 is untouched
by adaptation unless the support also contains 9.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Mapping, Protocol

import torch
from torch import Tensor
from torch.func import functional_call, grad_and_value, vmap

from gmeta_ds.errors import ConfigError

Params = dict[str, Tensor]
# A learning rate per adapted parameter: a float, or a tensor broadcastable to the parameter.
LearningRates = Mapping[str, "float | Tensor"]

# The fast weights of adapted embedding rows are named ``embedding.<field>`` (module docstring).
ROW_PREFIX = "embedding."


def row_param_name(field: str) -> str:
    return ROW_PREFIX + field


def unique_rows(ids_s: Tensor, ids_q: Tensor, rows_s: Tensor, rows_q: Tensor,
                fields: dict[int, str]) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """Deduplicated rows of the adapted fields and per-row indices into them.

    ids_s (T, S, F) single-hot ids; rows_s (T, S, W, d), rows_q (T, Q, W, d) with W >= F
    (pooled multi-hot fields follow the single-hot ones and are never adapted); fields:
    position in F -> field name. Returns ({"embedding.<field>": (M_f, d)}, index_s (T, S, W),
    index_q (T, Q, W)) — index columns of other fields are 0.
    """
    t, s, f = ids_s.shape
    width, dim = rows_s.shape[2], rows_s.shape[-1]
    ids = torch.cat([ids_s.reshape(-1, f), ids_q.reshape(-1, f)])
    rows = torch.cat([rows_s.reshape(-1, width, dim), rows_q.reshape(-1, width, dim)])
    index = torch.zeros(len(ids), width, dtype=ids.dtype)
    table_rows = {}
    positions = torch.arange(len(ids))
    for j, name in fields.items():
        uniq, inverse = torch.unique(ids[:, j], return_inverse=True)
        first = torch.full((len(uniq),), len(ids)).scatter_reduce(0, inverse, positions, "amin")
        table_rows[row_param_name(name)] = rows[first, j]
        index[:, j] = inverse
    return table_rows, index[: t * s].reshape(t, s, width), index[t * s:].reshape(t, -1, width)


def compose_rows(fast: dict[str, Tensor], x, fields: dict[int, str]) -> Tensor:
    """One task's model input: rows (N, F, d) with adapted fields' columns read from the
    (adapted) deduplicated rows in ``fast``. ``x`` is rows, or (rows, index) when rows adapt."""
    if not fields or not isinstance(x, tuple):  # nothing adapts per row (or not MeLU rows)
        return x
    rows, index = x
    columns = [fast[row_param_name(fields[j])][index[:, j]] if j in fields else rows[:, j]
               for j in range(rows.shape[1])]
    return torch.stack(columns, dim=1)


def select_task(x, i: int):
    """Task ``i`` of a batched input (a tensor or nested tuples of tensors)."""
    return tuple(select_task(a, i) for a in x) if isinstance(x, tuple) else x[i]


def masked_bce(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Mean binary cross-entropy over the real rows of one task.

    logits, labels, mask: (N,) — mask is 1.0 on real rows and 0.0 on padding. Returns a scalar;
    a task with no real rows has loss 0 (never NaN).
    """
    per_row = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    return (per_row * mask).sum() / mask.sum().clamp(min=1.0)


def masked_mse(preds: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Mean squared error over the real rows of one task (rating regression); (N,) -> scalar."""
    return ((preds - targets).pow(2) * mask).sum() / mask.sum().clamp(min=1.0)


def masked_pairwise(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Mean pairwise logistic (RankNet) loss over the ordered pairs of one task's real rows:
    ``softplus(s_j - s_i)`` for every pair whose labels order them (``y_i > y_j``: a click above
    a non-click, a higher rating above a lower one), a smooth bound of 1 - the task's AUC.
    (N,) -> scalar; a task with no such pair (one class only) has loss 0 (never NaN)."""
    real = mask[:, None] * mask[None, :]
    ordered = (labels[:, None] > labels[None, :]).to(logits.dtype) * real
    gaps = torch.nn.functional.softplus(logits[None, :] - logits[:, None])
    return (gaps * ordered).sum() / ordered.sum().clamp(min=1.0)


def masked_cross_entropy(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Mean cross-entropy over the real rows of one task (N-way classification): logits
    (N, C), labels (N,) in 0..C-1, mask (N,); half-precision logits are upcast to float32."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    per_row = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return (per_row * mask).sum() / mask.sum().clamp(min=1.0)


# Label kind -> (per-task loss on model outputs, map from model output to prediction).
# binary, regression, multiclass -> the masked losses above
from gmeta_ds.registry import LOSSES  # noqa: E402

LOSSES.bind({"binary": masked_bce, "regression": masked_mse, "multiclass": masked_cross_entropy})
PREDICTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "binary": torch.sigmoid, "regression": lambda x: x, "multiclass": lambda x: x.softmax(-1)}


MODEL_CONTRACT = ("the model contract (docs/api.md): model(rows) maps one task's rows (N, F, d) to "
                  "one logit per row, shape (N,) ((N, C) for loss='multiclass'), and is a pure "
                  "function of its parameters and input (no in-place updates of buffers)")


def check_output(out, inputs, kind: str) -> None:
    """Refuse a model output that is not one logit per input row: an (N, 1) output would
    broadcast against (N,) labels (silently wrong under MSE). Shapes only (no data, no sync),
    so it costs nothing per call and works under vmap (per-task shapes)."""
    if not isinstance(out, Tensor) or not isinstance(inputs, Tensor):
        return
    want = 2 if kind == "multiclass" else 1
    n = inputs.shape[0] if inputs.dim() else None
    if out.dim() != want or out.shape[0] != n:
        shape = f"({n},)" if want == 1 else f"({n}, C)"
        hint = " (squeeze the last dimension: .squeeze(-1))" if out.shape == (n, 1) and want == 1 else ""
        raise ConfigError([f"model output: model(rows) returned shape {tuple(out.shape)} for rows of shape "
                           f"{tuple(inputs.shape)}; expected {shape}{hint}: {MODEL_CONTRACT}"])


class TaskRecipe(Protocol):
    """What a model's recipe adds to the inner loop (the item-popularity offset of
    models/popularity.py is one; a model without a recipe gets none of it). With a recipe each
    task's input is ``(x, side)``: ``side`` is per-row data of the recipe that bypasses the
    model's body (models/protocol.py, `TaskRecipeSource.side_input`). ``own``: the recipe's
    parameters among the adapted ones, ``prefix`` removed."""

    prefix: str  # the recipe's parameter names among the adapted ones start with it
    # (inner, fast, x, y, mask) -> fast: applied before the inner steps, or None
    before_steps: "Callable[..., Params] | None"
    # (inner, theta, fast, xs, ys, ms) -> Tensor: added to the adapted query logits, or None
    query_shift: "Callable[..., Tensor] | None"

    def model_inputs(self, rows: Tensor, side: Tensor, own: Params) -> Tensor:
        """The model's input rows, given the rows, the side input and the recipe's parameters."""

    def model_output(self, out: Tensor, side: Tensor, own: Params) -> Tensor:
        """The task's logits, given the model's output."""


@dataclass(frozen=True, kw_only=True)
class InnerSettings:
    """The algorithm's own inner-loop settings, by keyword, built once per algorithm
    (`MetaAlgorithm.inner`): ``steps`` SGD steps, second or first order, the label ``kind``
    (its loss: `LOSSES`) and ``support_prior`` (meta.inner_loss_prior k: the support loss is
    sum / (rows + k) instead of the mean, so a task with n support rows takes steps
    n / (n + k) as long: shrinkage of small supports) and ``rank_weight`` (meta.rank_weight w: the
    query loss is the label kind's loss + w x `masked_pairwise`, so the outer loss also asks
    for the order of each task's query rows, not only their level)."""

    steps: int
    first_order: bool
    kind: str = "binary"
    support_prior: float = 0.0
    rank_weight: float = 0.0

    @cached_property
    def loss_fn(self) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """The label kind's loss, looked up once per algorithm (not on every micro-batch)."""
        return LOSSES[self.kind]


@dataclass(kw_only=True)
class InnerLoop:
    """How one task adapts: ``settings.steps`` SGD steps with ``lrs`` on the support loss.

    module: the single-device model; ``module(x)`` maps one task's inputs ``(N, ...)`` to
    logits ``(N,)``. Parameters not in the adapted dict come from the module itself.
    """

    module: torch.nn.Module
    settings: InnerSettings
    # Field position -> name of fields whose looked-up rows adapt too (`unique_rows`).
    row_fields: dict[int, str] = field(default_factory=dict)
    # Prepended to parameter names for functional_call (``net.`` for a `split.HeadModule`).
    prefix: str = ""
    # The model's recipe (`TaskRecipe`), or None: then each task's input is x, not (x, side).
    recipe: "TaskRecipe | None" = None

    def __post_init__(self) -> None:
        # functional_call re-checks weight tying on every call by walking every parameter
        # (embedding tables included): ~16% of the loop path. Check once here instead.
        unique = {n for n, _ in self.module.named_parameters()}
        every = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        self.tied = unique != every
        self.first_order = self.settings.first_order
        self.kind = self.settings.kind
        self.loss_fn: Callable[[Tensor, Tensor, Tensor], Tensor] = self.settings.loss_fn

    def logits(self, fast: Params, x) -> Tensor:
        """Model output of one task with the adapted ("fast") parameters ``fast``; ``x`` is
        rows, or (rows, index) when embedding rows adapt too; with a recipe, (that, side)."""
        params = {self.prefix + n: v for n, v in fast.items() if not n.startswith(ROW_PREFIX)}
        side = None
        if self.recipe is not None:
            x, side = x
        inputs = compose_rows(fast, x, self.row_fields)
        own = {}
        if side is not None:
            start = self.recipe.prefix
            own = {n[len(start):]: v for n, v in fast.items() if n.startswith(start)}
            inputs = self.recipe.model_inputs(inputs, side, own)
        out = functional_call(self.module, params, (inputs,), tie_weights=self.tied)
        check_output(out, inputs, self.kind)
        if side is None:
            return out
        return self.recipe.model_output(out, side, own)

    def task_loss(self, fast: Params, x, y: Tensor, mask: Tensor) -> Tensor:
        """Loss of one task with the adapted parameters ``fast``."""
        return self.loss_fn(self.logits(fast, x), y, mask)

    def support_loss(self, fast: Params, x, y: Tensor, mask: Tensor) -> Tensor:
        """The inner (adaptation) loss: `task_loss`, times n / (n + ``support_prior``) for a
        task with n real support rows."""
        loss = self.task_loss(fast, x, y, mask)
        prior = self.settings.support_prior
        if not prior:
            return loss
        n = mask.sum().clamp(min=1.0)
        return loss * (n / (n + prior))

    def query_loss(self, logits: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        """The outer (query) loss of one task's adapted logits: the label kind's loss, plus
        ``rank_weight`` x the pairwise ranking loss (`masked_pairwise`) when it is set."""
        loss = self.loss_fn(logits, y, mask)
        weight = self.settings.rank_weight
        return loss + weight * masked_pairwise(logits, y, mask) if weight else loss

    def query_logits(self, theta: Params, fast: Params, xs, ys: Tensor, ms: Tensor, xq) -> Tensor:
        """Adapted logits of the query rows ``xq``, plus the recipe's ``query_shift`` if any."""
        out = self.logits(fast, xq)
        shift = None if self.recipe is None else self.recipe.query_shift
        if shift is None:
            return out
        return out + shift(self, theta, fast, xs, ys, ms)

    def _update(self, fast: Params, grads: Params, lrs: LearningRates) -> Params:
        if self.first_order:
            grads = {n: g.detach() for n, g in grads.items()}
        return {n: p - lrs[n] * grads[n] for n, p in fast.items()}

    def adapt_func(self, theta: Params, lrs: LearningRates, x: Tensor, y: Tensor,
                   mask: Tensor) -> tuple[Params, Tensor]:
        """Adapt with `torch.func.grad_and_value` (composable with vmap).

        Returns (fast params, support loss before the first step)."""
        fast, first_loss = dict(theta), None
        before = None if self.recipe is None else self.recipe.before_steps
        if before is not None:
            fast = before(self, fast, x, y, mask)
        step_fn = grad_and_value(self.support_loss)
        for _ in range(self.settings.steps):
            grads, loss = step_fn(fast, x, y, mask)
            first_loss = loss if first_loss is None else first_loss
            fast = self._update(fast, grads, lrs)
        return fast, first_loss

    def adapt_autograd(self, theta: Params, lrs: LearningRates, x: Tensor, y: Tensor,
                       mask: Tensor) -> tuple[Params, Tensor]:
        """Adapt with `torch.autograd.grad` (one task, no vmap). Same results as `adapt_func`."""
        fast, first_loss = dict(theta), None
        before = None if self.recipe is None else self.recipe.before_steps
        if before is not None:
            # New graph nodes: the inner gradient is then w.r.t. these values alone, not also
            # through the hook's dependence on theta (as `adapt_func`'s grad_and_value).
            fast = {n: v.view_as(v) for n, v in before(self, fast, x, y, mask).items()}
        for _ in range(self.settings.steps):
            loss = self.support_loss(fast, x, y, mask)
            first_loss = loss if first_loss is None else first_loss
            names = [n for n, p in fast.items() if p.requires_grad]
            grads = torch.autograd.grad(loss, [fast[n] for n in names],
                                        create_graph=not self.first_order and torch.is_grad_enabled())
            grads = dict(zip(names, grads))
            for n in fast.keys() - grads.keys():  # frozen parameters (no grad): zero step
                grads[n] = torch.zeros_like(fast[n])
            fast = self._update(fast, grads, lrs)
        return fast, first_loss.detach() if first_loss is not None else first_loss


@dataclass
class TaskOutputs:
    """Per-task results of a micro-batch: losses (T,) and the adapted parameters, each (T, ...)."""

    query_loss: Tensor
    support_loss: Tensor
    fast: Params


def _one_task(inner: InnerLoop, theta: Params, lrs: LearningRates, detach_query: bool,
              adapt: Callable, xs, ys, ms, xq, yq, mq):
    fast, support_loss = adapt(theta, lrs, xs, ys, ms)
    at = {n: p.detach() for n, p in fast.items()} if detach_query else fast
    query_loss = inner.query_loss(inner.query_logits(theta, at, xs, ys, ms, xq), yq, mq)
    return query_loss, support_loss, fast


def vmap_tasks(inner: InnerLoop, theta: Params, lrs: LearningRates, support: tuple,
               query: tuple, detach_query: bool = False) -> TaskOutputs:
    """Run all T tasks at once with `torch.func.vmap`.

    support = (x (T, S, ...), y (T, S), mask (T, S)); query likewise with Q rows.
    ``detach_query``: the query loss is taken at the adapted params detached (Reptile).
    """
    def run(xs, ys, ms, xq, yq, mq):
        return _one_task(inner, theta, lrs, detach_query, inner.adapt_func, xs, ys, ms, xq, yq, mq)

    query_loss, support_loss, fast = vmap(run)(*support, *query)
    return TaskOutputs(query_loss, support_loss.detach(), fast)


def loop_tasks(inner: InnerLoop, theta: Params, lrs: LearningRates, support: tuple,
               query: tuple, detach_query: bool = False) -> TaskOutputs:
    """Run the T tasks one after another (`torch.autograd.grad`); same contract as `vmap_tasks`."""
    results = [
        _one_task(inner, theta, lrs, detach_query, inner.adapt_autograd,
                  *(select_task(t, i) for t in support), *(select_task(t, i) for t in query))
        for i in range(support[1].shape[0])
    ]
    query_loss = torch.stack([r[0] for r in results])
    support_loss = torch.stack([r[1] for r in results]).detach()
    fast = {n: torch.stack([r[2][n] for r in results]) for n in theta}
    return TaskOutputs(query_loss, support_loss, fast)


def _supervised_task(inner: InnerLoop, theta: Params, xs, ys, ms, xq, yq, mq) -> tuple[Tensor, Tensor, Tensor]:
    """One task without adaptation: (loss over its support and query rows, weighted by their
    counts; the support loss; the query loss), all at ``theta``."""
    support_loss = inner.task_loss(theta, xs, ys, ms)
    query_loss = inner.query_loss(inner.logits(theta, xq), yq, mq)
    ns, nq = ms.sum(), mq.sum()
    return (support_loss * ns + query_loss * nq) / (ns + nq).clamp(min=1.0), support_loss, query_loss


def supervised_tasks(inner: InnerLoop, theta: Params, support: tuple, query: tuple,
                     vectorize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The T tasks of a micro-batch trained as plain supervised data (``meta.warmup_steps``):
    per task (T,), the loss of the unadapted model over all its rows (support and query), the
    support loss and the query loss (with the query loss's ranking term, `InnerLoop.query_loss`)."""
    if vectorize:
        return vmap(lambda *task: _supervised_task(inner, theta, *task))(*support, *query)
    results = [_supervised_task(inner, theta, *(select_task(t, i) for t in support), *(select_task(t, i) for t in query))
               for i in range(support[1].shape[0])]
    return tuple(torch.stack(r) for r in zip(*results))


def memory_bytes_per_rank() -> int:
    """Memory one rank may plan for: the GPU's total memory, or the host's physical memory
    shared by the node's ranks. Totals, not what is free right now: the vmap-or-loop choice
    must not change from one run to the next with the machine's load (the two paths agree
    only to rounding, which Adam amplifies over many steps)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, local)


def choose_vectorize(setting: "bool | str", bytes_per_task: int, tasks: int,
                     budget_mb: "int | str" = "auto") -> bool:
    """``meta.vectorize``: true / false as given; "auto": vmap when the micro-batch's estimated
    activation memory (``bytes_per_task`` x ``tasks``) fits the budget (``budget_mb``, or a
    quarter of `memory_bytes_per_rank`), else the per-task loop."""
    if setting != "auto":
        return bool(setting)
    budget = memory_bytes_per_rank() // 4 if budget_mb == "auto" else int(budget_mb) * 2**20
    return bytes_per_task * tasks <= budget


def run_tasks(inner: InnerLoop, theta: Params, lrs: LearningRates, support: tuple,
              query: tuple, vectorize: bool, detach_query: bool = False) -> TaskOutputs:
    """Dispatch to `vmap_tasks` or `loop_tasks` (``meta.vectorize``)."""
    runner = vmap_tasks if vectorize else loop_tasks
    return runner(inner, theta, lrs, support, query, detach_query)
