"""The Meta-IO pipeline end to end on an ml-100k-format folder: gmeta-ds train and eval, one
process and two ranks with sharded tables (multi-hot genres included), and bad data."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import gmeta_ranks, summary, tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import write_ml100k  # noqa: E402

pytestmark = pytest.mark.launcher


def ml_config(tmp_path: Path, **sections) -> Path:
    write_ml100k(tmp_path / "ml-100k", users=60, items=80)
    data = {"source": "movielens-100k", "path": str(tmp_path / "ml-100k"), "query_size": 5,
            "min_interactions": 15, "max_interactions": 40, "cache_dir": str(tmp_path / "cache")}
    return tiny_config(tmp_path, data=data, eval={"enabled": True, "baseline_epochs": 1}, **sections)


def test_train_then_eval_on_movielens_files(tmp_path):
    path = ml_config(tmp_path)
    gmeta_ranks(1, "train", "--config", str(path))
    result = summary(path)
    ev = result["eval"]
    for key in ("auc", "auc_no_adapt", "baseline_auc", "logloss", "baseline_finetune_auc"):
        assert 0.0 < ev[key] < 1.5, key
    assert ev["tasks"] > 0 and ev["query_rows"] == 5 * ev["tasks"]
    gmeta_ranks(1, "eval", "--config", str(path))
    again = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert again["auc"] == pytest.approx(ev["auc"], rel=1e-6)


def test_adapted_item_rows_next_to_multi_hot_genres(tmp_path):
    """meta.adapt with item rows on data that has a pooled multi-hot field (genres)."""
    path = ml_config(tmp_path)
    gmeta_ranks(1, "train", "--config", str(path), "--set", "meta.adapt=[mlp.*, embedding.item_id]",
         "--set", "eval.baseline=false")
    ev = summary(path)["eval"]
    assert 0.0 < ev["auc"] < 1.0 and ev["logloss"] != ev["logloss_no_adapt"]


def test_rating_regression_reports_mae_and_rmse(tmp_path):
    path = ml_config(tmp_path)
    proc = gmeta_ranks(1, "train", "--config", str(path), "--set", "data.label=regression")
    ev = summary(path)["eval"]
    for key in ("mae", "rmse", "mae_no_adapt", "baseline_mae", "baseline_finetune_rmse", "ndcg@5"):
        assert 0.0 < ev[key] < 5.0, key
    assert "auc" not in ev and "cold-start MAE" in proc.stdout and "per-user AUC" not in proc.stdout
    assert "  vs non-meta baseline: MAE " in proc.stdout  # MAE first for ratings


def test_evaluation_on_validation_users(tmp_path):
    path = ml_config(tmp_path)
    gmeta_ranks(1, "train", "--config", str(path), "--set", "data.valid_fraction=0.2",
         "--set", "eval.split=valid", "--set", "eval.baseline=false")
    ev = summary(path)["eval"]
    assert ev["split"] == "valid" and ev["tasks"] > 0 and 0.0 < ev["auc"] < 1.0


def test_four_state_evaluation_reports_every_state(tmp_path):
    path = ml_config(tmp_path)
    gmeta_ranks(1, "train", "--config", str(path), "--set", "data.four_state=true",
         "--set", "data.new_item_year=1996")
    ev = summary(path)["eval"]
    assert sorted(ev["states"]) == ["item_cold", "user_cold", "user_item_cold", "warm"]
    assert ev["states"]["user_cold"]["auc"] == ev["auc"]  # eval.auc is the user-cold state
    for state in ev["states"].values():
        assert state["tasks"] > 0 and "baseline_auc" in state and "auc_no_adapt" in state
        # every state reports the fine-tuned baseline's per-user AUC, and its paired difference is that one's
        assert "baseline_finetune_auc_per_task" in state
        if state["baseline_finetune_auc_per_task"] is not None and state["auc_per_task"] is not None:
            d = state["intervals"]["differences"]["baseline_finetune"]["auc_per_task"]
            assert d["diff"] == pytest.approx(state["auc_per_task"] - state["baseline_finetune_auc_per_task"],
                                              abs=1e-9)
    user_cold = ev["states"]["user_cold"]
    assert user_cold["baseline_finetune_auc_per_task"] == ev["baseline_finetune_auc_per_task"]


SHARDED = {"sharding": "sharded", "plan": "row_wise", "tables": {"gender": {"plan": "replicated"}}}
# genres pooled on their owners (table-wise), the other bags' tables too (embedding.exchange)
POOLED = {**SHARDED, "exchange": "pooled", "tables": {"gender": {"plan": "replicated"},
                                                       "genres": {"plan": "table_wise", "exchange": "pooled"}}}


@pytest.mark.parametrize("embedding", [SHARDED, POOLED], ids=["rows", "pooled"])
def test_sharded_multi_hot_two_ranks_equal_one_process(tmp_path, embedding):
    """Training and the distributed evaluation (held-out tasks split over the ranks)."""
    one = ml_config(tmp_path / "one", embedding=embedding)
    gmeta_ranks(1, "train", "--config", str(one))
    two = ml_config(tmp_path / "two", embedding=embedding)
    gmeta_ranks(2, "train", "--config", str(two))
    a, b = summary(one), summary(two)
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key
    for key in ("auc", "auc_per_task", "logloss", "ndcg@10", "auc_no_adapt", "baseline_auc"):
        assert b["eval"][key] == pytest.approx(a["eval"][key], rel=1e-5), key
    assert b["eval"]["query_rows"] == a["eval"]["query_rows"] > 0
    # the paired intervals and the few-shot curve (rank 0, from the gathered predictions)
    for ev_a, ev_b in ((a["eval"]["intervals"]["differences"], b["eval"]["intervals"]["differences"]),
                       (a["eval"]["few_shot"]["intervals"][0], b["eval"]["few_shot"]["intervals"][0])):
        assert ev_b["baseline_popularity"]["auc"] == pytest.approx(ev_a["baseline_popularity"]["auc"], rel=1e-5)
    assert b["eval"]["few_shot"]["metrics"]["meta"]["auc_per_task"] == pytest.approx(
        a["eval"]["few_shot"]["metrics"]["meta"]["auc_per_task"], rel=1e-5)


def test_hierarchical_exchange_on_two_hosts_of_two_ranks_equals_one_process(tmp_path):
    """embedding.hosts: 2 makes 4 ranks 2 emulated hosts of 2; the genres and the other bags,
    row-wise and pooled on their owners, exchange hierarchically (validate says so) and the
    run equals one process; forced, the deduplicated row exchange of the single-hot fields
    too (about 30 s)."""
    embedding = {**POOLED, "tables": {"gender": {"plan": "replicated"}, "genres": {"exchange": "pooled"}}}
    micro = ("--set", "meta.tasks_per_micro_batch=2")
    one = ml_config(tmp_path / "one", embedding=embedding)
    gmeta_ranks(1, "train", "--config", str(one), *micro)
    two = ml_config(tmp_path / "two", embedding={**embedding, "hosts": 2, "exchange_topology": "auto"})
    out = gmeta_ranks(1, "validate", "--config", str(two), "--world-size", "4", *micro).stdout
    assert "  topology: 2 host(s) x 2 rank(s), hierarchical pooled exchange (est. cross-host" in out, out
    assert " row exchange (est. cross-host " in out and "ids' overlap in a host " in out, out
    hostfile = tmp_path / "hostfile"  # validate plans on a hostfile's hosts when embedding.hosts is 0
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    auto = ml_config(tmp_path / "auto", embedding={**embedding, "exchange_topology": "auto"})
    out = gmeta_ranks(1, "validate", "--config", str(auto), "--hostfile", str(hostfile), *micro).stdout
    assert "  topology: 2 host(s) x 2 rank(s), hierarchical pooled exchange" in out, out
    gmeta_ranks(4, "train", "--config", str(two), *micro)
    # forced: the single-hot fields' row exchange too, whatever their overlap
    forced = ml_config(tmp_path / "forced", embedding={**embedding, "hosts": 2, "exchange_topology": "hierarchical"})
    out = gmeta_ranks(1, "validate", "--config", str(forced), "--world-size", "4", *micro).stdout
    assert "hierarchical pooled exchange" in out and "hierarchical row exchange" in out, out
    gmeta_ranks(4, "train", "--config", str(forced), *micro)
    a = summary(one)
    for b in (summary(two), summary(forced)):
        for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
        assert b["eval"]["auc"] == pytest.approx(a["eval"]["auc"], rel=1e-5)


def test_validate_prints_each_tables_exchange_and_refuses_a_table_that_cannot_pool(tmp_path):
    config = ml_config(tmp_path, embedding={**SHARDED, "exchange": "pooled"})
    out = gmeta_ranks(1, "validate", "--config", str(config), "--world-size", "2").stdout
    genres = next(line for line in out.splitlines() if line.strip().startswith("genres:"))
    assert "pooled on the owner (est." in genres and "B per bag as rows" in genres, out
    assert "pooled" not in next(line for line in out.splitlines() if line.strip().startswith("item_id:"))
    bad = ml_config(tmp_path / "bad", embedding={**SHARDED, "tables": {"genres": {"plan": "replicated",
                                                                                   "exchange": "pooled"}}})
    proc = gmeta_ranks(1, "validate", "--config", str(bad), expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "table 'genres': exchange pooled needs a row_wise or table_wise static table" in proc.stderr


def test_missing_file_is_reported_with_its_name(tmp_path):
    path = ml_config(tmp_path)
    (tmp_path / "ml-100k" / "u.user").unlink()
    proc = gmeta_ranks(1, "train", "--config", str(path), expect_ok=False)
    assert proc.returncode == 2
    assert "u.user" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # CI runs it (make test-slow)
def test_shipped_recipe_options_two_ranks_equal_one_process(tmp_path):
    """The shipped ml-100k recipe's data and level options through the real launcher: warm
    users trained in chunks (data.long_tasks: train, here users above 25 ratings), episodes
    redrawn every meta-step (data.resample) and the support level (meta.support_level) give
    the same model and scores on 2 ranks as in 1 process; the held-out users are those of
    data.long_tasks: skip."""
    extra = ["--set", "data.max_interactions=25", "--set", "data.long_tasks=train", "--set", "data.resample=true",
             "--set", "model.item_popularity=true", "--set", "meta.adapt=[mlp.*, popularity.*]",
             "--set", "meta.support_level=3.0", "--set", "meta.algorithm=reptile"]
    one = ml_config(tmp_path / "one")
    gmeta_ranks(1, "train", "--config", str(one), *extra)
    two = ml_config(tmp_path / "two")
    gmeta_ranks(2, "train", "--config", str(two), *extra)
    a, b = summary(one), summary(two)
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key
    for key in ("auc", "auc_per_task", "logloss", "baseline_finetune_auc", "baseline_popularity_auc"):
        assert b["eval"][key] == pytest.approx(a["eval"][key], rel=1e-5), key
    skip = ml_config(tmp_path / "skip")
    gmeta_ranks(1, "train", "--config", str(skip), "--set", "data.max_interactions=25",
         "--set", "eval.baseline=false")
    assert summary(skip)["eval"]["query_rows"] == a["eval"]["query_rows"] > 0
