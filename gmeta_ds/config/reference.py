"""The configuration reference (docs/configuration.md), generated from the config dataclasses.

One source: each key's text is the comment above its field (and any comment on the field's
line) in gmeta_ds/config/*.py; its type and default come from the dataclass; what a value may
be comes from the validation itself, by asking `config_from_dict` about one bad value per key
(a choice list, a bound, "a positive number"), so the page cannot drift from the checks.
``python -m gmeta_ds.config.reference > docs/configuration.md`` rewrites the page;
tests/unit/test_docs_reference.py keeps the committed page equal to `render()`.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import typing
from collections.abc import Iterator
from typing import Any

import yaml

from gmeta_ds.config.bounds import short_value
from gmeta_ds.config.run import RunConfig, config_from_dict
from gmeta_ds.errors import ConfigError

# Sample name for the keys under a dict of per-table settings (embedding.tables.<table>.*).
TABLE = "<table>"
# Values no valid key accepts of its kind: a string outside every choice list, a number past
# every bound, a number below every lower bound.
_PROBES = {str: "\x00probe", int: (10**40, -1), float: (1e300, -1.0)}


def field_comments(cls: type) -> dict[str, str]:
    """The comment text of each field of the dataclass ``cls``: the comment lines right above
    the field, then the comment at the end of its line, joined into one paragraph.

    Args:
        cls: a config dataclass defined in a source file.

    Returns:
        Field name -> its comment text ("" for a field without comment).
    """
    lines, _ = inspect.getsourcelines(cls)
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline)
                if tok.type == tokenize.COMMENT}
    names = {f.name for f in dataclasses.fields(cls)}
    docs = {}
    for number, line in enumerate(lines, start=1):
        name = line.strip().split(":", 1)[0]
        if line.startswith("    ") and not line.startswith("     ") and name in names:
            above = []
            row = number - 1
            while row in comments and lines[row - 1].strip().startswith("#"):
                above.insert(0, comments[row])
                row -= 1
            docs[name] = " ".join(above + ([comments[number]] if number in comments else []))
    return docs


def type_name(tp: Any) -> str:
    """A field's type as a config file spells it (``null`` for None, ``|`` between options)."""
    if tp is type(None):
        return "null"
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        return " | ".join(type_name(arg) for arg in args)
    if args:
        return f"{getattr(typing.get_origin(tp), '__name__', str(tp))}[{', '.join(map(type_name, args))}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _yaml(value: Any) -> str:
    """A default as it would be written in a YAML config (one line)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


def config_keys(cls: type = RunConfig, prefix: str = "") -> Iterator[tuple[str, Any, Any, str]]:
    """Every key of a run config, depth first in the order the dataclasses declare them.

    Args:
        cls: the dataclass to walk (`RunConfig` for the whole config).
        prefix: the dotted path of ``cls`` in the config ("" at the top).

    Returns:
        An iterator of (dotted key, type, default, comment text); sections (nested dataclasses)
        are walked, not listed, and a dict of per-table dataclasses is walked under `TABLE`.
    """
    hints = typing.get_type_hints(cls)
    docs = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        tp, dotted = hints[f.name], f"{prefix}{f.name}"
        inner = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        if dataclasses.is_dataclass(tp):
            yield from config_keys(tp, f"{dotted}.")
        elif inner is not None and dataclasses.is_dataclass(inner):
            yield dotted, tp, _default(f), docs[f.name]
            yield from config_keys(inner, f"{dotted}.{TABLE}.")
        else:
            yield dotted, tp, _default(f), docs[f.name]


def _nest(dotted: str, value: Any) -> dict:
    node: Any = value
    for part in reversed(dotted.replace(TABLE, "t").split(".")):
        node = {part: node}
    return node


def allowed(dotted: str, tp: Any) -> str:
    """What validation says a key accepts: its words for each probe value it refuses.

    Args:
        dotted: the key, e.g. ``meta.algorithm`` (`TABLE` for a table's name).
        tp: the key's type (which probes apply: strings, integers, floats).

    Returns:
        The refusals' explanations joined with "; " ("" when every probe passes).
    """
    kinds = {tp, *(typing.get_args(tp) if typing.get_origin(tp) is typing.Union else ())}
    probes = [p for kind, values in _PROBES.items() if kind in kinds
              for p in (values if isinstance(values, tuple) else (values,))]
    found = []
    for probe in probes:
        try:
            config_from_dict(_nest(dotted, probe))
        except ConfigError as exc:
            # Only this key's verdict on this value: other problems are about other keys.
            said = f"{dotted.replace(TABLE, 't')}: {short_value(probe)} "
            found += [p.removeprefix(said) for p in exc.problems if p.startswith(said)]
    words = [text.removeprefix("is not ").removeprefix("is too large; ") for text in found]
    # "but ... remove it": the key is read only with another key's value, not a bound of its own.
    return "; ".join(dict.fromkeys(w for w in words if not w.startswith("but ")))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole page: one table per section, one row per key (type, default, allowed, text)."""
    out = ["# Configuration reference", "",
           "Every key of a run config (YAML sections `model`, `meta`, `embedding`, `data`, `train`,",
           "`eval`, `sites`, `text`, `deepspeed`), generated from the config dataclasses in",
           "`gmeta_ds/config/` by `python -m gmeta_ds.config.reference > docs/configuration.md`.",
           "*Allowed* is what validation answers to a bad value; unknown keys are errors too.",
           "Numbers without a listed bound are capped at 2**31 - 1 (integers) or 1e12 (floats).", ""]
    sections: dict[str, list[str]] = {}
    for dotted, tp, default, doc in config_keys():
        cells = [f"`{dotted}`", f"`{type_name(tp)}`", f"`{_yaml(default)}`", allowed(dotted, tp), doc]
        head = f"`{dotted.split('.')[0]}`" if "." in dotted else "Top level"
        sections.setdefault(head, []).append("| " + " | ".join(_cell(c) for c in cells) + " |")
    for head, rows in sections.items():
        out += [f"## {head}", "", "| Key | Type | Default | Allowed | Description |",
                "|---|---|---|---|---|", *rows, ""]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
