"""Config loading, overrides and the documented error messages."""
from __future__ import annotations

import json

import pytest

from gmeta_ds.config import RunConfig, apply_overrides, config_from_dict, load_config
from gmeta_ds.ds_config import resolve_ds_config
from gmeta_ds.errors import ConfigError


def test_defaults_are_valid():
    cfg = config_from_dict({})
    assert isinstance(cfg, RunConfig) and cfg.meta.algorithm == "maml"


def test_every_problem_is_reported_at_once_with_dotted_keys():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"meta": {"algorithm": "protonet", "inner_stepz": 1}, "trian": {},
                          "train": {"lr": "fast", "meta_steps": 0}})
    text = str(err.value)
    assert len(err.value.problems) == 5, text
    assert "meta.algorithm: 'protonet' is not one of maml, fomaml, reptile, metasgd" in text
    assert "meta.inner_stepz: unknown key; valid keys here: adapt, algorithm, inner_lr" in text
    assert "trian: unknown key; valid keys here: data, deepspeed, embedding, eval, meta" in text
    assert "train.lr: expected float, got 'fast'" in text
    assert "train.meta_steps: 0 is not a positive number" in text


def test_synthetic_data_sizes_are_checked():
    with pytest.raises(ConfigError, match=r"data.synthetic.min_interactions: 5 must exceed "
                                          r"data.synthetic.query_size \(10\)"):
        config_from_dict({"data": {"synthetic": {"min_interactions": 5}}})


def test_overrides_are_parsed_as_yaml_and_create_sections():
    data = apply_overrides({"meta": {"inner_lr": 0.1}},
                           ["meta.inner_lr=0.5", "meta.adapt=[mlp.4.*]", "train.meta_steps=7"])
    assert data == {"meta": {"inner_lr": 0.5, "adapt": ["mlp.4.*"]}, "train": {"meta_steps": 7}}
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        apply_overrides({}, ["meta.inner_lr"])


def test_load_config_names_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("meta: [unclosed\n")
    with pytest.raises(ConfigError, match=r"(?s)bad.yaml.*not valid YAML"):
        load_config(bad)


def ds_file(tmp_path, **keys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": "auto"}}, **keys}))
    return str(path)


def test_auto_batch_keys_follow_world_size(tmp_path):
    cfg = config_from_dict({"meta": {"tasks_per_micro_batch": 8, "tasks_per_meta_step": 32},
                            "train": {"lr": 0.02}, "deepspeed": ds_file(tmp_path)})
    for world, gas in ((1, 4), (2, 2), (4, 1)):
        ds, plan = resolve_ds_config(cfg, world)
        assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
                ds["train_batch_size"]) == (8, gas, 32)
        assert plan.describe() == f"8 tasks/micro-batch x {gas} accumulation steps x {world} ranks = 32 tasks/meta-step"
    assert ds["optimizer"]["params"]["lr"] == 0.02


def test_contradictory_batch_sizes_are_rejected(tmp_path):
    cfg = config_from_dict({"meta": {"tasks_per_micro_batch": 8, "tasks_per_meta_step": 32},
                            "deepspeed": ds_file(tmp_path, train_micro_batch_size_per_gpu=4,
                                                 train_batch_size=64, gradient_accumulation_steps=3)})
    with pytest.raises(ConfigError) as err:
        resolve_ds_config(cfg, 2)
    text = str(err.value)
    assert "meta.tasks_per_micro_batch (8) contradicts deepspeed.train_micro_batch_size_per_gpu (4)" in text
    assert "meta.tasks_per_meta_step (32) contradicts deepspeed.train_batch_size (64)" in text
    assert "deepspeed.gradient_accumulation_steps (3) contradicts 32 tasks/meta-step" in text


def test_meta_step_must_divide_over_ranks(tmp_path):
    cfg = config_from_dict({"meta": {"tasks_per_micro_batch": 8, "tasks_per_meta_step": 24},
                            "deepspeed": ds_file(tmp_path)})
    resolve_ds_config(cfg, 3)
    with pytest.raises(ConfigError, match=r"meta.tasks_per_meta_step \(24\) must be a multiple of "
                                          r"meta.tasks_per_micro_batch \(8\) x world size \(2\) = 16"):
        resolve_ds_config(cfg, 2)


def test_auto_everywhere_takes_deepspeed_values(tmp_path):
    cfg = config_from_dict({"meta": {"tasks_per_micro_batch": "auto", "tasks_per_meta_step": "auto"},
                            "deepspeed": ds_file(tmp_path, train_micro_batch_size_per_gpu=6,
                                                 gradient_accumulation_steps=2)})
    ds, plan = resolve_ds_config(cfg, 2)
    assert (plan.tasks_per_micro_batch, plan.grad_accum_steps, ds["train_batch_size"]) == (6, 2, 24)


def test_unknown_zero_stage_is_rejected_naming_supported_stages(tmp_path):
    cfg = config_from_dict({"deepspeed": ds_file(tmp_path, zero_optimization={"stage": 4})})
    with pytest.raises(ConfigError, match=r"zero_optimization.stage: 4 is not supported; "
                                          r"supported stages: 0, 1, 2, 3"):
        resolve_ds_config(cfg, 1)


def test_deepspeed_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="deepspeed: file 'missing.json' not found"):
        resolve_ds_config(config_from_dict({"deepspeed": "missing.json"}), 1)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json is not valid JSON"):
        resolve_ds_config(config_from_dict({"deepspeed": str(bad)}), 1)


def test_repo_ds_configs_resolve_relative_to_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for stage in (0, 1, 2, 3):
        ds, _ = resolve_ds_config(config_from_dict({"deepspeed": f"ds_configs/zero{stage}.json"}), 2)
        assert ds["zero_optimization"]["stage"] == stage


def test_valid_split_needs_valid_users():
    with pytest.raises(ConfigError, match="eval.split: 'valid' needs a log source with data.valid_fraction > 0"):
        config_from_dict({"eval": {"split": "valid"}})
    with pytest.raises(ConfigError, match="data.valid_fraction: 0.9 must be in"):
        config_from_dict({"data": {"valid_fraction": 0.9}})
