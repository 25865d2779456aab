"""Jobs of test_started_group.py: docs/api.md's small model (its complete example's tasks
and learner) trained through ``gm.initialize`` on a process group that someone else started (a
`call` job of the test pool: the pool's worker starts the group, as a user's own
``init_process_group``, Accelerate's ``Accelerator()`` or a test harness would) or on the group
``gm.initialize`` starts itself (this file run as a script, under the launcher's variables);
and ``gmeta_ds.cli.main(["train", ...])`` called on a started group.

Each rank of `train` writes ``OUT/rank{R}.json``: its world, its query losses and the model's
checksums.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
# A group started with init_method="tcp://..." or a store (mp.spawn, a harness) sets none of these.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DS_CONFIG = {"optimizer": {"type": "Adam", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 1}}
META_STEPS = 3


def _forget_the_launcher(deepspeed_comm: str = "") -> None:
    """The launcher's variables gone; with ``deepspeed_comm`` DeepSpeed's communication started
    on the group too, as Accelerate's DeepSpeed plugin does (DeepSpeed's config parser then
    reads the group's world size)."""
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)
    if deepspeed_comm:
        import deepspeed

        from gmeta_ds.engine import ds_internals

        ds_internals.skip_shm_op()  # as gmeta_ds does: no C++ op built for the test
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def _doc_example():
    """docs/api.md's complete example up to its step 4: (gm, data, learner)."""
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)[0]
    scope: dict = {"__name__": "api_doc_example"}
    exec(compile(code.split("\n# 4.")[0], str(DOC), "exec"), scope)  # noqa: S102 - the doc's own code
    return scope["gm"], scope["data"], scope["learner"]


def train(out: str) -> None:
    """The example's initialize (3 meta-steps instead of 20); the rank's record to OUT."""
    gm, data, learner = _doc_example()
    engine = gm.initialize(learner, DS_CONFIG, tables=gm.tables_for(data.fields, dim=8), sharding="row_wise",
                           tasks_per_micro_batch=8, tasks_per_meta_step=16, lr=1e-2, seed=0)
    losses = [engine.meta_step(engine.batches(data.train, step)).query_loss for step in range(META_STEPS)]
    record = {"rank": engine.rank, "world": engine.world_size, "losses": losses,
              "checksums": list(engine.checksums())}
    Path(out, f"rank{engine.rank}.json").write_text(json.dumps(record))


def train_on_started_group(out: str, deepspeed_comm: str = "") -> None:
    """`train` on the group the pool started, its launcher variables gone; the group must be the
    same one afterwards (no second start, not torn down: it stays its starter's)."""
    import torch.distributed as dist

    _forget_the_launcher(deepspeed_comm)
    group = dist.group.WORLD
    train(out)
    assert dist.is_initialized() and dist.group.WORLD is group, "gm.initialize replaced the started group"


def batch_for_one_rank(out: str) -> None:
    """``gm.initialize`` with a DeepSpeed config whose batch keys fit one rank, on a started
    2-rank group without launcher variables: the rank's error message to OUT."""
    import torch.distributed as dist

    _forget_the_launcher()
    gm, data, learner = _doc_example()
    config = {**DS_CONFIG, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}
    try:
        gm.initialize(learner, config, tables=gm.tables_for(data.fields, dim=8), lr=1e-2, seed=0)
    except gm.ConfigError as exc:
        Path(out, f"rank{dist.get_rank()}.txt").write_text(str(exc))


def cli_train_on_started_group(config: str) -> None:
    """``gmeta_ds.cli.main(["train", "--config", config])`` on the group the pool started, its
    launcher variables gone and DeepSpeed's communication started: it must train on the
    group's ranks and leave the group up."""
    import torch.distributed as dist

    import gmeta_ds.cli

    _forget_the_launcher(deepspeed_comm="yes")
    group = dist.group.WORLD
    code = gmeta_ds.cli.main(["train", "--config", config])
    assert code == 0, f"gmeta-ds train exited {code}"
    assert dist.is_initialized() and dist.group.WORLD is group, "gmeta-ds train ended the started group"


if __name__ == "__main__":
    train(sys.argv[1])
