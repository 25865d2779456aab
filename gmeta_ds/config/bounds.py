"""Upper bounds of every numeric config key (`BOUNDS`) and the walk that checks them."""
from __future__ import annotations

import dataclasses
from typing import Any


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
    "eval.bootstrap_resamples": (100_000, "100000 resamples (each holds a weight per held-out user)"),
    "meta.tasks_per_micro_batch": (2**20, "2**20 tasks"),
    "meta.tasks_per_meta_step": (2**30, "2**30 tasks"),
    "text.model.vocab_size": (2**24, "2**24 tokens"),
    "text.data.max_length": (2**16, "2**16 tokens"),
    "data.new_item_year": (9999, "9999"),
    "sites.count": (1024, "1024 sites"),
}
# In-memory synthetic data costs ~36 bytes per interaction.
MAX_SYNTHETIC_INTERACTIONS = 2**31


def short_value(value: Any) -> str:
    """A number for a message: a huge integer as ``~10**90``, not 91 digits (Python refuses to
    print more than 4300)."""
    if isinstance(value, int) and abs(value) > 10**15:
        digits = int(abs(value).bit_length() * 0.30103) + 1  # str() refuses over 4300 digits
        digits += abs(value) >= 10**digits
        digits -= abs(value) < 10**(digits - 1)
        return f"~{'-' if value < 0 else ''}10**{digits - 1}"
    return repr(value)


def _bound(schema_key: str, value: Any) -> tuple[float, str]:
    """The (limit, its text) for ``schema_key``: its `BOUNDS` entry, else the float or int32 default."""
    if schema_key in BOUNDS:
        return BOUNDS[schema_key]
    if isinstance(value, float):
        return MAX_FLOAT, f"{MAX_FLOAT:g}"
    return MAX_COUNT, "2**31 - 1 (int32)"


def check_bounds(node: Any, dotted: str, schema_key: str, problems: list[str]) -> None:
    """Every number under ``node`` (a config dataclass, one of its dicts of tables or globs, a
    list of widths) against its `BOUNDS` entry; free-form dicts (``deepspeed``,
    ``text.model.config``) are checked by their owners."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            if not f.metadata.get("internal"):
                join = f"{dotted}.{f.name}" if dotted else f.name
                check_bounds(getattr(node, f.name), join, f"{schema_key}.{f.name}" if schema_key else f.name,
                              problems)
    elif isinstance(node, dict) and schema_key in ("embedding.tables", "meta.inner_lr_scale"):
        for name, value in node.items():
            check_bounds(value, f"{dotted}.{name}", f"{schema_key}.*", problems)
    elif isinstance(node, list) and node and all(isinstance(v, (int, float)) for v in node):
        if len(node) > MAX_LAYERS:
            problems.append(f"{dotted}: {len(node)} entries; at most {MAX_LAYERS}")
        too_big = [v for v in node if not isinstance(v, bool) and abs(v) > _bound(schema_key, v)[0]]
        if too_big:
            limit = _bound(schema_key, too_big[0])[1]
            problems.append(f"{dotted}: {short_value(too_big[0])} is too large; at most {limit}")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        limit, text = _bound(schema_key, node)
        if abs(node) > limit:
            problems.append(f"{dotted}: {short_value(node)} is too large; at most {text}")
