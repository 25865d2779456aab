"""One warm rank of the test pool (`tests/pool.py`): imports torch, DeepSpeed and gmeta_ds once,
then runs jobs one after another, each as a fresh rank of a fresh job.

Started as ``python -u -P pool_worker.py TESTS_DIR`` (nothing imported from the working
directory). Jobs arrive as JSON lines on the original stdin; one JSON reply per job goes to the
original stdout. While a job runs, file descriptors 1 and 2 point at the job's own output
files, its environment is the job's (rank, world, port, the test's variables) and its working
directory is the job's; all three are restored afterwards, and any process group the job left
is destroyed, so the next job starts as a new process would, minus the imports.

Job kinds:
- ``cli``: ``gmeta_ds.cli.main(argv)``, what ``gmeta-ds ARGV`` runs on one rank;
- ``call``: ``module.function(*args)`` between a gloo ``init_process_group`` and a barrier
  (the worker functions of ``tests/distributed``);
- ``script``: ``python SCRIPT ARGS`` (a user's script against the public API): run as
  ``__main__`` with its folder first on sys.path, then the exit functions it registered, as
  the interpreter would at its exit.
"""
from __future__ import annotations

# ruff: noqa: I001

import atexit
import gc
import importlib
import json
import os
import runpy
import sys
import traceback

PROTO_IN = os.fdopen(os.dup(0), "r")
PROTO_OUT = os.fdopen(os.dup(1), "w", buffering=1)
ERR = os.dup(2)  # the worker's own stderr (the pool's log of this worker)
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0)  # a job never reads the protocol
os.dup2(_null, 1)

# Several ranks of a job share the cores and a job may ask for more threads than its share:
# workers that sleep at once (the CLI decides per run, before torch loads; a warm worker cannot).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import gmeta_ds.cli
import deepspeed  # noqa: F401
import torch
import torch.distributed as dist
from gmeta_ds.engine import ds_internals

torch.set_num_threads(1)  # a job sets its own (train.threads); `call` jobs run on one
sys.path.insert(0, sys.argv[1])  # the tests folder, for `call` jobs (distributed.workers)


def _forget_warnings() -> None:
    """Python shows a warning once per place per process; a job shows its own, as a fresh
    process would."""
    for module in list(sys.modules.values()):
        registry = getattr(module, "__warningregistry__", None)
        if isinstance(registry, dict):
            registry.clear()


_LINEAR = torch.nn.functional.linear


def _reset_deepspeed_state() -> None:
    """What a ZeRO-3 engine leaves in its process, reset as a new process has it. Ranks of one
    job may have run different jobs before (a world-1 job runs on worker 0 only):
    - ZeRO-3 numbers parameters and modules from process-wide counters and checks that all
      ranks agree on the numbers: each job starts them at 0;
    - ZeRO-3 replaces ``torch.nn.functional.linear`` by its own autograd function for good
      ("This will persist unless manually reset"); a rank with it and a rank without it
      produce gradients in another order, and ZeRO-2's bucketed reduction then sums the wrong
      buckets: the original is put back.
    DeepSpeed internals, tested with deepspeed 0.19.8 (the equality tests fail if they move)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = 0
    DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 0
    torch.nn.functional.linear = _LINEAR


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _script(path: str, args: list[str]) -> None:
    """``python path args`` in this process: the script's exit functions run when it ends."""
    path = os.path.abspath(path)
    registered, register = [], atexit.register
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [path, *args], [os.path.dirname(path)]
    atexit.register = lambda fn, *a, **k: (registered.append((fn, a, k)), fn)[1]
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        sys.last_value = sys.exc_info()[1]  # as the interpreter sets it for an uncaught error
        raise
    finally:
        atexit.register = register
        for fn, a, k in reversed(registered):
            fn(*a, **k)
        sys.argv, sys.path[:] = saved_argv, saved_path
        if hasattr(sys, "last_value"):
            del sys.last_value


def _call(job: dict) -> int:
    try:
        if job["kind"] == "cli":
            return int(gmeta_ds.cli.main(job["argv"]) or 0)
        if job["kind"] == "script":
            _script(job["script"], job["args"])
            return 0
        module = importlib.import_module(job["module"])
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        getattr(module, job["function"])(*job["args"])
        dist.barrier()
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:  # noqa: BLE001 - reported as the job's failure, as a process would
        traceback.print_exc()
        return 1


def _teardown() -> None:
    if dist.is_initialized():
        try:
            ds_internals.destroy_world()
        except Exception:  # noqa: BLE001 - a broken group: the pool recycles this worker
            traceback.print_exc()
    gc.collect()


def run(job: dict) -> dict:
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    try:
        for key in job["unset"]:
            os.environ.pop(key, None)
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        _forget_warnings()
        _reset_deepspeed_state()
        code = _call(job)
        _teardown()
        clean = not dist.is_initialized()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(_null, 1)
        os.dup2(ERR, 2)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
    torch.set_num_threads(1)  # the next job sets its own (train.threads)
    return {"rc": code, "clean": clean}


def main() -> None:
    PROTO_OUT.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in PROTO_IN:
        if not line.strip():
            continue
        PROTO_OUT.write(json.dumps(run(json.loads(line))) + "\n")
    os._exit(0)  # no interpreter finalisation (see gmeta_ds.cli.entry)


if __name__ == "__main__":
    main()
