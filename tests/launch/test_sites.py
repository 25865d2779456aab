"""Meta-training across sites (issue 38): each site its own process group, an outer
synchronisation every ``sites.sync_every`` meta-steps. The exact equivalences: H = 1 with plain
averaging is synchronous training over all ranks (SGD), a checkpoint taken between
synchronisations resumes exactly, also at another number of ranks per site. Real ranks of the
test pool (gloo), real cross-site groups."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import gmeta_ranks, summary, tiny_config

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]

# SGD everywhere: each site's update is linear in its averaged gradient, so averaging the sites'
# changes equals averaging their gradients (the identity H = 1 rests on).
SGD_DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.5}},
          "zero_optimization": {"stage": 0}}
TABLES = {"sharding": "sharded", "plan": "row_wise", "optimizer": "sgd", "lr": 0.05,
          "tables": {"gender": {"plan": "replicated"}, "price": {"plan": "table_wise"}}}
PLAIN = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}


def site_config(tmp_path: Path, sites: dict | None, algorithm: str = "fomaml", steps: int = 4, stage: int = 0,
                **extra) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "sgd.json").write_text(json.dumps({**SGD_DS, "zero_optimization": {"stage": stage},
                                                   "zero_allow_untested_optimizer": stage > 0}))
    sections = {"embedding": TABLES, "deepspeed": str(tmp_path / "sgd.json"),
                "meta": {"algorithm": algorithm, "tasks_per_micro_batch": 2, "tasks_per_meta_step": 8},
                "train": {"meta_steps": steps, "log_every": 1, "lr": 0.05, "progress": False, **extra.pop("train", {})}}
    if sites:
        sections["sites"] = sites
    return tiny_config(tmp_path, **sections, **extra)


def out_dir(config: Path) -> Path:
    return Path(yaml.safe_load(config.read_text())["output_dir"])


def site_summary(config: Path, site: int) -> dict:
    return json.loads((out_dir(config) / "sites" / f"site-{site}" / "summary.json").read_text())


def same(a: dict, b: dict, rel: float) -> None:
    for key in ("dense_checksum", "embedding_checksum"):
        assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-9), key


@pytest.mark.parametrize("algorithm,world,stage", [("fomaml", 4, 0), ("maml", 2, 0), ("reptile", 4, 2)])
def test_every_step_with_plain_averaging_is_synchronous_training(tmp_path, algorithm, world, stage):
    """2 sites x W/2 ranks, H = 1, outer lr 1 without momentum == W ranks as one site (under
    ZeRO-2 the synchronised weights must also reach DeepSpeed's fp32 partitions)."""
    flat = site_config(tmp_path / "flat", None, algorithm, stage=stage)
    gmeta_ranks(world, "train", "--config", flat)
    sites = site_config(tmp_path / "sites", {"count": 2, "sync_every": 1, **PLAIN}, algorithm, stage=stage)
    gmeta_ranks(world, "train", "--config", sites)
    one, two = summary(flat), summary(sites)
    same(one, two, 1e-5)
    same(two, site_summary(sites, 1), 0)  # every site ends with the same weights
    assert two["sites"]["synchronisations"] == 4 and two["sites"]["ranks_per_site"] == world // 2
    assert two["sites"]["tasks_seen_all_sites"] == one["tasks_seen"]


def test_local_steps_differ_from_synchronous_and_cross_sites_only_at_synchronisations(tmp_path):
    """H = 2 is not synchronous training, and int8 deltas cross in fewer bytes (a quarter of the
    values' bytes; here rows of 4 floats, so the ids and per-row scales weigh: about half)."""
    flat = site_config(tmp_path / "flat", None, steps=4)
    gmeta_ranks(2, "train", "--config", flat)
    h2 = site_config(tmp_path / "h2", {"count": 2, "sync_every": 2, **PLAIN}, steps=4)
    gmeta_ranks(2, "train", "--config", h2)
    int8 = site_config(tmp_path / "int8", {"count": 2, "sync_every": 2, "delta_dtype": "int8", **PLAIN}, steps=4)
    gmeta_ranks(2, "train", "--config", int8)
    base, local, small = summary(flat), summary(h2), summary(int8)
    assert local["dense_checksum"] != pytest.approx(base["dense_checksum"], rel=1e-6)
    assert local["sites"]["synchronisations"] == small["sites"]["synchronisations"] == 2
    same(small, site_summary(int8, 1), 0)
    ratio = small["sites"]["cross_site_bytes_site"] / local["sites"]["cross_site_bytes_site"]
    assert 0.3 < ratio < 0.55, ratio
    same(small, local, 1e-2)  # 8-bit deltas: the same model up to their rounding


def test_a_checkpoint_between_synchronisations_resumes_exactly_at_any_ranks_per_site(tmp_path):
    """H = 4, Nesterov outer step: 6 meta-steps in one go == 2 steps, stop, resume to 6 (the
    checkpoint at step 2 holds the anchor, the outer momentum and the touched rows' anchors),
    also when the 2 steps ran on 2 ranks per site and the resume on 1."""
    outer = {"count": 2, "sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
    ckpt = {"checkpoint_every": 2, "keep_last": 0}
    full = site_config(tmp_path / "full", outer, steps=6, train=ckpt)
    gmeta_ranks(2, "train", "--config", full)
    reference = summary(full)
    assert reference["sites"]["synchronisations"] == 2  # at step 4, and the last one after step 6
    for first_world, name in ((2, "same"), (4, "wider")):
        part = site_config(tmp_path / name, outer, steps=2, train=ckpt)
        gmeta_ranks(first_world, "train", "--config", part)
        gmeta_ranks(2, "train", "--config", part, "--set", "train.meta_steps=6", "--set", "train.resume=auto")
        resumed = summary(part)
        assert resumed["resumed_from"]["step"] == 2
        same(resumed, reference, 0 if first_world == 2 else 1e-5)
        same(resumed, site_summary(part, 1), 0)


def test_a_site_without_the_others_checkpoint_is_refused_on_every_rank(tmp_path):
    outer = {"count": 2, "sync_every": 4}
    part = site_config(tmp_path / "run", outer, steps=2, train={"checkpoint_every": 2})
    gmeta_ranks(2, "train", "--config", part)
    shutil.rmtree(out_dir(part) / "sites" / "site-1")  # site 1 starts afresh, site 0 resumes
    done = gmeta_ranks(2, "train", "--config", part, "--set", "train.meta_steps=4", "--set", "train.resume=auto",
                       expect_ok=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "do not start from the same state" in done.stderr and "site 0: meta-step 2" in done.stderr
    assert "site 1: meta-step 0" in done.stderr



@pytest.mark.parametrize("sets,expected", [
    (["sites.count=3"], "sites.count: 3 sites cannot share WORLD_SIZE=2 ranks evenly"),
    (["deepspeed=ds_configs/zero3.json"], "sites need ZeRO stage 0, 1 or 2 (got 3)"),
    (["embedding.tables.region.kind=dynamic"], "cannot synchronise dynamic tables (region"),
    (["train.resume=/tmp/elsewhere"], "train.resume: '/tmp/elsewhere' with sites.count: 2: use 'auto'"),
])
def test_bad_site_settings_are_refused_before_any_collective(tmp_path, sets, expected):
    config = site_config(tmp_path, {"count": 2})
    done = gmeta_ranks(2, "train", "--config", config, *[a for s in sets for a in ("--set", s)], expect_ok=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert expected in done.stderr and "Traceback" not in done.stderr
    assert not out_dir(config).exists() or not any(out_dir(config).iterdir())


def test_zero2_keeps_the_synchronised_weights_in_its_fp32_partitions(tmp_path):
    """ZeRO-2 steps fp32 partitions of its own: after a synchronisation they must hold the new
    anchor (DeepSpeed's refresh_fp32_params), so ZeRO-2 trains what ZeRO-0 trains across sites."""
    outer = {"count": 2, "sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
    runs = []
    for stage in (0, 2):
        config = site_config(tmp_path / f"zero{stage}", outer, "reptile", steps=6, stage=stage, train={"lr": 0.5})
        gmeta_ranks(2, "train", "--config", config)
        runs.append(summary(config))
    same(runs[0], runs[1], 1e-5)
