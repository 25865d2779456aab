"""``gmeta-ds``: parse -> validate -> build -> run -> always tear down.

    gmeta-ds train    --config FILE.yaml [--set dotted.key=value ...] [--overwrite]
    gmeta-ds validate --config FILE.yaml [--set ...] [--world-size N] [--overwrite]
    gmeta-ds eval     --config FILE.yaml [--set ...] [--weights PATH | --splits K]
    gmeta-ds validate --config FILE.yaml --hostfile HOSTFILE [--num_gpus N]
    gmeta-ds plot     RUN_DIR [--out DIR]
    gmeta-ds report   RUN_DIR [--out FILE.html]
    gmeta-ds export   CHECKPOINT OUT.safetensors [--overwrite]
    gmeta-ds export   CHECKPOINT|WEIGHTS OUT_DIR --config FILE.yaml [--set ...] [--overwrite]
    gmeta-ds serve    EXPORT_DIR [--host H] [--port P] [--model MODULE:FUNCTION] [...]
    gmeta-ds data synthesize --interactions N --out DIR [--shards K] [--seed S] [--items M]
    gmeta-ds tune     --config FILE.yaml --space SPACE.yaml --trials N [--study NAME] [--set ...]

``--deepspeed_config FILE`` (DeepSpeed's own argument; ``--deepspeed`` is accepted with it)
and Accelerate's ``deepspeed_config_file`` override the run config's ``deepspeed:`` key.

Runs unchanged as one plain process or under a launcher (``deepspeed``, ``torchrun``,
``accelerate launch``); the ``--local_rank=N`` the deepspeed launcher inserts before the
subcommand is accepted and ignored (LOCAL_RANK in the environment is what counts).

``--overwrite`` (= ``--set train.overwrite=true``): a run that does not resume the output_dir's
own checkpoint may replace an earlier run's outputs there (refused otherwise, exit 2); they are
removed only once every check has passed, just before meta-step 1.

Exit codes: 0 done; 2 bad input (config, data, arguments, an output_dir holding an earlier
run; the problems on stderr); 3 a collective timed out (``train.collective_timeout_s``: a peer
rank is stuck or gone; stderr names the meta-step or phase and the last complete checkpoint);
4 the file system refused a write (full disk, quota, read-only; stderr names the file or
folder); 5 the outer loss was NaN/inf (``train.nonfinite: abort``; stderr names the meta-step,
ranks and tasks; nothing was updated in that meta-step); anything else: a bug.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import sys
import warnings
from pathlib import Path

# DeepSpeed's ZeRO calls a torch collective that torch has renamed; the warning is theirs, not ours.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
# torch's sparse optimizers build COO tensors without opting in or out of invariant checks.
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

from gmeta_ds.config import RunConfig, config_to_dict, load_config  # noqa: E402
from gmeta_ds.errors import CheckpointWriteError, CollectiveTimeout, ConfigError, DataError  # noqa: E402
from gmeta_ds.files import not_a_directory


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
        if name in ("train", "validate"):
            p.add_argument("--overwrite", action="store_true",
                           help="replace an earlier run's outputs in output_dir (= --set "
                           "train.overwrite=true); removed only after every check passed")
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
            p.add_argument("--splits", type=_at_least(2), default=None, metavar="K",
                           help="train and evaluate over K user splits (seeds SEED..SEED+K-1) into "
                           "OUTPUT_DIR/splits/; the mean differences with intervals in OUTPUT_DIR/splits.json")
    _export_parser(sub)
    _serve_parser(sub)
    _tune_parser(sub)
    p = sub.add_parser("plot", help="write PNG charts of a run directory")
    p.add_argument("run_dir", help="a run's output_dir (metrics.jsonl, summary.json)")
    p.add_argument("--out", default=None, help="where to write the PNGs (default: RUN_DIR/plots)")
    p = sub.add_parser("report", help="one self-contained HTML page of a run's evaluation")
    p.add_argument("run_dir", help="a run's output_dir (summary.json, or splits.json of eval --splits)")
    p.add_argument("--out", default=None, help="the HTML file to write (default: RUN_DIR/report.html)")
    data = sub.add_parser("data", help="interaction logs").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("synthesize", help="write a synthetic interaction log as Parquet shards",
                        description="Exactly N rows as DIR/part-00000.parquet ... (Zipf items, 13-100 "
                        "interactions per user, user/item features, a multi-hot 'tags' column, "
                        "timestamps) and DIR/_schema.yaml, the data: block that reads them; "
                        "columns and model in gmeta_ds/data/parquet_log.py.")
    p.add_argument("--interactions", type=_at_least(13), required=True, metavar="N", help="rows (>= 13)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to create (refused if not empty)")
    p.add_argument("--shards", type=_at_least(1), default=1, metavar="K", help="Parquet files (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the same seed and sizes give the same files")
    p.add_argument("--items", type=_at_least(1), default=None, metavar="M",
                   help="distinct items (default: max(1000, N // 100))")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists and is not empty")
    return parser


def _export_parser(sub) -> None:
    """``gmeta-ds export``'s arguments."""
    p = sub.add_parser("export", help="one safetensors file (dense + full tables) from a checkpoint; with "
                       "--config, the self-contained folder gmeta-ds serve loads")
    p.add_argument("checkpoint", help="OUTPUT_DIR/checkpoints (its latest) or one step_* directory; with "
                   "--config also a weights file (OUTPUT_DIR/model.safetensors)")
    p.add_argument("out", help="the .safetensors file to write (outside the checkpoints folder); with "
                   "--config, the export folder")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--config", default=None, help="the run config YAML: write the serving export "
                   "(docs/serving.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable; with --config)")


def _serve_parser(sub) -> None:
    """``gmeta-ds serve``'s arguments (gmeta_ds/serving/server.py)."""
    p = sub.add_parser("serve", help="adapt to each user and score candidates over HTTP (docs/serving.md)")
    p.add_argument("export", help="the folder gmeta-ds export --config (or engine.save_model) wrote")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--grpc-port", type=_port, default=None, metavar="PORT",
                   help="also serve OIP v2 over gRPC (KServe's and Triton's inference.GRPCInferenceService) on "
                        "this port, beside HTTP (0: any free port; default: no gRPC)")
    p.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                   help="a function fields -> model, for an export saved through the Python API")
    p.add_argument("--max-batch", type=_at_least(1), default=64, help="users adapted together (default 64)")
    p.add_argument("--max-wait-ms", type=float, default=1.0, help="longest wait to fill a batch (default 1)")
    p.add_argument("--max-rows", type=_at_least(1), default=1000,
                   help="most support rows, and most candidates, per request (default 1000)")
    p.add_argument("--max-body-bytes", type=_at_least(1), default=1 << 20, help="largest request body (1 MiB)")
    p.add_argument("--cache-size", type=_at_least(0), default=10000, help="users' adapted parameters kept")
    p.add_argument("--cache-ttl-s", type=float, default=600.0, help="how long they are kept (seconds)")
    p.add_argument("--threads", type=_at_least(1), default=1, help="torch threads (default 1)")
    p.add_argument("--allow-reload", action="store_true",
                   help="turn on POST /v2/repository/models/{name}/load (off by default: it loads a folder a "
                        "request names; docs/serving.md says who may call it)")
    p.add_argument("--model-root", dest="model_roots", action="append", default=[], metavar="DIR",
                   help="a folder whose exports a reload may load (repeatable; with --allow-reload; without "
                        "one, only the export served is reloaded)")
    p.add_argument("--header-timeout", type=_positive_seconds, default=10.0, metavar="SECONDS",
                   help="close a connection whose request head is not whole this long after it connected or "
                        "began its request (default 10)")
    p.add_argument("--body-timeout", type=_positive_seconds, default=60.0, metavar="SECONDS",
                   help="answer 408 to a request whose body is not whole this long after its head (default 60)")


def _tune_parser(sub) -> None:
    """``gmeta-ds tune``'s arguments (gmeta_ds/run/tune.py, docs/tuning.md)."""
    from gmeta_ds.run.tune import TRIAL_TIMEOUT_S  # no optuna, no torch: cheap

    p = sub.add_parser("tune", help="Optuna search over config keys, each trial a train scored on the "
                       "validation users (docs/tuning.md)")
    p.add_argument("--config", required=True, help="run config YAML (needs data.valid_fraction > 0)")
    p.add_argument("--space", required=True, metavar="SPACE.yaml",
                   help="dotted config keys -> {low, high[, log][, step]} or {choices: [...]}")
    p.add_argument("--trials", type=_at_least(1), required=True, metavar="N",
                   help="finished trials in all (a rerun continues the study in OUTPUT_DIR/tune.db)")
    p.add_argument("--study", default="tune", metavar="NAME", help="the study's name (default: tune)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value for every trial (repeatable)")
    p.add_argument("--trial-timeout", type=_at_least(1), default=TRIAL_TIMEOUT_S, metavar="SECONDS",
                   help=f"a trial running longer is killed and recorded failed (default {TRIAL_TIMEOUT_S})")


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def _port(text: str) -> int:
    """A TCP port to listen on, 0 (any free one) to 65535: past it uvicorn hung without a word
    and grpc's probe raised OverflowError."""
    value = _at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} must be at most 65535 (a TCP port; 0: any free port)")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text} must be > 0 and at most 3600 seconds")
    return value


def _cmd_data(args: argparse.Namespace) -> int:
    from gmeta_ds.data.parquet_log import SCHEMA_FILE, NotEnoughDisk, synthesize_log

    try:  # data_command is "synthesize", the group's only command so far
        s = synthesize_log(args.out, args.interactions, args.shards, args.seed, args.items, args.overwrite)
    except (FileExistsError, ValueError, NotEnoughDisk) as exc:  # nothing was written
        print(f"gmeta-ds data {args.data_command}: {exc.strerror if isinstance(exc, NotEnoughDisk) else exc}",
              file=sys.stderr)
        return 4 if isinstance(exc, NotEnoughDisk) else 2
    print(f"wrote {s['rows']:,} rows, {s['users']:,} users, {s['items']:,} items in {s['shards']} shard(s), "
          f"{s['mb']:,.1f} MB, {s['seconds']:.1f} s ({s['rows_per_s'] / 1e6:.2f}M rows/s) to {s['path']}")
    print(f"data config ({Path(s['path']) / SCHEMA_FILE}):")
    print((Path(s["path"]) / SCHEMA_FILE).read_text(), end="")
    return 0


def _with_hostfile_hosts(cfg: RunConfig, hosts, num_gpus: int | None) -> RunConfig:
    """``cfg`` planned on the hostfile's hosts (``embedding.hosts`` left at 0, hosts of equal
    size: the topology the launch will have; with ``sites.count`` > 1 the run's hosts, which
    `resolve_topology` shares among the sites), else ``cfg`` itself."""
    sizes = {num_gpus or h.slots for h in hosts or ()}
    if cfg.embedding.hosts or len(sizes) != 1 or len(hosts) < 2:
        return cfg
    return dataclasses.replace(cfg, embedding=dataclasses.replace(cfg.embedding, hosts=len(hosts)))


def _cmd_validate(cfg: RunConfig, args: argparse.Namespace) -> int:
    from gmeta_ds.config.deepspeed import resolve_ds_config
    from gmeta_ds.run.launchers import hostfile_world_size, parse_hostfile

    hosts = parse_hostfile(args.hostfile) if args.hostfile else None
    for flag, value in (("--num_gpus", args.num_gpus), ("--world-size", args.world_size)):
        if value is not None and value < 1:
            raise ConfigError([f"{flag}: {value} must be >= 1"])
    if hosts is None and args.num_gpus is not None:
        raise ConfigError([f"--num_gpus {args.num_gpus}: only applies with --hostfile (ranks per "
                           "host); plan for one host with --world-size N"])
    from gmeta_ds.engine.dist import env_world  # torch from here on
    from gmeta_ds.workloads import get_workload

    world = (hostfile_world_size(hosts, args.num_gpus) if hosts else None) or args.world_size or env_world()[1]
    ds_config, plan = resolve_ds_config(cfg, world)
    sites_line = None
    if cfg.sites.count > 1:  # plan site 0 (every site is alike): its share of the batch and ranks
        from gmeta_ds.engine.sites import describe_site_hosts, describe_sites, site_run

        local = (args.num_gpus or hosts[0].slots) if hosts else world
        _, ds_config, plan = site_run(cfg, ds_config, plan, (0, world, local))
        sites_line = describe_sites(cfg.sites, world)
        if hosts:
            sites_line += "\n" + describe_site_hosts([h.name for h in hosts], local, cfg.sites.count)
    from gmeta_ds.engine.ds_engine import check_device_support, check_ds_config

    check_device_support(ds_config)  # train refuses fp16 without a GPU: so does validate
    check_ds_config(ds_config)
    check_output_dir(cfg.output_dir, create=False)
    from gmeta_ds.run.outputs import check_earlier_run

    replaced = check_earlier_run(cfg)  # what train refuses, validate refuses
    workload = get_workload(cfg.task)
    planned = _with_hostfile_hosts(cfg, hosts, args.num_gpus)
    workload.preflight(planned, plan.world_size)  # what train checks before its first collective
    lines = workload.describe(planned, ds_config, plan)
    print("run config:\n" + json.dumps(config_to_dict(cfg), indent=2))
    print("deepspeed config (resolved):\n" + json.dumps(ds_config, indent=2))
    if hosts:
        print(f"hostfile {args.hostfile}: " + ", ".join(
            f"{h.name} ({args.num_gpus or h.slots} rank(s))" for h in hosts) + f" = {world} ranks")
    print(f"batch: {plan.describe().replace('tasks', workload.noun)}" + (" per site" if sites_line else ""))
    if sites_line:
        print(sites_line)
    for line in lines:
        print(line)
    if replaced:
        print(f"output_dir {cfg.output_dir}: train.overwrite: the earlier run's {', '.join(replaced)} "
              "will be removed once every check has passed")
    print("config OK")
    return 0


def _cmd_train(cfg: RunConfig, splits: int | None = None) -> int:
    from gmeta_ds.config.deepspeed import resolve_ds_config
    from gmeta_ds.engine.dist import destroy_process_group, env_world, init_process_group, run_world, set_threads
    from gmeta_ds.engine.ds_engine import check_device_support, check_ds_config
    from gmeta_ds.engine.sites import site_run
    from gmeta_ds.run.outputs import check_earlier_run
    from gmeta_ds.meta_engine import NonFiniteLoss
    from gmeta_ds.engine.memory import rss_mib
    from gmeta_ds.evaluation.splits import prepare_splits, train_splits
    from gmeta_ds.run.trainer import completed_run, train
    from gmeta_ds.workloads import get_workload

    runtime_rss = rss_mib()  # interpreter, torch, DeepSpeed: before any model or data
    # Validate everything that can fail before the first collective, on every rank.
    ranks = run_world(cfg.train.collective_timeout_s)  # the launcher's, or a group's already up
    ds_config, plan = resolve_ds_config(cfg, ranks.size, ranks.origin)
    if cfg.sites.count > 1:  # this rank's site: its share of the batch, its own folder
        if splits:
            raise ConfigError([f"--splits {splits} with sites.count: {cfg.sites.count}: train the splits "
                               "on one site (sites.count: 1)"])
        cfg, ds_config, plan = site_run(cfg, ds_config, plan, env_world())
    check_device_support(ds_config)
    check_ds_config(ds_config)
    workload = get_workload(cfg.task)
    if splits:  # eval --splits: every split's checks first (gmeta_ds/evaluation/splits.py)
        runs = prepare_splits(cfg, splits, plan.world_size, workload, check_output_dir)

        def body(rank: int) -> list[str]:
            return train_splits(cfg, runs, ds_config, plan, rank, workload, runtime_rss)
    else:
        done = completed_run(cfg)
        if done is not None:  # a requeue of a finished run: exit 0, touch nothing
            if ranks.rank == 0:
                print(f"gmeta-ds train: {done}")
            return 0
        check_earlier_run(cfg)  # an earlier run in output_dir: refused unless train.overwrite
        check_output_dir(cfg.output_dir)
        prepared = workload.preflight(cfg, plan.world_size)

        def body(rank: int) -> list[str]:
            summary = train(cfg, ds_config, plan, rank, workload, prepared, runtime_rss)
            return workload.report(summary, cfg.output_dir) if rank == 0 else []
    set_threads(cfg.train.threads)
    try:
        rank, world = init_process_group(cfg.train.collective_timeout_s, cfg.sites.count)
        if world != plan.world_size:
            raise RuntimeError(f"process group has {world} ranks but WORLD_SIZE said "
                               f"{plan.world_size}")
        lines = body(rank)
        if ranks.rank == 0:  # the launcher's rank 0 (across sites: site 0's first rank)
            print("\n".join(lines))
    except NonFiniteLoss as exc:  # every rank raises it, before any update of that meta-step
        destroy_process_group(clean_exit=False)
        print(f"gmeta-ds train: {exc}", file=sys.stderr)
        return 5
    except BaseException:
        destroy_process_group(clean_exit=False)  # peers may be inside a collective
        raise
    destroy_process_group()
    return 0


def _cmd_eval(cfg: RunConfig, weights: str | None, splits: int | None = None) -> int:
    from gmeta_ds.files import write_json
    from gmeta_ds.workloads import get_workload

    if splits:  # train and evaluate each split (gmeta_ds/evaluation/splits.py)
        if weights:
            raise ConfigError([f"--weights {weights} with --splits {splits}: --splits trains a model per "
                               "split; pass one of them"])
        return _cmd_train(cfg, splits)
    check_output_dir(cfg.output_dir)  # eval.json goes there
    result = get_workload(cfg.task).evaluate_saved(cfg, weights)
    write_json(Path(cfg.output_dir) / "eval.json", result)
    print(json.dumps(result, indent=2))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from gmeta_ds.run.tune import tune

    return tune(args.config, args.space, args.overrides, args.trials, args.study, args.trial_timeout)


def _cmd_plot(run_dir: str, out: str | None) -> int:
    from gmeta_ds.evaluation.plots import plot_run

    for path in plot_run(run_dir, out):
        print(f"wrote {path}")
    return 0


def _find_checkpoint(checkpoint_path: str) -> Path:
    """The checkpoint CHECKPOINT names (a step_* folder, or the latest of a checkpoints folder)."""
    from gmeta_ds import checkpoint

    source = Path(checkpoint_path)
    expected = "expected OUTPUT_DIR/checkpoints or one of its step_* directories"
    if not source.is_dir():
        what = "is a file, not a directory" if source.exists() else "does not exist"
        raise ConfigError([f"CHECKPOINT {checkpoint_path!r} {what} ({expected}){_no_checkpoint_hint(source)}"])
    try:
        ckpt = checkpoint.find(checkpoint_path, ".")
    except ConfigError as exc:  # find() words its errors for train.resume
        problems = [p.replace("train.resume: ", "CHECKPOINT ", 1) for p in exc.problems]
        raise ConfigError([problems[0] + _no_checkpoint_hint(source), *problems[1:]]) from exc
    return ckpt


def _cmd_export(checkpoint_path: str, out: str, overwrite: bool = False) -> int:
    from safetensors import SafetensorError

    from gmeta_ds import checkpoint

    ckpt = _find_checkpoint(checkpoint_path)
    if Path(out).is_dir():
        raise ConfigError([f"OUT {out!r} is a directory; expected the path of the .safetensors "
                           "file to write"])
    _check_export_target(ckpt, Path(out), overwrite)
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


def _cmd_export_serving(args: argparse.Namespace) -> int:
    """``export --config``: the serving export folder (gmeta_ds/serving/recipe.py)."""
    from gmeta_ds.saved import target_problems
    from gmeta_ds.serving.recipe import export_run

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out)
    source = Path(args.checkpoint)
    if not source.is_file():
        source = _find_checkpoint(args.checkpoint)
        _check_export_target(source, out, args.overwrite)
    elif out.exists() and not args.overwrite:
        raise ConfigError([f"OUT {str(out)!r} exists; pass --overwrite to replace it, or another path"])
    # --overwrite replaces an earlier export only: never a folder holding anything we did not write
    problems = target_problems(out)
    if problems:
        raise ConfigError([p.replace("path: ", "OUT: ", 1) for p in problems])
    check_output_dir(out.parent, key="OUT's folder")
    path = export_run(cfg, source, out)
    print(f"wrote {path} (weights {source}); serve it with: gmeta-ds serve {path}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from gmeta_ds.serving.server import BOUNDS, ServerOptions, option_problems, serve
        services = ()
        if args.grpc_port is not None:
            from gmeta_ds.serving.grpc_server import grpc_service

            services = (grpc_service(args.host, args.grpc_port),)
    except ModuleNotFoundError as exc:  # the serve extra (FastAPI, uvicorn, orjson, grpcio...) is optional
        raise ConfigError([f"gmeta-ds serve needs the serve extra, which is not installed ({exc}); install it "
                           "with pip install 'gmeta-ds[serve]'"]) from None

    options = ServerOptions(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_rows=args.max_rows,
                            max_body_bytes=args.max_body_bytes, cache_size=args.cache_size,
                            cache_ttl_s=args.cache_ttl_s, model=args.model, threads=args.threads,
                            allow_reload=args.allow_reload, model_roots=tuple(args.model_roots),
                            header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)
    problems = option_problems(options, {n: "--" + n.replace("_", "-") for n in BOUNDS} |
                               {"header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout"})
    if problems:
        raise ConfigError(problems)
    serve(args.export, args.host, args.port, options, services)
    return 0


def _check_export_target(ckpt: Path, out: Path, overwrite: bool) -> None:
    """OUT may not lie inside the checkpoint it is read from, nor inside its checkpoints
    folder (symlinks resolved: it would replace a file the checkpoint is made of, or plant one
    its manifest does not list); an existing OUT is replaced only with ``--overwrite`` (and
    then atomically: a failed export leaves it as it was)."""
    target, ckpt = out.resolve(), ckpt.resolve()
    root = ckpt.parent if (ckpt.parent / "latest").is_file() or ckpt.parent.name == "checkpoints" else ckpt
    for folder, what in ((ckpt, "the checkpoint it reads"), (root, "that checkpoint's checkpoints folder")):
        if target.is_relative_to(folder):
            raise ConfigError([f"OUT {str(out)!r} is inside {what} ({str(folder)!r}); write the export "
                               f"outside it, e.g. {str(root.parent / 'export.safetensors')!r}"])
    if out.exists() and not overwrite:
        raise ConfigError([f"OUT {str(out)!r} exists; pass --overwrite to replace it, or another path"])


def _no_checkpoint_hint(source: Path) -> str:
    """Why CHECKPOINT holds no checkpoint when it is a finished run's folder or its
    ``checkpoints/``: ``train.checkpoint_every`` is 0 by default, so a run writes none."""
    run_dir = source.parent if source.name == "checkpoints" else source
    if not (run_dir / "summary.json").is_file():
        return ""
    root = run_dir / "checkpoints"
    if source == run_dir and (root / "latest").is_file():
        return f"; {str(run_dir)!r} is a run's folder: pass its checkpoints, {str(root)!r}"
    if root.is_dir() and any(root.glob("step_*")):
        return ""
    final = run_dir / "model.safetensors"
    weights = f"; its final weights are {str(final)!r}" if final.is_file() else ""
    return (f"; the run in {str(run_dir)!r} wrote no checkpoints (train.checkpoint_every is 0 by "
            "default): train with --set train.checkpoint_every=N to write one every N meta-steps "
            f"and at the end{weights}")


def check_output_dir(path: str | Path, create: bool = True, key: str = "output_dir") -> None:
    """Pre-flight for a folder the command writes into, run on every rank before any data is
    built or any collective: it is (or can be made) a directory, and a small file can be
    written there and removed. Permission bits do not stop root, so the write itself is the
    test: it also finds read-only mounts and full disks. ``create=False`` (validate) makes
    nothing and tests the nearest existing parent instead."""
    import tempfile

    target = Path(path)
    existing = next((p for p in (target, *target.parents) if os.path.lexists(p)), Path("."))
    if not existing.is_dir():  # a file, or a symbolic link to nothing (mkdir: "File exists")
        raise ConfigError([f"{key}: {str(target)!r} {not_a_directory(target, existing)}; expected a "
                           "directory to write the run's files in"])
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


def _set_wait_policy(threads: int | str | None) -> None:
    """OMP_WAIT_POLICY for this process, before torch loads (libgomp reads it once, at load).

    PASSIVE (a worker sleeps as soon as a parallel region ends) where this host would be
    oversubscribed: ``threads`` x this host's ranks above its cores, or ``threads`` unknown
    (serve, tune, data). There a spinning worker takes the core another rank needs. Otherwise
    libgomp's default (spin ~3 ms, then sleep): a meta-step is thousands of small parallel regions,
    and with PASSIVE each wakes its workers from sleep, which made ``train.threads: 2`` slower
    than 1 on 2 cores (benchmarks/cli_threads.py). A policy the user set (or GOMP_SPINCOUNT) is kept.
    """
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    cores = os.cpu_count() or 1
    try:  # the launcher's ranks on this host (checked properly later: engine/dist.env_world)
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
                           or os.environ.get("WORLD_SIZE") or 1))
        count = max(1, cores // ranks) if threads == "auto" else int(threads)
    except (TypeError, ValueError):
        count, ranks = cores + 1, 1
    if not 1 < count <= cores // ranks:  # one thread has no workers to spin; more than the share oversubscribe
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` overrides plus ``--overwrite`` and the DeepSpeed config the launcher
    imposes, if any."""
    from gmeta_ds.run.launchers import launcher_ds_config

    overrides = [*args.overrides, *(["train.overwrite=true"] if getattr(args, "overwrite", False) else [])]
    imposed = launcher_ds_config(args.deepspeed_config)
    if imposed is None:
        return overrides
    from gmeta_ds.config.deepspeed import shipped_ds_config

    def where(name: str) -> Path:  # a shipped name outside a checkout is the package's copy
        path = Path(name)
        return (path if path.is_file() else shipped_ds_config(name) or path).resolve()

    for item in args.overrides:
        key, _, value = item.partition("=")
        if key.strip() == "deepspeed" and where(value.strip()) != where(imposed):
            raise ConfigError([f"--set deepspeed={value.strip()} contradicts the launcher's DeepSpeed "
                               f"config {imposed!r}; pass one of them"])
    return [*overrides, f"deepspeed={Path(imposed).resolve()}"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command not in ("train", "eval", "validate"):
        _set_wait_policy(None)  # no run config: serve, tune (its trials decide their own), data, plot
    try:
        if args.command == "plot":
            return _cmd_plot(args.run_dir, args.out)
        if args.command == "report":
            from gmeta_ds.evaluation.report import write_report

            print(f"wrote {write_report(args.run_dir, args.out)}")
            return 0
        if args.command == "export":
            if args.config is not None:
                return _cmd_export_serving(args)
            return _cmd_export(args.checkpoint, args.out, args.overwrite)
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "data":
            return _cmd_data(args)
        if args.command == "tune":
            return _cmd_tune(args)
        cfg = load_config(args.config, _overrides(args))
        _set_wait_policy(cfg.train.threads)
        if args.command == "validate":
            return _cmd_validate(cfg, args)
        if args.command == "eval":
            return _cmd_eval(cfg, args.weights, args.splits)
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

    try:
        code = main()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # output piped into `head` and closed: not a failure of the command
        code = 0
    os._exit(code)


if __name__ == "__main__":
    entry()
