"""Every name a benchmark or an example imports from gmeta_ds exists (statically, without running
them): a rename inside the package must not leave `make bench` or a documented script broken, as
`data.loader.padding_efficiency` (now `TaskBatch.padding_efficiency`) and the module-level
`meta_engine.meta_step` (now `step_micro_batches`) once did."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("benchmarks/*.py"), *REPO.glob("examples/*/*.py")])


def _imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from gmeta_ds... import name`` in ``path``, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gmeta_ds"
            for alias in node.names]


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(REPO)) for p in SCRIPTS])
def test_every_name_imported_from_gmeta_ds_exists(path):
    missing = []
    for line, module, name in _imports(path):
        found = importlib.import_module(module)
        if not hasattr(found, name):
            try:  # a submodule imported by name (from gmeta_ds.data import stream)
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{path.relative_to(REPO)}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)
