"""``gmeta-ds``: parse -> validate -> build -> run -> always tear down.

    gmeta-ds train    --config FILE.yaml [--set dotted.key=value ...]
    gmeta-ds validate --config FILE.yaml [--set ...] [--world-size N]
    gmeta-ds eval     --config FILE.yaml [--set ...] [--weights PATH]

Runs unchanged as one plain process or under a launcher (``deepspeed``, ``torchrun``,
``accelerate launch``); the ``--local_rank=N`` the deepspeed launcher inserts before the
subcommand is accepted and ignored (LOCAL_RANK in the environment is what counts).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

# Ranks share few cores: busy-waiting OpenMP threads starve each other (set before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# DeepSpeed's ZeRO calls a torch collective that torch has renamed; the warning is theirs, not ours.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
# torch's sparse optimizers build COO tensors without opting in or out of invariant checks.
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

from gmeta_ds.config import RunConfig, config_to_dict, load_config  # noqa: E402
from gmeta_ds.errors import ConfigError, DataError  # noqa: E402


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
        if name == "validate":
            p.add_argument("--world-size", type=int, default=None,
                           help="world size to plan for (default: WORLD_SIZE or 1)")
        if name == "eval":
            p.add_argument("--weights", default=None,
                           help="safetensors file (default: OUTPUT_DIR/model.safetensors)")
    return parser


def _cmd_validate(cfg: RunConfig, world_size: int | None) -> int:
    from gmeta_ds.ds_config import resolve_ds_config
    from gmeta_ds.engine.dist import env_world
    from gmeta_ds.trainer import build_data, build_learner, embedding_plan

    world = world_size or env_world()[1]
    ds_config, plan = resolve_ds_config(cfg, world)
    data = build_data(cfg)
    sharded = cfg.embedding.sharding == "sharded"
    tables = embedding_plan(cfg, data.fields, world) if sharded else None
    learner = build_learner(cfg, data.fields, with_tables=not sharded)
    n_params = sum(p.numel() for p in learner.parameters())
    print("run config:\n" + json.dumps(config_to_dict(cfg), indent=2))
    print("deepspeed config (resolved):\n" + json.dumps(ds_config, indent=2))
    print(f"batch: {plan.describe()}")
    print(f"tasks: {len(data.train)} train, {len(data.test)} test users; "
          f"{data.train.num_interactions + data.test.num_interactions} interactions")
    print(f"model: {n_params} parameters; adapted in the inner loop: {', '.join(learner.adapted_names())}")
    if tables is not None:
        print(f"embedding: sharded over {world} rank(s), outside DeepSpeed:\n{tables.describe()}")
    else:
        table_bytes = sum(p.numel() * 4 for n, p in learner.named_parameters() if ".embedding." in n)
        print(f"embedding: replicated inside the DeepSpeed engine (every rank holds every table: "
              f"{table_bytes / 2**20:.2f} MiB, plus DeepSpeed's optimizer state)")
    print("config OK")
    return 0


def _cmd_train(cfg: RunConfig) -> int:
    from gmeta_ds.ds_config import resolve_ds_config
    from gmeta_ds.engine.dist import destroy_process_group, env_world, init_process_group, set_threads

    from gmeta_ds.trainer import preflight

    # Validate everything that can fail before the first collective, on every rank.
    ds_config, plan = resolve_ds_config(cfg, env_world()[1])
    preflight(cfg, plan.world_size)
    set_threads(cfg.train.threads)
    try:
        rank, world = init_process_group(cfg.train.collective_timeout_s)
        if world != plan.world_size:
            raise RuntimeError(f"process group has {world} ranks but WORLD_SIZE said "
                               f"{plan.world_size}")
        from gmeta_ds.trainer import train

        summary = train(cfg, ds_config, plan, rank)
        if rank == 0:
            _print_summary(summary, cfg.output_dir)
    finally:
        destroy_process_group()
    return 0


def _print_summary(summary: dict, output_dir: str) -> None:
    ev = summary.get("eval", {})
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
    from pathlib import Path

    from gmeta_ds.engine.ds_engine import load_weights
    from gmeta_ds.trainer import WEIGHTS_FILE, build_data, build_learner, run_evaluation, write_json

    data = build_data(cfg)
    learner = build_learner(cfg, data.fields)
    load_weights(learner, weights or Path(cfg.output_dir) / WEIGHTS_FILE)
    result = run_evaluation(cfg, learner, data)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    write_json(Path(cfg.output_dir) / "eval.json", result)
    print(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "validate":
            return _cmd_validate(cfg, args.world_size)
        if args.command == "eval":
            return _cmd_eval(cfg, args.weights)
        return _cmd_train(cfg)
    except (ConfigError, DataError) as exc:
        print(f"gmeta-ds {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
