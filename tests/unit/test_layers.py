"""Import rules: a module imports only from its own layer or lower (docs/architecture.md)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "gmeta_ds"
LAYERS = {
    "gmeta_ds.config": 0, "gmeta_ds.errors": 0, "gmeta_ds.ds_config": 0, "gmeta_ds.launchers": 0,
    "gmeta_ds.plots": 0, "gmeta_ds.registry": 0,
    "gmeta_ds.functional": 1, "gmeta_ds.data": 1, "gmeta_ds.models": 1, "gmeta_ds.embedding": 1,
    "gmeta_ds.embedding.comm": 3, "gmeta_ds.embedding.sharded": 3, "gmeta_ds.embedding.pooled": 3,
    "gmeta_ds.algorithms": 2,
    "gmeta_ds.engine": 3, "gmeta_ds.profiling": 3,
    "gmeta_ds.metrics": 1,
    "gmeta_ds.text": 1, "gmeta_ds.text.model": 2,
    "gmeta_ds.trainer": 5, "gmeta_ds.evaluation": 5, "gmeta_ds.checkpoint": 5, "gmeta_ds.outputs": 5, "gmeta_ds.baselines": 5,
    "gmeta_ds.api": 5, "gmeta_ds.workloads": 5, "gmeta_ds.saved": 5,
    "gmeta_ds.cli": 6,
}
DISTRIBUTED = ("torch.distributed", "deepspeed")


def layer_of(module: str) -> int:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return LAYERS[best]


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        if name != "gmeta_ds":
            yield name, path


def test_every_module_has_a_layer():
    for name, _ in modules():
        layer_of(name)


def test_imports_go_down_only():
    bad = []
    for name, path in modules():
        mine = layer_of(name)
        for imported in imports(path):
            if imported.startswith("gmeta_ds.") and layer_of(imported) > mine:
                bad.append(f"{name} (L{mine}) imports {imported} (L{layer_of(imported)})")
            if imported.startswith(DISTRIBUTED) and mine < 3:
                bad.append(f"{name} (L{mine}) imports {imported}: only L3+ may communicate")
    assert not bad, "\n".join(bad)


def test_layer_zero_does_not_import_torch():
    for name, path in modules():
        if layer_of(name) == 0:
            assert not any(i == "torch" or i.startswith("torch.") for i in imports(path)), name
