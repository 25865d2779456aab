"""`gm.initialize` sizes torch's threads per rank as `gmeta-ds train` does (issue 50 item 1):
the host's cores over its ranks, unless the user chose (``threads=N``, OMP_NUM_THREADS, or
fewer threads set in torch already). Under `deepspeed --num_gpus 2` an API script used to keep
torch's default (every core per rank) and ran ~20x slower than with OMP_NUM_THREADS=1."""
from __future__ import annotations

import os

import pytest
import torch

import gmeta_ds as gm
from gmeta_ds import api
from gmeta_ds.engine.dist import choose_threads

LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS")


@pytest.fixture
def host(monkeypatch):
    """A host of 8 cores; ``host(ranks, rank, omp)`` sets the deepspeed launcher's variables
    (LOCAL_SIZE) and OMP_NUM_THREADS (None: unset). torch's thread count is restored after."""
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)

    def set_env(ranks: int = 1, rank: int = 0, omp: str | None = None):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(ranks))
        monkeypatch.setenv("LOCAL_SIZE", str(ranks))
        if omp is not None:
            monkeypatch.setenv("OMP_NUM_THREADS", omp)
    yield set_env
    torch.set_num_threads(before)


def test_auto_gives_each_rank_its_share_of_the_hosts_cores(host):
    host(ranks=2)
    torch.set_num_threads(8)  # torch's default on 8 cores: every rank would take them all
    assert choose_threads("auto") == (4, "8 cores / 2 rank(s) on this host; threads=N or OMP_NUM_THREADS to choose")
    host(ranks=16)
    assert choose_threads("auto")[0] == 1  # never 0


def test_an_explicit_choice_is_kept(host):
    host(ranks=2, omp="3")
    torch.set_num_threads(3)  # what torch read from OMP_NUM_THREADS at import
    assert choose_threads("auto") == (3, "OMP_NUM_THREADS=3 kept")
    assert choose_threads(6) == (6, "threads=6")  # the argument wins over everything
    host(ranks=2)
    os.environ.pop("OMP_NUM_THREADS")
    torch.set_num_threads(1)  # torch.set_num_threads(1) called by the script before initialize
    count, why = choose_threads("auto")
    assert count == 1 and why.startswith("torch's setting kept")


def test_initialize_sets_the_threads_and_says_so_on_rank_0_only(host, capsys):
    host(ranks=2, rank=0)
    torch.set_num_threads(8)
    api._set_threads(*api._threads_for("auto"))
    assert torch.get_num_threads() == 4
    assert capsys.readouterr().err == ("gmeta_ds.initialize: 4 torch thread(s) per rank (8 cores / 2 rank(s) "
                                       "on this host; threads=N or OMP_NUM_THREADS to choose)\n")
    host(ranks=2, rank=1)
    api._set_threads(*api._threads_for(2))
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize("threads", [0, "two", 1.5, True, 5000])
def test_a_bad_threads_argument_is_refused_before_anything_starts(threads):
    with pytest.raises(gm.ConfigError, match=rf"threads: {threads!r} is not 'auto' or an integer in 1..4096"):
        gm.initialize(gm.meta_learner(torch.nn.Linear(2, 1), adapt="*"), threads=threads)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("cores, ranks, threads, policy", [
    (2, None, "auto", None),      # one process, its 2 threads on 2 cores: libgomp's spin-then-sleep
    (2, None, 2, None),
    (2, None, 1, "PASSIVE"),      # one thread: no OpenMP workers to keep awake
    (2, None, 4, "PASSIVE"),      # more threads than cores
    (2, 2, "auto", "PASSIVE"),    # 2 ranks on 2 cores: a thread each
    (8, 2, "auto", None),         # 2 ranks x 4 threads on 8 cores
    (8, 2, 8, "PASSIVE"),         # 2 ranks x 8 threads on 8 cores: oversubscribed
    (2, None, None, "PASSIVE"),   # no run config (serve, tune, data)
    (2, "x", "auto", "PASSIVE"),  # a garbled launcher variable (named later by env_world): the safe choice
])
def test_the_cli_lets_openmp_spin_only_where_its_threads_have_their_own_cores(monkeypatch, cores, ranks, threads, policy):
    """`gmeta-ds` sets OMP_WAIT_POLICY=PASSIVE before torch loads only where a spinning worker
    would take a core another thread or rank needs (benchmarks/cli_threads.py: on 2 cores,
    ``train.threads: 2`` under PASSIVE ran slower than 1 thread); a policy the user set is kept."""
    from gmeta_ds.cli import _set_wait_policy

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    for name in (*LAUNCHER, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    if ranks is not None:
        monkeypatch.setenv("LOCAL_SIZE", str(ranks))
        monkeypatch.setenv("WORLD_SIZE", str(ranks))
    _set_wait_policy(threads)
    assert os.environ.get("OMP_WAIT_POLICY") == policy
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    _set_wait_policy(threads)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's choice is kept
