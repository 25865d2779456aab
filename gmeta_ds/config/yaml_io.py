"""YAML reading for config files and ``--set`` values: YAML 1.2 floats, no duplicate keys,
bounded alias expansion."""
from __future__ import annotations

import re
from typing import Any

import yaml

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
        """Check ``node`` (`_check_nodes`), then build it; an unreadable value is a YAMLError."""
        _check_nodes(node)
        try:
            return super().construct_document(node)
        except (ValueError, OverflowError) as exc:  # a 5000-digit int, a date like 2024-13-01
            raise yaml.YAMLError(f"a value cannot be read ({exc})") from exc


YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))


def _key_text(node: yaml.Node) -> str:
    """A mapping key as a path names it: its scalar, or where a complex key is."""
    if isinstance(node, yaml.ScalarNode):
        return str(node.value)
    return f"<{node.id} on line {node.start_mark.line + 1}>"


def _check_nodes(root: yaml.Node) -> None:
    """Duplicate keys and the alias-expanded size of the tree under ``root`` (`YAMLLoader`).
    Sizes are memoised per node, so the walk costs the nodes written, not their expansion."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, path: str) -> int:
        """Nodes under ``node`` with aliases expanded, memoised; raises past the limit."""
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
