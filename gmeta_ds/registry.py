"""Every pluggable name in one place (layer 0: no torch): the single source of the names that
config validation accepts and of what each name builds.

A `Registry` maps a name to an object given as ``"module:attribute"`` (imported on first
use, so ``gmeta-ds validate`` stays torch-free) or as the object itself (what
`Registry.register` adds at run time)::

    from gmeta_ds.registry import ALGORITHMS

    @ALGORITHMS.register("my_maml")
    class MyMAML(gmeta_ds.MAML): ...

Where each kind is implemented: algorithms in ``algorithms/``, sharding plans in
``embedding/plan.py``, sharding strategies in ``embedding/sharding/`` (one file each), sparse
row optimizers in ``embedding/optim.py``, interaction-log readers in ``data/readers.py`` (and
the generator in ``data/synthetic.py``), losses in ``functional/inner.py``, CTR models (what
``model.name`` names) in ``models/``, workloads (what ``task:`` names) in ``workloads/``.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any


class Registry(Mapping):
    """Names -> objects of one kind; ``key`` is the config key that names them (for errors).
    A read-only mapping (``REGISTRY[name]``, ``name in REGISTRY``, iteration in registration
    order) plus `register`; an unknown name raises a `KeyError` listing the valid ones."""

    def __init__(self, kind: str, key: str, entries: dict[str, Any]):
        self.kind, self.key = kind, key
        self._entries: dict[str, Any] = dict(entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

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


ALGORITHMS = Registry("algorithm", "meta.algorithm", {
    "maml": "gmeta_ds.algorithms.maml:MAML", "fomaml": "gmeta_ds.algorithms.maml:FOMAML",
    "reptile": "gmeta_ds.algorithms.reptile:Reptile", "metasgd": "gmeta_ds.algorithms.metasgd:MetaSGD",
})
# Sharding plan kinds of a table (embedding.plan, embedding.tables.<name>.plan); "auto" picks
# replicated below embedding.replicate_below_rows rows, else row_wise.
PLANS = Registry("sharding plan", "embedding.plan", {
    "row_wise": "row_wise", "table_wise": "table_wise", "replicated": "replicated",
})
# How each planned table is stored, looked up and trained (embedding/sharding/, one file each):
# a table's plan kind, or owner_pooled for exchange: pooled (embedding.sharding.base.strategy_name).
SHARDINGS = Registry("sharding strategy", "embedding.plan", {
    "row_wise": "gmeta_ds.embedding.sharding.row_wise:RowWise",
    "table_wise": "gmeta_ds.embedding.sharding.table_wise:TableWise",
    "replicated": "gmeta_ds.embedding.sharding.replicated:Replicated",
    "dynamic": "gmeta_ds.embedding.sharding.dynamic:Dynamic",
    "owner_pooled": "gmeta_ds.embedding.sharding.owner_pooled:OwnerPooled",
    "hierarchical_pooled": "gmeta_ds.embedding.sharding.hierarchical:HierarchicalPooled",
})
SPARSE_OPTIMIZERS = Registry("sparse optimizer", "embedding.optimizer", {
    "sgd": "torch.optim:SGD", "adagrad": "torch.optim:Adagrad",
    "rowwise_adagrad": "gmeta_ds.embedding.optim:RowWiseAdagrad", "adam": "torch.optim:SparseAdam",
})
DATA_SOURCES = Registry("data source", "data.source", {
    "synthetic": "gmeta_ds.data.synthetic:generate_synthetic",
    "movielens-100k": "gmeta_ds.data.readers:read_movielens_100k",
    "movielens-1m": "gmeta_ds.data.readers:read_movielens_1m",
    "recbole": "gmeta_ds.data.readers:read_recbole",
    "table": "gmeta_ds.data.readers:read_table",
})
# Loss of a label kind: masked, mean over real rows. binary and regression label CTR logs
# (data.label); multiclass is the text workload's.
LOSSES = Registry("loss", "data.label", {
    "binary": "gmeta_ds.functional.inner:masked_bce", "regression": "gmeta_ds.functional.inner:masked_mse",
    "multiclass": "gmeta_ds.functional.inner:masked_cross_entropy",
})
LABEL_KINDS = ("binary", "regression")  # the LOSSES an interaction log's label can have
# CTR models (task: ctr): classes with ``from_config(fields, model_cfg, embedding)`` (models/base.py).
MODELS = Registry("model", "model.name", {
    "melu": "gmeta_ds.models.melu:MeLU", "dcn_v2": "gmeta_ds.models.dcn_v2:DCNv2",
    "deepfm": "gmeta_ds.models.deepfm:DeepFM", "wide_deep": "gmeta_ds.models.wide_deep:WideDeep",
    "dlrm": "gmeta_ds.models.dlrm:DLRM", "two_tower": "gmeta_ds.models.two_tower:TwoTower",
})
WORKLOADS = Registry("workload", "task", {
    "ctr": "gmeta_ds.workloads.ctr:CTRWorkload", "text": "gmeta_ds.workloads.text:TextWorkload",
})
