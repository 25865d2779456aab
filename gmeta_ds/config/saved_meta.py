"""Every number of a saved model's model.json (`gmeta_ds.saved`), checked as the run config
checks the keys it came from (`BOUNDS`, rates finite and in range, sizes positive and bounded).

model.json is read before anything else of an export and its numbers size what is built and
how long a request adapts: an edited one (1e9 inner steps, a NaN or negative rate, a table of
10**12 rows) must be refused naming the key, not hang a server or score ``null``. Its digest
(``model.json.sha256``) tells a damaged file from a sound one; these checks hold whatever the
digest says, for a folder whose writer also rewrote the digest.
"""
from __future__ import annotations

import math
from typing import Any

from gmeta_ds.config.arguments import is_int, is_number
from gmeta_ds.config.bounds import BOUNDS, MAX_COUNT, MAX_FLOAT, MAX_LAYERS

_STEPS = BOUNDS["meta.inner_steps"][0]
_DIM = BOUNDS["model.embed_dim"][0]
KINDS = ("binary", "regression", "multiclass")  # the label kinds an algorithm adapts on (registry.LOSSES)


def _integer(value: Any, low: int, high: int) -> str | None:
    """Why ``value`` is not an integer in [low, high] (None when it is)."""
    if is_int(value) and low <= value <= high:
        return None
    return f"expected an integer in [{low}, {high}]"


def _rate(value: Any, positive: bool = False, optional: bool = False) -> str | None:
    """Why ``value`` is not a finite number in [0, MAX_FLOAT] ((0, ...] when ``positive``;
    None allowed when ``optional``)."""
    if optional and value is None:
        return None
    if is_number(value) and math.isfinite(value) and (value > 0 if positive else value >= 0) and value <= MAX_FLOAT:
        return None
    return f"expected a finite number in {'(0' if positive else '[0'}, {MAX_FLOAT:g}]" + (" or null" if optional else "")


def _strings(value: Any) -> str | None:
    if isinstance(value, list) and len(value) <= MAX_LAYERS and all(isinstance(v, str) for v in value):
        return None
    return f"expected a list of at most {MAX_LAYERS} strings"


def _one_of(*allowed) -> Any:
    return lambda value: None if any(value is a or (type(value) is type(a) and value == a) for a in allowed) \
        else f"expected one of {', '.join(map(repr, allowed))}"


def _scales(value: Any) -> str | None:
    """``inner_lr_scale``: glob -> a positive finite multiplier (or null: none)."""
    if value is None or (isinstance(value, dict) and len(value) <= MAX_LAYERS and all(
            isinstance(k, str) and _rate(v, positive=True) is None for k, v in value.items())):
        return None
    return f"expected null or at most {MAX_LAYERS} globs each -> a finite number in (0, {MAX_FLOAT:g}]"


# The algorithm's settings (gmeta_ds.algorithms.base.AlgorithmSettings), as meta.* bounds them.
ALGORITHM = {
    "inner_steps": lambda v: _integer(v, 0, _STEPS),
    "inner_lr": lambda v: _rate(v, positive=True),
    "adapt": _strings,
    "vectorize": _one_of(True, False, "auto"),
    "kind": _one_of(*KINDS),
    "split_body": _one_of(True, False, "auto"),
    "inner_lr_scale": _scales,
    "inner_loss_prior": _rate,
    "offset_first": lambda v: _rate(v, optional=True),
    "support_level": lambda v: _rate(v, optional=True),
    "rank_weight": _rate,
    "warmup_steps": lambda v: _integer(v, 0, MAX_COUNT),
    "init_weight": _rate,
}
FIELD = {"name": lambda v: None if isinstance(v, str) else "expected a string",
         "num_ids": lambda v: _integer(v, 1, MAX_COUNT), "side": _one_of("user", "item"),
         "multi_hot": _one_of(True, False), "raw": _one_of(True, False)}
TABLE = {"name": lambda v: None if isinstance(v, str) else "expected a string",
         "num_rows": lambda v: _integer(v, 1, MAX_COUNT), "dim": lambda v: _integer(v, 1, _DIM),
         "features": _strings, "init_std": _rate, "lr": _rate,
         "capacity": lambda v: None if v is None else _integer(v, 1, MAX_COUNT),
         "admit_after": lambda v: _integer(v, 1, MAX_COUNT)}


def section_problems(values: dict, checks: dict) -> list[str]:
    """``key value, expected ...`` for each key of ``values`` that ``checks`` refuses (keys
    ``values`` lacks are the loader's to report, as a missing key or a default)."""
    return [f"{key} {values[key]!r:.60}, {why}" for key, check in checks.items()
            if key in values and (why := check(values[key])) is not None]


def saved_meta_problems(meta: dict) -> list[str]:
    """Every number (and switch) of model.json's ``algorithm``, ``fields`` and ``tables``
    sections that a run config could not have held: one line per problem, naming the section
    and key (``'algorithm' holds inner_lr nan, expected ...``). The ``serving`` section's
    inner steps are `gmeta_ds.serving.export.open_export`'s to check, its recipe goes through
    `config_from_dict` whole."""
    problems = []
    algorithm = meta.get("algorithm")
    if isinstance(algorithm, dict):
        found = section_problems(algorithm, ALGORITHM)
        problems += [f"'algorithm' holds {'; '.join(found)}"] if found else []
    for section, checks in (("fields", FIELD), ("tables", TABLE)):
        entries = meta.get(section)
        if isinstance(entries, list) and len(entries) > MAX_COUNT:
            problems.append(f"'{section}' holds {len(entries)} entries; at most {MAX_COUNT}")
            continue
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            found = section_problems(entry, checks) if isinstance(entry, dict) else ["expected an object"]
            problems += [f"'{section}'[{i}] holds {'; '.join(found)}"] if found else []
    return problems
