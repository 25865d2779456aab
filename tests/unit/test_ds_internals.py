"""The DeepSpeed internals gmeta_ds relies on exist in the installed DeepSpeed, a missing one
is reported by name and purpose, and no module outside engine/ds_internals.py touches them."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gmeta_ds.engine import ds_internals
from gmeta_ds.engine.ds_internals import check_internals

PKG = Path(__file__).resolve().parents[2] / "gmeta_ds"
TESTED = "gmeta_ds is tested with deepspeed 0.19.8 (setup.cfg allows >=0.16,<0.20)"


def test_installed_deepspeed_has_every_internal():
    problems = check_internals()
    assert problems == [], "\n".join(problems)


def test_supported_range_is_setup_cfgs():
    cfg = (PKG.parent / "setup.cfg").read_text()
    assert f"deepspeed{ds_internals.SUPPORTED}" in cfg.replace(" ", ""), "update ds_internals.SUPPORTED"


@pytest.mark.parametrize("module, attr, named", [
    ("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload", "_remove_module_hooks",
     ("DeepSpeedZeRoOffload._remove_module_hooks (deepspeed.runtime.zero.parameter_offload) is missing "
     "(used for removing ZeRO-3's module hooks")),
    ("deepspeed.comm.torch", "build_shm_op", ("deepspeed.comm.torch.build_shm_op, called by "
     "TorchBackend.__init__ is missing (used for skipping the JIT build")),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler",
     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler is missing (used for allow-listing"),
    ("deepspeed.checkpoint.ds_to_universal", "parse_arguments",
     "python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state"),
    ("deepspeed.runtime.constants", "LOAD_UNIVERSAL_CHECKPOINT", "checkpoint.load_universal"),
    ("deepspeed.runtime.config", "DEEPSPEED_OPTIMIZERS", "deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS is missing"),
    ("deepspeed.runtime.config", "DeepSpeedConfig", "deepspeed.runtime.config.DeepSpeedConfig is missing"),
    ("deepspeed.runtime.zero.offload_config", "OffloadDeviceEnum",
     "OffloadDeviceEnum (cpu, nvme) is missing (used for telling whether ZeRO offloads the optimizer"),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "_common_checkpoint_state",
     "mp_rank_00_model_states.pt and its key ds_config (DeepSpeedEngine._get_ckpt_name"),
])
def test_a_missing_internal_is_named_with_its_purpose(monkeypatch, module, attr, named):
    path, _, cls = module.rpartition(".")
    try:
        owner = importlib.import_module(module)
    except ImportError:  # module.Class
        owner = getattr(importlib.import_module(path), cls)
    import deepspeed

    monkeypatch.delattr(owner, attr)
    problems = check_internals()
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"deepspeed {deepspeed.__version__}: "), problems[0]
    assert named in problems[0] and problems[0].endswith(TESTED), problems[0]


def test_zero3_attributes_gone_are_reported(monkeypatch):
    from deepspeed.runtime.zero.partition_parameters import Init

    def convert(self, param):  # a DeepSpeed that no longer sets ds_id / ds_numel
        param.other_id = 0
    monkeypatch.setattr(Init, "_convert_to_deepspeed_param", convert)
    problems = check_internals()
    assert [p.split(" is missing")[0].split(": ", 1)[1] for p in problems] == [
        "the ZeRO-3 parameter attribute ds_id (zero.Init._convert_to_deepspeed_param)",
        "the ZeRO-3 parameter attribute ds_numel (zero.Init._convert_to_deepspeed_param)"]


def test_other_shm_buffer_name_or_converter_flag_is_reported(monkeypatch):
    monkeypatch.setattr(ds_internals, "SHM_BUFFER_NAME", "deepspeed_other_buffer")
    monkeypatch.setattr(ds_internals, "UNIVERSAL_FLAGS", ("--no_such_flag",))
    whats = [p.split(" is missing")[0] for p in check_internals()]
    assert len(whats) == 2 and "/dev/shm buffer name" in whats[0] and "ds_to_universal" in whats[1], whats


def test_remove_zero3_module_hooks_error_names_the_internal():
    engine = SimpleNamespace(optimizer=SimpleNamespace())  # no parameter_offload
    with pytest.raises(RuntimeError, match=r"no optimizer\.parameter_offload\._remove_module_hooks.*"
                                           r"use ZeRO-2.*tested with deepspeed 0\.19\.8"):
        ds_internals.remove_zero3_module_hooks(engine)
    calls = []
    offload = SimpleNamespace(_remove_module_hooks=lambda: calls.append(1))
    ds_internals.remove_zero3_module_hooks(SimpleNamespace(optimizer=SimpleNamespace(parameter_offload=offload)))
    assert calls == [1]


def test_small_helpers():
    p = torch.nn.Parameter(torch.zeros(3, 4))
    assert not ds_internals.is_zero3_param(p) and ds_internals.full_numel(p) == 12
    p.ds_id, p.ds_numel = 7, 120  # as ZeRO-3 marks a partitioned parameter
    assert ds_internals.is_zero3_param(p) and ds_internals.full_numel(p) == 120
    assert ds_internals.shm_buffer_path(1, "127.0.0.1", "29500").name.startswith("deepspeed_allreduce_buffer_")
    assert str(ds_internals.shm_buffer_path(1, "127.0.0.1", "29500")).endswith("_127.0.0.1_29500_1")
    cmd = ds_internals.universal_conversion_command("a", "b")
    assert cmd[1:-len(ds_internals.UNIVERSAL_FLAGS)] == [
        *ds_internals.SAFE_PATH_FLAGS, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(Path("a").absolute()), "--output_folder", str(Path("b").absolute())]
    cfg = {"checkpoint": {"tag_validation": "Warn"}}
    assert ds_internals.with_load_universal(cfg) == {"checkpoint": {"tag_validation": "Warn", "load_universal": True}}
    assert cfg == {"checkpoint": {"tag_validation": "Warn"}}


# What only engine/ds_internals.py may name: DeepSpeed submodules (``import deepspeed`` and its
# public top-level API are fine anywhere at L3+), the internal attributes, the guessed names.
SUBMODULES = ("deepspeed.runtime", "deepspeed.comm", "deepspeed.checkpoint", "deepspeed.utils",
              "deepspeed.ops", "deepspeed.moe", "deepspeed.module_inject")
ATTRIBUTES = {ds_internals.ZERO3_REMOVE_HOOKS, ds_internals.ZERO3_HOOKS_OWNER, ds_internals.ZERO3_ID_ATTR,
              ds_internals.ZERO3_NUMEL_ATTR, ds_internals.SHM_BUILD, ds_internals.SHM_BACKEND,
              "DeepSpeedConfig", "DEEPSPEED_OPTIMIZERS"}
STRINGS = ATTRIBUTES | {ds_internals.LOAD_UNIVERSAL}
SUBSTRINGS = (ds_internals.SHM_BUFFER_NAME, "ds_to_universal", *SUBMODULES)


def _docstrings(tree) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def test_no_other_module_touches_deepspeed_internals():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path == PKG / "engine" / "ds_internals.py":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        where = path.relative_to(PKG.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad += [f"{where}:{node.lineno}: import {a.name}" for a in node.names if a.name.startswith(SUBMODULES)]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(SUBMODULES):
                bad.append(f"{where}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Attribute) and node.attr in ATTRIBUTES:
                bad.append(f"{where}:{node.lineno}: .{node.attr}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                  and (node.value in STRINGS or any(s in node.value for s in SUBSTRINGS))):
                bad.append(f"{where}:{node.lineno}: {node.value[:60]!r}")
    assert not bad, "DeepSpeed internals outside gmeta_ds/engine/ds_internals.py:\n" + "\n".join(bad)
