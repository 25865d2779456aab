"""Argument checks of the Python API: each appends a problem naming the argument, the value
given and what is allowed; `check` raises them all as one `ConfigError`."""
from __future__ import annotations

import math

import numpy as np

from gmeta_ds.errors import ConfigError


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value) -> bool:
    return is_int(value) or isinstance(value, (float, np.floating))


def int_at_least(problems: list[str], name: str, value, low: int) -> None:
    if not (is_int(value) and value >= low):
        problems.append(f"{name}: {value!r} is not an integer >= {low}")


def finite(problems: list[str], name: str, value, low: float = 0.0, strict: bool = True) -> None:
    """``value`` must be a finite number > ``low`` (>= with ``strict=False``); NaN and inf fail."""
    if not (is_number(value) and math.isfinite(value) and (value > low if strict else value >= low)):
        problems.append(f"{name}: {value!r} is not a finite number {'>' if strict else '>='} {low:g}")


def check(problems: list[str], where: str) -> None:
    if problems:
        raise ConfigError(problems, where)
