"""The warm rank pool (tests/pool.py) itself: a hung job fails its test within its timeout and
the pool is rebuilt, a failed rank ends its job instead of leaving peers waiting, and one job's
environment and working directory do not reach the next."""
from __future__ import annotations

import time

import pytest
from pool import PoolTimeout, RankPool

pytestmark = pytest.mark.distributed


@pytest.fixture
def own_pool():
    """A pool of its own (the session's pool is left alone), closed afterwards."""
    pool = RankPool(size=2)
    try:
        yield pool
    finally:
        pool.close()


def call(function: str, *args: str) -> dict:
    return {"kind": "call", "module": "distributed.workers", "function": function, "args": list(args)}


def test_a_hung_job_fails_within_its_timeout_and_the_pool_recovers(own_pool, tmp_path):
    own_pool.warm(2)
    own_pool.run(call("leave_traces", "warm"), 2, cwd=tmp_path, timeout=120)  # imports done
    started = time.monotonic()
    with pytest.raises(PoolTimeout, match=r"ranks \[0, 1\] did not finish within 3 s"):
        own_pool.run(call("hang"), 2, cwd=tmp_path, timeout=3)
    assert time.monotonic() - started < 30
    result = own_pool.run(call("leave_traces", "after"), 2, cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and result.codes == [0, 0]


def test_a_failed_rank_ends_the_job_with_its_error(own_pool, tmp_path, monkeypatch):
    import pool as pool_module

    monkeypatch.setattr(pool_module, "FAILED_RANK_GRACE_S", 2)
    result = own_pool.run(call("fail_on_rank", "1"), 2, cwd=tmp_path, timeout=120)
    assert result.codes[1] == 1 and result.returncode != 0
    assert "rank 1 failed on purpose" in result.rank_stderr[1]
    again = own_pool.run(call("leave_traces", "x"), 2, cwd=tmp_path, timeout=120)
    assert again.codes == [0, 0]


def test_a_job_sees_its_own_environment_and_folder_only(own_pool, tmp_path):
    first = own_pool.run(call("leave_traces", "first"), 2, cwd=tmp_path, timeout=120,
                         env={"GMETA_POOL_MARK": "given"})
    assert [line.split()[1] for line in first.rank_stdout] == ["given", "given"]
    assert all(f" {tmp_path} " in line for line in first.rank_stdout)
    second = own_pool.run(call("leave_traces", "second"), 2, cwd=tmp_path, timeout=120)
    assert [line.split()[1:3] for line in second.rank_stdout] == [["unset", str(tmp_path)]] * 2
