"""ZeRO-3 with the body split (issue 18): when only the head adapts, the body stays
partitioned (DeepSpeed's hooks gather it layer by layer) and the run trains the same model as
ZeRO-2 on 2 ranks and as one plain process, for every algorithm, on the text task (BERT,
classifier head) and the CTR task (MeLU, last decision layer; replicated and sharded tables),
with gradient accumulation and bf16; checkpoints resume exactly, also at another world size;
`gmeta-ds validate` says which path a run takes."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, assert_same_model, gmeta_ranks, summary, text_config, tiny_config, trained_once

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]

HEAD = {"adapt": ["model.classifier.*"], "tasks_per_meta_step": 8}  # 2 per micro-batch: GAS 2 at W=2


def train(path: Path, world: int, *sets: str) -> dict:
    args = ["train", "--config", str(path), *[a for s in sets for a in ("--set", s)]]
    gmeta_ranks(world, *args)
    return summary(path)


def same_text_model(a: dict, b: dict, rel: float = 1e-5) -> None:
    assert a["dense_checksum"] == pytest.approx(b["dense_checksum"], rel=rel)
    assert a["final_query_loss"] == pytest.approx(b["final_query_loss"], rel=rel)
    assert a["tasks_seen"] == b["tasks_seen"] == 32


def text_run(tmp_path: Path, algorithm: str, ds: str, world: int, **extra) -> dict:
    return train(text_config(tmp_path, algorithm, ds, meta={**HEAD, "algorithm": algorithm}, **extra), world)


@pytest.fixture(scope="module")
def text_one_process(tmp_path_factory):
    cache = {}

    def get(algorithm: str) -> dict:
        if algorithm not in cache:
            path = text_config(tmp_path_factory.mktemp(f"one_{algorithm}"), algorithm, "zero0",
                               meta={**HEAD, "algorithm": algorithm})
            cache[algorithm] = trained_once(path, 1)
            assert cache[algorithm]["split_body"] is False
        return cache[algorithm]
    return get


@pytest.mark.parametrize("algorithm", ["maml", pytest.param("fomaml", marks=pytest.mark.slow),
                                       pytest.param("reptile", marks=pytest.mark.slow),
                                       pytest.param("metasgd", marks=pytest.mark.slow)])
def test_text_zero3_split_equals_one_process(tmp_path, text_one_process, algorithm):
    result = text_run(tmp_path, algorithm, "zero3", 2)
    assert result["split_body"] is True and result["ds_config"]["zero_optimization"]["stage"] == 3
    assert result["batch"].startswith("2 tasks/micro-batch x 2")  # gradient accumulation
    same_text_model(result, text_one_process(algorithm))


@pytest.mark.slow
def test_text_zero2_equals_zero3_split(tmp_path, text_one_process):
    result = text_run(tmp_path, "maml", "zero2", 2)
    assert result["split_body"] is False
    same_text_model(result, text_one_process("maml"))


@pytest.mark.slow
def test_text_zero3_split_bf16_trains_close_to_fp32(tmp_path, text_one_process):
    result = text_run(tmp_path, "maml", "zero3_bf16", 2)
    assert result["split_body"] is True and result["ds_config"]["bf16"]["enabled"] is True
    reference = text_one_process("maml")
    assert result["final_query_loss"] == pytest.approx(reference["final_query_loss"], rel=2e-2)
    assert result["dense_checksum"] != reference["dense_checksum"]  # bf16 really ran


@pytest.mark.slow
def test_text_zero3_split_resumes_exactly_and_exports(tmp_path, text_one_process):
    """2 of 4 meta-steps on 2 ZeRO-3 ranks; resumed on 2 ranks for the 3rd (the same world
    size) and on 1 rank for the 4th (another: ZeRO-3's checkpoint is per rank, so DeepSpeed's
    universal conversion reloads it): the uninterrupted model. The exported Hugging Face model
    is then evaluated by `gmeta-ds eval` to the accuracy the run reported."""
    import json

    path = text_config(tmp_path, "maml", "zero3", meta=HEAD,
                       train={"meta_steps": 2, "log_every": 1, "lr": 0.01, "progress": False,
                              "checkpoint_every": 1})
    train(path, 2)
    same_world = train(path, 2, "train.meta_steps=3", "train.resume=auto")
    assert same_world["resumed_from"]["step"] == 2 and same_world["resumed_from"]["optimizer_restored"]
    resumed = train(path, 1, "train.meta_steps=4", "train.resume=auto", "eval.enabled=true")
    assert resumed["resumed_from"]["step"] == 3 and resumed["resumed_from"]["optimizer_restored"]
    assert same_world["split_body"] is True and resumed["split_body"] is True
    same_text_model(resumed, text_one_process("maml"))
    gmeta_ranks(1, "eval", "--config", str(path), "--set", "eval.enabled=true")
    evaluated = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert evaluated["accuracy"] == pytest.approx(resumed["eval"]["accuracy"], abs=1e-6)


# ------------------------------------------------------------------------------------ CTR
def ctr_config(tmp_path: Path, ds: str, algorithm: str = "maml", sharding: str = "dense") -> Path:
    return tiny_config(tmp_path, model={"embed_dim": 4, "hidden": [8, 6]},
                       meta={"algorithm": algorithm, "adapt": ["mlp.4.*"]},
                       embedding={"sharding": sharding},
                       deepspeed=str(REPO / "ds_configs" / f"{ds}.json"))


@pytest.mark.parametrize("sharding", ["dense", pytest.param("sharded", marks=pytest.mark.slow)])
def test_ctr_zero3_split_equals_one_process(tmp_path, sharding):
    one = trained_once(ctr_config(tmp_path / "one", "zero0", sharding=sharding), 1)
    two = train(ctr_config(tmp_path / "two", "zero3", sharding=sharding), 2)
    assert two["split_body"] is True and one["split_body"] is False
    assert_same_model(two, one)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fomaml", "reptile", "metasgd"])
def test_ctr_zero3_split_equals_one_process_every_algorithm(tmp_path, algorithm):
    one = trained_once(ctr_config(tmp_path / "one", "zero0", algorithm), 1)
    two = train(ctr_config(tmp_path / "two", "zero3", algorithm), 2)
    assert two["split_body"] is True
    assert_same_model(two, one)


def test_validate_says_which_zero3_path_a_run_takes(tmp_path):
    def body_line(path: Path, *sets: str) -> str:
        out = gmeta_ranks(1, "validate", "--config", str(path), "--world-size", "2",
                   *[a for s in sets for a in ("--set", s)]).stdout
        return next(line for line in out.splitlines() if line.startswith("model body:"))

    head = text_config(tmp_path / "head", "maml", "zero3", meta=HEAD)
    assert "partitioned (DeepSpeed's ZeRO-3 hooks gather one module at a time" in body_line(head)
    assert "not split (meta.split_body: false): ZeRO-3 gathers every parameter" in body_line(
        head, "meta.split_body=false")
    everything = text_config(tmp_path / "all", "maml", "zero3")
    assert "adapted parameters lie in the model's body" in body_line(everything)
    bad = gmeta_ranks(1, "validate", "--config", str(everything), "--world-size", "2",
               "--set", "meta.split_body=sometimes", expect_ok=False)
    assert bad.returncode == 2 and "meta.split_body: 'sometimes' is not one of true, false, auto" in bad.stdout + bad.stderr
