"""``meta.compile``: the vectorized inner loop and query loss (`inner.vmap_tasks`) under
`torch.compile`.

Only this functional part is compiled: the fused embedding lookup (which reads ids' values to
check them), the sharded row exchange and DeepSpeed's engine stay eager around it.
AOTAutograd traces the inner `torch.func.grad` into plain operations, so the compiled graph
keeps the inner gradients in its forward and the outer backward (second-order MAML) is
compiled with it; its gradients equal eager's to rounding (tests/unit/test_compiled_tasks.py).

Shapes: a micro-batch is padded to its longest task, so the row dimensions (S, Q, and the
number M of deduplicated adapted rows) change from one micro-batch to the next. They are marked
dynamic before the first call (`mark_rows_dynamic`): one graph serves every length. Dynamo's
automatic dynamic shapes (a static graph for the first lengths, then one per dimension that
changes: 2-3 graphs) ran no faster per micro-batch and compiled 2-3 times as long, and static
graphs per bucket of lengths (`pad_to_buckets`: rows padded to the bucket's edge and masked out)
ran no faster than the one dynamic graph (benchmarks/compile_options.py, docs/performance.md).
A model whose graph specialises the marked dimensions (DCN-v2) would compile a graph per length:
from its second graph the runner compiles a static graph per bucket instead. `MAX_GRAPHS` bounds
the graphs one runner compiles; past it (inputs that keep changing what the graph specialises on)
it runs eager with one warning. A compile that fails (no C++ compiler, an operation the compiler refuses)
runs eager too, with one warning naming the reason: ``meta.compile: true`` never ends a run.
"""
from __future__ import annotations

import itertools
import os
import tempfile
import time
import types
import warnings
from collections.abc import Callable

import torch

from gmeta_ds.functional.inner import ROW_PREFIX, LearningRates, Params, TaskOutputs, vmap_tasks

# Graphs one runner may compile before it runs eager: one with the row dimensions dynamic, and
# room for specialisations (a length of 1, Dynamo's automatic dynamic shapes: 2-3 graphs).
MAX_GRAPHS = 6
# The compiler: inductor (C++/OpenMP kernels on CPU, Triton on GPUs).
BACKEND = "inductor"
# Inductor's settings for our graphs only (compile_fx's config_patches, not inductor's global
# config): the C++ wrapper calls the kernels without a Python wrapper; measured on the demo's
# meta-step (docs/performance.md, "Second pass"): at least as fast per call, its cold compile
# 88 s against 121 s, 161 s against 416 s, 47 s against 71 s (pairs at the same load).
INDUCTOR_OPTIONS = {"cpp_wrapper": True}
# meta.compile: auto resolves to this: on CPU no faster end to end (the demo 0.93-1.04x eager on
# a quiet machine; no zoo model 1.5x in every round) and a cold compile of 30-60% of the demo's
# training (docs/performance.md "Compiled meta-step"); not measured on GPUs.
AUTO_COMPILES = False
_RUNNERS = itertools.count()  # numbers each runner's own copy of vmap_tasks (`_own_code`)


def choose_compile(setting: bool | str, vectorize: bool) -> bool:
    """``meta.compile``: true / false as given, "auto": `AUTO_COMPILES`. Compiling needs the
    vmap path: true with ``vectorize`` false warns once and runs eager."""
    on = AUTO_COMPILES if setting == "auto" else bool(setting)
    if on and not vectorize:
        warnings.warn("meta.compile: true compiles the vectorized inner loop, but meta.vectorize resolved to "
                      "false (the per-task loop): the meta-step runs eager", RuntimeWarning, stacklevel=2)
        return False
    return on


def use_temporary_cache() -> str:
    """Inductor's cache folder: TORCHINDUCTOR_CACHE_DIR when set, else one in the temporary
    folder (never the home folder), set for this process and its children."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        folder = os.path.join(tempfile.gettempdir(), f"gmeta_ds_inductor_{os.getuid()}")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object and a name of its own: Dynamo keeps compiled graphs and counts
    recompilations per code object, and remembers which dimensions changed per (file, line,
    name), so each runner's graphs, bound and shape history stay its own (a process may build
    many learners: tests, the warm rank pool)."""
    name = f"{fn.__name__}_{next(_RUNNERS)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def failure_reason(exc: BaseException) -> str:
    """One line naming why a compile failed: the compiler's own exception (unwrapped from
    Dynamo's ``BackendCompilerFailed``), its type and first line."""
    inner = getattr(exc, "inner_exception", None) or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0] if lines else 'no message'}"[:300]


def mark_rows_dynamic(theta: Params, support: tuple, query: tuple) -> None:
    """Mark the row dimensions dynamic before the first call: dimension 1 of every batched
    input of two or more dimensions (T, S, ...) and dimension 0 of the deduplicated rows."""
    def mark(x):
        if isinstance(x, tuple):
            for a in x:
                mark(a)
        elif isinstance(x, torch.Tensor) and x.dim() >= 2:
            torch._dynamo.maybe_mark_dynamic(x, 1)
    for part in (*support, *query):
        mark(part)
    for name, value in theta.items():
        if name.startswith("embedding."):
            torch._dynamo.maybe_mark_dynamic(value, 0)


def bucket_edge(n: int) -> int:
    """The smallest bucket edge >= ``n``: 4, then m x 2**k for m in 4..7 (4, 5, 6, 7, 8, 10, 12,
    14, 16, 20, ...): four edges per doubling, so padding adds under a quarter of the rows."""
    if n <= 4:
        return 4
    k = (n - 1).bit_length() - 3  # n - 1 < 8 x 2**k: the edges m x 2**k with m in 4..8 cover n
    return -(-n // (1 << k)) << k


def _pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size`` (autograd flows to ``x``'s part)."""
    missing = size - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _pad_part(part: tuple, rows: int) -> tuple:
    """One side's inputs (x, labels (T, N), mask (T, N)), every tensor of two or more dimensions
    whose dimension 1 holds the N rows padded to ``rows``: padded rows have mask 0, label 0, id
    index 0, so every masked loss leaves them out."""
    n = part[1].shape[1]

    def pad(x):
        if isinstance(x, tuple):
            return tuple(pad(a) for a in x)
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == n:
            return _pad_dim(x, 1, rows)
        return x
    return pad(part)


def pad_to_buckets(theta: Params, support: tuple, query: tuple) -> tuple[Params, tuple, tuple, dict[str, int]]:
    """Support and query rows padded to their `bucket_edge`, and each adapted row table
    (``embedding.<field>`` (M, d)) to the edge of M: a static graph per bucket serves every
    length in it. Returns the padded (theta, support, query) and the row tables' own counts M
    (the adapted rows past M are padding: their ids are never indexed)."""
    counts = {n: v.shape[0] for n, v in theta.items() if n.startswith(ROW_PREFIX)}
    theta = {n: _pad_dim(v, 0, bucket_edge(counts[n])) if n in counts else v for n, v in theta.items()}
    support = _pad_part(support, bucket_edge(support[1].shape[1]))
    query = _pad_part(query, bucket_edge(query[1].shape[1]))
    return theta, support, query, counts


class CompiledTasks:
    """`vmap_tasks` compiled with ``backend`` (None: `BACKEND`), falling back to eager.

    Call it as `vmap_tasks`. ``graphs`` counts compiled graphs, ``seconds`` the wall time of
    the calls that compiled (tracing, both graphs' compilation, one run), ``failure`` is None
    or the one-line reason the runner went eager. ``mark_dynamic``: mark the row dimensions
    dynamic from the first call (`mark_rows_dynamic`); False: Dynamo's automatic dynamic shapes.
    ``static``: instead, a static graph per bucket of lengths (`pad_to_buckets`; measured no
    faster than one dynamic graph, and a compile per bucket: benchmarks/inner_loop.py --compiled).
    ``options``: inductor's config patches for these graphs (None: `INDUCTOR_OPTIONS` with
    inductor, none with another backend).
    """

    def __init__(self, backend: str | Callable | None = None, mark_dynamic: bool = True,
                 max_graphs: int = MAX_GRAPHS, static: bool = False, options: dict | None = None):
        use_temporary_cache()
        backend = BACKEND if backend is None else backend
        if options is None:
            options = INDUCTOR_OPTIONS if backend == "inductor" else {}
        self.backend = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.options = dict(options)
        self.mark_dynamic, self.max_graphs = mark_dynamic and not static, max_graphs
        self.graphs, self.seconds, self.failure = 0, 0.0, None
        self._use(static)

    def _use(self, static: bool) -> None:
        """Compile from here on one graph for every length (rows marked dynamic or Dynamo's
        automatic dynamic shapes), or a static graph per bucket (``static``)."""
        self.static = static
        self._compiled = torch.compile(_own_code(vmap_tasks), backend=self._count, fullgraph=True,
                                       dynamic=False if static else None)

    def _count(self, graph, example_inputs):
        self.graphs += 1
        if self.options:  # inductor's settings for our graphs only (compile_fx's config_patches)
            return self.backend(graph, example_inputs, config_patches=self.options)
        return self.backend(graph, example_inputs)

    def __call__(self, inner, theta: Params, lrs: LearningRates, support: tuple, query: tuple,
                 detach_query: bool = False) -> TaskOutputs:
        if self.failure is not None:
            return vmap_tasks(inner, theta, lrs, support, query, detach_query)
        before, start = self.graphs, time.perf_counter()
        if self.mark_dynamic and not self.graphs:
            mark_rows_dynamic(theta, support, query)
        try:
            out = self._run(inner, theta, lrs, support, query, detach_query)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: eager, named once
            # the model's own errors (its contract, its shapes) raise here, from eager code
            out = vmap_tasks(inner, theta, lrs, support, query, detach_query)
            self._fall_back(f"torch.compile failed ({failure_reason(exc)})")
            return out
        if self.graphs != before:
            self.seconds += time.perf_counter() - start
            if self.graphs > self.max_graphs:
                self._fall_back(f"{self.graphs} graphs compiled, more than {self.max_graphs} (the inputs' "
                                "shapes or settings keep changing)")
            elif self.mark_dynamic and not self.static and self.graphs > 1:
                # the model specialised the marked row dimensions (DCN-v2 does, through its
                # concatenation): a graph per length would follow, so a static graph per bucket
                self._use(static=True)
        return out

    def _run(self, inner, theta: Params, lrs: LearningRates, support: tuple, query: tuple,
             detach_query: bool) -> TaskOutputs:
        """The compiled call; static: on inputs padded to their bucket edges (`pad_to_buckets`),
        the adapted rows' fast weights cut back to their own count."""
        rows = {}
        if self.static:
            theta, support, query, rows = pad_to_buckets(theta, support, query)
        # the backward graph is compiled now, not at the outer backward: a failure is caught here
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), \
                torch._dynamo.config.patch(recompile_limit=self.max_graphs + 1):
            out = self._compiled(inner, theta, lrs, support, query, detach_query)
        if rows:
            out.fast = {n: v[:, :rows[n]] if n in rows else v for n, v in out.fast.items()}
        return out

    def _fall_back(self, reason: str) -> None:
        self.failure = reason
        warnings.warn(f"meta.compile: {reason}; the meta-step runs eager from here", RuntimeWarning,
                      stacklevel=3)

    def facts(self) -> dict:
        """summary.json's ``compile``: graphs compiled, their seconds, the fallback reason."""
        return {"enabled": True, "graphs": self.graphs, "compile_s": round(self.seconds, 3),
                "eager_fallback": self.failure}
