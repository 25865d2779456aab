"""Run configuration: dataclasses built from YAML, ``--set`` overrides, validation.

Layer 0: no torch. Every problem is collected and raised at once as a `ConfigError` whose
lines name the dotted key, the value and what is allowed. Defaults live here only, one module
per section (``model``, ``meta``, ``embedding``, ``data``, ``train``, ``eval``, ``text``), each
with its dataclasses and its own checks; `run` holds `RunConfig`, the cross-section checks,
loading and overrides, and `DEFAULTS` (every default, which the Python API's signatures read
too); `bounds` the numeric limits; `yaml_io` the YAML reader.
"""
from __future__ import annotations

from gmeta_ds.config.bounds import (BOUNDS, MAX_COUNT, MAX_FLOAT, MAX_LAYERS, MAX_SYNTHETIC_INTERACTIONS,
                                    MAX_WIDTH)
from gmeta_ds.config.checks import (AUTO, BAD_ID_POLICIES, EXCHANGES, ROW_OWNERS, EMBEDDING_MODES, SPLITS,
                                    SUPPORTED_ZERO_STAGES, TABLE_DEVICES, TEXT_FORMATS, one_of, check_positive)
from gmeta_ds.config.data import DataConfig, SchemaConfig, SyntheticConfig, parse_memory
from gmeta_ds.config.embedding import OLD_SHARDING, EmbeddingConfig, TableOverride, renew_sharding
from gmeta_ds.config.eval import EvalConfig
from gmeta_ds.config.meta import DEFAULT_MICRO_BATCH, MetaConfig, task_activation_bytes
from gmeta_ds.config.model import MODEL_DEFAULT_ADAPT, ModelConfig
from gmeta_ds.config.run import (DEFAULTS, LOG_ONLY_KEYS, MAX_CONFIG_BYTES, SOURCE_ONLY_KEYS, RunConfig,
                                 apply_overrides, config_from_dict, config_to_dict, load_config, parse_override)
from gmeta_ds.config.sites import SitesConfig
from gmeta_ds.config.text import TextConfig, TextDataConfig, TextModelConfig, TextSyntheticConfig
from gmeta_ds.config.train import TrainConfig
from gmeta_ds.config.yaml_io import MAX_YAML_NODES, YAMLLoader, load_yaml

__all__ = [
    "AUTO", "BAD_ID_POLICIES", "BOUNDS", "DEFAULTS", "DEFAULT_MICRO_BATCH", "EXCHANGES", "LOG_ONLY_KEYS",
    "MAX_CONFIG_BYTES", "MAX_COUNT", "MAX_FLOAT", "MAX_LAYERS", "MAX_SYNTHETIC_INTERACTIONS", "MAX_WIDTH",
    "MAX_YAML_NODES",
    "MODEL_DEFAULT_ADAPT", "ROW_OWNERS", "EMBEDDING_MODES", "SOURCE_ONLY_KEYS", "SPLITS", "SUPPORTED_ZERO_STAGES",
    "TABLE_DEVICES", "TEXT_FORMATS", "DataConfig", "EmbeddingConfig", "EvalConfig", "MetaConfig",
    "ModelConfig", "RunConfig", "SchemaConfig", "SitesConfig", "SyntheticConfig", "TableOverride", "TextConfig",
    "TextDataConfig", "TextModelConfig", "TextSyntheticConfig", "TrainConfig", "YAMLLoader", "one_of",
    "check_positive", "OLD_SHARDING", "renew_sharding",
    "apply_overrides", "config_from_dict", "config_to_dict", "load_config", "load_yaml",
    "parse_memory", "parse_override", "task_activation_bytes",
]
