"""The Python API refuses bad arguments and models that break the contract (docs/api.md)
with a `ConfigError` naming the argument or the contract, and never reports a silently wrong
evaluation (issue 32): in-process, tiny models, no process group."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import gmeta_ds as gm
from gmeta_ds.api import MetaEngine
from gmeta_ds.evaluation.scores import FEW_TASKS, MetricWarning, evaluate, score


def _log(users: int = 24, click=None) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for u in range(users):
        for i in rng.choice(20, size=16, replace=False):
            label = float(rng.random() < 0.4) if click is None else click
            rows.append((f"u{u}", f"i{i}", f"a{u % 3}", label))
    return pd.DataFrame(rows, columns=["user", "item", "age", "click"])


KEYS = dict(task_key="user", item_key="item", label="click", user_features=["age"],
            label_kind="binary", threshold=0.5, query_size=4, seed=1)


class Tower(nn.Module):
    """Two single-hot fields of d = 4: rows (N, 2, 4) -> (N,)."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.row_fields = ["age", "item"]
        self.body = nn.Linear(2 * dim, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, rows):
        return self.head(torch.relu(self.body(rows.flatten(start_dim=-2)))).squeeze(-1)


class ColumnOut(Tower):
    """Breaks the contract: (N, 1) logits."""

    def forward(self, rows):
        return self.head(torch.relu(self.body(rows.flatten(start_dim=-2))))


class Counting(Tower):
    """Breaks the contract: a buffer updated in place inside forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, rows):
        self.calls += 1
        return super().forward(rows)


@pytest.fixture(scope="module")
def data():
    return gm.build_tasks(_log(), **KEYS)


def _own_tables(model, data, dim: int = 4):
    torch.manual_seed(0)
    model.embedding = gm.EmbeddingCollection(gm.tables_for(data.fields, dim), seed=0)
    return model


def _engine(learner) -> MetaEngine:
    """A MetaEngine over a learner with its own tables, without DeepSpeed or a process group
    (what `evaluate` and the argument checks need)."""
    plan = SimpleNamespace(world_size=1, tasks_per_micro_batch=2, grad_accum_steps=1)
    return MetaEngine(SimpleNamespace(module=learner), None, [], plan, {}, 0, 0)


# ------------------------------------------------------------------ 1. adapt
def test_a_string_adapt_is_one_glob_not_its_characters(data):
    learner = gm.meta_learner(Tower(), "maml", adapt="head.*")
    assert learner.adapted == ["head.weight", "head.bias"]  # "*" alone would adapt body.* too


def test_every_adapt_glob_must_match_something():
    with pytest.raises(gm.ConfigError, match=r"meta.adapt: \['haed.\*'\] matches nothing; candidates are: "
                                             r"body.weight, body.bias, head.weight"):
        gm.meta_learner(Tower(), adapt=["head.*", "haed.*"])
    with pytest.raises(gm.ConfigError, match=r"adapt: 3 \(int\) is not a glob \(str\) or a parameter"):
        gm.meta_learner(Tower(), adapt=["head.*", 3])
    with pytest.raises(gm.ConfigError, match="adapt: empty"):
        gm.meta_learner(Tower(), adapt=[])


# ------------------------------------------------------------------ 2. inner_steps = 0
def test_evaluate_with_zero_inner_steps_does_not_adapt(data):
    learner = gm.meta_learner(_own_tables(Tower(), data), "maml", inner_steps=3, inner_lr=0.5, adapt="head.*")
    engine = _engine(learner)
    with pytest.warns(MetricWarning):  # the few test users
        none = engine.evaluate(data.test, inner_steps=0)
        some = engine.evaluate(data.test)
    assert none["auc"] == none["auc_no_adapt"] and none["logloss"] == none["logloss_no_adapt"]
    assert some["logloss"] != some["logloss_no_adapt"]  # the default (3 steps) does adapt
    lrs = learner.learning_rates()
    with pytest.warns(MetricWarning):
        assert evaluate(learner, lrs, data.test, 0)["logloss"] == none["logloss_no_adapt"]


def test_training_needs_at_least_one_inner_step():
    with pytest.raises(gm.ConfigError, match=r"inner_steps: 0 is not an integer >= 1"):
        gm.meta_learner(Tower(), inner_steps=0, adapt="head.*")


# ------------------------------------------------------------------ 3. argument types and values
@pytest.mark.parametrize("kwargs, words", [
    (dict(inner_steps="2"), r"inner_steps: '2' is not an integer >= 1"),
    (dict(inner_steps=True), r"inner_steps: True is not an integer >= 1"),
    (dict(inner_lr=float("nan")), r"inner_lr: nan is not a finite number > 0"),
    (dict(inner_lr=float("inf")), r"inner_lr: inf is not a finite number > 0"),
    (dict(inner_lr=-0.1), r"inner_lr: -0.1 is not a finite number > 0"),
    (dict(vectorize="yes"), r"vectorize: 'yes' is not True \(vmap over tasks\) or False"),
    (dict(loss="hinge"), r"loss: 'hinge' is not one of binary, regression, multiclass"),
    (dict(split_body="yes"), r"split_body: 'yes' is not one of True, False, 'auto'"),
    (dict(inner_lr_scale={"head.*": float("nan")}), r"inner_lr_scale\['head.\*'\]: nan is not a finite"),
    (dict(inner_loss_prior="x"), r"inner_loss_prior: 'x' is not a finite number >= 0"),
])
def test_meta_learner_refuses_bad_arguments_naming_them(kwargs, words):
    with pytest.raises(gm.ConfigError, match=words) as info:
        gm.meta_learner(Tower(), "maml", adapt="head.*", **kwargs)
    assert "gmeta_ds.meta_learner" in str(info.value)


def test_meta_learner_refuses_what_is_not_a_model_or_an_algorithm():
    with pytest.raises(gm.ConfigError, match="model: expected a torch.nn.Module, got str"):
        gm.meta_learner("model.pt")
    with pytest.raises(gm.ConfigError, match=r"algorithm: 3 is not one of maml, fomaml"):
        gm.meta_learner(Tower(), 3, adapt="head.*")


@pytest.mark.parametrize("kwargs, words", [
    (dict(optimizer="lion"), r"optimizer: 'lion' is not one of sgd, adagrad, rowwise_adagrad, adam"),
    (dict(dim=0), r"dim: 0 is not an integer >= 1"),
    (dict(dim=4.0), r"dim: 4.0 is not an integer >= 1"),
    (dict(lr=float("nan")), r"lr: nan is not a finite number > 0"),
    (dict(init_std=-1.0), r"init_std: -1.0 is not a finite number >= 0"),
    (dict(eviction="fifo"), r"eviction: 'fifo' is not one of lru, lfu"),
    (dict(exchange="bags"), r"exchange: 'bags' is not one of auto, rows, pooled"),
])
def test_tables_for_refuses_bad_arguments_naming_them(data, kwargs, words):
    args = {"dim": 4, **kwargs}
    with pytest.raises(gm.ConfigError, match=words):
        gm.tables_for(data.fields, **args)


def test_build_tasks_refuses_bad_column_names_and_seed():
    with pytest.raises(gm.ConfigError, match=r"task_key: 3 is not a column name"):
        gm.build_tasks(_log(), **{**KEYS, "task_key": 3})
    with pytest.raises(gm.ConfigError, match=r"user_features: 'age' is not a list of column names"):
        gm.build_tasks(_log(), **{**KEYS, "user_features": "age"})
    with pytest.raises(gm.ConfigError, match=r"seed: -1 is not an integer >= 0"):
        gm.build_tasks(_log(), **{**KEYS, "seed": -1})


def test_engine_methods_refuse_bad_arguments(data):
    engine = _engine(gm.meta_learner(_own_tables(Tower(), data), adapt="head.*"))
    with pytest.raises(gm.ConfigError, match=r"inner_steps: '2' is not an integer >= 0"):
        engine.evaluate(data.test, inner_steps="2")
    with pytest.raises(gm.ConfigError, match=r"inner_steps: -1 is not an integer >= 0"):
        engine.evaluate(data.test, inner_steps=-1)
    with pytest.raises(gm.ConfigError, match=r"tasks_per_batch: 0 is not an integer >= 1"):
        engine.evaluate(data.test, tasks_per_batch=0)
    with pytest.raises(gm.ConfigError, match=r"tasks: expected a gm.TaskSet"):
        engine.evaluate(data)
    with pytest.raises(gm.ConfigError, match=r"step: -1 is not an integer >= 0"):
        engine.batches(data.train, -1)
    with pytest.raises(gm.ConfigError, match=r"keep_last: 1.5 is not an integer >= 0"):
        engine.save_checkpoint("runs/x", keep_last=1.5)


def test_initialize_refuses_bad_inputs_before_starting_anything(data):
    """Checked before the process group or DeepSpeed start (none is started here)."""
    tables = gm.tables_for(data.fields, 4)
    learner = gm.meta_learner(Tower(), adapt="head.*")
    with pytest.raises(gm.ConfigError, match=r"learner: expected the result of gm.meta_learner"):
        gm.initialize(Tower(), tables=tables)
    with pytest.raises(gm.ConfigError, match=r"lr: inf is not a finite number > 0"):
        gm.initialize(learner, tables=tables, lr=float("inf"))
    with pytest.raises(gm.ConfigError, match=r"resume: 3 is not None or a directory path"):
        gm.initialize(learner, tables=tables, resume=3)
    with pytest.raises(gm.ConfigError, match=r"tables: expected a list of gm.TableConfig"):
        gm.initialize(learner, tables=tables[0])
    mixed = [tables[0], gm.TableConfig("item", 30, 8, ("item",))]
    with pytest.raises(gm.ConfigError, match=r"tables: every table must have the same dim .*age: 4, item: 8"):
        gm.initialize(learner, tables=mixed)
    zoo = gm.meta_learner(gm.MeLU(data.fields, embed_dim=8, hidden=[4]))
    with pytest.raises(gm.ConfigError, match=r"tables: dim 4 but the model's embed_dim is 8"):
        gm.initialize(zoo, tables=tables)
    wrong = Tower()
    wrong.row_fields = ["age", "itm"]
    with pytest.raises(gm.ConfigError, match=r"model.row_fields: \['itm'\] are not features of the tables; "
                                             r"the tables' features are: age, item"):
        gm.initialize(gm.meta_learner(wrong, adapt="head.*"), tables=tables)
    assert not torch.distributed.is_initialized()


# ------------------------------------------------------------------ 4. undefined and thin scores
def _preds(labels, tasks) -> dict:
    labels = np.asarray(labels, dtype=np.float32)
    p = np.linspace(0.1, 0.9, len(labels))
    return {"labels": labels, "adapted": p, "plain": p[::-1].copy(),
            "task": np.asarray(tasks, dtype=np.int64)}


def test_one_class_labels_give_a_null_auc_with_the_reason():
    with pytest.warns(MetricWarning, match="AUC undefined: the held-out query labels are all one class"):
        out = score(_preds([0] * 12, np.repeat(np.arange(6), 2)))
    assert out["auc"] is None and out["auc_no_adapt"] is None and out["auc_per_task"] is None
    assert ("auc, auc_no_adapt: AUC undefined: the held-out query labels are all one class (all 0, 12 rows); "
            "AUC needs both classes") in out["warnings"]
    per_task = "auc_per_task, auc_per_task_no_adapt: per-task AUC undefined"
    assert any(w.startswith(per_task) for w in out["warnings"])
    assert math.isfinite(out["logloss"])
    json.dumps(out, allow_nan=False)  # a summary never holds a bare NaN


def test_one_class_held_out_users_end_to_end(data):
    zeros = gm.build_tasks(_log(), **KEYS)  # a log of one class is refused (DataError naming the column)
    zeros.test.labels[:] = 0.0  # held-out users without a click
    engine = _engine(gm.meta_learner(_own_tables(Tower(), zeros), adapt="head.*"))
    with pytest.warns(MetricWarning, match="AUC undefined"):
        out = engine.evaluate(zeros.test)
    assert out["auc"] is None and out["tasks"] == len(zeros.test)
    json.dumps(out, allow_nan=False)


def test_a_score_from_few_users_says_so():
    few = r"only 1 task\(s\) scored: the AUC rests on the query rows of 1 user"
    with pytest.warns(MetricWarning, match=few):
        out = score(_preds([0, 1, 0, 1], [7, 7, 7, 7]))
    assert out["tasks_scored"] == 1 and out["auc"] is not None
    assert any("auc_per_task is the mean over only 1 task(s)" in w for w in out["warnings"])
    many = score(_preds([0, 1] * FEW_TASKS, np.repeat(np.arange(FEW_TASKS), 2)), warn=False)
    assert "warnings" not in many and many["tasks_scored"] == FEW_TASKS


def test_the_run_report_prints_a_null_metric():
    from gmeta_ds.workloads.ctr import CTRWorkload

    summary = {"meta_steps": 2, "tasks_seen": 4, "world_size": 1, "elapsed_s": 1.0, "final_query_loss": 0.5,
               "eval": {"tasks": 3, "auc": None, "auc_no_adapt": None, "warnings": ["auc: AUC undefined: x"]}}
    lines = CTRWorkload().report(summary, "out")
    assert "cold-start AUC: meta-learned + adaptation nan | without adaptation nan" in "\n".join(lines)
    assert "warning: auc: AUC undefined: x" in lines


def test_the_run_report_leads_with_per_user_auc_and_keeps_mae_first_for_ratings():
    """The printed cold-start lines: per-user AUC (every model that has one, the fine-tuned
    baselines included), then the global AUC; each interval line per-user AUC first, then AUC,
    then logloss. Ratings: MAE, then RMSE, and no per-user AUC line."""
    from gmeta_ds.workloads.ctr import CTRWorkload

    def d(x):
        return {"diff": x, "low": x - 0.01, "high": x + 0.01}

    ev = {"tasks": 9, "auc": 0.7, "auc_per_task": 0.65, "logloss": 0.6, "auc_no_adapt": 0.6,
          "auc_per_task_no_adapt": 0.62, "baseline_auc": 0.61, "baseline_auc_per_task": 0.6,
          "baseline_finetune_auc": 0.66, "baseline_finetune_auc_per_task": 0.63, "baseline_finetune_tuned_auc": 0.67,
          "baseline_finetune_tuned_auc_per_task": 0.64, "baseline_finetune_lr": 0.1, "baseline_finetune_steps": 5,
          "baseline_popularity_auc": 0.55, "baseline_popularity_auc_per_task": None,
          "intervals": {"level": 0.95, "users": 9, "resamples": 100, "differences": {
              "baseline_finetune": {"auc": d(0.04), "auc_per_task": d(0.02), "logloss": d(-0.01)}}}}
    summary = {"meta_steps": 2, "tasks_seen": 4, "world_size": 1, "elapsed_s": 1.0, "final_query_loss": 0.5,
               "eval": ev}
    lines = CTRWorkload().report(summary, "out")
    models = ("meta-learned + adaptation {} | without adaptation {} | non-meta baseline {} | baseline + "
              "fine-tune {} | baseline + tuned fine-tune (lr 0.1, 5 steps) {} | popularity + user offset {}")
    assert lines[1:5] == [
        "cold-start per-user AUC: " + models.format("0.6500", "0.6200", "0.6000", "0.6300", "0.6400", "nan"),
        "cold-start AUC: " + models.format("0.7000", "0.6000", "0.6100", "0.6600", "0.6700", "0.5500"),
        "meta-learned minus baseline, 95% paired bootstrap interval over 9 held-out users (100 resamples):",
        ("  vs baseline + fine-tune: per-user AUC +0.0200 [+0.0100, +0.0300] | AUC +0.0400 [+0.0300, +0.0500] | "
         "logloss -0.0100 [-0.0200, +0.0000]")]
    summary["eval"] = {"tasks": 9, "mae": 0.7, "rmse": 0.9, "mae_no_adapt": 0.8, "rmse_no_adapt": 1.0,
                       "baseline_mae": 0.75, "baseline_finetune_mae": 0.72, "intervals": {
                           "level": 0.95, "users": 9, "resamples": 100,
                           "differences": {"baseline_finetune": {"rmse": d(-0.01), "mae": d(-0.02)}}}}
    lines = CTRWorkload().report(summary, "out")
    assert lines[1:4] == [
        ("cold-start MAE: meta-learned + adaptation 0.7000 | without adaptation 0.8000 | non-meta baseline 0.7500 | "
         "baseline + fine-tune 0.7200"),
        "meta-learned minus baseline, 95% paired bootstrap interval over 9 held-out users (100 resamples):",
        "  vs baseline + fine-tune: MAE -0.0200 [-0.0300, -0.0100] | RMSE -0.0100 [-0.0200, +0.0000]"]


# ------------------------------------------------------------------ 5. the model contract
@pytest.mark.parametrize("loss", ["binary", "regression"])
@pytest.mark.parametrize("vectorize", [True, False])
def test_column_shaped_logits_are_refused_naming_the_contract(data, loss, vectorize):
    """Under MSE an (N, 1) output broadcast against (N,) labels trained silently."""
    learner = gm.meta_learner(_own_tables(ColumnOut(), data), adapt="head.*", loss=loss, vectorize=vectorize)
    words = (r"model output: model\(rows\) returned shape \(12, 1\) for rows of shape \(12, 2, 4\); "
             r"expected \(12,\) \(squeeze the last dimension")
    with pytest.raises(gm.ConfigError, match=words):
        learner(gm.collate(data.train, [0, 1]))


@pytest.mark.parametrize("vectorize", [True, False])
def test_a_buffer_updated_in_forward_is_refused_naming_it(data, vectorize):
    learner = gm.meta_learner(_own_tables(Counting(), data), adapt="head.*", vectorize=vectorize)
    with pytest.raises(gm.ConfigError, match=r"model: Counting.*(calls|tensor in place).*model contract"):
        learner(gm.collate(data.train, [0, 1]))


def test_a_table_dim_the_model_does_not_expect_names_the_rows_shape(data):
    learner = gm.meta_learner(_own_tables(Tower(dim=4), data, dim=8), adapt="head.*")
    words = (r"model: Tower\(rows\) failed on one task's rows of shape \(N, F, d\) = \(12, 2, 8\): "
             r"F = 2 fields \(row_fields age, item\), d = 8 \(the tables' dim\): the rows' shape is not "
             r"what the model's layers")
    with pytest.raises(gm.ConfigError, match=words):
        learner(gm.collate(data.train, [0, 1]))


def test_row_fields_must_name_the_tables_features_and_every_id_column(data):
    wrong = Tower()
    wrong.row_fields = ["age", "itm"]
    with pytest.raises(gm.ConfigError, match=r"model.row_fields: \['itm'\] are not features of the tables"):
        gm.meta_learner(_own_tables(wrong, data), adapt="head.*")
    short = Tower()
    short.row_fields = ["item"]
    learner = gm.meta_learner(_own_tables(short, data), adapt="head.*")
    words = r"model.row_fields: names 1 field\(s\) \(item\) but the tasks have 2 single-hot id column\(s\)"
    with pytest.raises(gm.ConfigError, match=words):
        learner(gm.collate(data.train, [0, 1]))


# ------------------------------------------------------------------ 6. one forward at initialize
class ExtraArgument(Tower):
    """Breaks the contract: forward takes the labels too."""

    def forward(self, rows, labels):
        return super().forward(rows) * labels


class OneField(Tower):
    """Built for one field (the item's) while the tables hold two."""

    def __init__(self):
        super().__init__()
        self.row_fields = ["age", "item"]
        self.body = nn.Linear(4, 6)


class BranchOnData(Tower):
    """Runs alone, but branches in Python on the data: torch.func.vmap cannot vectorize it."""

    def forward(self, rows):
        out = super().forward(rows)
        return out if float(rows.sum()) > 0 else -out


class Dropout(Tower):
    """Dropout left on: random per call, which vmap over tasks refuses."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, rows):
        return self.head(self.drop(torch.relu(self.body(rows.flatten(start_dim=-2))))).squeeze(-1)


MISTAKES = [
    (ExtraArgument, {}, r"model: ExtraArgument\(rows\) raised TypeError: .*missing 1 required positional "
                        r"argument: 'labels'.*model contract \(docs/api.md\): model\(rows\)"),
    (OneField, {}, r"model: OneField\(rows\) failed on rows of shape \(N, F, d\) = \(3, 2, 4\): F = 2 fields "
                   r"\(age, item\), d = 4 \(the tables' dim\): .*a field the model does not expect, or a model "
                   r"built for another dim \(torch: mat1 and mat2 shapes cannot be multiplied"),
    (lambda: Tower(dim=8), {}, r"model: Tower\(rows\) failed on rows of shape \(N, F, d\) = \(3, 2, 4\): .*d = 4 "
                               r"\(the tables' dim\)"),
    (ColumnOut, {}, r"model output: model\(rows\) returned shape \(3, 1\) for rows of shape \(3, 2, 4\); "
                    r"expected \(3,\) \(squeeze the last dimension"),
    (Tower, {"loss": "multiclass"}, r"model output: model\(rows\) returned shape \(3,\) for rows of shape "
                                    r"\(3, 2, 4\); expected \(3, C\)"),
    (Counting, {}, r"model: Counting.forward updated buffer\(s\) calls in place"),
    (BranchOnData, {}, r"model: BranchOnData\(rows\) runs alone but not under torch.func.vmap over tasks "
                       r"\(torch: .*\): make forward vectorizable .*or pass vectorize=False"),
    (Dropout, {}, r"model: Dropout\(rows\) runs alone but not under torch.func.vmap .*random"),
]


@pytest.mark.parametrize("make, options, words", MISTAKES,
                         ids=["signature", "missing_field", "dim", "column_out", "multiclass_flat", "buffer",
                              "branch", "dropout"])
def test_initialize_runs_the_model_once_and_names_what_breaks_the_contract(data, make, options, words):
    """Each mistake of a first day with one's own model is one ConfigError from gm.initialize,
    on every rank before the process group starts, not a traceback at the first meta-step."""
    learner = gm.meta_learner(make(), adapt="head.*", **options)
    with pytest.raises(gm.ConfigError, match=words) as err:
        gm.initialize(learner, tables=gm.tables_for(data.fields, 4))
    assert "gmeta_ds.initialize" in str(err.value)
    assert not torch.distributed.is_initialized()


def test_a_model_that_loops_over_tasks_may_branch_on_data(data):
    """vectorize=False runs each task alone: the vmap probe is not the model's contract then."""
    from gmeta_ds.algorithms.base import probe_model

    learner = gm.meta_learner(BranchOnData(), adapt="head.*", vectorize=False)
    probe_model(learner, ["age", "item"], 4, "test")
    with pytest.raises(gm.ConfigError, match="not under torch.func.vmap"):
        probe_model(gm.meta_learner(BranchOnData(), adapt="head.*"), ["age", "item"], 4, "test")


def test_the_probe_changes_neither_the_model_nor_the_random_stream(data):
    from gmeta_ds.algorithms.base import probe_model

    model = Tower()
    model.register_buffer("scale", torch.ones(()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    probe_model(gm.meta_learner(model, adapt="head.*"), ["age", "item"], 4, "test")
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_the_probe_reads_fields_and_dim_from_the_models_own_tables(data):
    """A model owning its tables (sharding='dense' or its own EmbeddingCollection) is probed
    with their fields and dim."""
    from gmeta_ds.api import probe_shape

    model = _own_tables(OneField(), data)
    assert probe_shape(model, []) == (["age", "item"], 4)
    with pytest.raises(gm.ConfigError, match=r"F = 2 fields \(age, item\), d = 4"):
        gm.initialize(gm.meta_learner(model, adapt="head.*"))
    assert probe_shape(Tower(), []) == ([], 0)  # fed otherwise (the text workload): nothing to probe


def test_tasks_whose_fields_the_model_does_not_name_are_refused_naming_them(data):
    """engine.batches / engine.evaluate compare model.row_fields with the tasks' own fields."""
    for row_fields, words in ((["item"], r"misses the tasks' field\(s\) age"),
                              (["age", "brand"], r"misses the tasks' field\(s\) item and names brand, which "
                                                 r"the tasks do not have"),
                              (["item", "age"], r"lists the fields in another order \(item, age\)")):
        model = Tower()
        model.row_fields = row_fields
        engine = _engine(gm.meta_learner(model, adapt="head.*"))
        pattern = words + r"; the tasks' single-hot fields are, in order: age, item"
        with pytest.raises(gm.ConfigError, match=pattern):
            engine.batches(data.train, 0)
        with pytest.raises(gm.ConfigError, match=pattern):
            engine.evaluate(data.test)


# ------------------------------------------------------------------ 7. baselines from the API
def _engine_with_initial(learner) -> MetaEngine:
    engine = _engine(learner)
    engine.initial = {k: v.detach().clone() for k, v in learner.state_dict().items()}
    return engine


@pytest.mark.filterwarnings("ignore::gmeta_ds.evaluation.scores.MetricWarning")
def test_evaluate_scores_the_non_meta_and_popularity_baselines_as_train_reports_them(data):
    from gmeta_ds.evaluation.baselines import fit_popularity, popularity_scores
    from gmeta_ds.evaluation.scores import train_baseline

    learner = gm.meta_learner(_own_tables(Tower(), data), "maml", inner_steps=2, inner_lr=0.3, adapt="head.*")
    engine = _engine_with_initial(learner)
    # Zero baseline epochs: the baseline is the initial model, which this untrained learner is.
    same = engine.evaluate(data.test, baselines=["non_meta"], train=data.train, baseline_epochs=0)
    assert same["baseline_auc"] == same["auc_no_adapt"] and same["baseline_logloss"] == same["logloss_no_adapt"]
    assert same["baseline_finetune_logloss"] == same["logloss"]  # the learner's own inner loop
    assert same["baseline_auc_per_task"] == same["auc_per_task_no_adapt"]
    assert same["baseline_finetune_auc_per_task"] == same["auc_per_task"] is not None
    # Now move the learner away from its initial weights: the baseline still starts from them.
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.5)
    moved = {k: v.clone() for k, v in learner.state_dict().items()}
    trained = engine.evaluate(data.test, baselines=("non_meta", "popularity"), train=data.train,
                              baseline_epochs=2, baseline_lr=0.01, baseline_batch_size=32)
    reference = gm.meta_learner(_own_tables(Tower(), data), "maml", inner_steps=2, inner_lr=0.3, adapt="head.*")
    reference.load_state_dict(engine.initial)
    train_baseline(reference.net, data.train, 2, 32, 0.01, 0)
    fixed = {n: 0.3 for n in reference.adapted_names()}
    expected = evaluate(reference, fixed, data.test, 2)
    assert trained["baseline_logloss"] == pytest.approx(expected["logloss_no_adapt"], abs=1e-6)
    assert trained["baseline_finetune_logloss"] == pytest.approx(expected["logloss"], abs=1e-6)
    # The fine-tuned baseline's mean per-user AUC: that of its fine-tuned predictions.
    assert trained["baseline_finetune_auc_per_task"] == pytest.approx(expected["auc_per_task"], abs=1e-9)
    assert trained["baseline_auc_per_task"] == pytest.approx(expected["auc_per_task_no_adapt"], abs=1e-9)
    assert trained["baseline_logloss"] != same["baseline_logloss"]  # it did train
    popularity = popularity_scores(fit_popularity(data.train, 1, "binary", oov_id=0), data.test)
    assert {k: trained[k] for k in popularity} == popularity
    assert trained["logloss_no_adapt"] != same["logloss_no_adapt"]  # the meta-learned model is scored as it is
    # Paired bootstrap intervals of each difference, meta-learned minus each baseline.
    differences = trained["intervals"]["differences"]
    assert set(differences) == {"baseline", "baseline_finetune", "baseline_popularity"}
    for metric in ("auc", "auc_per_task", "logloss"):  # every difference is that of the reported scores
        for name in differences:
            assert differences[name][metric]["diff"] == pytest.approx(
                trained[metric] - trained[f"{name}_{metric}"], abs=1e-9), (name, metric)
    pop = differences["baseline_popularity"]["logloss"]
    assert pop["diff"] == pytest.approx(trained["logloss"] - trained["baseline_popularity_logloss"], abs=1e-9)
    assert pop["low"] <= pop["high"] and trained["intervals"]["users"] == len(data.test)
    assert same["intervals"]["differences"]["baseline_finetune"]["logloss"] == {"diff": 0.0, "low": 0.0, "high": 0.0}
    assert "intervals" not in engine.evaluate(data.test, baselines=["popularity"], train=data.train,
                                              bootstrap_resamples=0)
    after = learner.state_dict()  # and never trained in place
    assert all(torch.equal(moved[k], after[k]) for k in moved)


def test_evaluate_refuses_bad_baseline_arguments_naming_them(data):
    engine = _engine(gm.meta_learner(_own_tables(Tower(), data), adapt="head.*"))
    with pytest.raises(gm.ConfigError, match=r"baselines: 'scratch' not among non_meta, popularity"):
        engine.evaluate(data.test, baselines=["scratch"], train=data.train)
    with pytest.raises(gm.ConfigError, match=r"train: the baselines popularity are fitted on the training tasks: "
                                             r"pass train=data.train"):
        engine.evaluate(data.test, baselines="popularity")
    with pytest.raises(gm.ConfigError, match=r"baseline_lr: -1 is not a finite number > 0"):
        engine.evaluate(data.test, baselines="popularity", train=data.train, baseline_lr=-1)
    with pytest.raises(gm.ConfigError, match=r"'non_meta' starts from the model's initial weights, which this "
                                             r"engine did not keep"):
        engine.evaluate(data.test, baselines="non_meta", train=data.train)
