"""Every pluggable name in one place (layer 0: no torch): the single source of the names that
config validation accepts.

A `Registry` declares the names of one kind here; what each name builds is bound by the module
that implements the kind (its home, `Registry.bind`, run when that module is imported), so
this layer names no module above it and the homes import it, never the other way round. A
user's own component is added at run time with `Registry.register`::

    from gmeta_ds.registry import ALGORITHMS

    @ALGORITHMS.register("my_maml")
    class MyMAML(gmeta_ds.MAML): ...

The homes: algorithms in ``algorithms/__init__.py``, sharding strategies in
``embedding/sharded.py`` (one file each in ``embedding/sharding/``), sparse row optimizers in
``embedding/optim.py``, data sources in ``data/readers.py``, losses in
``functional/inner.py``, CTR models (what ``model.name`` names) in ``models/__init__.py``,
workloads (what ``task:`` names) in ``workloads/__init__.py``; sharding plans are names only
(``embedding/plan.py`` reads them).
"""
from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

_UNBOUND = object()  # a declared name whose home has not bound it yet


class Registry(Mapping):
    """Names -> objects of one kind; ``key`` is the config key that names them (for errors).
    A read-only mapping (``REGISTRY[name]``, ``name in REGISTRY``, iteration in declaration
    order) plus `bind` and `register`; an unknown name raises a `KeyError` listing the valid
    ones. ``names`` are declared unbound; ``home`` is the module that binds them."""

    def __init__(self, kind: str, key: str, names: Iterable[str], home: str):
        self.kind, self.key, self.home = kind, key, home
        self._entries: dict[str, Any] = dict.fromkeys(names, _UNBOUND)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def bind(self, entries: dict[str, Any]) -> None:
        """Bind declared names to their objects: the object itself, or ``"module:attribute"``
        (imported on first lookup, so a heavy implementation loads only when named). Called
        once by the kind's home; a name not declared here, or bound already, is an error."""
        for name, value in entries.items():
            if name not in self._entries:
                raise ValueError(f"{self.kind} {name!r} is not declared in gmeta_ds.registry")
            if self._entries[name] is not _UNBOUND:
                raise ValueError(f"{self.kind} {name!r} is bound already")
            self._entries[name] = value

    def bound(self, name: str) -> bool:
        """Whether ``name`` has its object (its home was imported, or it was registered)."""
        return self._entries.get(name, _UNBOUND) is not _UNBOUND

    def register(self, name: str, obj: Any = None):
        """Add ``obj`` under ``name`` (or use as a decorator); a name taken is an error."""
        def add(value):
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = value
            return value
        return add if obj is None else add(obj)

    def __getitem__(self, name: str) -> Any:
        if name not in self._entries:
            raise KeyError(f"{self.key}: {name!r} is not one of {', '.join(self._entries)}")
        value = self._entries[name]
        if value is _UNBOUND:
            raise LookupError(f"{self.kind} {name!r} is declared but not bound: {self.home} binds it; "
                              f"import it first")
        if isinstance(value, str) and ":" in value:
            module, attribute = value.split(":")
            value = getattr(importlib.import_module(module), attribute)
            self._entries[name] = value
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self._entries)})"


ALGORITHMS = Registry("algorithm", "meta.algorithm", ("maml", "fomaml", "reptile", "metasgd"),
                      home="gmeta_ds.algorithms")
# Sharding plan kinds of a table (embedding.plan, embedding.tables.<name>.plan); "auto" picks
# replicated below embedding.replicate_below_rows rows, else row_wise. Names only: a plan kind
# builds nothing by itself (its strategy is a name in SHARDINGS).
PLANS = Registry("sharding plan", "embedding.plan", ("row_wise", "table_wise", "replicated"),
                 home="gmeta_ds.registry")
PLANS.bind({name: name for name in PLANS.names()})
# How each planned table is stored, looked up and trained (embedding/sharding/, one file each):
# a table's plan kind, or owner_pooled for exchange: pooled (embedding.sharding.base.strategy_name).
SHARDINGS = Registry("sharding strategy", "embedding.plan", (
    "row_wise", "table_wise", "replicated", "dynamic", "owner_pooled", "hierarchical_pooled"),
    home="gmeta_ds.embedding.sharded")
SPARSE_OPTIMIZERS = Registry("sparse optimizer", "embedding.optimizer", ("sgd", "adagrad", "rowwise_adagrad", "adam"),
                             home="gmeta_ds.embedding.optim")
DATA_SOURCES = Registry("data source", "data.source", ("synthetic", "movielens-100k", "movielens-1m", "recbole", "table"),
                        home="gmeta_ds.data.readers")
# Loss of a label kind: masked, mean over real rows. binary and regression label CTR logs
# (data.label); multiclass is the text workload's.
LOSSES = Registry("loss", "data.label", ("binary", "regression", "multiclass"), home="gmeta_ds.functional.inner")
LABEL_KINDS = ("binary", "regression")  # the LOSSES an interaction log's label can have
# CTR models (task: ctr): classes with ``from_config(fields, model_cfg, embedding)`` (models/base.py).
MODELS = Registry("model", "model.name", ("melu", "dcn_v2", "deepfm", "wide_deep", "dlrm", "two_tower"),
                  home="gmeta_ds.models")
WORKLOADS = Registry("workload", "task", ("ctr", "text"), home="gmeta_ds.workloads")
# Every registry, for the checks that each declared name is bound by its home.
REGISTRIES = (ALGORITHMS, PLANS, SHARDINGS, SPARSE_OPTIMIZERS, DATA_SOURCES, LOSSES, MODELS, WORKLOADS)
