"""Shared value checks and choice lists of the config sections (layer 0: no torch)."""
from __future__ import annotations

from typing import Any, Iterable

# embedding.sharding: tables inside the DeepSpeed module (dense) or gmeta_ds's own, outside it
# (sharded). Not registry.SHARDINGS, the strategies of the sharded mode.
EMBEDDING_MODES = ("dense", "sharded")
ROW_OWNERS = ("modulo", "block")
TABLE_DEVICES = ("auto", "accelerator", "host")
EXCHANGES = ("auto", "rows", "pooled")
EXCHANGE_TOPOLOGIES = ("flat", "hierarchical", "auto")
BAD_ID_POLICIES = ("error", "hash")
SPLITS = ("random", "time")
TEXT_FORMATS = ("auto", "csv", "json", "parquet")
SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
AUTO = "auto"


def one_of(problems: list[str], key: str, value: Any, allowed: Iterable) -> None:
    """Report ``key`` unless ``value`` is among ``allowed`` (a config's or an API argument's choice)."""
    allowed = tuple(allowed)
    if value not in allowed:
        problems.append(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")


def check_positive(problems: list[str], key: str, value: Any, allow_auto: bool = False) -> None:
    """Report ``key`` unless ``value`` is a number > 0 (or 'auto' where ``allow_auto``)."""
    if allow_auto and value == AUTO:
        return
    if isinstance(value, str) or not value > 0:  # `not >` also refuses NaN
        allowed = "a positive number" + (" or 'auto'" if allow_auto else "")
        problems.append(f"{key}: {value!r} is not {allowed}")

