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
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gmeta_ds.config.arguments import check, finite, int_at_least, is_int
from gmeta_ds.config.checks import one_of
from gmeta_ds.config.bounds import BOUNDS
from gmeta_ds.algorithms import ALGORITHMS, MetaAlgorithm, MetaLearner, set_compile
from gmeta_ds.algorithms.base import (
    AlgorithmSettings, check_row_fields, probe_model, shown_candidates, unmatched_patterns)
from gmeta_ds.config import (AUTO, DEFAULT_MICRO_BATCH, DEFAULTS, RunConfig, TableOverride, config_from_dict,
                             task_activation_bytes)
from gmeta_ds.data.builder import TaskData, tasks_from_log
from gmeta_ds.data.builder import build_tasks as build_task_store
from gmeta_ds.data.readers import LogSchema, log_from_frame
from gmeta_ds.sparse import FieldSpec, model_field_order, single_fields
from gmeta_ds.config.deepspeed import resolve_ds_config
from gmeta_ds.embedding.plan import plan_tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.dynamic import EVICTIONS
from gmeta_ds.embedding.tables import EXCHANGES, EmbeddingCollection, TableConfig
from gmeta_ds.engine import ds_engine
from gmeta_ds.engine.dist import choose_threads, destroy_process_group, env_world, init_process_group, run_world
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.inner import LOSSES, choose_vectorize
from gmeta_ds.models.base import FieldModel
from gmeta_ds.models.protocol import model_hooks
from gmeta_ds.meta_engine import BASELINES, EngineSpec, MetaEngine, StepResult, start_engine  # noqa: F401
from gmeta_ds.registry import PLANS, SPARSE_OPTIMIZERS


# ---------------------------------------------------------------------------- argument checks
# Every public function checks its arguments before any work: a wrong type or value is a
# `ConfigError` naming the argument, the value and what is expected (as the config's keys are),
# never a torch error later or a value silently taken for another (a str read per character).
#
# Defaults: an argument that is a run-config key takes that key's default from `DEFAULTS` (the
# config dataclasses), never a literal of its own, so the YAML and the API cannot drift apart;
# the few that differ on purpose are listed with their reasons in docs/api.md ("Defaults") and
# pinned by tests/unit/test_api_defaults.py.
_TABLE = TableOverride()  # embedding.tables.<name>.*: a dynamic table's capacity, admission, eviction
MAX_THREADS = BOUNDS["train.threads"][0]  # initialize(threads=): train.threads' bound
# ---------------------------------------------------------------------------- tasks
def build_tasks(source: Any, *, task_key: str, item_key: str, label: str,
                timestamp: str | None = None, user_features: Iterable[str] = (),
                item_features: Iterable[str] = (), multi_hot: dict[str, str] | None = None,
                seed: int = DEFAULTS.seed, **options) -> TaskData:
    """Cold-start tasks (one per ``task_key`` value) from an interaction log.

    Labels (``label_kind="binary"``): a click is ``label >= threshold``; a 0/1 column with
    ``threshold`` left at its default (4.0, for ratings) is read as clicks as it is.
    Vocabularies come from the training tasks only (id 0 is out-of-vocabulary). The result is
    the same at every rank for the same seed and the same for every kind of source.

    Args:
        source: a CSV / Parquet file, a folder of shards (as ``gmeta-ds data synthesize`` and
            Spark write them) or a glob, built out of core into the task store under
            ``cache_dir`` (default ``~/.cache/gmeta_ds``, or ``$XDG_CACHE_HOME/gmeta_ds`` when
            that is set; bounded memory, reused by later calls) as ``gmeta-ds train`` builds
            ``data.path``; or rows in memory: a pandas DataFrame, a pyarrow Table, a Hugging
            Face ``datasets.Dataset`` or a dict of equal-length arrays, one row per interaction.
            A path may be a URL (``s3://``, ``gs://``, ``abfs://``, ``hdfs://``, ``file://``)
            read in place, with Hive ``key=value`` folders as columns (docs/data.md;
            ``storage_options=`` and ``filter=`` as ``data.storage_options`` / ``data.filter``),
            or a Delta Lake table's folder (``version_as_of=`` / ``timestamp_as_of=`` pin its
            snapshot; the version read is in ``stats["snapshot"]``).
        task_key: the column whose values are the tasks (users).
        item_key: the column of item ids.
        label: the column of labels.
        timestamp: the column that orders a task's interactions; None: the log's order.
        user_features: columns of per-task features.
        item_features: columns of per-item features.
        multi_hot: column -> separator of its values in a string cell (list cells are taken
            as they are); None: no multi-hot columns.
        seed: the run seed (the split into train / test / valid tasks), >= 0.
        **options (Any): any ``data.*`` key of the run config (``label`` is the label kind
            there: pass ``label_kind=``; ``query_size``, ``min_interactions``, ``threshold``,
            ``test_fraction``, ``split``, ``cache_dir``...).

    Returns:
        The `TaskData`: ``fields``, ``train``, ``test``, ``valid``, ``stats``, ``vocab``.

    Raises:
        ConfigError: an argument or option of the wrong type or value, naming it.
        DataError: a log that is missing, unreadable or malformed (naming the file, row or
            column), or labels left with one class (naming the column).
    """
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
    int_at_least(problems, "seed", seed, 0)
    check(problems, "gmeta_ds.build_tasks")
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


def tables_for(fields: list[FieldSpec], dim: int, optimizer: str = DEFAULTS.embedding.optimizer,
               lr: float = DEFAULTS.embedding.lr, init_std: float = DEFAULTS.embedding.init_std,
               capacity: int | None = _TABLE.capacity, admit_after: int = _TABLE.admit_after,
               eviction: str = _TABLE.eviction, exchange: str = DEFAULTS.embedding.exchange) -> list[TableConfig]:
    """One embedding table per field (named after it): single-hot fields sum their one row,
    multi-hot fields mean-pool their bag; ``optimizer``: the sparse row optimizer (sgd,
    adagrad, rowwise_adagrad, adam). Fields of raw ids (``raw_ids``) get dynamic tables of
    ``capacity`` rows per rank (required then), ``admit_after`` and ``eviction``.
    ``exchange`` (sharded, multi-hot static fields): ``pooled`` pools each bag on the rows'
    owners and sends one partial sum per bag back, ``rows`` sends every distinct row, ``auto``
    keeps rows here (``gmeta-ds train`` picks by the expected bytes of the data's bags,
    `gmeta_ds.embedding.plan.choose_exchange`); single-hot fields always exchange rows.

    Args:
        fields: the task set's fields (``data.fields`` of `build_tasks`).
        dim: the embedding dimension, >= 1.
        optimizer: the sparse row optimizer (sgd, adagrad, rowwise_adagrad, adam).
        lr: its learning rate.
        init_std: the standard deviation of the rows' normal initialisation, >= 0.
        capacity: rows per rank of a dynamic table (required when a field holds raw ids).
        admit_after: lookups of a raw id before it gets a row of its own (rarer ids share a
            default row), >= 1.
        eviction: ``lru`` or ``lfu``, which row a full dynamic table gives up.
        exchange: ``pooled``, ``rows`` or ``auto``, for the multi-hot static fields.

    Returns:
        One `TableConfig` per field, in the fields' order.

    Raises:
        ConfigError: an argument of the wrong type or value, or raw-id fields without
            ``capacity``.
    """
    problems = []
    if not isinstance(fields, (list, tuple)) or not all(isinstance(f, FieldSpec) for f in fields):
        problems.append("fields: expected the FieldSpec list of a task set (data.fields from gm.build_tasks)")
    int_at_least(problems, "dim", dim, 1)
    one_of(problems, "optimizer", optimizer, SPARSE_OPTIMIZERS.names())
    finite(problems, "lr", lr)
    finite(problems, "init_std", init_std, strict=False)
    if capacity is not None:
        int_at_least(problems, "capacity", capacity, 1)
    int_at_least(problems, "admit_after", admit_after, 1)
    one_of(problems, "eviction", eviction, EVICTIONS)
    one_of(problems, "exchange", exchange, EXCHANGES)
    check(problems, "gmeta_ds.tables_for")
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
def meta_learner(model: nn.Module, algorithm: str | MetaAlgorithm = DEFAULTS.meta.algorithm, *,
                 inner_steps: int = DEFAULTS.meta.inner_steps, inner_lr: float = DEFAULTS.meta.inner_lr,
                 adapt: Iterable[str | nn.Parameter] | None = None, loss: str = DEFAULTS.data.label,
                 vectorize: bool | str = DEFAULTS.meta.vectorize, split_body: bool | str = DEFAULTS.meta.split_body,
                 compile: bool | str = DEFAULTS.meta.compile,
                 inner_lr_scale: dict[str, float] | None = None,
                 inner_loss_prior: float = DEFAULTS.meta.inner_loss_prior,
                 offset_first: float | None = DEFAULTS.meta.offset_first,
                 support_level: float | None = DEFAULTS.meta.support_level,
                 rank_weight: float = DEFAULTS.meta.rank_weight,
                 warmup_steps: int = DEFAULTS.meta.warmup_steps,
                 init_weight: float = DEFAULTS.meta.init_weight) -> MetaLearner:
    """``model`` wrapped as a meta-learner: the inner loop adapts what ``adapt`` names for
    ``inner_steps`` SGD steps of ``inner_lr`` on each task's support set; the outer loss is the
    algorithm's.

    Args:
        model: the network (a ``torch.nn.Module``).
        algorithm: ``maml``, ``fomaml``, ``reptile``, ``metasgd``, or a `MetaAlgorithm` (whose
            own settings then stand: the inner-loop arguments below are not read).
        inner_steps: SGD steps on each task's support set, >= 1.
        inner_lr: the inner steps' learning rate.
        adapt: globs over the model's parameter names (``"head.*"``), parameters of the model
            themselves, or ``"embedding.<field>"`` for the looked-up rows of a single-hot
            field; None: the model's ``default_adapt`` (the zoo models of
            ``gmeta_ds.models``), else ``mlp.*``.
        loss: ``binary`` (masked BCE on logits), ``regression`` (masked MSE) or ``multiclass``.
        vectorize: run a micro-batch's tasks under vmap (True), one by one (False), or
            ``"auto"`` (``meta.vectorize``'s default): vmap unless a zoo model's activation
            estimate (``FieldModel.activation_floats()``) for `DEFAULT_MICRO_BATCH` tasks of
            ``data.max_interactions`` rows exceeds a quarter of the rank's memory; a model of
            your own is vmapped.
        compile: run the vectorized inner loop and query loss under ``torch.compile`` (True),
            eager (False), or ``"auto"`` (``meta.compile``'s default: eager, as measured on
            CPU, docs/performance.md); a compile that fails runs eager with one warning naming
            the reason. Needs the vmap path (``vectorize``).
        split_body: run the model's non-adapted body once per micro-batch and the inner loop
            on its head only, for a model with ``split_body(adapted) -> BodySplit``
            (`gmeta_ds.functional.split`): ``"auto"`` under ZeRO-3 (the body then stays
            partitioned), True at every ZeRO stage, False never.
        inner_lr_scale: globs over the adapted names -> multipliers of ``inner_lr`` (the first
            matching glob; e.g. ``{"popularity.*": 4.0}``); None: none.
        inner_loss_prior: the support loss is sum / (rows + prior) instead of the mean, so
            tasks with few support rows adapt less (0: the mean).
        offset_first: λ, with the popularity offset of ``gmeta_ds.models`` and
            ``popularity.bias`` adapted: each task's offset is first set to the MAP of its
            support (prior precision λ), then the inner steps run; None: off.
        support_level: λ, with the popularity offset: after the inner steps each task's
            logits are shifted so their support mean equals popularity + the task's MAP
            offset (prior λ); None: off.
        rank_weight: w, with binary or regression labels: the query loss is the pointwise
            loss + w x the mean pairwise logistic loss over each task's query pairs that its
            labels order, so the outer loss asks for each user's order of items, not only
            their level (0: pointwise only).
        warmup_steps: the engine's first meta-steps train the model on every row of their
            tasks without adaptation (plain supervised training), then meta-training starts
            from there.
        init_weight: a: the outer loss + a x the unadapted model's loss on every row of the
            tasks, so meta-training keeps the initialisation's own ranking while it learns to
            adapt.

    Returns:
        The `MetaLearner` (``model`` and its algorithm).

    Raises:
        ConfigError: an argument of the wrong type or value, or an ``adapt`` glob that
            matches no parameter, naming it.
    """
    where = "gmeta_ds.meta_learner"
    if not isinstance(model, nn.Module):
        raise ConfigError([f"model: expected a torch.nn.Module, got {type(model).__name__}"], where)
    problems = _learner_problems(algorithm, inner_steps, inner_lr, loss, vectorize, split_body,
                                 inner_lr_scale, inner_loss_prior, rank_weight, warmup_steps, init_weight)
    if not (compile is True or compile is False or compile == AUTO):
        problems.append(f"compile: {compile!r} is not True (torch.compile the vmap path), False (eager) or 'auto'")
    check(problems, where)
    patterns = _adapt_patterns(model, adapt, where)
    if isinstance(algorithm, MetaAlgorithm):
        algo = algorithm
    else:
        vmap = choose_vectorize(vectorize, _task_bytes(model, inner_steps), DEFAULT_MICRO_BATCH)
        algo = ALGORITHMS[algorithm].from_settings(AlgorithmSettings(
            inner_steps=inner_steps, inner_lr=inner_lr, adapt=patterns, vectorize=vmap, kind=loss,
            split_body=split_body, inner_lr_scale=inner_lr_scale, inner_loss_prior=inner_loss_prior,
            offset_first=offset_first, support_level=support_level, rank_weight=rank_weight,
            warmup_steps=warmup_steps, init_weight=init_weight))
    return MetaLearner(model, set_compile(algo, compile))


def _task_bytes(model: nn.Module, inner_steps: int) -> int:
    """``vectorize="auto"``'s estimate of one task's activation memory, as ``gmeta-ds train``
    makes it: a zoo model's ``activation_floats()`` (`FieldModel`) for a task of
    ``data.max_interactions`` rows (the longest `build_tasks` keeps by default); 0 (vmap) for
    a model of the user's own, which states no estimate."""
    if not isinstance(model, FieldModel):
        return 0
    return task_activation_bytes(model.activation_floats(), DEFAULTS.data.max_interactions, inner_steps)


def _learner_problems(algorithm, inner_steps, inner_lr, loss, vectorize, split_body, inner_lr_scale,
                      inner_loss_prior, rank_weight=0.0, warmup_steps=0, init_weight=0.0) -> list[str]:
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
    int_at_least(problems, "inner_steps", inner_steps, 1)
    finite(problems, "inner_lr", inner_lr)
    if not (isinstance(vectorize, bool) or vectorize == AUTO):
        problems.append(f"vectorize: {vectorize!r} is not True (vmap over tasks) or False (a loop), "
                        "or 'auto' (vmap when the model's activation estimate fits memory)")
    if inner_lr_scale is not None:
        if not isinstance(inner_lr_scale, dict):
            problems.append(f"inner_lr_scale: {inner_lr_scale!r} is not a dict of glob -> multiplier")
        else:
            for glob, scale in inner_lr_scale.items():
                if not isinstance(glob, str):
                    problems.append(f"inner_lr_scale: key {glob!r} is not a glob (str)")
                finite(problems, f"inner_lr_scale[{glob!r}]", scale)
    finite(problems, "inner_loss_prior", inner_loss_prior, strict=False)
    finite(problems, "rank_weight", rank_weight, strict=False)
    int_at_least(problems, "warmup_steps", warmup_steps, 0)
    finite(problems, "init_weight", init_weight, strict=False)
    if rank_weight and loss not in ("binary", "regression") and not problems:
        problems.append(f"rank_weight: orders a task's rows by their labels; loss {loss!r} has none "
                        "(binary or regression)")
    return problems


def _adapt_patterns(model: nn.Module, adapt, where: str) -> list[str]:
    """``adapt`` as glob patterns: one glob (a str is one pattern, never read per character),
    a parameter of the model, or a list of them; None: the model's ``default_adapt``. Every
    glob given must select something (a pattern that matches nothing is a typo)."""
    if adapt is None:
        return list(model_hooks(model).default_adapt or DEFAULTS.meta.adapt)
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
    check(problems, where)
    return patterns


def _teardown_at_exit() -> None:
    """The atexit end of a process group `initialize` created: ranks meet before closing
    their connections unless the script died of an uncaught exception (then peers may be
    inside a collective; Python has set ``sys.last_value`` by the time atexit runs)."""
    destroy_process_group(clean_exit=getattr(sys, "last_value", None) is None)


def initialize(learner: MetaLearner, config: dict | str | Path = DEFAULTS.deepspeed, *,
               tables: list[TableConfig] | None = None, sharding: str = "row_wise",
               tasks_per_micro_batch: int | str = AUTO, tasks_per_meta_step: int | str = AUTO,
               lr: float = DEFAULTS.train.lr, seed: int = DEFAULTS.seed, resume: str | None = DEFAULTS.train.resume,
               output_dir: str | Path | None = None, nonfinite: str = DEFAULTS.train.nonfinite,
               collective_timeout_s: int = DEFAULTS.train.collective_timeout_s,
               threads: int | str = DEFAULTS.train.threads) -> MetaEngine:
    """Put ``learner`` on DeepSpeed with its embedding ``tables``; returns a `MetaEngine`.

    ``config``: a DeepSpeed config dict or JSON path (the shipped ``ds_configs/zero0.json`` ...
    ``zero3.json``, bf16 and offload variants, or your own); its batch keys are tasks:
    ``train_micro_batch_size_per_gpu`` = tasks per micro-batch, ``train_batch_size`` = tasks
    per meta-step over all ranks ("auto" filled from the arguments). ``sharding``: how the
    tables are split over ranks, ``row_wise`` | ``table_wise`` | ``replicated`` | ``auto``
    (small tables replicated), or ``dense`` (tables inside the DeepSpeed module, trained by
    its optimizer with the dense parameters). ``tasks_per_micro_batch`` / ``tasks_per_meta_step``:
    "auto" by default (the run config says 32 / 64): the DeepSpeed config's batch keys decide,
    else 32 tasks per micro-batch and one micro-batch per rank. ``resume``: a checkpoint directory or
    ``"auto"`` (the newest complete one under ``output_dir``), at any world size.
    Starts the process group when none is (the launcher's RANK / WORLD_SIZE, or one process),
    and then also tears it down at interpreter exit; a group already started (your own
    ``init_process_group``, Accelerate's ``Accelerator()``) gives the ranks and stays yours.
    ``threads``: torch's intra-op threads on this rank, set before the process group starts;
    "auto" (as ``train.threads``) is the host's cores / its ranks unless OMP_NUM_THREADS is
    set or torch already has fewer (`engine.dist.choose_threads`); rank 0 prints the choice
    once, on stderr.

    Args:
        learner: the `MetaLearner` of `meta_learner`.
        config: a DeepSpeed config dict or the path of its JSON file.
        tables: the embedding tables (`tables_for`); None: the model embeds its own ids.
        sharding: ``row_wise``, ``table_wise``, ``replicated``, ``auto`` or ``dense``.
        tasks_per_micro_batch: tasks per micro-batch per rank, or ``"auto"``.
        tasks_per_meta_step: tasks per meta-step over all ranks, or ``"auto"``.
        lr: the outer (dense) learning rate.
        seed: the run seed (initial rows, task order).
        resume: a checkpoint directory, ``"auto"`` (the newest under ``output_dir``) or None.
        output_dir: where checkpoints and the run log go; None: nowhere.
        nonfinite: ``abort`` (an error naming the step, ranks and tasks) or ``skip`` a
            meta-step whose outer loss is NaN or inf.
        collective_timeout_s: seconds a collective may wait before it fails.
        threads: torch's intra-op threads on this rank, or ``"auto"``.

    Returns:
        The `MetaEngine` that trains ``learner``.

    Raises:
        ConfigError: an argument, the DeepSpeed config or the model of the wrong kind,
            naming it; a process group whose size differs from ``WORLD_SIZE``; an existing
            process group whose backend does not fit this host's device.
    """
    plans = (*PLANS.names(), "auto", "dense")
    if not isinstance(sharding, str) or sharding not in plans:
        raise ConfigError([f"sharding: {sharding!r} is not one of {', '.join(plans)}"])
    count, why = _threads_for(threads)  # checked before any work, set before the process group
    tables = _check_engine_inputs(learner, tables, lr, resume, output_dir)
    run = _run_config(config, tasks_per_micro_batch, tasks_per_meta_step, lr, seed, resume, output_dir,
                      nonfinite, collective_timeout_s)
    ranks = run_world(collective_timeout_s)  # a group the user started gives them: no second start
    ds_config, plan = resolve_ds_config(run, ranks.size, ranks.origin)
    ds_engine.check_device_support(ds_config)
    ds_engine.check_ds_config(ds_config)
    net = learner.net
    if sharding == "dense" and tables and model_hooks(net).embedding is None:
        net.embedding = EmbeddingCollection(tables, seed)  # trained by DeepSpeed with the rest
    if not ds_engine.is_partitioned(learner):  # local: before any collective
        probe_model(learner, *probe_shape(net, tables), "gmeta_ds.initialize")
    _set_threads(count, why, ranks.rank)
    if not ranks.joined:
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
        if not model_hooks(net).row_fields and any(len(t.features) for t in tables):
            raise ConfigError(["model.row_fields: the model must name its single-hot fields in the "
                               "order of the tasks' id columns (e.g. [f.name for f in "
                               "gm.single_fields(data.fields)]) so sharded lookups can find their tables"])
        kinds = {} if sharding == "auto" else {t.name: sharding for t in tables if t.kind != "dynamic"}
        embeddings = ShardedEmbeddingCollection(plan_tables(tables, world, kinds), rank, seed)
    meta, _ = start_engine(EngineSpec(learner, ds_config, plan, embeddings, tables, rank, seed, nonfinite, resume,
                                      output_dir, keep_initial=True))
    return meta


def _threads_for(threads: int | str) -> tuple[int, str]:
    """`initialize`'s ``threads`` checked, and this rank's count with why (`choose_threads`)."""
    if threads != AUTO and not (is_int(threads) and 1 <= threads <= MAX_THREADS):
        raise ConfigError([f"threads: {threads!r} is not 'auto' or an integer in 1..{MAX_THREADS}"],
                          "gmeta_ds.initialize")
    return choose_threads(threads)


def _set_threads(count: int, why: str, rank: int | None = None) -> None:
    """torch's intra-op threads for this rank, said once on rank 0 (``rank``: the process
    group's; None: the launcher's)."""
    torch.set_num_threads(count)
    if (env_world()[0] if rank is None else rank) == 0:
        print(f"gmeta_ds.initialize: {count} torch thread(s) per rank ({why})", file=sys.stderr)


def probe_shape(net: nn.Module, tables: list[TableConfig]) -> tuple[list[str], int]:
    """The fields (single-hot first, in ``row_fields`` order) and dim of the rows ``net`` will
    get: from ``tables``, else from the net's own `EmbeddingCollection`; ([], 0) for a net fed
    otherwise (the text workload)."""
    hooks = model_hooks(net)
    if tables:
        features = list(dict.fromkeys(f for t in tables for f in t.features))
        dim = tables[0].dim
    elif isinstance(hooks.embedding, EmbeddingCollection):
        features, dim = list(hooks.embedding.by_feature), next(iter(hooks.embedding.tables.values())).dim
    else:
        return [], 0
    first = [f for f in hooks.row_fields or [] if f in features]
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
    finite(problems, "lr", lr)
    for name, value in (("resume", resume), ("output_dir", output_dir)):
        if value is not None and not (isinstance(value, Path) or isinstance(value, str) and value.strip()):
            problems.append(f"{name}: {value!r} is not None or a directory path (str or Path)")
    if tables is None:
        tables = []
    elif not isinstance(tables, (list, tuple)) or not all(isinstance(t, TableConfig) for t in tables):
        problems.append("tables: expected a list of gm.TableConfig (gm.tables_for(data.fields, dim))")
    check(problems, where)
    tables = list(tables)
    dims = {t.name: t.dim for t in tables}
    if len(set(dims.values())) > 1:
        problems.append(f"tables: every table must have the same dim (rows are stacked into (N, F, d)); got "
                        f"{', '.join(f'{n}: {d}' for n, d in dims.items())}")
    want = model_hooks(learner.net).embed_dim
    if dims and is_int(want) and len(set(dims.values())) == 1 and want != next(iter(dims.values())):
        problems.append(f"tables: dim {next(iter(dims.values()))} but the model's embed_dim is {want}")
    check(problems, where)
    if tables:
        check_row_fields(learner.net, {f for t in tables for f in t.features})
    return tables


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
