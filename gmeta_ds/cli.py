"""``gmeta-ds``: parse -> validate -> build -> run -> always tear down.

    gmeta-ds train    --config FILE.yaml [--set dotted.key=value ...]
    gmeta-ds validate --config FILE.yaml [--set ...] [--world-size N]
    gmeta-ds eval     --config FILE.yaml [--set ...] [--weights PATH]
    gmeta-ds validate --config FILE.yaml --hostfile HOSTFILE [--num_gpus N]
    gmeta-ds plot     RUN_DIR [--out DIR]
    gmeta-ds export   CHECKPOINT OUT.safetensors

``--deepspeed_config FILE`` (DeepSpeed's own argument; ``--deepspeed`` is accepted with it)
and Accelerate's ``deepspeed_config_file`` override the run config's ``deepspeed:`` key.

Runs unchanged as one plain process or under a launcher (``deepspeed``, ``torchrun``,
``accelerate launch``); the ``--local_rank=N`` the deepspeed launcher inserts before the
subcommand is accepted and ignored (LOCAL_RANK in the environment is what counts).

Exit codes: 0 done; 2 bad input (config, data, arguments; the problems on stderr); 3 a
collective timed out (``train.collective_timeout_s``: a peer rank is stuck or gone; stderr
names the meta-step or phase and the last complete checkpoint); anything else: a bug.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import warnings
from pathlib import Path

# Ranks share few cores: busy-waiting OpenMP threads starve each other (set before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# DeepSpeed's ZeRO calls a torch collective that torch has renamed; the warning is theirs, not ours.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
# torch's sparse optimizers build COO tensors without opting in or out of invariant checks.
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

from gmeta_ds.config import RunConfig, config_to_dict, load_config  # noqa: E402
from gmeta_ds.errors import CheckpointWriteError, CollectiveTimeout, ConfigError, DataError  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gmeta-ds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "meta-train a model"),
                       ("validate", "check the config and print the resolved plan (no training)"),
                       ("eval", "cold-start evaluation of trained weights")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", required=True, help="run config YAML")
        p.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a config value (repeatable)")
        p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
        p.add_argument("--deepspeed", action="store_true",
                       help="accepted for DeepSpeed's argument convention (DeepSpeed is always on)")
        p.add_argument("--deepspeed_config", "--deepspeed-config", default=None, metavar="FILE",
                       help="DeepSpeed JSON; overrides the run config's 'deepspeed:' key")
        if name == "validate":
            p.add_argument("--world-size", type=int, default=None,
                           help="world size to plan for (default: WORLD_SIZE or 1)")
            p.add_argument("--hostfile", default=None,
                           help="check a deepspeed hostfile and plan for the ranks it starts")
            p.add_argument("--num_gpus", "--num-gpus", type=int, default=None,
                           help="with --hostfile: ranks per host (default: each host's slots)")
        if name == "eval":
            p.add_argument("--weights", default=None,
                           help="safetensors file (default: OUTPUT_DIR/model.safetensors)")
    p = sub.add_parser("export", help="one safetensors file (dense + full tables) from a checkpoint")
    p.add_argument("checkpoint", help="OUTPUT_DIR/checkpoints (its latest) or one step_* directory")
    p.add_argument("out", help="the .safetensors file to write")
    p = sub.add_parser("plot", help="write PNG charts of a run directory")
    p.add_argument("run_dir", help="a run's output_dir (metrics.jsonl, summary.json)")
    p.add_argument("--out", default=None, help="where to write the PNGs (default: RUN_DIR/plots)")
    return parser


def _cmd_validate(cfg: RunConfig, args: argparse.Namespace) -> int:
    from gmeta_ds.ds_config import dense_state_bytes, resolve_ds_config
    from gmeta_ds.launchers import hostfile_world_size, parse_hostfile

    hosts = parse_hostfile(args.hostfile) if args.hostfile else None
    for flag, value in (("--num_gpus", args.num_gpus), ("--world-size", args.world_size)):
        if value is not None and value < 1:
            raise ConfigError([f"{flag}: {value} must be >= 1"])
    if hosts is None and args.num_gpus is not None:
        raise ConfigError([f"--num_gpus {args.num_gpus}: only applies with --hostfile (ranks per "
                           "host); plan for one host with --world-size N"])
    from gmeta_ds.engine.dist import env_world  # torch from here on
    from gmeta_ds.trainer import build_data, build_learner, embedding_plan

    world = (hostfile_world_size(hosts, args.num_gpus) if hosts else None) or args.world_size or env_world()[1]
    ds_config, plan = resolve_ds_config(cfg, world)
    from gmeta_ds.engine.ds_engine import check_ds_config

    check_ds_config(ds_config)
    check_output_dir(cfg.output_dir, create=False)
    if cfg.train.resume:
        from gmeta_ds import checkpoint

        checkpoint.find(cfg.train.resume, cfg.output_dir)
    if cfg.task == "text":
        return _validate_text(cfg, ds_config, plan)
    data = build_data(cfg)
    sharded = cfg.embedding.sharding == "sharded"
    tables = embedding_plan(cfg, data.fields, world) if sharded else None
    learner = build_learner(cfg, data.fields, with_tables=not sharded)
    n_params = sum(p.numel() for p in learner.parameters())
    print("run config:\n" + json.dumps(config_to_dict(cfg), indent=2))
    print("deepspeed config (resolved):\n" + json.dumps(ds_config, indent=2))
    if hosts:
        print(f"hostfile {args.hostfile}: " + ", ".join(
            f"{h.name} ({args.num_gpus or h.slots} rank(s))" for h in hosts) + f" = {world} ranks")
    print(f"batch: {plan.describe()}")
    print(f"tasks: {len(data.train)} train, {len(data.test)} test users; "
          f"{data.train.num_interactions + data.test.num_interactions} interactions")
    print(f"model: {n_params} parameters; adapted in the inner loop: {', '.join(learner.adapted_names())}")
    dense = dense_state_bytes(ds_config, n_params, world)
    print(f"dense state per rank (DeepSpeed ZeRO-{dense['stage']}, {world} rank(s)): "
          f"parameters {_size(dense['params'])}, gradients {_size(dense['grads'])}, "
          f"optimizer {_size(dense['optimizer'])}")
    if tables is not None:
        print(f"embedding: sharded over {world} rank(s), outside DeepSpeed:\n{tables.describe()}")
    else:
        table_bytes = sum(p.numel() * 4 for n, p in learner.named_parameters() if ".embedding." in n)
        print(f"embedding: replicated inside the DeepSpeed engine (every rank holds every table: "
              f"{_size(table_bytes)}, counted in the dense state above)")
    print("config OK")
    return 0


def _validate_text(cfg: RunConfig, ds_config: dict, plan) -> int:
    from gmeta_ds.ds_config import dense_state_bytes
    from gmeta_ds.text.train import build

    _, tasks, learner = build(cfg)
    n_params = sum(p.numel() for p in learner.parameters())
    print("run config:\n" + json.dumps(config_to_dict(cfg), indent=2))
    print("deepspeed config (resolved):\n" + json.dumps(ds_config, indent=2))
    print(f"batch: {plan.describe().replace('tasks', 'episodes')}")
    print(f"data: {tasks.describe()}")
    print(f"model: {type(learner.net.model).__name__}, {n_params} parameters; adapted in the inner "
          f"loop: {len(learner.adapted)} tensors ({', '.join(learner.adapted[:6])}"
          f"{', ...' if len(learner.adapted) > 6 else ''}); tasks run "
          f"{'vectorized (vmap)' if learner.algorithm.vectorize else 'one by one (loop)'}")
    dense = dense_state_bytes(ds_config, n_params, plan.world_size)
    print(f"dense state per rank (DeepSpeed ZeRO-{dense['stage']}, {plan.world_size} rank(s)): "
          f"parameters {_size(dense['params'])}, gradients {_size(dense['grads'])}, "
          f"optimizer {_size(dense['optimizer'])}")
    print("config OK")
    return 0


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _cmd_train(cfg: RunConfig) -> int:
    from gmeta_ds.ds_config import resolve_ds_config
    from gmeta_ds.engine.dist import destroy_process_group, env_world, init_process_group, set_threads

    from gmeta_ds.trainer import preflight

    # Validate everything that can fail before the first collective, on every rank.
    ds_config, plan = resolve_ds_config(cfg, env_world()[1])
    from gmeta_ds.engine.ds_engine import check_device_support, check_ds_config

    check_device_support(ds_config)
    check_ds_config(ds_config)
    from gmeta_ds.trainer import completed_run

    done = completed_run(cfg)
    if done is not None:  # a requeue of a finished run: exit 0, touch nothing
        if env_world()[0] == 0:
            print(f"gmeta-ds train: {done}")
        return 0
    check_output_dir(cfg.output_dir)
    built = None
    if cfg.task == "text":
        from gmeta_ds.text.train import build

        built = build(cfg)
    else:
        preflight(cfg, plan.world_size)
    set_threads(cfg.train.threads)
    try:
        rank, world = init_process_group(cfg.train.collective_timeout_s)
        if world != plan.world_size:
            raise RuntimeError(f"process group has {world} ranks but WORLD_SIZE said "
                               f"{plan.world_size}")
        if cfg.task == "text":
            from gmeta_ds.text.train import train_text

            summary = train_text(cfg, ds_config, plan, rank, built)
        else:
            from gmeta_ds.trainer import train

            summary = train(cfg, ds_config, plan, rank)
        if rank == 0:
            _print_summary(summary, cfg.output_dir)
    finally:
        destroy_process_group()
    return 0


def _print_summary(summary: dict, output_dir: str) -> None:
    ev = summary.get("eval", {})
    if summary.get("task") == "text":
        print(f"done: {summary['meta_steps']} meta-steps, {summary['tasks_seen']} episodes on "
              f"{summary['world_size']} rank(s) in {summary['elapsed_s']:.1f}s; final query loss "
              f"{summary['final_query_loss']:.4f}")
        if ev:
            print(f"held-out classes, {ev['ways']}-way {ev['shots']}-shot accuracy: meta-learned + "
                  f"adaptation {ev['accuracy']:.4f} | without adaptation {ev['accuracy_no_adapt']:.4f}"
                  f" | from scratch: {ev.get('baseline_scratch_steps', 0)} Adam steps "
                  f"{ev.get('baseline_scratch_accuracy', float('nan')):.4f}, the same inner loop "
                  f"{ev.get('baseline_scratch_inner_loop_accuracy', float('nan')):.4f}"
                  f" | chance {ev['chance']:.4f}")
        print(f"outputs: {output_dir}/summary.json, metrics.jsonl, model/ (save_pretrained)")
        return
    line = (f"done: {summary['meta_steps']} meta-steps, {summary['tasks_seen']} tasks on "
            f"{summary['world_size']} rank(s) in {summary['elapsed_s']:.1f}s; "
            f"final query loss {summary['final_query_loss']:.4f}")
    print(line)
    name = "auc" if "auc" in ev else "mae"
    if ev:
        nan = float("nan")
        print(f"cold-start {name.upper()}: meta-learned + adaptation {ev[name]:.4f} | without "
              f"adaptation {ev[name + '_no_adapt']:.4f} | non-meta baseline "
              f"{ev.get('baseline_' + name, nan):.4f} | baseline + fine-tune "
              f"{ev.get('baseline_finetune_' + name, nan):.4f}")
    print(f"outputs: {output_dir}/summary.json, metrics.jsonl, model.safetensors")


def _cmd_eval(cfg: RunConfig, weights: str | None) -> int:
    check_output_dir(cfg.output_dir)  # eval.json goes there
    if cfg.task == "text":
        return _eval_text(cfg, weights)
    from gmeta_ds.engine.ds_engine import load_weights
    from gmeta_ds.trainer import WEIGHTS_FILE, build_data, build_learner, run_evaluation, write_json

    data = build_data(cfg)
    learner = build_learner(cfg, data.fields)
    load_weights(learner, weights or Path(cfg.output_dir) / WEIGHTS_FILE)
    result = run_evaluation(cfg, learner, data)
    write_json(Path(cfg.output_dir) / "eval.json", result)
    print(json.dumps(result, indent=2))
    return 0


def _eval_text(cfg: RunConfig, weights: str | None) -> int:
    """Held-out-class accuracy of a saved classifier (default: OUTPUT_DIR/model)."""
    import dataclasses

    from gmeta_ds.text.train import MODEL_DIR, build, evaluate
    from gmeta_ds.trainer import write_json

    folder = weights or str(Path(cfg.output_dir) / MODEL_DIR)
    model_cfg = dataclasses.replace(cfg.text.model, pretrained=folder, tokenizer=folder)
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, model=model_cfg))
    tokenizer, tasks, learner = build(cfg)
    result = evaluate(cfg, learner, tokenizer, tasks)
    write_json(Path(cfg.output_dir) / "eval.json", result)
    print(json.dumps(result, indent=2))
    return 0


def _cmd_plot(run_dir: str, out: str | None) -> int:
    from gmeta_ds.plots import plot_run

    for path in plot_run(run_dir, out):
        print(f"wrote {path}")
    return 0


def _cmd_export(checkpoint_path: str, out: str) -> int:
    from safetensors import SafetensorError

    from gmeta_ds import checkpoint

    source = Path(checkpoint_path)
    expected = "expected OUTPUT_DIR/checkpoints or one of its step_* directories"
    if not source.is_dir():
        what = "is a file, not a directory" if source.exists() else "does not exist"
        raise ConfigError([f"CHECKPOINT {checkpoint_path!r} {what} ({expected})"])
    try:
        ckpt = checkpoint.find(checkpoint_path, ".")
    except ConfigError as exc:  # find() words its errors for train.resume
        raise ConfigError([p.replace("train.resume: ", "CHECKPOINT ", 1) for p in exc.problems]) from exc
    if Path(out).is_dir():
        raise ConfigError([f"OUT {out!r} is a directory; expected the path of the .safetensors "
                           "file to write"])
    check_output_dir(Path(out).parent, key="OUT's folder")
    try:
        path = checkpoint.export(ckpt, Path(out))
    except OSError as exc:
        raise ConfigError([f"{exc.filename or out}: {exc.strerror or exc}"]) from exc
    except (KeyError, IndexError, TypeError, AttributeError, RuntimeError, SafetensorError) as exc:
        raise ConfigError([f"CHECKPOINT {str(ckpt)!r}: its manifest and files do not make one gmeta-ds "
                           f"checkpoint ({type(exc).__name__}: {exc})"]) from exc
    print(f"wrote {path} (checkpoint {ckpt})")
    return 0


def check_output_dir(path: str | Path, create: bool = True, key: str = "output_dir") -> None:
    """Pre-flight for a folder the command writes into, run on every rank before any data is
    built or any collective: it is (or can be made) a directory, and a small file can be
    written there and removed. Permission bits do not stop root, so the write itself is the
    test: it also finds read-only mounts and full disks. ``create=False`` (validate) makes
    nothing and tests the nearest existing parent instead."""
    import tempfile

    target = Path(path)
    existing = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        where = ("exists and is not a directory" if existing == target
                 else f"is under {str(existing)!r}, a file")
        raise ConfigError([f"{key}: {str(target)!r} {where}; expected a directory to write the "
                           "run's files in"])
    try:
        if create:
            target.mkdir(parents=True, exist_ok=True)
            existing = target
        fd, probe = tempfile.mkstemp(prefix=".gmeta-ds-write-test-", dir=existing)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise ConfigError([f"{key}: {str(target)!r} is not writable: {exc.strerror or exc} (writing a "
                           f"test file in {str(existing)!r} failed; expected a writable directory)"]) from exc


def _overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` overrides plus the DeepSpeed config the launcher imposes, if any."""
    from gmeta_ds.launchers import launcher_ds_config

    imposed = launcher_ds_config(args.deepspeed_config)
    if imposed is None:
        return args.overrides
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key.strip() == "deepspeed" and Path(value.strip()).resolve() != Path(imposed).resolve():
            raise ConfigError([f"--set deepspeed={value.strip()} contradicts the launcher's DeepSpeed "
                               f"config {imposed!r}; pass one of them"])
    return [*args.overrides, f"deepspeed={Path(imposed).resolve()}"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "plot":
            return _cmd_plot(args.run_dir, args.out)
        if args.command == "export":
            return _cmd_export(args.checkpoint, args.out)
        cfg = load_config(args.config, _overrides(args))
        if args.command == "validate":
            return _cmd_validate(cfg, args)
        if args.command == "eval":
            return _cmd_eval(cfg, args.weights)
        return _cmd_train(cfg)
    except (ConfigError, DataError) as exc:
        print(f"gmeta-ds {args.command}: {exc}", file=sys.stderr)
        return 2
    except CollectiveTimeout as exc:
        print(f"gmeta-ds {args.command}: {exc}", file=sys.stderr)
        return 3
    except CheckpointWriteError as exc:
        print(f"gmeta-ds {args.command}: {exc}", file=sys.stderr)
        return 4
    except OSError as exc:  # the file system refused a write (full disk, quota, read-only)
        if exc.errno not in _STORAGE_ERRNOS and exc.filename is None:
            raise
        where = f" {exc.filename}" if exc.filename else ""
        print(f"gmeta-ds {args.command}: could not access{where}: {exc.strerror or exc} "
              f"(errno {exc.errno}); outputs written before this point may be incomplete",
              file=sys.stderr)
        return 4


_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO)


def entry() -> None:
    """Console entry point (``gmeta-ds``, ``python -m gmeta_ds.cli``): run, flush, and leave
    without interpreter finalisation. After gloo collectives (all-to-all of sharded lookups)
    torch intermittently aborts in a C++ static destructor at exit ("terminate called without
    an active exception", ~1 run in 10 at world 2, torch 2.13), turning a finished job into a
    failed one; all outputs are written and closed before this point."""
    import logging

    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
