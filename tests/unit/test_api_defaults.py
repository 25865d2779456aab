"""Every default the Python API states is the run config's default for the same setting
(issue 35: defaults written once, shared by the YAML and the API).

`test_every_api_default_is_the_config_default` walks the signatures of the public API (the
`gm.*` functions, `MetaEngine`'s methods, the algorithms, tables and zoo models) and checks each
parameter with a default against ``SAME`` (a config key: both defaults must be equal),
``ON_PURPOSE`` (a config key it differs from on purpose, docs/api.md "Defaults" says why: both
values are pinned, so changing either side alone fails here) or ``API_ONLY`` (no config key).
A new defaulted parameter fails until it is classified. `test_reference_signatures_match_the_code`
holds docs/api.md's Reference signatures to the code's, defaults included. The config keys'
defaults are written out for readers on docs/configuration.md, generated from the dataclasses
(tests/unit/test_docs_reference.py keeps the page equal to what they render).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest
from torch import nn

import gmeta_ds as gm
from gmeta_ds import api
from gmeta_ds.config import DEFAULTS, MetaConfig, RunConfig, TableOverride
from gmeta_ds.functional import inner

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
FIELDS = [gm.FieldSpec("user", 5, side="user"), gm.FieldSpec("item", 7, side="item")]

# (callable as named here) -> the callable; classes by their constructor.
WALKED = {
    "build_tasks": gm.build_tasks, "tables_for": gm.tables_for, "meta_learner": gm.meta_learner,
    "initialize": gm.initialize, "MetaEngine": gm.MetaEngine, "MetaEngine.batches": gm.MetaEngine.batches,
    "MetaEngine.evaluate": gm.MetaEngine.evaluate, "MetaEngine.save_checkpoint": gm.MetaEngine.save_checkpoint,
    "MetaAlgorithm": gm.MetaAlgorithm, "MAML": gm.MAML, "FOMAML": gm.FOMAML, "Reptile": gm.Reptile,
    "MetaSGD": gm.MetaSGD, "TableConfig": gm.TableConfig, "EmbeddingCollection": gm.EmbeddingCollection,
    "ShardedEmbeddingCollection": gm.ShardedEmbeddingCollection, "plan_tables": gm.plan_tables,
    "MeLU": gm.MeLU, "DCNv2": gm.DCNv2, "DeepFM": gm.DeepFM, "WideDeep": gm.WideDeep, "DLRM": gm.DLRM,
    "TwoTower": gm.TwoTower,
}
_ALGORITHM = {"kind": "data.label", "split_body": "meta.split_body", "inner_lr_scale": "meta.inner_lr_scale",
              "inner_loss_prior": "meta.inner_loss_prior", "offset_first": "meta.offset_first",
              "support_level": "meta.support_level", "rank_weight": "meta.rank_weight",
              "warmup_steps": "meta.warmup_steps", "init_weight": "meta.init_weight"}
_TABLE = {"init_std": "embedding.init_std", "optimizer": "embedding.optimizer", "lr": "embedding.lr",
          "kind": "embedding.tables.*.kind", "capacity": "embedding.tables.*.capacity",
          "admit_after": "embedding.tables.*.admit_after", "eviction": "embedding.tables.*.eviction",
          "device": "embedding.device", "exchange": "embedding.exchange"}
# parameter -> the config key whose default it must equal (None and () stand for an empty list or dict).
SAME = {
    "build_tasks": {"seed": "seed", "timestamp": "data.schema.timestamp", "user_features": "data.schema.user_features",
                    "item_features": "data.schema.item_features", "multi_hot": "data.schema.multi_hot"},
    "tables_for": {k: _TABLE[k] for k in ("optimizer", "lr", "init_std", "capacity", "admit_after", "eviction",
                                          "exchange")},
    "meta_learner": {"algorithm": "meta.algorithm", "inner_steps": "meta.inner_steps", "inner_lr": "meta.inner_lr",
                     "loss": "data.label", "vectorize": "meta.vectorize", "compile": "meta.compile",
                     **{k: v for k, v in _ALGORITHM.items() if k != "kind"}},
    "initialize": {"config": "deepspeed", "lr": "train.lr", "seed": "seed", "resume": "train.resume",
                   "nonfinite": "train.nonfinite", "collective_timeout_s": "train.collective_timeout_s",
                   "threads": "train.threads"},
    "MetaEngine": {"nonfinite": "train.nonfinite"},
    "MetaEngine.batches": {"bucket_by_length": "data.bucket_by_length", "resample": "data.resample",
                           "resample_support": "data.resample_support"},
    "MetaEngine.evaluate": {"tasks_per_batch": "eval.tasks_per_batch", "baseline_epochs": "eval.baseline_epochs",
                            "baseline_lr": "eval.baseline_lr", "baseline_batch_size": "eval.baseline_batch_size",
                            "bootstrap_resamples": "eval.bootstrap_resamples",
                            "finetune_search": "eval.finetune_search"},
    "MetaEngine.save_checkpoint": {"keep_last": "train.keep_last"},
    **{name: _ALGORITHM for name in ("MetaAlgorithm", "MAML", "FOMAML", "Reptile", "MetaSGD")},
    "TableConfig": _TABLE,
    "EmbeddingCollection": {"seed": "seed", "bad_ids": "embedding.bad_ids"},
    "ShardedEmbeddingCollection": {"seed": "seed", "bad_ids": "embedding.bad_ids", "dedup": "embedding.dedup"},
    "plan_tables": {"row_owner": "embedding.row_owner", "replicate_below_rows": "embedding.replicate_below_rows",
                    "default_exchange": "embedding.exchange"},
    **{name: {"hidden": "model.hidden"} for name in ("MeLU", "DeepFM", "WideDeep")},
    "DCNv2": {"hidden": "model.hidden", "cross_layers": "model.cross_layers"},
    "DLRM": {"hidden": "model.hidden", "bottom_hidden": "model.bottom_hidden"},
    "TwoTower": {"tower_hidden": "model.tower_hidden"},
}
# (callable, parameter) -> (config key, the API's default, the config's default): different on
# purpose, each reason in docs/api.md "Defaults".
ON_PURPOSE = {
    ("meta_learner", "adapt"): ("meta.adapt", None, ["mlp.*"]),
    ("initialize", "sharding"): ("embedding.sharding", "row_wise", "dense"),
    ("initialize", "tasks_per_micro_batch"): ("meta.tasks_per_micro_batch", "auto", 32),
    ("initialize", "tasks_per_meta_step"): ("meta.tasks_per_meta_step", "auto", 64),
    ("initialize", "output_dir"): ("output_dir", None, "runs/default"),
    ("MetaEngine.evaluate", "inner_steps"): ("eval.inner_steps", None, "auto"),
    ("MetaEngine.evaluate", "baselines"): ("eval.baseline", (), True),
    ("MetaEngine.evaluate", "few_shot"): ("eval.few_shot", (), [1, 2, 5, 10, 20]),
    ("MetaEngine.evaluate", "steps_curve"): ("eval.steps_curve", (), [0, 1, 2, 5, 10]),
}
# Parameters with no config key: what the API is handed instead of reading it from a file.
API_ONLY = {
    ("initialize", "tables"), ("MetaEngine", "initial"), ("MetaEngine.evaluate", "train"),
    ("MetaEngine.evaluate", "valid"), ("MetaEngine.evaluate", "states"), ("MetaEngine.evaluate", "synthetic"),
    ("MetaEngine.evaluate", "out"),
    ("TableConfig", "pooling"), ("ShardedEmbeddingCollection", "device"), ("ShardedEmbeddingCollection", "timeout_s"),
    ("plan_tables", "bag_stats"),
    *((name, "embedding") for name in ("MeLU", "DCNv2", "DeepFM", "WideDeep", "DLRM", "TwoTower")),
}


def config_default(key: str):
    """The default of dotted config ``key``; ``embedding.tables.*.x`` is a table's own."""
    node, owner, parts = RunConfig(), None, key.split(".")
    for i, part in enumerate(parts):
        if part == "*":  # dict[str, Section] field: one entry's defaults
            node = typing.get_args(typing.get_type_hints(type(owner))[parts[i - 1]])[1]()
            continue
        assert dataclasses.is_dataclass(node) and part in {f.name for f in dataclasses.fields(node)}, key
        owner, node = node, getattr(node, part)
    return node


def _plain(value):
    """Defaults compared as values: tuples as lists, None and empty containers as one 'empty'."""
    if value is None or value in ((), [], {}):
        return "<empty>"
    return list(value) if isinstance(value, tuple) else value


def _defaults(fn) -> dict:
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("name", sorted(WALKED))
def test_every_api_default_is_the_config_default(name):
    problems = []
    for param, value in _defaults(WALKED[name]).items():
        if param in SAME.get(name, {}):
            key = SAME[name][param]
            if _plain(value) != _plain(config_default(key)):
                problems.append(f"{name}({param}={value!r}) but {key}'s default is {config_default(key)!r}: "
                                "take it from gmeta_ds.config.DEFAULTS")
        elif (name, param) in ON_PURPOSE:
            key, api_value, config_value = ON_PURPOSE[(name, param)]
            if value != api_value or config_default(key) != config_value:
                problems.append(f"{name}({param}={value!r}) and {key}: {config_default(key)!r} differ on purpose "
                                f"as {api_value!r} and {config_value!r}; one side changed: revisit docs/api.md "
                                "'Defaults' and this pin")
        elif (name, param) not in API_ONLY:
            problems.append(f"{name}({param}={value!r}) is not classified: add it to SAME (its config key), "
                            "ON_PURPOSE or API_ONLY")
    assert not problems, "\n".join(problems)


def test_every_mapped_parameter_exists():
    """A renamed parameter or config key must not leave its entry silently checking nothing."""
    for name, params in SAME.items():
        assert set(params) <= set(_defaults(WALKED[name])), name
        for key in params.values():
            config_default(key)
    for (name, param), (key, _, _) in ON_PURPOSE.items():
        assert param in _defaults(WALKED[name]), (name, param)
        config_default(key)
    for name, param in API_ONLY:
        assert param in _defaults(WALKED[name]), (name, param)


def test_defaults_object_is_the_dataclasses_defaults():
    assert DEFAULTS == RunConfig()
    assert config_default("embedding.tables.*.capacity") is TableOverride().capacity


def test_adapt_none_is_meta_adapts_default():
    """``adapt=None`` and ``meta.adapt`` left out mean the same: the model's ``default_adapt``,
    else meta.adapt's default."""
    assert api._adapt_patterns(nn.Linear(2, 1), None, "test") == MetaConfig().adapt
    assert api._adapt_patterns(gm.TwoTower(FIELDS, embed_dim=4), None, "test") == list(gm.TwoTower.default_adapt)


def test_vectorize_auto_resolves_as_the_cli_does(monkeypatch):
    """vectorize's default is meta.vectorize's "auto": the zoo's models vmap at their sizes, and a
    model of the user's own (no activation estimate) vmaps: the API's earlier default, True."""
    zoo = gm.meta_learner(gm.MeLU(FIELDS, embed_dim=4))
    assert zoo.algorithm.vectorize is True
    own = gm.meta_learner(nn.Sequential(nn.Flatten(), nn.Linear(8, 1)), adapt="1.*")
    assert own.algorithm.vectorize is True
    assert gm.meta_learner(gm.MeLU(FIELDS, embed_dim=4), vectorize=False).algorithm.vectorize is False
    monkeypatch.setattr(inner, "memory_bytes_per_rank", lambda: 1024)  # a 256-byte budget
    assert gm.meta_learner(gm.MeLU(FIELDS, embed_dim=4)).algorithm.vectorize is False
    assert gm.meta_learner(nn.Sequential(nn.Flatten(), nn.Linear(8, 1)), adapt="1.*").algorithm.vectorize is True


# ---------------------------------------------------------------------------- docs/api.md
_SIGNATURE = re.compile(r"`(gm\.\w+|batches|evaluate|save_checkpoint)\(([^`]*)\)(?: -> [\w\[\], ]+)?`")
_METHODS = {"batches": gm.MetaEngine.batches, "evaluate": gm.MetaEngine.evaluate,
            "save_checkpoint": gm.MetaEngine.save_checkpoint}


def _documented() -> list[tuple[str, str]]:
    """(name, parameter list) of every signature docs/api.md's Reference writes out."""
    text = DOC.read_text().split("## Reference", 1)[1].split("\n## ", 1)[0]
    whole_line = re.compile(r"(?m)^" + _SIGNATURE.pattern + "$")
    methods = [m for m in _SIGNATURE.finditer(text) if m.group(1) in _METHODS]
    functions = [m for m in whole_line.finditer(text) if m.group(1).startswith("gm.")]
    return [(m.group(1), m.group(2)) for m in functions + methods]


def test_reference_signatures_match_the_code():
    documented = _documented()
    assert {"gm.build_tasks", "gm.tables_for", "gm.meta_learner", "gm.initialize", "evaluate"} <= {
        n for n, _ in documented}
    problems = []
    for name, params in documented:
        fn = _METHODS.get(name) or getattr(gm, name.removeprefix("gm."))
        args = ast.parse(f"def f({params}): pass").body[0].args
        positional = args.posonlyargs + args.args
        written = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults):]], args.defaults))
        written.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
        names = [a.arg for a in positional + args.kwonlyargs]
        code = [p for p in inspect.signature(fn).parameters.values()
                if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if names != [p.name for p in code]:
            problems.append(f"{name}: docs/api.md lists {names}, the code {[p.name for p in code]}")
            continue
        for p in code:
            doc_value = ast.literal_eval(written[p.name]) if p.name in written else inspect.Parameter.empty
            if doc_value != p.default:
                problems.append(f"{name}({p.name}): docs/api.md says {doc_value!r}, the code {p.default!r}")
    assert not problems, "\n".join(problems)

