"""Config loading, overrides and the documented error messages."""
from __future__ import annotations

import json

import pytest

from gmeta_ds.config import RunConfig, apply_overrides, config_from_dict, load_config
from gmeta_ds.config.deepspeed import resolve_ds_config
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
    assert "meta.inner_stepz: unknown key; valid keys here: adapt, algorithm, compile, init_weight, inner_loss_prior" in text
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
    with pytest.raises(ConfigError, match=r"eval.split: 'valid' scores the validation users; set data.valid_fraction > 0"):
        config_from_dict({"eval": {"split": "valid"}})
    # synthetic data holds validation users too (taken from its training users)
    assert config_from_dict({"eval": {"split": "valid"}, "data": {"valid_fraction": 0.1}}).eval.split == "valid"
    with pytest.raises(ConfigError, match="data.valid_fraction: 0.9 must be in"):
        config_from_dict({"data": {"valid_fraction": 0.9}})


def _float_keys(cls=RunConfig, prefix="") -> list[str]:
    """Every dotted key whose schema type is float (or float | None)."""
    import dataclasses
    import typing

    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _float_keys(tp, f"{prefix}{f.name}.")
        elif tp is float or float in typing.get_args(tp):
            keys.append(prefix + f.name)
    return keys


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf"])
def test_non_finite_numbers_are_rejected_for_every_float_key(tmp_path, text):
    keys = _float_keys() + ["embedding.tables.item_id.lr"]
    assert {"meta.inner_lr", "train.lr", "embedding.lr", "data.threshold", "text.baseline_lr"} <= set(keys)
    path = tmp_path / "c.yaml"
    path.write_text("embedding: {sharding: sharded}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, [f"{key}={text}" for key in keys])
    shown = text.replace(".", "")
    for key in keys:
        assert f"{key}: {shown} is not a finite number" in str(err.value), key
    # the same in the file itself, not only in --set values
    path.write_text(f"meta: {{inner_lr: {text}}}\ntrain: {{lr: {text}}}\n")
    with pytest.raises(ConfigError, match=rf"meta.inner_lr: {shown} is not a finite number"):
        load_config(path)


def test_positive_check_refuses_nan_that_skipped_the_type_check():
    from gmeta_ds.config import check_positive

    problems: list[str] = []
    check_positive(problems, "train.lr", float("nan"))
    assert problems == ["train.lr: nan is not a positive number"]


def test_exponent_floats_parse_in_files_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: {lr: 1e-3}\nmeta: {inner_lr: 5E+2}\nembedding: {lr: 2.5e-2}\n")
    cfg = load_config(path, ["eval.baseline_lr=1e3", "data.synthetic.zipf_exponent=1.5E0"])
    assert (cfg.train.lr, cfg.meta.inner_lr, cfg.embedding.lr) == (1e-3, 500.0, 0.025)
    assert (cfg.eval.baseline_lr, cfg.data.synthetic.zipf_exponent) == (1000.0, 1.5)


def test_other_scalars_parse_as_before():
    import yaml

    from gmeta_ds.config import load_yaml

    for text in ("1.5", "10", "-3", "0x1F", "012", "1_000", "1:30", "yes", "off", "~", "null", ".inf",
                 "2020-01-01", "1e", "e3", "1.2.3", "1e-3x", "abc", "[1, 2e0]", "{a: 1}"):
        expected = yaml.safe_load(text)
        if text == "[1, 2e0]":
            expected = [1, 2.0]
        assert load_yaml(text) == expected, text


def test_deepspeed_json_configs_are_unaffected():
    from pathlib import Path

    from gmeta_ds.config.deepspeed import load_ds_config

    files = sorted((Path(__file__).resolve().parents[2] / "ds_configs").glob("*.json"))
    assert files
    for path in files:
        ds, _ = load_ds_config(config_from_dict({"deepspeed": str(path)}))
        assert ds == json.loads(path.read_text()), path.name


def test_config_file_that_is_empty_a_list_or_a_directory(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="the file is empty; expected a YAML mapping"):
        load_config(empty)
    listed = tmp_path / "list.yaml"
    listed.write_text("- model\n- meta\n")
    with pytest.raises(ConfigError, match="config: expected a mapping of sections .* got a list"):
        load_config(listed, ["meta.inner_lr=0.1"])
    with pytest.raises(ConfigError, match="is a directory, expected a YAML file"):
        load_config(tmp_path)


def test_overrides_with_an_empty_key_or_bad_yaml_or_a_yaml_date(tmp_path):
    for text in ("=3", "meta..inner_lr=1", "meta.=1"):
        with pytest.raises(ConfigError, match="empty key part"):
            apply_overrides({}, [text])
    with pytest.raises(ConfigError, match=r"--set 'meta.adapt=\[x': the value is not valid YAML"):
        apply_overrides({}, ["meta.adapt=[x"])
    path = tmp_path / "c.yaml"
    path.write_text("output_dir: 2020-01-01\n")  # a YAML date: an error, not a TypeError
    with pytest.raises(ConfigError, match="output_dir: expected str, got datetime.date"):
        load_config(path, ["seed=1"])


def test_values_the_data_generator_would_refuse_are_config_errors():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"seed": -1, "output_dir": " ", "model": 3,
                          "data": {"synthetic": {"num_users": 1, "user_bias_std": -0.5}}})
    text = str(err.value)
    for message in ("seed: -1 must be an integer >= 0", "output_dir: empty",
                    "model: expected a mapping, got 3",
                    "data.synthetic.num_users: 1 must be >= 2",
                    "data.synthetic.user_bias_std: -0.5 must be >= 0"):
        assert message in text


@pytest.mark.parametrize("keys, message", [
    ({"zero_optimization": 3}, "deepspeed.zero_optimization: expected a JSON object, got 3"),
    ({"bf16": True}, "deepspeed.bf16: expected a JSON object, got True"),
    ({"optimizer": {"type": "Adam", "params": [0.1]}}, "deepspeed.optimizer.params: expected a JSON object"),
])
def test_deepspeed_sections_that_are_not_objects(tmp_path, keys, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(keys))
    with pytest.raises(ConfigError, match=message):
        resolve_ds_config(config_from_dict({"deepspeed": str(path)}), 1)


def test_batch_errors_name_where_each_key_comes_from(tmp_path):
    """meta.* keys are the run config's, deepspeed.* keys the DeepSpeed file's: the message
    names each source and the fix, not only the DeepSpeed file."""
    cfg = config_from_dict({"meta": {"tasks_per_micro_batch": 32, "tasks_per_meta_step": 64},
                            "deepspeed": ds_file(tmp_path)})
    with pytest.raises(ConfigError) as err:
        resolve_ds_config(cfg, 16)
    text = str(err.value)
    assert "ds.json" not in text.splitlines()[0]  # not "invalid configuration in ds.json"
    assert ("meta.tasks_per_meta_step (64) must be a multiple of meta.tasks_per_micro_batch (32) x "
            "world size (16) = 512 (B and T from the run config's meta.*, W from the launch); set "
            "meta.tasks_per_meta_step to a multiple of 512, or lower meta.tasks_per_micro_batch to a "
            "divisor of 64 / 16 = 4") in text
    auto = config_from_dict({"meta": {"tasks_per_micro_batch": 32, "tasks_per_meta_step": "auto"},
                             "deepspeed": ds_file(tmp_path, train_batch_size=48)})
    with pytest.raises(ConfigError, match=r"B from deepspeed.train_batch_size in .*ds.json, T from the "
                                          r"run config, W from the launch\); set deepspeed.train_batch_size"):
        resolve_ds_config(auto, 2)
    clash = config_from_dict({"meta": {"tasks_per_micro_batch": 8, "tasks_per_meta_step": 32},
                              "deepspeed": ds_file(tmp_path, train_batch_size=64)})
    with pytest.raises(ConfigError, match=r"contradicts deepspeed.train_batch_size \(64\); set one to 'auto' "
                                          r"\(meta.\* in the run config, deepspeed.\* in .*ds.json\)"):
        resolve_ds_config(clash, 2)


def test_inner_lr_scale_parses_from_an_override_and_refuses_non_positive_multipliers():
    cfg = config_from_dict(apply_overrides({}, ['meta.inner_lr_scale={"popularity.*": 4, mlp.*: 0.5}']))
    assert cfg.meta.inner_lr_scale == {"popularity.*": 4, "mlp.*": 0.5}
    with pytest.raises(ConfigError, match=r"meta.inner_lr_scale.mlp.\*: 0 is not a positive number"):
        config_from_dict({"meta": {"inner_lr_scale": {"mlp.*": 0}}})
    with pytest.raises(ConfigError, match=r"meta.inner_lr_scale: expected dict"):
        config_from_dict({"meta": {"inner_lr_scale": [2.0]}})


def test_per_task_offset_options_need_the_popularity_offset_of_a_ctr_model():
    for key in ("support_level", "offset_first"):
        with pytest.raises(ConfigError, match=f"meta.{key}: "):
            config_from_dict({"task": "text", "model": {"item_popularity": True}, "meta": {key: 1.0}})
        cfg = config_from_dict({"model": {"item_popularity": True}, "meta": {key: 1.0}})
        assert getattr(cfg.meta, key) == 1.0
        with pytest.raises(ConfigError, match=f"meta.{key}: expected float or NoneType, got 'x'"):
            config_from_dict({"model": {"item_popularity": True}, "meta": {key: "x"}})


def test_old_sharding_spelling_reads_as_dense_with_one_warning(tmp_path):
    """`embedding.sharding: replicated` (before the rename to `dense`) keeps loading: configs,
    and model.json recipes that serving rebuilds with config_from_dict({model, embedding})."""
    path = tmp_path / "old.yaml"
    path.write_text("embedding: {sharding: replicated}\n")
    with pytest.warns(FutureWarning, match="embedding.sharding: 'replicated' is now spelled 'dense'"):
        cfg = load_config(path)
    assert cfg.embedding.sharding == "dense"
    recipe = {"model": {}, "embedding": {"sharding": "replicated"}}
    with pytest.warns(FutureWarning):
        assert config_from_dict(recipe, "model.json").embedding.sharding == "dense"
    assert recipe["embedding"]["sharding"] == "replicated"  # the caller's dict is not changed


def test_sharding_modes_are_dense_and_sharded():
    assert config_from_dict({}).embedding.sharding == "dense"
    with pytest.raises(ConfigError, match="embedding.sharding: 'copies' is not one of dense, sharded"):
        config_from_dict({"embedding": {"sharding": "copies"}})


def test_runs_and_studies_from_before_the_rename_still_match(tmp_path):
    """A finished split whose summary.json says `replicated` is reused by the same config now
    read as `dense`; a tune study stored with `replicated` continues with `dense`."""
    from gmeta_ds.config import config_to_dict
    from gmeta_ds.evaluation.splits import finished_summary
    from gmeta_ds.run.tune import _mismatch

    cfg = config_from_dict({"output_dir": str(tmp_path)})
    old = config_to_dict(cfg)
    old["embedding"]["sharding"] = "replicated"
    (tmp_path / "summary.json").write_text(json.dumps({"config": old, "eval": {"auc": 0.7}}))
    assert finished_summary(cfg) is not None
    given = {"space": {}, "metric": "auc", "base": {"embedding.sharding": "dense"}}
    assert _mismatch({**given, "base": {"embedding.sharding": "replicated"}}, given) == []
    assert _mismatch({**given, "base": {"embedding.sharding": "sharded"}}, given)
