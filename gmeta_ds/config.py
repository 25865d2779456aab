"""Run configuration: dataclasses built from YAML, ``--set`` overrides, validation.

Layer 0: no torch. Every problem is collected and raised at once as a `ConfigError` whose
lines name the dotted key, the value and what is allowed. Defaults live here only.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from gmeta_ds.errors import ConfigError
from gmeta_ds.registry import (ALGORITHMS, DATA_SOURCES, LABEL_KINDS, MODELS, PLANS,  # noqa: F401
                               SPARSE_OPTIMIZERS, WORKLOADS)

SHARDINGS = ("replicated", "sharded")
ROW_OWNERS = ("modulo", "block")
TABLE_DEVICES = ("auto", "accelerator", "host")
EXCHANGES = ("auto", "rows", "pooled")
BAD_ID_POLICIES = ("error", "hash")
SPLITS = ("random", "time")
TEXT_FORMATS = ("auto", "csv", "json", "parquet")
SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
AUTO = "auto"


def parse_memory(text: str) -> str:
    """``data.memory_limit`` ("2GB", "512MiB", bytes) as DuckDB's setting ("2048MB");
    ValueError naming the key for anything else or below 64 MB."""
    units = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    t = str(text).strip().upper().replace("IB", "B")
    num = t.rstrip("KMGTB ")
    unit = t[len(num):].strip()
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(f"data.memory_limit: {text!r} is not a size like 2GB or 512MB") from None
    if value < 64 * 2**20:
        raise ValueError(f"data.memory_limit: {text!r} is below 64MB; DuckDB needs more to sort")
    return f"{int(value // 2**20)}MB"


@dataclass
class ModelConfig:
    """The CTR model (``task: ctr``): ``name`` is one of `registry.MODELS` (models/). The other
    keys are the models' hyper-parameters, flat; each model reads only its own."""

    name: str = "melu"                        # melu | dcn_v2 | deepfm | wide_deep | dlrm | two_tower
    embed_dim: int = 16
    # MeLU's MLP; the deep part of dcn_v2, deepfm, wide_deep; DLRM's top MLP.
    hidden: list[int] = field(default_factory=lambda: [64, 32])
    cross_layers: int = 2                     # dcn_v2: cross layers
    bottom_hidden: list[int] = field(default_factory=list)  # dlrm: hidden widths of the bottom projection (d -> ... -> d)
    tower_hidden: list[int] = field(default_factory=lambda: [64, 32])  # two_tower: each tower; the last = dot-product dim
    # Every model: add the training users' item popularity (shrunk click log-odds / mean rating)
    # as a logit offset, weight * popularity + bias (models/popularity.py; popularity.* in meta.adapt).
    item_popularity: bool = False
    popularity_prior: float = 10.0            # pseudo-interactions at the global rate per item
    # With item_popularity: the statistic also enters the model's input, s * popularity.feature
    # (a learned row, zeros at start) added to the item field's row, so the layers can combine it
    # with the user's features.
    popularity_feature: bool = False
    # The last linear layer of ``mlp`` starts at zero (melu, dcn_v2, dlrm: the whole output, so
    # with item_popularity the model starts as popularity alone; deepfm, wide_deep: the deep part).
    zero_init_output: bool = False


@dataclass
class MetaConfig:
    """The meta-learning algorithm and how tasks are grouped."""

    algorithm: str = "maml"
    inner_steps: int = 1
    inner_lr: float = 0.1
    # Glob over adapted names -> multiplier of inner_lr (the first matching glob; others x1),
    # e.g. {"popularity.*": 4.0}: the offset adapts faster than the layers.
    inner_lr_scale: dict[str, float] = field(default_factory=dict)
    # Shrinkage of small supports: the inner loss is sum / (support rows + inner_loss_prior)
    # instead of the mean, so a task with n support rows adapts n / (n + prior) as far per step
    # (0 = the mean). Like the popularity baseline's offset prior: few rows, small update.
    inner_loss_prior: float = 0.0
    # With model.item_popularity and popularity.bias adapted: before the inner steps, each task's
    # offset is moved to the MAP of its support given the model's own logits (the popularity
    # baseline's offset fit, Gaussian prior of precision offset_first); null = off.
    offset_first: Union[float, None] = None
    # With model.item_popularity: after the inner steps, each task's logits get one constant so
    # that their mean over its support equals that of popularity + the task's MAP offset
    # (prior precision support_level): the adapted model ranks, the shrunk statistic sets the
    # user's level (InnerLoop.level_shift). Applies to the non-meta baseline's fine-tune too.
    support_level: Union[float, None] = None
    # Glob patterns over dense parameter names adapted in the inner loop (MeLU: decision layers).
    # Left at this default, the model's own default_adapt is used (two_tower: user_tower.*).
    adapt: list[str] = field(default_factory=lambda: ["mlp.*"])
    tasks_per_micro_batch: Union[int, str] = 32
    tasks_per_meta_step: Union[int, str] = 64
    # Run a micro-batch's tasks with vmap (true), a per-task loop (false), or vmap when its
    # estimated activation memory fits vectorize_budget_mb ("auto").
    vectorize: Union[bool, str] = AUTO
    # "auto": a quarter of the memory available to this rank (free GPU memory, or host RAM).
    vectorize_budget_mb: Union[int, str] = AUTO
    # Run the model's non-adapted body once per micro-batch as an ordinary module call and the
    # inner loop on its head only (gmeta_ds.functional.split): "auto" under ZeRO-3, where the
    # body then stays partitioned, when the model offers a split for meta.adapt; true at every
    # ZeRO stage (an error if the model cannot be split); false never.
    split_body: Union[bool, str] = AUTO


@dataclass
class TableOverride:
    """Per-table settings under ``embedding.tables.<name>`` (unset = the section's default)."""

    plan: str = "auto"
    optimizer: Union[str, None] = None
    lr: Union[float, None] = None
    # static: a vocabulary of ids 0..V-1 from the task build; dynamic: any int64 id (the
    # field's raw values, strings hashed), `capacity` rows per rank, an id's own row after
    # `admit_after` lookups (rarer ids share a default row), `eviction` lru | lfu when full.
    kind: str = "static"
    capacity: Union[int, None] = None
    admit_after: int = 1
    eviction: str = "lru"
    device: Union[str, None] = None           # auto | accelerator | host; unset: embedding.device
    exchange: Union[str, None] = None         # auto | rows | pooled; unset: embedding.exchange


@dataclass
class EmbeddingConfig:
    """Where embedding tables live.

    ``replicated``: plain tables inside the DeepSpeed engine (dense gradients all-reduced; the
    DMAML-like baseline). ``sharded``: gmeta_ds's own sharded tables outside DeepSpeed, looked
    up by all-to-all, trained by sparse optimizers on owned rows.
    """

    sharding: str = "replicated"
    # Sharded mode: plan kind for tables without an override; "auto" replicates tables with
    # fewer than replicate_below_rows rows and shards the rest row-wise.
    plan: str = "auto"
    row_owner: str = "modulo"
    replicate_below_rows: int = 1024
    optimizer: str = "adagrad"
    lr: float = 0.05
    init_std: float = 0.05
    bad_ids: str = "error"
    dedup: bool = True
    # Where sharded tables live: accelerator (the rank's GPU; exchanges over the default group,
    # NCCL there), host (host memory, its own gloo group, rows moved to the device after the
    # exchange) or auto (the accelerator when the tables fit half its memory, else the host).
    device: str = "auto"
    # What sharded lookups of multi-hot (pooled) fields send back: rows (every distinct row,
    # pooled by the requester), pooled (each owner's partial sum per bag), or auto (by the
    # expected bytes of each, from the training data's bag lengths and distinct ids).
    exchange: str = "auto"
    tables: dict[str, TableOverride] = field(default_factory=dict)


@dataclass
class SyntheticConfig:
    """Synthetic cold-start CTR data: users (tasks) and items with latent preferences."""

    num_users: int = 2000
    num_items: int = 500
    latent_dim: int = 8
    min_interactions: int = 13
    max_interactions: int = 100
    query_size: int = 10
    zipf_exponent: float = 1.1
    test_fraction: float = 0.2
    # How strongly categorical features reveal the latent vectors (0 = pure noise).
    feature_signal: float = 2.0
    # Std of the per-user click propensity that no feature reveals (learned from support).
    user_bias_std: float = 1.0
    preference_scale: float = 2.0
    base_logit: float = -0.5


@dataclass
class SchemaConfig:
    """Column roles of a generic CSV/Parquet log (``data.source: table``)."""

    task_key: str = "user_id"
    item_key: str = "item_id"
    label: str = "rating"
    timestamp: Union[str, None] = None
    user_features: list[str] = field(default_factory=list)
    item_features: list[str] = field(default_factory=list)
    # multi-hot column -> separator inside a cell, e.g. {genres: "|"}
    multi_hot: dict[str, str] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Where tasks come from: ``synthetic`` (generated), or an interaction log on disk
    (``movielens-100k``, ``movielens-1m``, ``recbole``, ``table``) at ``path``."""

    source: str = "synthetic"
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    bucket_by_length: bool = True             # sort each meta-batch by task length: less padding
    prefetch: bool = True                     # collate the next meta-step in a background thread
    path: Union[str, None] = None
    dataset_name: Union[str, None] = None     # recbole: <name>.inter, .user, .item
    format: str = "auto"                      # table: auto | csv | parquet
    sep: str = ","                            # table: CSV separator
    schema: SchemaConfig = field(default_factory=SchemaConfig)
    label: str = "binary"                     # binary: click = rating >= threshold; regression: the rating
    threshold: float = 4.0
    query_size: int = 10
    split: str = "random"                     # support/query: random (seeded) or time (query = latest)
    # Episode resampling: each time meta-training draws a task, its support and query are
    # redrawn at random from all its rows (same sizes), keyed by (seed, meta-step); held-out
    # users keep their one split. Needs split: random (a time split's query is the latest rows).
    resample: bool = False
    min_interactions: int = 13                # tasks outside [min, max] are dropped and counted
    max_interactions: int = 100
    short_tasks: str = "skip"                 # tasks below min_interactions: skip (counted) or error
    # Tasks above max_interactions: skip (counted), or train (the warm users' logs): kept for
    # meta-training only, never held out, each cut into ceil(n / max_interactions) tasks (rows
    # dealt at random by their seeded order key), so they look like the held-out users' tasks.
    # The held-out users are the same as with skip.
    long_tasks: str = "skip"
    min_count: int = 1                        # rarer categorical values share the OOV id 0
    # Single-hot columns kept as raw int64 ids, no vocabulary (strings: 63 bits of their MD5,
    # gmeta_ds.embedding.dynamic.string_id); the CTR workload adds every dynamic table's field.
    raw_ids: list[str] = field(default_factory=list)
    test_fraction: float = 0.2                # held-out (cold-start) users
    valid_fraction: float = 0.0               # further held-out users for tuning (eval.split: valid, eval.finetune_search)
    # MeLU's four states: items released in or after new_item_year are new; training uses
    # existing users x existing items; evaluation reports warm, user_cold, item_cold and
    # user_item_cold (eval.auc is user_cold's).
    four_state: bool = False
    new_item_year: int = 1998
    cache_dir: str = "~/.cache/gmeta_ds"
    # Memory the out-of-core task build may use (DuckDB's limit; it spills to disk beyond it).
    memory_limit: str = "1GB"


@dataclass
class TrainConfig:
    """Outer loop."""

    meta_steps: int = 200
    lr: float = 1e-3
    log_every: int = 10
    # Threads per rank; "auto" = cores // local ranks.
    threads: Union[int, str] = AUTO
    collective_timeout_s: int = 600
    progress: bool = True                     # tqdm bar on rank 0 (meta-step, tasks/s, query loss)
    tensorboard: bool = True                  # TensorBoard events under OUTPUT_DIR/tensorboard (rank 0)
    nonfinite: str = "abort"                  # NaN/inf outer loss: abort (error naming step, ranks, tasks) or skip
    checkpoint_every: int = 0                 # meta-steps between checkpoints (and one at the end); 0 = none
    keep_last: int = 2                        # complete checkpoints kept (0 = all)
    # Resume: null, "auto" (OUTPUT_DIR/checkpoints/latest when there is one), or a checkpoint path.
    resume: Union[str, None] = None
    # A new (not resumed) run into an output_dir holding an earlier run's outputs: refused unless
    # true (CLI --overwrite); then they are removed once every check passed, before meta-step 1.
    overwrite: bool = False
    # Per-phase time per rank (gmeta_ds/profiling.py): profile this many meta-steps after
    # profile_warmup ones; OUTPUT_DIR/profile.json (+ Chrome traces with profile_trace).
    profile_steps: int = 0
    profile_warmup: int = 5
    profile_trace: bool = False


@dataclass
class EvalConfig:
    """Cold-start evaluation on held-out users (adapt on support, score query)."""

    enabled: bool = True
    # Inner steps at evaluation; "auto" = meta.inner_steps.
    inner_steps: Union[int, str] = AUTO
    tasks_per_batch: int = 64
    baseline: bool = True
    baseline_epochs: int = 3
    baseline_batch_size: int = 512
    baseline_lr: float = 1e-3
    # Fine-tune the baseline on each test user's support before scoring (its own metric).
    baseline_finetune: bool = True
    # Also fine-tune it with (lr, steps) chosen from a grid on the validation users
    # (data.valid_fraction > 0): baseline_finetune_tuned_*, baseline_finetune_lr / _steps.
    finetune_search: bool = False
    # Item popularity (shrunk click rate / mean rating) + a per-user offset fitted on the
    # support: baseline_popularity_* (gmeta_ds/baselines.py).
    popularity_baseline: bool = True
    # Which held-out users to score: test, or valid (log sources with data.valid_fraction > 0).
    split: str = "test"


@dataclass
class TextSyntheticConfig:
    """Generated few-shot text classification data (``text.data.path: null``): each class is
    a pair of words from a pool of ``topic_words``; its texts hold both among filler words
    that every class shares (see gmeta_ds/text/data.py)."""

    num_classes: int = 60
    examples_per_class: int = 20
    topic_words: int = 12
    filler_words: int = 200
    words_per_text: int = 8


@dataclass
class TextDataConfig:
    """A local text classification table and its N-way K-shot episodes."""

    path: Union[str, None] = None             # CSV / JSON(L) / Parquet file; null = generated
    format: str = "auto"                      # auto (from the extension) | csv | json | parquet
    text_column: str = "text"
    label_column: str = "label"
    ways: int = 5                             # N classes per episode (labels remapped to 0..N-1)
    shots: int = 5                            # K support examples per class
    queries: int = 5                          # Q query examples per class
    max_length: int = 32                      # tokens per text (truncated / padded)
    test_classes: float = 0.25                # share of classes held out (unseen in meta-training)
    synthetic: TextSyntheticConfig = field(default_factory=TextSyntheticConfig)


@dataclass
class TextModelConfig:
    """An ``AutoModelForSequenceClassification``: from a local pretrained directory, or built
    from ``config`` (random init) with a tokenizer trained on the data."""

    pretrained: Union[str, None] = None       # local model directory (from_pretrained)
    tokenizer: Union[str, None] = None        # local tokenizer directory (default: pretrained)
    vocab_size: int = 1000                    # trained tokenizer's vocabulary (no tokenizer given)
    config: dict = field(default_factory=lambda: {
        "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 128})
    # Second-order MAML differentiates attention twice: "eager" supports that everywhere;
    # "sdpa" is faster but its CPU kernels have no double backward (fine for first order).
    attn_implementation: str = "eager"


@dataclass
class TextConfig:
    """Few-shot sequence classification (``task: text``)."""

    data: TextDataConfig = field(default_factory=TextDataConfig)
    model: TextModelConfig = field(default_factory=TextModelConfig)
    eval_episodes: int = 100                  # test-class episodes scored after training
    baseline_steps: int = 30                  # fine-tune-from-scratch baseline: Adam steps per episode
    baseline_lr: float = 3e-3


@dataclass
class RunConfig:
    """A whole run: sections ``model``, ``meta``, ``embedding``, ``data``, ``train``, ``eval``,
    ``deepspeed`` (path to a JSON file, relative to the config file or cwd, or an inline dict)."""

    output_dir: str = "runs/default"
    seed: int = 0
    task: str = "ctr"                         # ctr (model.name on interaction logs) | text (Hugging Face)
    model: ModelConfig = field(default_factory=ModelConfig)
    meta: MetaConfig = field(default_factory=MetaConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    text: TextConfig = field(default_factory=TextConfig)
    deepspeed: Union[str, dict] = "ds_configs/zero0.json"
    # Directory the config file was read from: relative paths resolve against it first.
    config_dir: str = field(default=".", metadata={"internal": True})


# ---------------------------------------------------------------- building from dicts
def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Union:
        return any(_type_ok(value, t) for t in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is dict or typing.get_origin(tp) is dict:
        return isinstance(value, dict)
    if tp is type(None):
        return value is None
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Union:
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    if not isinstance(data, dict):
        problems.append(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            problems.append(f"{dotted}: unknown key; valid keys here: {', '.join(sorted(fields))}")
            continue
        tp = hints[key]
        inner = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        if inner is not None and dataclasses.is_dataclass(inner):
            if not isinstance(value, dict):
                problems.append(f"{dotted}: expected a mapping of name -> settings, got {value!r}")
                continue
            kwargs[key] = {k: _build(inner, v or {}, f"{dotted}.{k}.", problems) for k, v in value.items()}
        elif dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, f"{dotted}.", problems)
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{dotted}: {value!r} is not a finite number")
        elif tp is float and isinstance(value, int) and abs(value) > MAX_FLOAT:  # float() may overflow
            problems.append(f"{dotted}: {_short(value)} is too large; at most {MAX_FLOAT:g}")
        elif _type_ok(value, tp):
            kwargs[key] = float(value) if tp is float else value
        else:
            problems.append(f"{dotted}: expected {_type_name(tp)}, got {value!r}")
    return cls(**kwargs)


def _one_of(problems: list[str], key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        problems.append(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")


def _positive(problems: list[str], key: str, value: Any, allow_auto: bool = False) -> None:
    if allow_auto and value == AUTO:
        return
    if isinstance(value, str) or not value > 0:  # `not >` also refuses NaN
        allowed = "a positive number" + (" or 'auto'" if allow_auto else "")
        problems.append(f"{key}: {value!r} is not {allowed}")


# Upper bounds of numeric keys (their magnitude): past them a value is a mistake that would
# otherwise end deep in numpy, torch or datetime with an overflow or a MemoryError. Keys not
# listed: integers up to MAX_COUNT (an int32 index: ids, rows, users, steps), floats up to
# MAX_FLOAT. ``*`` stands for a table name or glob.
MAX_COUNT = 2**31 - 1
MAX_FLOAT = 1e12
MAX_WIDTH = 2**16
MAX_LAYERS = 1024
BOUNDS: dict[str, tuple[int, str]] = {
    "seed": (2**32 - 1, "2**32 - 1 (numpy's largest seed)"),
    "train.collective_timeout_s": (7 * 24 * 3600, "604800 (7 days)"),
    "train.threads": (4096, "4096 threads per rank"),
    "model.embed_dim": (4096, "4096 floats per row"),
    "model.hidden": (MAX_WIDTH, f"{MAX_WIDTH} units per layer"),
    "model.bottom_hidden": (MAX_WIDTH, f"{MAX_WIDTH} units per layer"),
    "model.tower_hidden": (MAX_WIDTH, f"{MAX_WIDTH} units per layer"),
    "model.cross_layers": (MAX_LAYERS, f"{MAX_LAYERS} layers"),
    "data.synthetic.latent_dim": (MAX_WIDTH, f"{MAX_WIDTH} dimensions"),
    "meta.inner_steps": (10_000, "10000 steps"),
    "eval.inner_steps": (10_000, "10000 steps"),
    "meta.tasks_per_micro_batch": (2**20, "2**20 tasks"),
    "meta.tasks_per_meta_step": (2**30, "2**30 tasks"),
    "text.model.vocab_size": (2**24, "2**24 tokens"),
    "text.data.max_length": (2**16, "2**16 tokens"),
    "data.new_item_year": (9999, "9999"),
}
# In-memory synthetic data costs ~36 bytes per interaction.
MAX_SYNTHETIC_INTERACTIONS = 2**31


def _short(value: Any) -> str:
    """A number for a message: a huge integer as ``~10**90``, not 91 digits (Python refuses to
    print more than 4300)."""
    if isinstance(value, int) and abs(value) > 10**15:
        digits = int(abs(value).bit_length() * 0.30103) + 1  # str() refuses over 4300 digits
        digits += abs(value) >= 10**digits
        digits -= abs(value) < 10**(digits - 1)
        return f"~{'-' if value < 0 else ''}10**{digits - 1}"
    return repr(value)


def _bound(schema_key: str, value: Any) -> tuple[float, str]:
    if schema_key in BOUNDS:
        return BOUNDS[schema_key]
    if isinstance(value, float):
        return MAX_FLOAT, f"{MAX_FLOAT:g}"
    return MAX_COUNT, "2**31 - 1 (int32)"


def _check_bounds(node: Any, dotted: str, schema_key: str, problems: list[str]) -> None:
    """Every number under ``node`` (a config dataclass, one of its dicts of tables or globs, a
    list of widths) against its `BOUNDS` entry; free-form dicts (``deepspeed``,
    ``text.model.config``) are checked by their owners."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            if not f.metadata.get("internal"):
                join = f"{dotted}.{f.name}" if dotted else f.name
                _check_bounds(getattr(node, f.name), join, f"{schema_key}.{f.name}" if schema_key else f.name,
                              problems)
    elif isinstance(node, dict) and schema_key in ("embedding.tables", "meta.inner_lr_scale"):
        for name, value in node.items():
            _check_bounds(value, f"{dotted}.{name}", f"{schema_key}.*", problems)
    elif isinstance(node, list) and node and all(isinstance(v, (int, float)) for v in node):
        if len(node) > MAX_LAYERS:
            problems.append(f"{dotted}: {len(node)} entries; at most {MAX_LAYERS}")
        too_big = [v for v in node if not isinstance(v, bool) and abs(v) > _bound(schema_key, v)[0]]
        if too_big:
            limit = _bound(schema_key, too_big[0])[1]
            problems.append(f"{dotted}: {_short(too_big[0])} is too large; at most {limit}")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        limit, text = _bound(schema_key, node)
        if abs(node) > limit:
            problems.append(f"{dotted}: {_short(node)} is too large; at most {text}")


# data.* keys that only interaction logs read (synthetic data has its own in data.synthetic),
# and those that only one log source reads. Not here: the machine's settings (cache_dir,
# memory_limit) and data.synthetic.* under a log source, so that one list of ``--set`` (a
# site's, a test harness's) serves every source.
LOG_ONLY_KEYS = ("path", "query_size", "split", "min_interactions", "max_interactions", "short_tasks",
                 "long_tasks", "min_count", "raw_ids", "test_fraction", "label", "threshold",
                 "four_state", "new_item_year")
SOURCE_ONLY_KEYS = {"dataset_name": "recbole", "format": "table", "sep": "table", "schema": "table"}
# model.name -> its default meta.adapt where that is not MetaConfig's ["mlp.*"] (the class's
# ``default_adapt``; tests/unit/test_input_matrix.py keeps the two equal).
MODEL_DEFAULT_ADAPT = {"two_tower": ("user_tower.*",)}


def _changed(section: Any, default: Any, names) -> list[str]:
    """The names among ``names`` whose value in ``section`` differs from ``default``'s."""
    return [n for n in names if getattr(section, n) != getattr(default, n)]


def _not_applying(problems: list[str], keys: list[str], why: str) -> None:
    for key in keys:
        problems.append(f"{key}: set, but {why}; remove it")


def _validate_applies(cfg: RunConfig, data: dict, problems: list[str]) -> None:
    """Keys set to a non-default value where the chosen source, model, table kind or task
    never reads them: refused, since a run would silently do something else than asked."""
    if cfg.task == "text":
        machine = {"cache_dir": cfg.data.cache_dir, "memory_limit": cfg.data.memory_limit}
        for name in ("model", "embedding", "data"):
            default = type(getattr(cfg, name))(**(machine if name == "data" else {}))
            if getattr(cfg, name) != default:
                _not_applying(problems, [name], "task: text reads text.* (this section is the CTR task's)")
        return
    if cfg.text != TextConfig():
        _not_applying(problems, ["text"], "task: ctr does not read it (it configures task: text)")
    d, default = cfg.data, DataConfig()
    if d.source == "synthetic":
        keys = _changed(d, default, (*LOG_ONLY_KEYS, *SOURCE_ONLY_KEYS))
        _not_applying(problems, [f"data.{n}" for n in keys],
                      "data.source: synthetic does not read it (its settings are data.synthetic.*)")
    else:
        for name, source in SOURCE_ONLY_KEYS.items():
            if d.source != source and _changed(d, default, [name]):
                _not_applying(problems, [f"data.{name}"], f"only data.source: {source} reads it")
        if d.label == "regression" and _changed(d, default, ["threshold"]):
            _not_applying(problems, ["data.threshold"],
                          "data.label: regression keeps the rating (no click threshold)")
        if not d.four_state and _changed(d, default, ["new_item_year"]):
            _not_applying(problems, ["data.new_item_year"], "it applies with data.four_state: true")
    m = cfg.model
    if not m.item_popularity and _changed(m, ModelConfig(), ["popularity_prior"]):
        _not_applying(problems, ["model.popularity_prior"], "it applies with model.item_popularity: true")
    given = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    default_adapt = tuple(cfg.meta.adapt) == tuple(MetaConfig().adapt)
    if "adapt" in given and m.name in MODEL_DEFAULT_ADAPT and default_adapt:  # not replaced unseen
        problems.append(f"meta.adapt: {cfg.meta.adapt!r} is given, but model.name: {m.name} has no mlp; "
                        f"leave meta.adapt out for its default {list(MODEL_DEFAULT_ADAPT[m.name])} or "
                        "name its parameters")
    for name, table in cfg.embedding.tables.items():
        if table.kind != "dynamic":
            keys = _changed(table, TableOverride(), ("admit_after", "eviction"))
            _not_applying(problems, [f"embedding.tables.{name}.{k}" for k in keys],
                          "only kind: dynamic tables admit and evict ids")


def _validate(cfg: RunConfig, problems: list[str]) -> None:
    _check_bounds(cfg, "", "", problems)
    syn = cfg.data.synthetic
    sizes = (syn.num_users, syn.max_interactions)
    if (cfg.data.source == "synthetic" and all(isinstance(v, int) for v in sizes)
            and syn.num_users * syn.max_interactions > MAX_SYNTHETIC_INTERACTIONS):
        problems.append(f"data.synthetic.num_users x max_interactions: {syn.num_users} x "
                        f"{syn.max_interactions} interactions are too many; at most 2**31 (generated "
                        "in memory, ~36 bytes each)")
    _one_of(problems, "task", cfg.task, WORKLOADS.names())
    if not cfg.output_dir.strip():
        problems.append("output_dir: empty; expected the directory the run writes its files to")
    if cfg.seed < 0:
        problems.append(f"seed: {cfg.seed} must be an integer >= 0")
    if cfg.meta.vectorize not in (True, False, AUTO):
        problems.append(f"meta.vectorize: {cfg.meta.vectorize!r} is not one of true, false, auto")
    if cfg.meta.split_body not in (True, False, AUTO):
        problems.append(f"meta.split_body: {cfg.meta.split_body!r} is not one of true, false, auto")
    _positive(problems, "meta.vectorize_budget_mb", cfg.meta.vectorize_budget_mb, allow_auto=True)
    if cfg.model.popularity_feature and not cfg.model.item_popularity:
        problems.append("model.popularity_feature: needs model.item_popularity: true (the statistic it "
                        "feeds in)")
    if cfg.meta.support_level is not None and cfg.meta.support_level < 0:
        problems.append(f"meta.support_level: {cfg.meta.support_level!r} must be null or a number >= 0")
    if cfg.meta.support_level is not None and (cfg.task != "ctr" or not cfg.model.item_popularity):
        problems.append("meta.support_level: sets each task's level from the item-popularity offset; "
                        "set model.item_popularity: true")
    if cfg.meta.offset_first is not None and cfg.meta.offset_first < 0:
        problems.append(f"meta.offset_first: {cfg.meta.offset_first!r} must be null or a number >= 0")
    if cfg.meta.offset_first is not None and (cfg.task != "ctr" or not cfg.model.item_popularity):
        problems.append("meta.offset_first: fits the popularity offset's bias per task; set "
                        "model.item_popularity: true")
    if not isinstance(cfg.meta.inner_loss_prior, (int, float)) or cfg.meta.inner_loss_prior < 0:
        problems.append(f"meta.inner_loss_prior: {cfg.meta.inner_loss_prior!r} must be a number >= 0")
    for pattern, scale in cfg.meta.inner_lr_scale.items():
        _positive(problems, f"meta.inner_lr_scale.{pattern}", scale)
    if cfg.task == "text":
        _validate_text(cfg.text, problems)
    _one_of(problems, "meta.algorithm", cfg.meta.algorithm, ALGORITHMS.names())
    _one_of(problems, "embedding.sharding", cfg.embedding.sharding, SHARDINGS)
    _one_of(problems, "data.source", cfg.data.source, DATA_SOURCES.names())
    _validate_embedding(cfg.embedding, problems)
    for key in ("meta.inner_steps", "meta.inner_lr", "train.meta_steps", "train.lr",
                "train.log_every", "train.collective_timeout_s", "model.embed_dim",
                "eval.tasks_per_batch", "eval.baseline_batch_size", "eval.baseline_lr"):
        section, name = key.split(".")
        _positive(problems, key, getattr(getattr(cfg, section), name))
    for key in ("meta.tasks_per_micro_batch", "meta.tasks_per_meta_step"):
        _positive(problems, key, getattr(cfg.meta, key.split(".")[1]), allow_auto=True)
    _positive(problems, "train.threads", cfg.train.threads, allow_auto=True)
    _positive(problems, "eval.inner_steps", cfg.eval.inner_steps, allow_auto=True)
    _one_of(problems, "eval.split", cfg.eval.split, ("test", "valid"))
    if cfg.eval.split == "valid" and (cfg.data.source == "synthetic" or cfg.data.valid_fraction <= 0):
        problems.append("eval.split: 'valid' needs a log source with data.valid_fraction > 0")
    if not 0.0 <= cfg.data.valid_fraction < 1.0 or cfg.data.valid_fraction + cfg.data.test_fraction >= 1.0:
        problems.append(f"data.valid_fraction: {cfg.data.valid_fraction!r} must be in [0, 1) and leave "
                        f"training users next to data.test_fraction ({cfg.data.test_fraction})")
    if cfg.eval.finetune_search:
        if cfg.data.valid_fraction <= 0:
            problems.append("eval.finetune_search: chooses the fine-tuned baseline's lr and steps on "
                            "validation users; set data.valid_fraction > 0 (e.g. 0.1)")
        if not cfg.eval.baseline:
            problems.append("eval.finetune_search: needs eval.baseline: true (it tunes that baseline)")
        if cfg.eval.split == "valid":
            problems.append("eval.finetune_search: chooses on the validation users, so it needs "
                            "eval.split: test (not valid)")
    _one_of(problems, "data.long_tasks", cfg.data.long_tasks, ("skip", "train"))
    if cfg.data.resample and cfg.data.split == "time":
        problems.append("data.resample: redraws each task's query at random, which would break "
                        "data.split: time (query = the latest rows); use data.split: random")
    if cfg.eval.baseline_epochs < 0:
        problems.append(f"eval.baseline_epochs: {cfg.eval.baseline_epochs!r} must be >= 0")
    _one_of(problems, "train.nonfinite", cfg.train.nonfinite, ("abort", "skip"))
    for key in ("checkpoint_every", "keep_last", "profile_steps", "profile_warmup"):
        value = getattr(cfg.train, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(f"train.{key}: {value!r} must be an integer >= 0")
    if cfg.train.resume is not None and not (isinstance(cfg.train.resume, str) and cfg.train.resume):
        problems.append(f"train.resume: {cfg.train.resume!r} must be null, 'auto' or a checkpoint path")
    if not cfg.meta.adapt:
        problems.append("meta.adapt: empty; give at least one glob pattern, e.g. ['mlp.*']")
    _one_of(problems, "model.name", cfg.model.name, MODELS.names())
    for key in ("hidden", "bottom_hidden", "tower_hidden"):
        widths = getattr(cfg.model, key)
        if any(h <= 0 for h in widths):
            problems.append(f"model.{key}: {widths!r} must be positive layer widths")
    if not cfg.model.tower_hidden:
        problems.append("model.tower_hidden: empty; the last width is the two towers' dot-product dimension")
    _positive(problems, "model.cross_layers", cfg.model.cross_layers)
    _positive(problems, "model.popularity_prior", cfg.model.popularity_prior)
    if cfg.data.source == "synthetic":
        _validate_synthetic(cfg.data.synthetic, problems)
    else:
        _validate_log(cfg.data, problems)


def _validate_text(text: TextConfig, problems: list[str]) -> None:
    d = text.data
    _one_of(problems, "text.data.format", d.format, TEXT_FORMATS)
    for name in ("ways", "shots", "queries", "max_length"):
        _positive(problems, f"text.data.{name}", getattr(d, name))
    if d.ways < 2 and not isinstance(d.ways, str):
        problems.append(f"text.data.ways: {d.ways} must be >= 2 (a classification episode)")
    if not 0.0 < d.test_classes < 1.0:
        problems.append(f"text.data.test_classes: {d.test_classes!r} must be in (0, 1)")
    syn = d.synthetic
    for name in ("num_classes", "examples_per_class", "topic_words", "filler_words", "words_per_text"):
        _positive(problems, f"text.data.synthetic.{name}", getattr(syn, name))
    if d.path is None and syn.topic_words * (syn.topic_words - 1) // 2 < syn.num_classes:
        problems.append(f"text.data.synthetic.topic_words: {syn.topic_words} words make "
                        f"{syn.topic_words * (syn.topic_words - 1) // 2} pairs, fewer than "
                        f"num_classes ({syn.num_classes})")
    if d.path is None and syn.words_per_text < 2:
        problems.append(f"text.data.synthetic.words_per_text: {syn.words_per_text} must be >= 2 "
                        "(a text holds its class's two topic words)")
    for name in ("eval_episodes", "baseline_steps", "baseline_lr"):
        _positive(problems, f"text.{name}", getattr(text, name))
    _positive(problems, "text.model.vocab_size", text.model.vocab_size)
    _one_of(problems, "text.model.attn_implementation", text.model.attn_implementation,
            ("eager", "sdpa"))


def _validate_embedding(emb: EmbeddingConfig, problems: list[str]) -> None:
    _one_of(problems, "embedding.plan", emb.plan, (AUTO, *PLANS.names()))
    _one_of(problems, "embedding.row_owner", emb.row_owner, ROW_OWNERS)
    _one_of(problems, "embedding.optimizer", emb.optimizer, SPARSE_OPTIMIZERS.names())
    _one_of(problems, "embedding.bad_ids", emb.bad_ids, BAD_ID_POLICIES)
    _positive(problems, "embedding.lr", emb.lr)
    _positive(problems, "embedding.init_std", emb.init_std)
    _one_of(problems, "embedding.device", emb.device, TABLE_DEVICES)
    _one_of(problems, "embedding.exchange", emb.exchange, EXCHANGES)
    for name, table in emb.tables.items():
        _validate_table(name, table, problems)
    if emb.sharding != "replicated":
        return
    if any(t.kind == "dynamic" for t in emb.tables.values()):
        problems.append("embedding.tables: dynamic tables need embedding.sharding: sharded (they live "
                        "outside the DeepSpeed engine, on their owner ranks)")
    elif emb.tables or emb.plan != "auto":
        problems.append("embedding.plan / embedding.tables apply to embedding.sharding: sharded; "
                        "with 'replicated' every table lives inside the DeepSpeed engine")
    if emb.exchange != AUTO:
        problems.append("embedding.exchange applies to embedding.sharding: sharded; replicated tables "
                        "are looked up inside the DeepSpeed engine, with no exchange")
    if emb.device != AUTO:
        problems.append("embedding.device applies to embedding.sharding: sharded; replicated tables "
                        "live inside the DeepSpeed engine, on its device")


def _validate_table(name: str, table: TableOverride, problems: list[str]) -> None:
    key = f"embedding.tables.{name}"
    _one_of(problems, f"{key}.kind", table.kind, ("static", "dynamic"))
    if table.device is not None:
        _one_of(problems, f"{key}.device", table.device, TABLE_DEVICES)
    if table.exchange is not None:
        _one_of(problems, f"{key}.exchange", table.exchange, EXCHANGES)
    if table.kind == "dynamic":
        if not isinstance(table.capacity, int) or isinstance(table.capacity, bool) or table.capacity < 1:
            problems.append(f"{key}.capacity: a dynamic table needs its rows per rank as an integer "
                            f">= 1, got {table.capacity!r}")
        if not isinstance(table.admit_after, int) or table.admit_after < 1:
            problems.append(f"{key}.admit_after: expected an integer >= 1 (lookups before an id gets "
                            f"its own row), got {table.admit_after!r}")
        _one_of(problems, f"{key}.eviction", table.eviction, ("lru", "lfu"))
        if table.plan not in (AUTO, "dynamic"):
            problems.append(f"{key}.plan: {table.plan!r}, but a dynamic table's rows are placed by a "
                            "hash of the id; leave plan at auto")
    elif table.capacity is not None:
        problems.append(f"{key}.capacity applies to kind: dynamic (a static table has one row per "
                        "vocabulary id)")
    if table.kind != "dynamic":
        _one_of(problems, f"{key}.plan", table.plan, (AUTO, *PLANS.names()))
    if table.optimizer is not None:
        _one_of(problems, f"{key}.optimizer", table.optimizer, SPARSE_OPTIMIZERS.names())
    if table.lr is not None:
        _positive(problems, f"{key}.lr", table.lr)


def _validate_log(data: DataConfig, problems: list[str]) -> None:
    if not data.path:
        problems.append(f"data.path: required for data.source {data.source!r} (the folder or file "
                        "holding the log)")
    if data.source == "recbole" and not data.dataset_name:
        problems.append("data.dataset_name: required for data.source 'recbole' (<name>.inter)")
    _one_of(problems, "data.split", data.split, SPLITS)
    if data.source == "table" and data.split == "time" and not data.schema.timestamp:
        problems.append("data.split: 'time' orders each task by its timestamp, but "
                        "data.schema.timestamp names no column; name it, or use 'random'")
    _one_of(problems, "data.short_tasks", data.short_tasks, ("skip", "error"))
    _one_of(problems, "data.label", data.label, LABEL_KINDS)
    _one_of(problems, "data.format", data.format, ("auto", "csv", "parquet"))
    try:
        parse_memory(data.memory_limit)
    except ValueError as exc:
        problems.append(str(exc))
    _positive(problems, "data.min_count", data.min_count)
    _check_task_sizes(data, "data.", problems)


def _check_task_sizes(section, p: str, problems: list[str]) -> None:
    """Task-size keys shared by data and data.synthetic (``p`` is the dotted prefix)."""
    for name in ("min_interactions", "query_size"):
        _positive(problems, p + name, getattr(section, name))
    if section.min_interactions <= section.query_size:
        problems.append(f"{p}min_interactions: {section.min_interactions} must exceed "
                        f"{p}query_size ({section.query_size}) so every task keeps a support set")
    if section.max_interactions < section.min_interactions:
        problems.append(f"{p}max_interactions: {section.max_interactions} must be >= "
                        f"{p}min_interactions ({section.min_interactions})")
    if not 0.0 < section.test_fraction < 1.0:
        problems.append(f"{p}test_fraction: {section.test_fraction!r} must be in (0, 1)")


def _validate_synthetic(syn: SyntheticConfig, problems: list[str]) -> None:
    for name in ("num_users", "num_items", "latent_dim"):
        _positive(problems, "data.synthetic." + name, getattr(syn, name))
    if syn.num_users == 1:
        problems.append(f"data.synthetic.num_users: {syn.num_users} must be >= 2 (train and test "
                        "each need a user)")
    if syn.user_bias_std < 0:
        problems.append(f"data.synthetic.user_bias_std: {syn.user_bias_std} must be >= 0")
    _check_task_sizes(syn, "data.synthetic.", problems)


# ---------------------------------------------------------------- public API
MAX_CONFIG_BYTES = 2**20  # a run config is a few KB; more is a wrong file, or an attack
# Nodes a document may hold with every alias expanded: a few hundred in any real config. An
# alias is shared in the parsed object, but the checks and copies downstream walk it once per
# use: ten lines of nested aliases ("billion laughs") make 10**9 nodes and exhaust memory.
MAX_YAML_NODES = 100_000


class YAMLLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads exponent floats without a dot (``1e-3``, ``5E+2``,
    ``1e3``) as floats, as YAML 1.2 does (PyYAML follows YAML 1.1, where they are strings).

    Before building anything it refuses a mapping that repeats a key (PyYAML keeps the last
    value silently, so a typo'd second ``lr:`` would win unseen) and a document whose aliases
    expand past `MAX_YAML_NODES` nodes, each a `yaml.YAMLError` naming the key path and line."""

    def construct_document(self, node):
        _check_nodes(node)
        try:
            return super().construct_document(node)
        except (ValueError, OverflowError) as exc:  # a 5000-digit int, a date like 2024-13-01
            raise yaml.YAMLError(f"a value cannot be read ({exc})") from exc


YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))


def _key_text(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        return str(node.value)
    return f"<{node.id} on line {node.start_mark.line + 1}>"


def _check_nodes(root: yaml.Node) -> None:
    """Duplicate keys and the alias-expanded size of the tree under ``root`` (`YAMLLoader`).
    Sizes are memoised per node, so the walk costs the nodes written, not their expansion."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, path: str) -> int:
        if id(node) in sizes:  # an alias of a node already walked
            return sizes[id(node)]
        sizes[id(node)] = 1  # a recursive alias counts once (the constructor handles cycles)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple, int] = {}
            for key, value in node.value:
                name, line = _key_text(key), key.start_mark.line + 1
                dotted = f"{path}.{name}" if path else name
                if name != "<<" and (key.tag, name) in seen:  # merge keys may repeat
                    raise yaml.YAMLError(f"{dotted}: duplicate key on line {line} (first on line "
                                         f"{seen[key.tag, name]}); keep one")
                seen.setdefault((key.tag, name), line)
                total += size(key, dotted) + size(value, dotted)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(size(item, f"{path}[{i}]") for i, item in enumerate(node.value))
        if total > MAX_YAML_NODES:
            raise yaml.YAMLError(f"{path or 'the document'} (line {node.start_mark.line + 1}): its "
                                 f"aliases (*name) expand to more than {MAX_YAML_NODES} values; a "
                                 "config needs a few hundred, write them out")
        sizes[id(node)] = total
        return total

    size(root, "")


def load_yaml(text: str) -> Any:
    """Parse YAML text as config files and ``--set`` values are parsed (`YAMLLoader`)."""
    return yaml.load(text, Loader=YAMLLoader)  # a SafeLoader subclass: no arbitrary objects


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"meta.inner_lr=0.05"`` -> (["meta", "inner_lr"], 0.05); values are parsed as YAML."""
    if "=" not in text:
        raise ConfigError([f"--set {text!r}: expected dotted.key=value"])
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(part.strip() for part in path):
        raise ConfigError([f"--set {text!r}: empty key part in {key.strip()!r}; expected dotted.key=value"])
    try:
        return path, load_yaml(raw)
    except RecursionError:
        raise ConfigError([f"--set {text!r}: the value nests too deeply"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"--set {text!r}: the value is not valid YAML "
                           f"({getattr(exc, 'problem', None) or exc})"]) from exc


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``dotted.key=value`` override applied."""
    data = copy.deepcopy(data)  # not a JSON round trip: YAML dates would fail it
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError([f"--set {text!r}: {part!r} is not a section"])
        node[path[-1]] = value
    return data


def config_from_dict(data: dict, source: str | None = None, config_dir: str = ".") -> RunConfig:
    """Build and validate a `RunConfig`; raises `ConfigError` listing every problem."""
    problems: list[str] = []
    cfg = _build(RunConfig, data, "", problems)
    _validate(cfg, problems)  # values with a wrong type kept their defaults: safe to check
    _validate_applies(cfg, data, problems)
    if problems:
        raise ConfigError(problems, source)
    cfg.config_dir = config_dir
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config file, apply ``--set`` overrides, validate."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, expected a YAML file" if path.is_dir() else "does not exist"
        raise ConfigError([f"config file {str(path)!r} {what}"])
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError([f"config file {str(path)!r} holds {path.stat().st_size} bytes; a run config "
                               f"is a few KB (at most {MAX_CONFIG_BYTES}): is it the right file?"])
        data = load_yaml(path.read_text())
    except RecursionError:
        raise ConfigError(["not valid as a config: its values nest too deeply"], str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], str(path)) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"config file {str(path)!r} cannot be read as text ({exc})"]) from exc
    if data is None:
        expected = "a YAML mapping of sections (model, meta, data, train, deepspeed, ...)"
        raise ConfigError([f"the file is empty; expected {expected}"], str(path))
    if not isinstance(data, dict):
        raise ConfigError([f"config: expected a mapping of sections (model, meta, ...), got a "
                           f"{type(data).__name__}"], str(path))
    data = apply_overrides(data, overrides or [])
    return config_from_dict(data, str(path), str(path.parent))


def config_to_dict(cfg: RunConfig) -> dict:
    """Plain dict of a config (for logging and summary files), without internal fields."""
    out = dataclasses.asdict(cfg)
    out.pop("config_dir", None)
    return out
