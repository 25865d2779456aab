"""Module boundaries: what one module of gmeta_ds needs of another has a public name in its home
module (CONTRIBUTING.md). A private name (``_x``) imported by another module of the package, or by
the benchmarks and examples (they use the package as a user does), fails here; an attribute
reached through a module object (``mod._x``) too. Tests may reach into the module they test."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "gmeta_ds"
# (importing file, module, name): reason. Empty: every cross-module name is public.
ALLOWED: dict[tuple[str, str, str], str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _private_imports(path: Path, own: str | None = None) -> list[tuple[str, str]]:
    """(module, name) of every private name ``path`` takes from another gmeta_ds module:
    ``from gmeta_ds.m import _x`` and ``import gmeta_ds.m as m; m._x``."""
    tree = ast.parse(path.read_text())
    own = own or _module_name(path)
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gmeta_ds"):
            for alias in node.names:
                if node.module != own and _private(alias.name):
                    found.append((node.module, alias.name))
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("gmeta_ds") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and aliases[node.value.id] != own
                and (PKG.parent / (aliases[node.value.id].replace(".", "/") + ".py")).is_file()):
            found.append((aliases[node.value.id], node.attr))
    return found


def _sources() -> list[Path]:
    return sorted(p for d in ("gmeta_ds", "benchmarks", "examples") for p in (REPO / d).rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_no_private_name_is_imported_across_modules():
    bad = sorted({f"{p.relative_to(REPO)}: {m}.{n}" for p in _sources() for m, n in _private_imports(p)
                  if (str(p.relative_to(REPO)), m, n) not in ALLOWED})
    assert not bad, "private names used outside their module (give them a public name):\n" + "\n".join(bad)


def test_the_check_sees_both_forms(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from gmeta_ds.evaluation.metrics import _x\nimport gmeta_ds.run.trainer as t\nt._y\n"
                     "from gmeta_ds.evaluation.scores import _own\n")
    found = _private_imports(probe, own="gmeta_ds.evaluation.scores")
    assert found == [("gmeta_ds.evaluation.metrics", "_x"), ("gmeta_ds.run.trainer", "_y")]
