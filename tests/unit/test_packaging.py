"""What a built wheel holds: every subpackage (an ``__init__.py`` wherever there is code, or
``packages = find:`` leaves the folder out) and the shipped DeepSpeed configs, found by their
documented names ``ds_configs/<file>.json`` from any working directory.
tests/wheel/check_wheel.sh builds and installs the real wheel (``make wheel-check``)."""
from __future__ import annotations

import configparser
import json
from pathlib import Path

import pytest

import gmeta_ds
from gmeta_ds.config import RunConfig, config_from_dict
from gmeta_ds.config.deepspeed import (
    SHIPPED_DIR,
    find_ds_config_file,
    load_ds_config,
    shipped_ds_config,
    shipped_ds_configs,
)
from gmeta_ds.errors import ConfigError
from gmeta_ds.run.launchers import launcher_ds_config

PKG = Path(gmeta_ds.__file__).resolve().parent
REPO = PKG.parent
DOCUMENTED = ("zero0", "zero0_bf16", "zero1", "zero2", "zero2_bf16", "zero2_fp16", "zero2_offload",
              "zero3", "zero3_bf16")


def test_every_code_directory_is_a_package():
    missing = sorted(str(d.relative_to(REPO)) for d in {p.parent for p in PKG.rglob("*.py")}
                     if "__pycache__" not in d.parts and not (d / "__init__.py").is_file())
    assert not missing, f"no __init__.py (a built wheel leaves these out): {missing}"


def test_setup_cfg_ships_the_ds_configs():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    globs = [g.strip() for g in cfg["options.package_data"]["gmeta_ds"].replace("\n", ",").split(",")]
    assert "ds_configs/*.json" in globs
    assert SHIPPED_DIR == PKG / "ds_configs"


def test_checkout_ds_configs_is_the_packaged_folder():
    # one copy of each file: the top-level folder of docs and examples is a symlink to the package's
    top = REPO / "ds_configs"
    if not top.exists():
        pytest.skip("not a checkout")
    assert top.resolve() == SHIPPED_DIR


def test_shipped_names_resolve_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ds_configs/ here nor next to the run config
    names = shipped_ds_configs()
    assert names == sorted(f"ds_configs/{n}.json" for n in DOCUMENTED)
    assert RunConfig().deepspeed in names  # the default resolves too
    for name in names:
        path = find_ds_config_file(name, str(tmp_path))
        assert path == SHIPPED_DIR / Path(name).name
        ds, source = load_ds_config(config_from_dict({"deepspeed": name}))
        assert ds == json.loads(path.read_text()) and source == str(path)
    assert shipped_ds_config("./ds_configs/zero2.json") == SHIPPED_DIR / "zero2.json"
    for other in ("zero2.json", "/ds_configs/zero2.json", "ds_configs/zero9.json", "x/ds_configs/zero2.json"):
        assert shipped_ds_config(other) is None, other
    # launcher-level files (--deepspeed_config, Accelerate's deepspeed_config_file) too
    assert launcher_ds_config("ds_configs/zero1.json", env={}) == str(SHIPPED_DIR / "zero1.json")
    accel = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero2.json"}
    assert launcher_ds_config(None, env=accel) == str(SHIPPED_DIR / "zero2.json")


def test_a_local_file_wins_over_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "cfgdir" / "ds_configs" / "zero2.json"
    local.parent.mkdir(parents=True)
    local.write_text('{"zero_optimization": {"stage": 1}}')
    assert find_ds_config_file("ds_configs/zero2.json", str(tmp_path / "cfgdir")) == local
    monkeypatch.chdir(tmp_path / "cfgdir")
    assert find_ds_config_file("ds_configs/zero2.json", str(tmp_path)) == Path("ds_configs/zero2.json")


def test_missing_ds_config_names_the_file_and_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("ds_configs/zero9.json", "mine.json"):
        with pytest.raises(ConfigError) as err:
            load_ds_config(config_from_dict({"deepspeed": name}))
        text = str(err.value)
        assert f"deepspeed: file {name!r} not found" in text
        assert "shipped DeepSpeed configs: ds_configs/zero0.json, " in text and "ds_configs/zero3_bf16.json" in text
    with pytest.raises(ConfigError, match=r"'ds_configs/zero9.json' does not exist \(shipped DeepSpeed "
                                          r"configs: ds_configs/zero0.json, "):
        launcher_ds_config("ds_configs/zero9.json", env={})
