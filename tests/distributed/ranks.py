"""Run a worker function on W ranks (gloo on CPU) of the warm test pool, with a hard timeout.

Each rank runs ``module.NAME(*args)`` in a worker of `tests/pool.py` with RANK/WORLD_SIZE/MASTER_*
set, between a gloo ``init_process_group`` and a barrier; the pool kills every rank when the
timeout passes and the test fails with every rank's output.
"""
from __future__ import annotations

from pool import pool


def run_ranks(worker: str, world: int, *args: str, timeout: float = 120.0,
              module: str = "distributed.workers") -> list[str]:
    """Run worker ``worker`` (a function of ``module``) on ``world`` ranks; returns each rank's
    stdout; raises on failure."""
    result = pool().run({"kind": "call", "module": module, "function": worker, "args": list(args)},
                        world, timeout=timeout, label=f"{module}.{worker}{tuple(args)}")
    failed = [(r, c) for r, c in enumerate(result.codes) if c != 0]
    if failed:
        detail = "\n".join(f"--- rank {r}\n{out[-3000:]}\n{err[-3000:]}"
                           for r, (out, err) in enumerate(zip(result.rank_stdout, result.rank_stderr)))
        raise AssertionError(f"{worker} failed on ranks {failed}\n{detail}")
    return result.rank_stdout
