"""The whole run config: `RunConfig`, building it from dicts, cross-section checks, loading
files and ``--set`` overrides. Every problem is raised at once as one `ConfigError`."""
from __future__ import annotations

import copy
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from gmeta_ds.config.bounds import MAX_FLOAT, MAX_SYNTHETIC_INTERACTIONS, check_bounds, short_value
from gmeta_ds.config.checks import EMBEDDING_MODES, one_of, check_positive
from gmeta_ds.config.data import SUPPORT_SIZES, DataConfig, validate_log, validate_synthetic
from gmeta_ds.config.embedding import EmbeddingConfig, TableOverride, renew_sharding, validate_embedding
from gmeta_ds.config.eval import EvalConfig
from gmeta_ds.config.meta import MetaConfig, validate_meta_options
from gmeta_ds.config.model import MODEL_DEFAULT_ADAPT, ModelConfig, validate_model
from gmeta_ds.config.sites import SitesConfig, validate_sites, validate_sites_run
from gmeta_ds.config.text import TextConfig, validate_text
from gmeta_ds.config.train import TrainConfig, validate_train
from gmeta_ds.config.yaml_io import load_yaml
from gmeta_ds.errors import ConfigError
from gmeta_ds.files import not_a_file
from gmeta_ds.registry import ALGORITHMS, DATA_SOURCES, WORKLOADS

MAX_CONFIG_BYTES = 2**20  # a run config is a few KB; more is a wrong file, or an attack


@dataclass
class RunConfig:
    """A whole run: sections ``model``, ``meta``, ``embedding``, ``data``, ``train``, ``eval``,
    ``sites``, ``deepspeed`` (path to a JSON file, relative to the config file or cwd, or an inline dict)."""

    # Where rank 0 writes metrics, summary, checkpoints (relative: to the cwd).
    output_dir: str = "runs/default"
    # The run seed: data, initialisation and sampling all derive from it.
    seed: int = 0
    task: str = "ctr"                         # ctr (model.name on interaction logs) | text (Hugging Face)
    model: ModelConfig = field(default_factory=ModelConfig)
    meta: MetaConfig = field(default_factory=MetaConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sites: SitesConfig = field(default_factory=SitesConfig)
    text: TextConfig = field(default_factory=TextConfig)
    # A DeepSpeed JSON (ds_configs/README.md) or an inline dict; --deepspeed_config overrides.
    deepspeed: Union[str, dict] = "ds_configs/zero0.json"
    # Directory the config file was read from: relative paths resolve against it first.
    config_dir: str = field(default=".", metadata={"internal": True})


# Every default, read back: the Python API's signatures take theirs from here
# (``inner_steps=DEFAULTS.meta.inner_steps``), so one edit of a section's dataclass changes the
# YAML's default and the API's together (tests/unit/test_api_defaults.py keeps them so). Read
# only: copy a list or dict before changing it.
DEFAULTS = RunConfig()


# ---------------------------------------------------------------- building from dicts
def _type_ok(value: Any, tp: Any) -> bool:
    """Whether a YAML ``value`` fits the field type ``tp`` (ints are floats; bools are not ints)."""
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
    if origin is dict:  # dict[K, V]: every key and value typed (a bare dict: any mapping)
        key_type, value_type = typing.get_args(tp)
        return isinstance(value, dict) and all(_type_ok(k, key_type) and _type_ok(v, value_type)
                                               for k, v in value.items())
    if tp is dict:
        return isinstance(value, dict)
    if tp is type(None):
        return value is None
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    """``tp`` as a message names it: 'int or str', 'list of int'."""
    if typing.get_origin(tp) is Union:
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return "dict of {} -> {}".format(*(_type_name(t) for t in typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    """The dataclass ``cls`` from a mapping; unknown keys and wrong types go to ``problems``."""
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
            problems.append(f"{dotted}: {short_value(value)} is too large; at most {MAX_FLOAT:g}")
        elif _type_ok(value, tp):
            kwargs[key] = float(value) if tp is float else value
        else:
            problems.append(f"{dotted}: expected {_type_name(tp)}, got {value!r}")
    return cls(**kwargs)


# data.* keys that only interaction logs read (synthetic data has its own in data.synthetic),
# and those that only one log source reads. Not here: the machine's settings (cache_dir,
# memory_limit) and data.synthetic.* under a log source, so that one list of ``--set`` (a
# site's, a test harness's) serves every source.
LOG_ONLY_KEYS = ("path", "query_size", "split", "min_interactions", "max_interactions", "short_tasks",
                 "long_tasks", "min_count", "raw_ids", "test_fraction", "label", "threshold",
                 "four_state", "new_item_year")
SOURCE_ONLY_KEYS = {"dataset_name": "recbole", "format": "table", "sep": "table", "schema": "table",
                    "storage_options": "table", "filter": "table", "version_as_of": "table",
                    "timestamp_as_of": "table"}


def _changed(section: Any, default: Any, names) -> list[str]:
    """The names among ``names`` whose value in ``section`` differs from ``default``'s."""
    return [n for n in names if getattr(section, n) != getattr(default, n)]


def _not_applying(problems: list[str], keys: list[str], why: str) -> None:
    """Report each of ``keys`` as set where nothing reads it, and ``why``."""
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
    if cfg.sites.count == 1:
        keys = _changed(cfg.sites, SitesConfig(), ("sync_every", "outer_lr", "outer_momentum", "nesterov",
                                                   "delta_dtype"))
        _not_applying(problems, [f"sites.{k}" for k in keys], "sites.count is 1 (one site: nothing to synchronise)")
    for name, table in cfg.embedding.tables.items():
        if table.kind != "dynamic":
            keys = _changed(table, TableOverride(), ("admit_after", "eviction"))
            _not_applying(problems, [f"embedding.tables.{name}.{k}" for k in keys],
                          "only kind: dynamic tables admit and evict ids")


def _validate(cfg: RunConfig, problems: list[str]) -> None:
    """Every value check, section by section, in the order their lines are reported."""
    check_bounds(cfg, "", "", problems)
    _validate_run(cfg, problems)
    validate_meta_options(cfg.meta, problems)
    _validate_popularity(cfg, problems)
    _validate_objective(cfg, problems)
    if cfg.task == "text":
        validate_text(cfg.text, problems)
    one_of(problems, "meta.algorithm", cfg.meta.algorithm, ALGORITHMS.names())
    one_of(problems, "embedding.sharding", cfg.embedding.sharding, EMBEDDING_MODES)
    one_of(problems, "data.source", cfg.data.source, DATA_SOURCES.names())
    validate_embedding(cfg.embedding, problems)
    _validate_positives(cfg, problems)
    _validate_held_out(cfg, problems)
    one_of(problems, "data.long_tasks", cfg.data.long_tasks, ("skip", "train"))
    one_of(problems, "data.resample_support", cfg.data.resample_support, SUPPORT_SIZES)
    if cfg.data.resample_support == "random" and not cfg.data.resample:
        problems.append("data.resample_support: random sizes the support of redrawn episodes; set "
                        "data.resample: true")
    if cfg.data.resample and cfg.data.split == "time":
        problems.append("data.resample: redraws each task's query at random, which would break "
                        "data.split: time (query = the latest rows); use data.split: random")
    for key in ("baseline_epochs", "bootstrap_resamples"):
        if getattr(cfg.eval, key) < 0:
            problems.append(f"eval.{key}: {getattr(cfg.eval, key)!r} must be >= 0")
    if any(k < 1 for k in cfg.eval.few_shot):
        problems.append(f"eval.few_shot: {cfg.eval.few_shot!r} must be support sizes >= 1")
    if any(k < 0 for k in cfg.eval.steps_curve):
        problems.append(f"eval.steps_curve: {cfg.eval.steps_curve!r} must be inner step counts >= 0")
    validate_train(cfg.train, problems)
    validate_sites(cfg.sites, problems)
    validate_sites_run(cfg, None, problems)
    if not cfg.meta.adapt:
        problems.append("meta.adapt: empty; give at least one glob pattern, e.g. ['mlp.*']")
    validate_model(cfg.model, problems)
    if cfg.data.source == "synthetic":
        validate_synthetic(cfg.data.synthetic, problems)
    else:
        validate_log(cfg.data, problems)


def _validate_run(cfg: RunConfig, problems: list[str]) -> None:
    """Top-level keys, and the in-memory size of generated data."""
    syn = cfg.data.synthetic
    sizes = (syn.num_users, syn.max_interactions)
    if (cfg.data.source == "synthetic" and all(isinstance(v, int) for v in sizes)
            and syn.num_users * syn.max_interactions > MAX_SYNTHETIC_INTERACTIONS):
        problems.append(f"data.synthetic.num_users x max_interactions: {syn.num_users} x "
                        f"{syn.max_interactions} interactions are too many; at most 2**31 (generated "
                        "in memory, ~36 bytes each)")
    one_of(problems, "task", cfg.task, WORKLOADS.names())
    if not cfg.output_dir.strip():
        problems.append("output_dir: empty; expected the directory the run writes its files to")
    if not cfg.data.cache_dir.strip():
        problems.append("data.cache_dir: empty; expected the folder task stores are kept in (default "
                        "~/.cache/gmeta_ds, following $XDG_CACHE_HOME); an empty path would write them "
                        "into the working directory")
    if cfg.seed < 0:
        problems.append(f"seed: {cfg.seed} must be an integer >= 0")


def _validate_popularity(cfg: RunConfig, problems: list[str]) -> None:
    """The meta keys that build on the item-popularity offset (model.item_popularity), and the
    inner loss's prior and per-glob scales."""
    meta = cfg.meta
    if cfg.model.popularity_feature and not cfg.model.item_popularity:
        problems.append("model.popularity_feature: needs model.item_popularity: true (the statistic it "
                        "feeds in)")
    if meta.support_level is not None and meta.support_level < 0:
        problems.append(f"meta.support_level: {meta.support_level!r} must be null or a number >= 0")
    if meta.support_level is not None and (cfg.task != "ctr" or not cfg.model.item_popularity):
        problems.append("meta.support_level: sets each task's level from the item-popularity offset; "
                        "set model.item_popularity: true")
    if meta.offset_first is not None and meta.offset_first < 0:
        problems.append(f"meta.offset_first: {meta.offset_first!r} must be null or a number >= 0")
    if meta.offset_first is not None and (cfg.task != "ctr" or not cfg.model.item_popularity):
        problems.append("meta.offset_first: fits the popularity offset's bias per task; set "
                        "model.item_popularity: true")
    if not isinstance(meta.inner_loss_prior, (int, float)) or meta.inner_loss_prior < 0:
        problems.append(f"meta.inner_loss_prior: {meta.inner_loss_prior!r} must be a number >= 0")
    for pattern, scale in meta.inner_lr_scale.items():
        check_positive(problems, f"meta.inner_lr_scale.{pattern}", scale)


def _validate_objective(cfg: RunConfig, problems: list[str]) -> None:
    """``meta.rank_weight``, ``meta.init_weight``, ``meta.warmup_steps``: what the outer loss asks for."""
    meta = cfg.meta
    if isinstance(meta.rank_weight, bool) or not isinstance(meta.rank_weight, (int, float)) or not meta.rank_weight >= 0:
        problems.append(f"meta.rank_weight: {meta.rank_weight!r} must be a finite number >= 0")
    elif meta.rank_weight and cfg.task != "ctr":
        problems.append(f"meta.rank_weight: orders a task's rows by their labels; task {cfg.task!r} "
                        "has class labels (ctr only)")
    if isinstance(meta.init_weight, bool) or not isinstance(meta.init_weight, (int, float)) or not meta.init_weight >= 0:
        problems.append(f"meta.init_weight: {meta.init_weight!r} must be a finite number >= 0")
    if isinstance(meta.warmup_steps, bool) or not isinstance(meta.warmup_steps, int) or meta.warmup_steps < 0:
        problems.append(f"meta.warmup_steps: {meta.warmup_steps!r} must be an integer >= 0")
    elif isinstance(cfg.train.meta_steps, int) and meta.warmup_steps >= cfg.train.meta_steps > 0:
        problems.append(f"meta.warmup_steps: {meta.warmup_steps} leaves no meta-step of meta-training "
                        f"(train.meta_steps is {cfg.train.meta_steps}); it must be below it")


def _validate_positives(cfg: RunConfig, problems: list[str]) -> None:
    """Rates, steps and sizes across sections that must be > 0 (some may be 'auto')."""
    for key in ("meta.inner_steps", "meta.inner_lr", "train.meta_steps", "train.lr",
                "train.log_every", "train.collective_timeout_s", "model.embed_dim",
                "eval.tasks_per_batch", "eval.baseline_batch_size", "eval.baseline_lr"):
        section, name = key.split(".")
        check_positive(problems, key, getattr(getattr(cfg, section), name))
    for key in ("meta.tasks_per_micro_batch", "meta.tasks_per_meta_step"):
        check_positive(problems, key, getattr(cfg.meta, key.split(".")[1]), allow_auto=True)
    check_positive(problems, "train.threads", cfg.train.threads, allow_auto=True)
    check_positive(problems, "eval.inner_steps", cfg.eval.inner_steps, allow_auto=True)


def _validate_held_out(cfg: RunConfig, problems: list[str]) -> None:
    """Which held-out users eval scores (eval.split) against the fractions data holds out."""
    one_of(problems, "eval.split", cfg.eval.split, ("test", "valid"))
    if cfg.eval.split == "valid" and cfg.data.valid_fraction <= 0:
        problems.append("eval.split: 'valid' scores the validation users; set data.valid_fraction > 0 (e.g. 0.1)")
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
    data = renew_sharding(data)
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
    what = not_a_file(path)
    if what not in (None, "is empty"):  # an empty file: the message below
        what = "is a directory, expected a YAML file" if what == "is a folder" else f"{what}; expected a YAML file"
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


# data.storage_options keys whose values are secrets (S3's secret_key, Azure's account_key,
# sas_token, client_secret, GCS's access_token...): never printed nor written to a file
SECRET_OPTION_WORDS = ("secret", "key", "token", "password", "credential", "sas")


def config_to_dict(cfg: RunConfig) -> dict:
    """Plain dict of a config (for logging and summary files), without internal fields and with
    the secrets among ``data.storage_options`` shown as ``***``."""
    out = dataclasses.asdict(cfg)
    out.pop("config_dir", None)
    options = out["data"]["storage_options"]
    for k in options:
        if any(word in k.lower() for word in SECRET_OPTION_WORDS):
            options[k] = "***"
    return out
