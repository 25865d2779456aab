"""The public Python API: meta-train your own model on your own tasks, on DeepSpeed.

Four calls, mirroring what users already know (``deepspeed.initialize``, learn2learn's
``MAML(model)``, TorchRec's table configs)::

    import gmeta_ds as gm

    data = gm.build_tasks(frame, task_key="user", item_key="item", label="click")  # tasks
    tables = gm.tables_for(data.fields, dim=16)                                    # tables
    learner = gm.meta_learner(model, "maml", inner_steps=2, adapt=["head.*"])      # algorithm
    engine = gm.initialize(learner, "ds_configs/zero2.json", tables=tables,
                           tasks_per_micro_batch=8, tasks_per_meta_step=32)        # DeepSpeed
    for step in range(100):
        stats = engine.meta_step(engine.batches(data.train, step))
    print(engine.evaluate(data.test))

The model contract (see ``docs/api.md``): ``model(rows)`` maps looked-up embedding rows
``(N, F, d)`` (the single-hot fields in ``row_fields`` order, then the multi-hot ones) to one
logit per row ``(N,)`` (``(N, C)`` for ``loss="multiclass"``); ``model.row_fields`` names the
single-hot fields in the order of the tasks' id columns. The tables live outside the model:
sharded over the ranks (row-wise, table-wise or replicated, all-to-all lookups) or, with
``sharding="dense"``, replicated inside the DeepSpeed module and trained with it.
"""
from __future__ import annotations

import atexit
import copy
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gmeta_ds import checkpoint
from gmeta_ds.algorithms import ALGORITHMS, MetaAlgorithm, MetaLearner
from gmeta_ds.algorithms.base import (
    check_id_columns, check_row_fields, check_task_fields, probe_model, shown_candidates, unmatched_patterns)
from gmeta_ds.config import RunConfig, config_from_dict
from gmeta_ds.data.builder import TaskData, tasks_from_log
from gmeta_ds.data.builder import build_tasks as build_task_store
from gmeta_ds.data.readers import LogSchema, log_from_frame
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.data.tasks import FieldSpec, TaskBatch, TaskSet, collate, model_field_order, single_fields
from gmeta_ds.ds_config import BatchPlan, resolve_ds_config, zero_stage
from gmeta_ds.embedding.plan import plan_tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.dynamic import EVICTIONS
from gmeta_ds.embedding.tables import EXCHANGES, EmbeddingCollection, TableConfig
from gmeta_ds.engine import ds_engine, ds_internals
from gmeta_ds.engine.dist import destroy_process_group, init_process_group
from gmeta_ds.errors import ConfigError
from gmeta_ds.evaluation import predict, score
from gmeta_ds.functional.inner import LOSSES
from gmeta_ds.registry import PLANS, SPARSE_OPTIMIZERS


# ---------------------------------------------------------------------------- argument checks
# Every public function checks its arguments before any work: a wrong type or value is a
# `ConfigError` naming the argument, the value and what is expected (as the config's keys are),
# never a torch error later or a value silently taken for another (a str read per character).
def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return _is_int(value) or isinstance(value, (float, np.floating))


def _int_at_least(problems: list[str], name: str, value, low: int) -> None:
    if not (_is_int(value) and value >= low):
        problems.append(f"{name}: {value!r} is not an integer >= {low}")


def _finite(problems: list[str], name: str, value, low: float = 0.0, strict: bool = True) -> None:
    """``value`` must be a finite number > ``low`` (>= with ``strict=False``); NaN and inf fail."""
    if not (_is_number(value) and math.isfinite(value) and (value > low if strict else value >= low)):
        problems.append(f"{name}: {value!r} is not a finite number {'>' if strict else '>='} {low:g}")


def _one_of(problems: list[str], name: str, value, allowed) -> None:
    allowed = list(allowed)
    if not isinstance(value, str) or value not in allowed:
        problems.append(f"{name}: {value!r} is not one of {', '.join(map(str, allowed))}")


def _check(problems: list[str], where: str) -> None:
    if problems:
        raise ConfigError(problems, where)


# ---------------------------------------------------------------------------- tasks
def build_tasks(source: Any, *, task_key: str, item_key: str, label: str,
                timestamp: str | None = None, user_features: Iterable[str] = (),
                item_features: Iterable[str] = (), multi_hot: dict[str, str] | None = None,
                seed: int = 0, **options) -> TaskData:
    """Cold-start tasks (one per ``task_key`` value) from an interaction log.

    ``source``: a CSV / Parquet file, a folder of shards (as ``gmeta-ds data synthesize`` and
    Spark write them) or a glob, built out of core into the task store under ``cache_dir``
    (bounded memory, reused by later calls) as ``gmeta-ds train`` builds ``data.path``; or
    rows in memory: a pandas DataFrame, a pyarrow Table, a Hugging Face ``datasets.Dataset``
    or a dict of equal-length arrays, one row per interaction. ``multi_hot``: column ->
    separator of its values in a string cell (list cells are taken as they are).
    ``options``: any ``data.*`` key of the run config (``label`` is the label kind there:
    pass ``label_kind=``; ``query_size``, ``min_interactions``, ``threshold``,
    ``test_fraction``, ``split``, ``cache_dir``...). Labels (``label_kind="binary"``): a click
    is ``label >= threshold``; a 0/1 column with ``threshold`` left at its default (4.0, for
    ratings) is read as clicks as it is; a label set left with one class is a `DataError`
    naming the column. Vocabularies come from the training tasks only (id 0 is
    out-of-vocabulary); returns `TaskData` (``fields``, ``train``, ``test``, ``valid``,
    ``stats``), the same at every rank for the same seed and the same for every kind of source."""
    keys = (("task_key", task_key), ("item_key", item_key), ("label", label))
    problems = [f"{name}: {value!r} is not a column name (str)" for name, value in keys
                if not isinstance(value, str)]
    if timestamp is not None and not isinstance(timestamp, str):
        problems.append(f"timestamp: {timestamp!r} is not None or a column name (str)")
    for name, columns in (("user_features", user_features), ("item_features", item_features)):
        listed = not isinstance(columns, str) and hasattr(columns, "__iter__")
        if not listed or not all(isinstance(c, str) for c in columns):
            problems.append(f"{name}: {columns!r} is not a list of column names (str)")
    if multi_hot is not None and not (isinstance(multi_hot, dict) and all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in multi_hot.items())):
        problems.append(f"multi_hot: {multi_hot!r} is not a dict of column -> separator (non-empty str)")
    _int_at_least(problems, "seed", seed, 0)
    _check(problems, "gmeta_ds.build_tasks")
    if "label_kind" in options:
        options["label"] = options.pop("label_kind")
    multi = dict(multi_hot or {})
    schema = LogSchema(task_key, item_key, label, timestamp, list(user_features), list(item_features), multi)
    if isinstance(source, (str, Path)):  # the CLI's out-of-core build and task store (data.path)
        columns = {"task_key": task_key, "item_key": item_key, "label": label, "timestamp": timestamp,
                   "user_features": list(user_features), "item_features": list(item_features),
                   "multi_hot": multi}
        data_cfg = config_from_dict({"data": {"source": "table", "path": str(source), "schema": columns,
                                              **options}}, "gmeta_ds.build_tasks").data
        return build_task_store(data_cfg, seed)
    data_cfg = config_from_dict({"data": {"source": "table", "path": f"<{type(source).__name__}>",
                                          **options}}, "gmeta_ds.build_tasks").data
    log = log_from_frame(_as_frame(source, schema), schema, f"{type(source).__name__} passed to build_tasks")
    return tasks_from_log(log, data_cfg, seed)


def _as_frame(source: Any, schema: LogSchema):
    import pandas as pd

    if isinstance(source, pd.DataFrame):
        frame = source
    elif hasattr(source, "to_pandas"):  # pyarrow.Table, datasets.Dataset
        frame = source.to_pandas()
    elif isinstance(source, dict):
        frame = pd.DataFrame({k: list(v) if np.ndim(v) != 1 else v for k, v in source.items()})
    else:
        raise ConfigError([f"build_tasks: source of type {type(source).__name__} is not a path, a "
                           "pandas DataFrame, a pyarrow Table, a datasets.Dataset or a dict of arrays"])
    frame = frame.copy()
    for column in schema.multi_hot:  # list cells -> joined strings, split again by the reader
        if column in frame and len(frame) and not isinstance(frame[column].iloc[0], str):
            sep = schema.multi_hot[column]
            frame[column] = [sep.join(map(str, v)) for v in frame[column]]
    return frame


def tables_for(fields: list[FieldSpec], dim: int, optimizer: str = "adagrad", lr: float = 0.05,
               init_std: float = 0.05, capacity: int | None = None, admit_after: int = 1,
               eviction: str = "lru", exchange: str = "auto") -> list[TableConfig]:
    """One embedding table per field (named after it): single-hot fields sum their one row,
    multi-hot fields mean-pool their bag; ``optimizer``: the sparse row optimizer (sgd,
    adagrad, rowwise_adagrad, adam). Fields of raw ids (``raw_ids``) get dynamic tables of
    ``capacity`` rows per rank (required then), ``admit_after`` and ``eviction``.
    ``exchange`` (sharded, multi-hot static fields): ``pooled`` pools each bag on the rows'
    owners and sends one partial sum per bag back, ``rows`` sends every distinct row, ``auto``
    keeps rows here (``gmeta-ds train`` picks by the expected bytes of the data's bags,
    `gmeta_ds.embedding.plan.choose_exchange`); single-hot fields always exchange rows."""
    problems = []
    if not isinstance(fields, (list, tuple)) or not all(isinstance(f, FieldSpec) for f in fields):
        problems.append("fields: expected the FieldSpec list of a task set (data.fields from gm.build_tasks)")
    _int_at_least(problems, "dim", dim, 1)
    _one_of(problems, "optimizer", optimizer, SPARSE_OPTIMIZERS.names())
    _finite(problems, "lr", lr)
    _finite(problems, "init_std", init_std, strict=False)
    if capacity is not None:
        _int_at_least(problems, "capacity", capacity, 1)
    _int_at_least(problems, "admit_after", admit_after, 1)
    _one_of(problems, "eviction", eviction, EVICTIONS)
    _one_of(problems, "exchange", exchange, EXCHANGES)
    _check(problems, "gmeta_ds.tables_for")
    raw = [f.name for f in fields if f.raw]
    if raw and capacity is None:
        raise ConfigError([f"tables_for: field(s) {', '.join(map(repr, raw))} hold raw ids and need dynamic "
                           "tables: pass capacity= (rows per rank)"])
    return [TableConfig(f.name, max(1, f.num_ids), dim, (f.name,), pooling="mean" if f.multi_hot else "sum",
                        init_std=init_std, optimizer=optimizer, lr=lr,
                        exchange=exchange if f.multi_hot and not f.raw else "rows",
                        **(dict(kind="dynamic", capacity=capacity, admit_after=admit_after, eviction=eviction)
                           if f.raw else {}))
            for f in fields]


# ---------------------------------------------------------------------------- learner
def meta_learner(model: nn.Module, algorithm: str | MetaAlgorithm = "maml", *, inner_steps: int = 1,
                 inner_lr: float = 0.1, adapt: Iterable[str | nn.Parameter] | None = None,
                 loss: str = "binary", vectorize: bool = True,
                 split_body: bool | str = "auto",
                 inner_lr_scale: dict[str, float] | None = None,
                 inner_loss_prior: float = 0.0, offset_first: float | None = None,
                 support_level: float | None = None) -> MetaLearner:
    """``model`` wrapped as a meta-learner: the inner loop adapts what ``adapt`` names for
    ``inner_steps`` SGD steps of ``inner_lr`` on each task's support set; the outer loss is the
    algorithm's (``maml``, ``fomaml``, ``reptile``, ``metasgd``, or a `MetaAlgorithm`).

    ``adapt``: globs over the model's parameter names (``"head.*"``), parameters of the
    model themselves, or ``"embedding.<field>"`` for the looked-up rows of a single-hot field;
    None: the model's ``default_adapt`` (the zoo models of ``gmeta_ds.models``), else ``mlp.*``.
    ``loss``: binary (masked BCE on logits), regression (masked MSE) or multiclass.
    ``split_body``: run the model's non-adapted body once per micro-batch and the inner loop
    on its head only, for a model with ``split_body(adapted) -> BodySplit``
    (`gmeta_ds.functional.split`): "auto" under ZeRO-3 (the body then stays partitioned),
    True at every ZeRO stage, False never. ``inner_lr_scale``: globs over the adapted names ->
    multipliers of ``inner_lr`` (the first matching glob; e.g. ``{"popularity.*": 4.0}``).
    ``inner_loss_prior``: the support loss is sum / (rows + prior) instead of the mean, so
    tasks with few support rows adapt less (0: the mean). ``offset_first`` (λ, with the
    popularity offset of ``gmeta_ds.models`` and ``popularity.bias`` adapted): each task's
    offset is first set to the MAP of its support (prior precision λ), then the inner steps run.
    ``support_level`` (λ, with the popularity offset): after the inner steps each task's logits
    are shifted so their support mean equals popularity + the task's MAP offset (prior λ)."""
    where = "gmeta_ds.meta_learner"
    if not isinstance(model, nn.Module):
        raise ConfigError([f"model: expected a torch.nn.Module, got {type(model).__name__}"], where)
    problems = _learner_problems(algorithm, inner_steps, inner_lr, loss, vectorize, split_body,
                                 inner_lr_scale, inner_loss_prior)
    _check(problems, where)
    patterns = _adapt_patterns(model, adapt, where)
    if isinstance(algorithm, MetaAlgorithm):
        algo = algorithm
    else:
        algo = ALGORITHMS[algorithm](inner_steps, inner_lr, patterns, vectorize, loss, split_body,
                                     inner_lr_scale, inner_loss_prior, offset_first, support_level)
    return MetaLearner(model, algo)


def _learner_problems(algorithm, inner_steps, inner_lr, loss, vectorize, split_body, inner_lr_scale,
                      inner_loss_prior) -> list[str]:
    """What is wrong with `meta_learner`'s arguments (the inner loop's: only when the
    algorithm is built here from its name)."""
    problems = []
    if not (split_body is True or split_body is False or split_body == "auto"):
        problems.append(f"split_body: {split_body!r} is not one of True, False, 'auto'")
    if not isinstance(loss, str) or loss not in LOSSES:
        problems.append(f"loss: {loss!r} is not one of {', '.join(LOSSES)}")
    if isinstance(algorithm, MetaAlgorithm):
        return problems
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        problems.append(f"algorithm: {algorithm!r} is not one of {', '.join(ALGORITHMS)} "
                        "(or a gm.MetaAlgorithm)")
    # 0 inner steps would train without adaptation (and leave no support loss): as meta.inner_steps.
    _int_at_least(problems, "inner_steps", inner_steps, 1)
    _finite(problems, "inner_lr", inner_lr)
    if not isinstance(vectorize, bool):
        problems.append(f"vectorize: {vectorize!r} is not True (vmap over tasks) or False (a loop)")
    if inner_lr_scale is not None:
        if not isinstance(inner_lr_scale, dict):
            problems.append(f"inner_lr_scale: {inner_lr_scale!r} is not a dict of glob -> multiplier")
        else:
            for glob, scale in inner_lr_scale.items():
                if not isinstance(glob, str):
                    problems.append(f"inner_lr_scale: key {glob!r} is not a glob (str)")
                _finite(problems, f"inner_lr_scale[{glob!r}]", scale)
    _finite(problems, "inner_loss_prior", inner_loss_prior, strict=False)
    return problems


def _adapt_patterns(model: nn.Module, adapt, where: str) -> list[str]:
    """``adapt`` as glob patterns: one glob (a str is one pattern, never read per character),
    a parameter of the model, or a list of them; None: the model's ``default_adapt``. Every
    glob given must select something (a pattern that matches nothing is a typo)."""
    if adapt is None:
        return list(getattr(model, "default_adapt", ("mlp.*",)))
    if isinstance(adapt, (str, nn.Parameter)):
        adapt = [adapt]
    try:
        items = list(adapt)
    except TypeError:
        raise ConfigError([f"adapt: {adapt!r} is not a glob (str), a parameter of the model or a list of "
                           "them"], where) from None
    names = {id(p): n for n, p in model.named_parameters()}
    patterns, problems = [], []
    for item in items:
        if isinstance(item, nn.Parameter):
            if id(item) not in names:
                problems.append("adapt: a parameter passed is not one of the model's parameters")
            else:
                patterns.append(names[id(item)])
        elif isinstance(item, str):
            patterns.append(item)
        else:
            problems.append(f"adapt: {item!r} ({type(item).__name__}) is not a glob (str) or a parameter of "
                            "the model")
    if not items:
        problems.append("adapt: empty; give at least one glob over the model's parameter names, "
                        "e.g. 'head.*'")
    unmatched = unmatched_patterns(model, patterns) if not problems else []
    if unmatched:
        problems.append(f"meta.adapt: {unmatched!r} matches nothing; candidates are: "
                        f"{shown_candidates(model)}")
    _check(problems, where)
    return patterns


# ---------------------------------------------------------------------------- engine
BASELINES = ("non_meta", "popularity")


def _baseline_names(problems: list[str], baselines) -> list[str]:
    """``evaluate``'s ``baselines`` as a list of names of `BASELINES` (a str is one name)."""
    if isinstance(baselines, str):
        baselines = [baselines]
    try:
        names = list(baselines)
    except TypeError:
        problems.append(f"baselines: {baselines!r} is not a list of {', '.join(BASELINES)}")
        return []
    bad = [n for n in names if n not in BASELINES]
    if bad:
        problems.append(f"baselines: {', '.join(map(repr, bad))} not among {', '.join(BASELINES)}")
    return [n for n in BASELINES if n in names]


@dataclass
class StepResult:
    """One meta-step on this rank: mean query / support loss over its micro-batches
    (``nan`` when ``skipped``: a non-finite loss with ``nonfinite="skip"``)."""

    query_loss: float
    support_loss: float
    skipped: bool
    padding_efficiency: float = 1.0  # real rows / padded rows of the micro-batches


class MetaEngine:
    """A meta-learner on a DeepSpeed engine with its embedding tables; made by `initialize`.

    ``engine``: the DeepSpeed engine (its ``module`` is the `MetaLearner`); ``embeddings``:
    this rank's `ShardedEmbeddingCollection` (None with ``sharding="dense"``); ``plan``: the
    `BatchPlan` (tasks per micro-batch, accumulation steps, world size); ``rank``."""

    def __init__(self, engine, embeddings: ShardedEmbeddingCollection | None, tables: list[TableConfig],
                 plan: BatchPlan, ds_config: dict, rank: int, seed: int, nonfinite: str = "abort",
                 initial: dict[str, torch.Tensor] | None = None):
        self.engine, self.embeddings, self.tables = engine, embeddings, tables
        self.plan, self.ds_config, self.rank, self.seed = plan, ds_config, rank, seed
        self.nonfinite = nonfinite
        self.fields = list(getattr(engine.module.net, "row_fields", []))
        self.step = 0  # meta-steps done (restored by `resume`)
        # The learner's weights before training (CPU copies; tables sharded outside it are
        # re-made from their configs): the non-meta baseline starts from them.
        self.initial = initial

    @property
    def learner(self) -> MetaLearner:
        return self.engine.module

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def batches(self, tasks: TaskSet, step: int, bucket_by_length: bool = True,
                resample: bool = False) -> list[TaskBatch]:
        """This rank's micro-batches of meta-step ``step``: the global batch of
        ``plan.tasks_per_meta_step`` tasks is the same at every world size (a seeded
        permutation per epoch), split over (micro-batch, rank). ``resample``: episode
        resampling (``data.resample``), each task's support and query redrawn from its rows,
        keyed by (seed, step)."""
        from gmeta_ds.data.loader import task_lengths

        problems = [] if isinstance(tasks, TaskSet) else [f"tasks: expected a gm.TaskSet (data.train), got "
                                                          f"{type(tasks).__name__}"]
        _int_at_least(problems, "step", step, 0)
        _check(problems, "MetaEngine.batches")
        check_task_fields(self.learner.net, tasks.fields, "MetaEngine.batches")
        lengths = task_lengths(tasks) if bucket_by_length else None
        sampler = MetaBatchSampler(len(tasks), self.plan.tasks_per_micro_batch, self.plan.grad_accum_steps,
                                   self.plan.world_size, self.rank, self.seed, lengths)
        key = (self.seed, step) if resample else None
        return [collate(tasks, ids, resample=key) for ids in sampler.micro_batches(step)]

    def meta_step(self, batches: list[TaskBatch]) -> StepResult:
        """One outer step on this rank's micro-batches (collective): fused lookups of support
        and query rows, inner loops, ``engine.backward`` of each outer loss, DeepSpeed's step
        (averaged over ranks and micro-batches) and the sparse row optimizers' step."""
        from gmeta_ds.trainer import meta_step

        if len(batches) != self.plan.grad_accum_steps:
            raise ValueError(f"meta_step: got {len(batches)} micro-batches, expected "
                             f"{self.plan.grad_accum_steps} (gradient_accumulation_steps) per rank")
        from gmeta_ds.text.data import TextEpisodes  # the text workload's micro-batches

        if not all(isinstance(b, (TaskBatch, TextEpisodes)) for b in batches):
            raise ConfigError(["batches: expected a list of gm.TaskBatch (engine.batches(tasks, step))"],
                              "MetaEngine.meta_step")
        if self.embeddings is not None:  # the lookup reads the id columns by row_fields
            check_id_columns(self.learner.net, batches[0])
        stats = meta_step(self.engine, self.embeddings, self.fields, batches, self.step, self.nonfinite)
        self.step += 1
        return StepResult(stats.query_loss, stats.support_loss, stats.skipped, stats.padding_efficiency)

    # ------------------------------------------------------------------ weights
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight of the learner in full (gathered under ZeRO-3), sharded tables under
        ``net.embedding.weights.<table>``; collective."""
        state = ds_engine.full_state_dict(self.learner)
        if self.embeddings is not None:
            for key, value in self.embeddings.gather_state(everywhere=True).items():
                state[f"net.embedding.{key}"] = value
        return state

    def save_weights(self, path: str | Path) -> Path | None:
        """`state_dict` as safetensors, written by rank 0 (collective; None on other ranks)."""
        state = self.state_dict()
        if self.rank != 0:
            return None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return ds_engine.save_weights(state, path)

    def save_model(self, path: str | Path, data: TaskData) -> Path | None:
        """The trained model as one folder that `gmeta_ds.load_model` reads back without running
        code (`gmeta_ds.saved`): every weight with the tables reassembled from their shards
        (model.safetensors), ``data``'s fields and vocabularies (raw values -> rows), the
        tables and the algorithm's settings (model.json, with each file's SHA-256). Written by
        rank 0 beside ``path`` and renamed into place (collective; None on other ranks).
        ``path`` may be new, empty or an earlier saved model; anything else is refused, on
        every rank, before the collective."""
        from gmeta_ds.saved import META

        where = "MetaEngine.save_model"
        problems = []
        if not (isinstance(path, Path) or isinstance(path, str) and path.strip()):
            problems.append(f"path: {path!r} is not a folder path (str or Path)")
        if not isinstance(data, TaskData):
            problems.append(f"data: expected the gm.TaskData the model was trained on (its fields and "
                            f"vocabularies), got {type(data).__name__}")
        _check(problems, where)
        folder = Path(path)
        if folder.exists() and not folder.is_dir():
            problems.append(f"path: {folder} is a file, expected a folder for the saved model")
        elif folder.is_dir() and any(folder.iterdir()) and not (folder / META).is_file():
            problems.append(f"path: {folder} is a folder that holds other files and no {META}; save into a new "
                            "or empty folder, or over an earlier saved model")
        _check(problems, where)
        state = self.state_dict()
        if self.rank != 0:
            return None
        from gmeta_ds.saved import write_model

        net = self.learner.net
        tables = self.tables or (list(net.embedding.tables.values())
                                 if isinstance(getattr(net, "embedding", None), EmbeddingCollection) else [])
        return write_model(folder, state, net, data.fields, tables, data.vocab, self.learner.algorithm)

    def single_process_learner(self, state: dict | None = None) -> MetaLearner:
        """A plain copy of the learner holding every weight (its tables inside the model, as
        ``model.embedding``): for evaluation, serving or export. Collective without ``state``."""
        state = self.state_dict() if state is None else state
        template = self.learner.__dict__.get("_skeleton", self.learner)
        learner = copy.deepcopy(template)
        if template is not self.learner:
            learner = learner.to_empty(device="cpu")
        if self.embeddings is not None:
            learner.net.embedding = EmbeddingCollection(self.tables, self.seed)
        learner.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        return learner

    def evaluate(self, tasks: TaskSet, inner_steps: int | None = None, tasks_per_batch: int = 64, *,
                 baselines: Iterable[str] = (), train: TaskSet | None = None, baseline_epochs: int = 3,
                 baseline_lr: float = 1e-3, baseline_batch_size: int = 512) -> dict:
        """Cold-start scores of ``tasks``: each adapted on its support set (first order,
        ``inner_steps``, default the algorithm's), scored on its query set (binary: AUC,
        per-task AUC, logloss, nDCG; regression: MAE, RMSE, nDCG), and the same without
        adaptation (``*_no_adapt``). The tasks are split over the ranks; every rank returns
        the same dict (collective). ``inner_steps=0`` scores without adapting (the adapted
        metrics then equal the ``*_no_adapt`` ones). A metric that is undefined on these tasks
        (AUC when every query label is one class) is None, with the reason under ``warnings``
        (`gmeta_ds.evaluation.score`).

        ``baselines`` (what ``gmeta-ds train`` reports next to the meta-learned model, scored
        on the same tasks; each needs ``train``, the training tasks): ``"non_meta"``, the same
        model from the same initial weights trained without meta-learning on every training
        interaction (Adam, ``baseline_epochs`` x ``baseline_lr``, batches of
        ``baseline_batch_size`` rows, seeded by the engine's seed), scored as is
        (``baseline_<metric>``) and fine-tuned on each support with the learner's inner loop
        (``baseline_finetune_<metric>``); ``"popularity"``, each item's shrunk training click
        rate (or mean rating) plus a per-user offset fitted on the support
        (``baseline_popularity_<metric>``, `gmeta_ds.baselines`). Every rank computes them
        alone (no collective; deterministic on CPU)."""
        problems = [] if isinstance(tasks, TaskSet) else [f"tasks: expected a gm.TaskSet (data.test), got "
                                                          f"{type(tasks).__name__}"]
        if inner_steps is not None:
            _int_at_least(problems, "inner_steps", inner_steps, 0)
        _int_at_least(problems, "tasks_per_batch", tasks_per_batch, 1)
        wanted = _baseline_names(problems, baselines)
        if wanted:
            if not isinstance(train, TaskSet):
                problems.append(f"train: the baselines {', '.join(wanted)} are fitted on the training tasks: "
                                f"pass train=data.train (got {type(train).__name__})")
            _int_at_least(problems, "baseline_epochs", baseline_epochs, 0)
            _finite(problems, "baseline_lr", baseline_lr)
            _int_at_least(problems, "baseline_batch_size", baseline_batch_size, 1)
            if "non_meta" in wanted and self.initial is None:
                problems.append("baselines: 'non_meta' starts from the model's initial weights, which this "
                                "engine did not keep (its parameters were already partitioned when "
                                "gm.initialize got them)")
        _check(problems, "MetaEngine.evaluate")
        check_task_fields(self.learner.net, tasks.fields, "MetaEngine.evaluate")
        learner = self.single_process_learner()
        lrs = learner.algorithm.learning_rates(learner)
        steps = learner.algorithm.inner_steps if inner_steps is None else int(inner_steps)
        mine = predict(learner, lrs, tasks, steps, tasks_per_batch,
                       np.arange(self.rank, len(tasks), self.world_size))
        parts = [mine]
        if dist.is_initialized() and self.world_size > 1:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, mine)
        if len(tasks) == 0:
            return {"tasks": 0}
        result = {**score(parts, learner.algorithm.kind), "tasks": len(tasks)}
        if "non_meta" in wanted:
            result.update(self._non_meta_scores(tasks, train, steps, tasks_per_batch, baseline_epochs,
                                                baseline_lr, baseline_batch_size))
        if "popularity" in wanted:
            result.update(self._popularity_scores(tasks, train))
        return result

    def initial_learner(self) -> MetaLearner:
        """A single-process copy of the learner holding the weights `initialize` started from
        (its tables freshly initialised from the tables' configs and the engine's seed)."""
        if self.initial is None:
            raise ConfigError(["the initial weights were not kept (the parameters were already partitioned "
                               "when gm.initialize got them)"], "MetaEngine.initial_learner")
        state = dict(self.initial)
        if self.embeddings is not None:
            fresh = EmbeddingCollection(self.tables, self.seed).state_dict()
            state.update({f"net.embedding.{k}": v for k, v in fresh.items()})
        return self.single_process_learner(state)

    def _non_meta_scores(self, tasks: TaskSet, train: TaskSet, steps: int, tasks_per_batch: int,
                         epochs: int, lr: float, batch_size: int) -> dict:
        from gmeta_ds.evaluation import HEADLINE, evaluate, train_baseline

        baseline = self.initial_learner()
        kind = baseline.algorithm.kind
        train_baseline(baseline.net, train, epochs, batch_size, lr, self.seed, LOSSES[kind])
        fixed = {n: baseline.algorithm.rate(n) for n in baseline.adapted_names()}
        base = evaluate(baseline, fixed, tasks, steps, tasks_per_batch)
        out = {}
        for name in HEADLINE[kind]:
            out[f"baseline_{name}"] = base[f"{name}_no_adapt"]
            out[f"baseline_finetune_{name}"] = base[name]
        if kind == "binary":
            out["baseline_auc_per_task"] = base["auc_per_task_no_adapt"]
        return out

    def _popularity_scores(self, tasks: TaskSet, train: TaskSet) -> dict:
        from gmeta_ds.baselines import POPULARITY_METRICS, fit_popularity, popularity_scores
        from gmeta_ds.data.popularity import item_column

        kind = self.learner.algorithm.kind
        if kind not in POPULARITY_METRICS:
            raise ConfigError([f"baselines: 'popularity' scores binary or regression labels, not {kind!r}"],
                              "MetaEngine.evaluate")
        try:
            column = item_column(train.fields)
        except ValueError as err:
            raise ConfigError([f"baselines: 'popularity': {err}"], "MetaEngine.evaluate") from None
        raw = single_fields(train.fields)[column].raw
        popularity = fit_popularity(train, column, kind, oov_id=None if raw else 0, raw=raw)
        return popularity_scores(popularity, tasks)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self) -> dict:
        """What a checkpoint must match to load into this engine."""
        return _checkpoint_meta(self.learner, self.embeddings)

    def save_checkpoint(self, output_dir: str | Path, keep_last: int = 2) -> Path:
        """Checkpoint meta-step `step` under ``output_dir/checkpoints`` (collective): DeepSpeed's
        files, every rank's table rows by global id and sparse-optimizer state, a manifest
        with every file's SHA-256; ``latest`` moves only once all of it is on disk.
        ``keep_last``: complete checkpoints kept (0: all)."""
        problems = []
        _int_at_least(problems, "keep_last", keep_last, 0)
        if not (isinstance(output_dir, Path) or isinstance(output_dir, str) and output_dir.strip()):
            problems.append(f"output_dir: {output_dir!r} is not a directory path (str or Path)")
        _check(problems, "MetaEngine.save_checkpoint")
        return checkpoint.save(self.engine, self.embeddings, {"step": self.step}, self.step, output_dir,
                               keep_last, self.checkpoint_meta())



def _teardown_at_exit() -> None:
    """The atexit end of a process group `initialize` created: ranks meet before closing
    their connections unless the script died of an uncaught exception (then peers may be
    inside a collective; Python has set ``sys.last_value`` by the time atexit runs)."""
    destroy_process_group(clean_exit=getattr(sys, "last_value", None) is None)


def initialize(learner: MetaLearner, config: dict | str | Path = "ds_configs/zero0.json", *,
               tables: list[TableConfig] | None = None, sharding: str = "row_wise",
               tasks_per_micro_batch: int | str = "auto", tasks_per_meta_step: int | str = "auto",
               lr: float = 1e-3, seed: int = 0, resume: str | None = None,
               output_dir: str | Path | None = None, nonfinite: str = "abort",
               collective_timeout_s: int = 600) -> MetaEngine:
    """Put ``learner`` on DeepSpeed with its embedding ``tables``; returns a `MetaEngine`.

    ``config``: a DeepSpeed config dict or JSON path (the shipped ``ds_configs/zero0.json`` ...
    ``zero3.json``, bf16 and offload variants, or your own); its batch keys are tasks:
    ``train_micro_batch_size_per_gpu`` = tasks per micro-batch, ``train_batch_size`` = tasks
    per meta-step over all ranks ("auto" filled from the arguments). ``sharding``: how the
    tables are split over ranks, ``row_wise`` | ``table_wise`` | ``replicated`` | ``auto``
    (small tables replicated), or ``dense`` (tables inside the DeepSpeed module, trained by
    its optimizer with the dense parameters). ``resume``: a checkpoint directory or
    ``"auto"`` (the newest complete one under ``output_dir``), at any world size.
    Starts the process group when none is (the launcher's RANK / WORLD_SIZE, or one process),
    and then also tears it down at interpreter exit."""
    plans = (*PLANS.names(), "auto", "dense")
    if not isinstance(sharding, str) or sharding not in plans:
        raise ConfigError([f"sharding: {sharding!r} is not one of {', '.join(plans)}"])
    tables = _check_engine_inputs(learner, tables, lr, resume, output_dir)
    run = _run_config(config, tasks_per_micro_batch, tasks_per_meta_step, lr, seed, resume, output_dir,
                      nonfinite, collective_timeout_s)
    from gmeta_ds.engine.dist import env_world

    ds_config, plan = resolve_ds_config(run, env_world()[1])
    ds_engine.check_device_support(ds_config)
    ds_engine.check_ds_config(ds_config)
    net = learner.net
    if sharding == "dense" and tables and getattr(net, "embedding", None) is None:
        net.embedding = EmbeddingCollection(tables, seed)  # trained by DeepSpeed with the rest
    if not ds_engine.is_partitioned(learner):  # local: before any collective
        probe_model(learner, *_probe_shape(net, tables), "gmeta_ds.initialize")
    if not dist.is_initialized():
        init_process_group(collective_timeout_s)
        # Tear the group down before the interpreter finalises: left to process exit, gloo's
        # threads are destroyed unjoined after all-to-alls and torch aborts ("terminate called
        # without an active exception", ~1 exit in 6 at world 2), failing a finished script.
        atexit.register(_teardown_at_exit)
    rank, world = (dist.get_rank(), dist.get_world_size())
    if world != plan.world_size:
        raise ConfigError([f"the process group has {world} ranks but WORLD_SIZE said {plan.world_size}"])
    embeddings = None
    if tables and sharding != "dense":
        if not getattr(net, "row_fields", None) and any(len(t.features) for t in tables):
            raise ConfigError(["model.row_fields: the model must name its single-hot fields in the "
                               "order of the tasks' id columns (e.g. [f.name for f in "
                               "gm.single_fields(data.fields)]) so sharded lookups can find their tables"])
        kinds = {} if sharding == "auto" else {t.name: sharding for t in tables if t.kind != "dynamic"}
        embeddings = ShardedEmbeddingCollection(plan_tables(tables, world, kinds), rank, seed)
    found = checkpoint.find(resume, output_dir) if resume else None
    universal = manifest = None
    if found is not None:
        manifest = checkpoint.verify(found, _checkpoint_meta(learner, embeddings))
        if manifest["world_size"] != world and zero_stage(ds_config) > 0:
            universal = checkpoint.to_universal(found, output_dir, manifest)
            ds_config = ds_internals.with_load_universal(ds_config)
    initial = None if ds_engine.is_partitioned(learner) else {
        k: v.detach().to("cpu", copy=True) for k, v in learner.state_dict().items()}
    engine = ds_engine.initialize(learner, ds_config, resume=found)
    meta = MetaEngine(engine, embeddings, tables, plan, ds_config, rank, seed, nonfinite, initial)
    if found is not None:
        meta.step = checkpoint.load(found, manifest, engine, embeddings, universal)["step"]
    return meta


def _probe_shape(net: nn.Module, tables: list[TableConfig]) -> tuple[list[str], int]:
    """The fields (single-hot first, in ``row_fields`` order) and dim of the rows ``net`` will
    get: from ``tables``, else from the net's own `EmbeddingCollection`; ([], 0) for a net fed
    otherwise (the text workload)."""
    if tables:
        features = list(dict.fromkeys(f for t in tables for f in t.features))
        dim = tables[0].dim
    elif isinstance(getattr(net, "embedding", None), EmbeddingCollection):
        own = net.embedding
        features, dim = list(own.by_feature), next(iter(own.tables.values())).dim
    else:
        return [], 0
    first = [f for f in getattr(net, "row_fields", None) or [] if f in features]
    return first + [f for f in features if f not in first], dim


def _check_engine_inputs(learner, tables, lr, resume, output_dir) -> list[TableConfig]:
    """`initialize`'s learner and tables against the model contract (docs/api.md): one dim
    for every table (rows are stacked into (N, F, d)), the model's own ``embed_dim`` if it
    states one, ``row_fields`` among the tables' features. Returns the tables as a list."""
    where = "gmeta_ds.initialize"
    if not isinstance(learner, MetaLearner):
        raise ConfigError([f"learner: expected the result of gm.meta_learner(model, ...), got "
                           f"{type(learner).__name__}"], where)
    problems = []
    _finite(problems, "lr", lr)
    for name, value in (("resume", resume), ("output_dir", output_dir)):
        if value is not None and not (isinstance(value, Path) or isinstance(value, str) and value.strip()):
            problems.append(f"{name}: {value!r} is not None or a directory path (str or Path)")
    if tables is None:
        tables = []
    elif not isinstance(tables, (list, tuple)) or not all(isinstance(t, TableConfig) for t in tables):
        problems.append("tables: expected a list of gm.TableConfig (gm.tables_for(data.fields, dim))")
    _check(problems, where)
    tables = list(tables)
    dims = {t.name: t.dim for t in tables}
    if len(set(dims.values())) > 1:
        problems.append(f"tables: every table must have the same dim (rows are stacked into (N, F, d)); got "
                        f"{', '.join(f'{n}: {d}' for n, d in dims.items())}")
    want = getattr(learner.net, "embed_dim", None)
    if dims and _is_int(want) and len(set(dims.values())) == 1 and want != next(iter(dims.values())):
        problems.append(f"tables: dim {next(iter(dims.values()))} but the model's embed_dim is {want}")
    _check(problems, where)
    if tables:
        check_row_fields(learner.net, {f for t in tables for f in t.features})
    return tables


def _checkpoint_meta(learner: MetaLearner, embeddings) -> dict:
    """Tables, fields, algorithm and dense shapes: what a checkpoint must match to load."""
    return {"tables": checkpoint.table_meta(embeddings), "fields": list(getattr(learner.net, "row_fields", [])),
            "algorithm": type(learner.algorithm).__name__.lower(),
            "dense_shapes": {n: list(v.shape) for n, v in learner.state_dict().items()}}


def _run_config(config, micro, per_step, lr, seed, resume, output_dir, nonfinite, timeout) -> RunConfig:
    if resume and output_dir is None and resume == "auto":
        raise ConfigError(["resume: 'auto' needs output_dir (where the checkpoints are)"])
    deepspeed = str(config) if isinstance(config, Path) else config
    return config_from_dict({
        "seed": seed, "output_dir": str(output_dir or "."), "deepspeed": deepspeed,
        "meta": {"tasks_per_micro_batch": micro, "tasks_per_meta_step": per_step},
        "train": {"lr": lr, "nonfinite": nonfinite, "collective_timeout_s": timeout},
    }, "gmeta_ds.initialize")


__all__ = ["MetaEngine", "StepResult", "build_tasks", "initialize", "meta_learner", "tables_for",
           "model_field_order", "single_fields"]
