"""The CTR workload (``task: ctr``): a CTR model (``model.name``: MeLU by default, or another
of `registry.MODELS`) over interaction logs, cold-start users as tasks.

Builds the tasks (the embedded synthetic generator or a log on disk, data/builder.py), the
learner, its tables (replicated inside DeepSpeed, or sharded over the ranks outside
it) and each meta-step's micro-batches (`TaskLoader`). At the end: ``model.safetensors``
(rank 0) and cold-start evaluation -- held-out users split over the ranks, predictions
gathered on rank 0, the non-meta baseline trained and scored there.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gmeta_ds.algorithms import MetaLearner, build_algorithm
from gmeta_ds.algorithms.base import EMBEDDING_PREFIX, probe_model
from gmeta_ds.evaluation.baselines import oov_id
from gmeta_ds.config import RunConfig, task_activation_bytes
from gmeta_ds.data.builder import TaskData, build_tasks
from gmeta_ds.data.loader import TaskLoader, task_lengths
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.data.synthetic import SyntheticData, generate_synthetic, split_valid, synthetic_fields
from gmeta_ds.data.tasks import bag_statistics
from gmeta_ds.sparse import model_field_order, single_fields
from gmeta_ds.config.deepspeed import BatchPlan, dense_state_bytes, size_text
from gmeta_ds.embedding.plan import ShardingPlan, plan_from_config, with_topology
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection, resolve_placement
from gmeta_ds.engine import ds_engine
from gmeta_ds.engine.parallelize import check_split_body
from gmeta_ds.engine.sites import data_part
from gmeta_ds.engine.hosts import resolve_topology
from gmeta_ds.errors import ConfigError
from gmeta_ds.evaluation.held_out import EvalSettings, evaluate_held_out
from gmeta_ds.evaluation.scores import EVAL_PER_USER_FILE, PER_USER_FILE, write_per_user
from gmeta_ds.models import build_model, resolve_adapt
from gmeta_ds.models.base import field_tables
from gmeta_ds.models.popularity import fit as fit_popularity_offset
from gmeta_ds.models.protocol import model_hooks
from gmeta_ds.run.outputs import WEIGHTS_FILE, run_phase
from gmeta_ds.workloads.base import Built, Workload, body_split_line, check_ranks_read_the_same


class CTRWorkload(Workload):
    name = "ctr"
    noun = "tasks"

    def preflight(self, cfg: RunConfig, world_size: int) -> None:
        preflight(cfg, world_size)

    def build(self, cfg: RunConfig, rank: int, world_size: int, prepared=None) -> Built:
        data = build_data(cfg)
        check_ranks_read_the_same(cfg, data)  # before the tables and the engine depend on it
        sharded = build_sharded(cfg, data, rank, world_size)
        learner = build_learner(cfg, data.fields, with_tables=sharded is None, train=data.train)
        tables = [p.table for p in sharded.plan.tables.values()] if sharded is not None else []
        return Built(learner, data, sharded, tables, [f.name for f in data.fields],
                     {"lookup_fields": [f.name for f in single_fields(data.fields)]})

    def batches(self, cfg: RunConfig, built: Built, plan: BatchPlan, rank: int) -> TaskLoader:
        train = built.data.train
        lengths = task_lengths(train) if cfg.data.bucket_by_length else None
        sampler = MetaBatchSampler(len(train), plan.tasks_per_micro_batch, plan.grad_accum_steps,
                                   plan.world_size, rank, cfg.seed, lengths, part=data_part())
        return TaskLoader(train, sampler, cfg.data.prefetch, resample=cfg.data.resample,
                          support=cfg.data.resample_support)

    def finish(self, cfg: RunConfig, engine, built: Built, rank: int, world: int) -> tuple[dict, dict]:
        with run_phase(cfg, "final gather"):
            tables = built.sharded.gather_state(everywhere=cfg.eval.enabled) if built.sharded else {}
            state = full_state(engine.module, tables)
        if rank == 0:
            ds_engine.save_weights(state, Path(cfg.output_dir) / WEIGHTS_FILE)
        evaluation = {}
        if cfg.eval.enabled:
            with run_phase(cfg, "evaluation"):
                evaluation = run_evaluation(cfg, eval_learner(cfg, engine.module, built.data, state),
                                            built.data, rank, world, Path(cfg.output_dir))
        snapshot = getattr(built.data, "stats", {}).get("snapshot")  # a Delta table's version read
        return evaluation, {"data_snapshot": snapshot} if snapshot else {}

    def evaluate_saved(self, cfg: RunConfig, weights: str | None) -> dict:
        data = build_data(cfg)
        learner = build_learner(cfg, data.fields)  # the popularity counts come with the weights
        ds_engine.load_weights(learner, weights or Path(cfg.output_dir) / WEIGHTS_FILE)
        # its per-user rows beside its eval.json: per_user.csv stays the pair of the run's summary.json
        return run_evaluation(cfg, learner, data, out_dir=Path(cfg.output_dir), per_user_file=EVAL_PER_USER_FILE)

    def describe(self, cfg: RunConfig, ds_config: dict, plan: BatchPlan) -> list[str]:
        world = plan.world_size
        data = build_data(cfg)
        sharded = cfg.embedding.sharding == "sharded"
        tables = embedding_plan(cfg, data.fields, world, data.train) if sharded else None
        learner = build_learner(cfg, data.fields, with_tables=not sharded)
        n_params = sum(p.numel() for p in learner.parameters())
        dense = dense_state_bytes(ds_config, n_params, world)
        snapshot = getattr(data, "stats", {}).get("snapshot")
        lines = [f"tasks: {len(data.train)} train, {len(data.test)} test users; "
                 f"{data.train.num_interactions + data.test.num_interactions} interactions"
                 + (f" (Delta table version {snapshot['version']}, committed {snapshot['committed_at']})"
                    if snapshot else ""),
                 f"model: {cfg.model.name}, {n_params} parameters; adapted in the inner loop: {', '.join(learner.adapted_names())}",
                 f"dense state per rank (DeepSpeed ZeRO-{dense['stage']}, {world} rank(s)): parameters "
                 f"{size_text(dense['params'])}, gradients {size_text(dense['grads'])}, optimizer "
                 f"{size_text(dense['optimizer'])}", body_split_line(learner, ds_config)]
        if tables is not None:
            lines.append(f"embedding: sharded over {world} rank(s), outside DeepSpeed:\n{tables.describe()}")
        else:
            table_bytes = sum(p.numel() * 4 for n, p in learner.named_parameters() if ".embedding." in n)
            lines.append(f"embedding: replicated inside the DeepSpeed engine (every rank holds every "
                         f"table: {size_text(table_bytes)}, counted in the dense state above)")
        return lines

    def report(self, summary: dict, output_dir) -> list[str]:
        sites = summary.get("sites")
        where = (f"{sites['tasks_seen_all_sites']} tasks on {sites['count']} sites x {sites['ranks_per_site']} rank(s)"
                 if sites else f"{summary['tasks_seen']} tasks on {summary['world_size']} rank(s)")
        lines = [f"done: {summary['meta_steps']} meta-steps, {where} in {summary['elapsed_s']:.1f}s; final query "
                 f"loss {summary['final_query_loss']:.4f}"]
        if sites:
            lines.append(f"sites: {sites['synchronisations']} synchronisation(s) (every {sites['sync_every']} "
                         f"meta-steps), {sites['cross_site_bytes_per_task']:.0f} bytes sent across sites per task "
                         f"({sites['delta_dtype']})")
        # null: a metric undefined on these tasks (printed nan; why: ev["warnings"])
        ev = {k: float("nan") if v is None else v for k, v in summary.get("eval", {}).items()}
        if ev and ev.get("tasks", 1):
            # binary: per-user AUC first (the metric a cold-start user decides on), then the
            # global AUC; ratings: MAE (no per-user AUC)
            lines += cold_start_lines(ev, ("auc_per_task", "auc") if "auc" in ev else ("mae",))
            lines += interval_lines(summary["eval"].get("intervals"))
            lines += few_shot_lines(summary["eval"].get("few_shot"))
            lines += few_shot_lines(summary["eval"].get("inner_steps_curve"))
            lines += [f"warning: {note}" for note in ev.get("warnings", [])]
        lines.append(f"outputs: {output_dir}/summary.json, metrics.jsonl, {WEIGHTS_FILE}")
        return lines


# How the report names each baseline of ``eval.intervals`` and each metric.
BASELINE_NAMES = {"baseline": "non-meta baseline", "baseline_finetune": "baseline + fine-tune",
                  "baseline_finetune_tuned": "baseline + tuned fine-tune",
                  "baseline_popularity": "popularity + user offset"}
METRIC_NAMES = {"auc": "AUC", "auc_per_task": "per-user AUC", "logloss": "logloss", "mae": "MAE", "rmse": "RMSE"}
# The order metrics are shown in: the mean per-user AUC first (the metric a cold-start user
# decides on), then the global AUC, then logloss; MAE first for ratings.
METRIC_ORDER = ("auc_per_task", "auc", "logloss", "mae", "rmse")
# The models of the printed cold-start lines: (name, key of a metric m in summary.json's eval).
COLD_START_MODELS = (("meta-learned + adaptation", "{m}"), ("without adaptation", "{m}_no_adapt"),
                     ("non-meta baseline", "baseline_{m}"), ("baseline + fine-tune", "baseline_finetune_{m}"),
                     ("baseline + tuned fine-tune", "baseline_finetune_tuned_{m}"),
                     ("popularity + user offset", "baseline_popularity_{m}"))


def ordered_metrics(names) -> list[str]:
    """``names`` in `METRIC_ORDER` (names it does not know last, in their order)."""
    names = list(names)
    rank = {m: i for i, m in enumerate(METRIC_ORDER)}
    return sorted(names, key=lambda m: (rank.get(m, len(rank)), names.index(m)))


def cold_start_lines(ev: dict, metrics) -> list[str]:
    """``cold-start <metric>: meta-learned + adaptation X | ...``, one line per metric of
    ``metrics``, each listing every model whose value of it is in ``ev`` (summary.json's
    ``eval``, undefined values as nan)."""
    lines = []
    for metric in metrics:
        parts = []
        for label, key in COLD_START_MODELS:
            key = key.format(m=metric)
            if key not in ev:
                continue
            if key.startswith("baseline_finetune_tuned_"):
                label += f" (lr {ev['baseline_finetune_lr']:g}, {ev['baseline_finetune_steps']} steps)"
            parts.append(f"{label} {ev[key]:.4f}")
        if parts:
            lines.append(f"cold-start {METRIC_NAMES[metric]}: " + " | ".join(parts))
    return lines


def interval_lines(intervals: dict | None) -> list[str]:
    """The report's lines of ``eval.intervals``: per baseline, each metric's difference
    (meta-learned minus baseline) with its interval ([] without intervals)."""
    if not intervals or not intervals["differences"]:
        return []
    return [f"meta-learned minus baseline, {intervals['level']:.0%} paired bootstrap interval over "
            f"{intervals['users']} held-out users ({intervals['resamples']} resamples):",
            *difference_lines(intervals["differences"])]


def difference_lines(differences: dict) -> list[str]:
    """One line per baseline of {baseline: {metric: {"diff", "low", "high"}}}, its metrics
    in `METRIC_ORDER` (per-user AUC first)."""
    return [f"  vs {BASELINE_NAMES.get(baseline, baseline)}: "
            + " | ".join(f"{METRIC_NAMES[m]} {difference_text(metrics[m])}" for m in ordered_metrics(metrics))
            for baseline, metrics in differences.items()]


def difference_text(d: dict) -> str:
    """``+0.0123 [-0.0040, +0.0286]``: a difference and its interval (nan where undefined)."""
    return f"{_signed(d['diff'])} [{_signed(d['low'])}, {_signed(d['high'])}]"


def few_shot_lines(curve: dict | None) -> list[str]:
    """The report's lines of ``eval.few_shot`` (or of ``eval.inner_steps_curve``): each model's
    mean per-user AUC (MAE for ratings) at each support size (number of inner steps); []
    without the curve."""
    if not curve:
        return []
    metric = "auc_per_task" if "auc_per_task" in curve["metrics"]["meta"] else "mae"
    if "support" in curve:
        head = f"few-shot {METRIC_NAMES[metric]} adapting on the first {', '.join(map(str, curve['support']))} "
        head += "support rows of each user:"
    else:
        head = f"{METRIC_NAMES[metric]} after {', '.join(map(str, curve['inner_steps']))} inner steps on the full support:"
    lines = [head]
    for name, values in curve["metrics"].items():
        numbers = " ".join("nan" if v is None else f"{v:.4f}" for v in values[metric])
        lines.append(f"  {BASELINE_NAMES.get(name, 'meta-learned + adaptation')}: {numbers}")
    return lines


def _signed(value: float | None) -> str:
    return "nan" if value is None else f"{value:+.4f}"


def build_data(cfg: RunConfig) -> SyntheticData | TaskData:
    """The run's tasks (deterministic by seed: every rank builds the same ones): generated
    (``data.valid_fraction`` of its training users moved to ``valid``), or built from an
    interaction log on disk (cached, data/builder.py)."""
    if cfg.data.source == "synthetic":
        data = generate_synthetic(cfg.data.synthetic, cfg.seed)
        return split_valid(data, cfg.data.valid_fraction, cfg.seed)
    return build_tasks(data_config(cfg), cfg.seed, cfg.train.collective_timeout_s)


def data_config(cfg: RunConfig):
    """``data`` with every dynamic table's field in ``raw_ids`` (its raw values flow through)."""
    dynamic = {n for n, t in cfg.embedding.tables.items() if t.kind == "dynamic"}
    if cfg.embedding.sharding != "sharded" or dynamic <= set(cfg.data.raw_ids):
        return cfg.data
    return dataclasses.replace(cfg.data, raw_ids=sorted(set(cfg.data.raw_ids) | dynamic))


def check_dynamic_capacity(cfg: RunConfig, plan: ShardingPlan, tasks_per_micro_batch: int) -> None:
    """Every dynamic table holds, per rank, the most distinct ids one lookup can bring to one
    rank (every rank's micro-batch, padded tasks at their longest): checked before any
    collective, so a lookup never runs out of rows mid-run."""
    rows = cfg.data.synthetic.max_interactions if cfg.data.source == "synthetic" else cfg.data.max_interactions
    problems = []
    for name, p in plan.tables.items():
        if p.kind != "dynamic":
            continue
        most = tasks_per_micro_batch * rows * plan.world_size * len(p.table.features)
        if p.table.capacity < most:
            problems.append(
                f"embedding.tables.{name}.capacity: {p.table.capacity} rows per rank, but one lookup can "
                f"bring up to {most} distinct ids to one rank ({tasks_per_micro_batch} tasks per micro-batch "
                f"x {rows} interactions x {plan.world_size} rank(s) x {len(p.table.features)} feature(s)); "
                f"raise it to at least {most} or lower meta.tasks_per_micro_batch")
    if problems:
        raise ConfigError(problems)


def check_raw_fields(cfg: RunConfig, fields) -> None:
    """A field holding raw ids needs a dynamic table (a static one has rows 0..V-1 only)."""
    tables = cfg.embedding.tables
    for f in fields:
        if f.raw and not (cfg.embedding.sharding == "sharded" and f.name in tables
                          and tables[f.name].kind == "dynamic"):
            raise ConfigError([f"data.raw_ids: field {f.name!r} keeps its raw ids, but its table is static; "
                               f"set embedding.sharding: sharded and embedding.tables.{f.name}.kind: dynamic, "
                               f"or drop {f.name!r} from data.raw_ids"])


def preflight(cfg: RunConfig, world_size: int) -> None:
    """Checks that need the model's shape but no data or process group (run on every rank
    before the first collective): the embedding plan and what ``meta.adapt`` matches."""
    if cfg.data.source == "synthetic":
        fields = synthetic_fields(cfg.data.synthetic)
    else:
        fields = build_data(cfg).fields  # cached after the first build
        check_raw_fields(cfg, fields)
    if cfg.embedding.sharding == "sharded":
        from gmeta_ds.config.deepspeed import resolve_ds_config

        plan = embedding_plan(cfg, fields, world_size)
        check_dynamic_capacity(cfg, plan, resolve_ds_config(cfg, world_size)[1].tasks_per_micro_batch)
        try:
            resolve_placement(plan, 0)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from None
    learner = build_learner(cfg, fields, with_tables=False)
    check_split_body(learner)
    # One forward of a small batch (and under vmap): a registered model (gmeta_ds.registry.MODELS)
    # that breaks the model contract fails here, in validate too, not at the first meta-step.
    probe_model(learner, [f.name for f in model_field_order(fields)], cfg.model.embed_dim, f"model {cfg.model.name}")


def build_learner(cfg: RunConfig, fields, with_tables: bool = True, train=None) -> MetaLearner:
    """Model + algorithm, initialised from the run seed (identical on every rank). Without
    tables when they are sharded outside the engine. ``train``: the training tasks, which
    ``model.item_popularity``'s counts are fitted on (the same on every rank)."""
    torch.manual_seed(cfg.seed)
    net = build_model(cfg.model, fields, cfg.embedding, cfg.seed, with_tables, kind=label_kind(cfg),
                      oov_id=oov_id(cfg.data.source == "synthetic"))
    if train is not None:
        fit_popularity_offset(net, train)
    # meta.vectorize: auto -- activations of one task's padded rows (its longest) through the model.
    rows = cfg.data.synthetic.max_interactions if cfg.data.source == "synthetic" else cfg.data.max_interactions
    per_task = task_activation_bytes(net.activation_floats(), rows, cfg.meta.inner_steps)
    meta = dataclasses.replace(cfg.meta, adapt=resolve_adapt(net, cfg.meta.adapt))
    return MetaLearner(net, build_algorithm(meta, label_kind(cfg), per_task))


def label_kind(cfg: RunConfig) -> str:
    """binary (clicks; synthetic data is always binary) or regression (ratings)."""
    return "binary" if cfg.data.source == "synthetic" else cfg.data.label


def embedding_plan(cfg: RunConfig, fields, world_size: int, train=None) -> ShardingPlan:
    """The sharding plan of the model's tables (``embedding.sharding: sharded``); with the
    training tasks, ``exchange: auto`` tables choose rows or pooled by their bag statistics.
    A plan the tables cannot take is a `ConfigError` naming the table."""
    mode = cfg.embedding.exchange_topology
    topology = resolve_topology(cfg.embedding.hosts, world_size, required=mode != "flat", sites=cfg.sites.count)
    stats = None
    if train is not None:
        from gmeta_ds.config.deepspeed import resolve_ds_config

        stats = bag_statistics(train, resolve_ds_config(cfg, world_size)[1].tasks_per_micro_batch,
                               topology.ranks_per_host if topology is not None else 1)
    try:
        # the rows-or-pooled choice is the bags' (single-hot fields exchange rows); the topology's is every field's
        bags = {name: s for name, s in stats.items() if name in train.multi} if stats is not None else None
        plan = plan_from_config(field_tables(fields, cfg.model.embed_dim, cfg.embedding), cfg.embedding,
                                world_size, bags)
        if topology is not None and (topology.hosts > 1 or mode != "flat"):  # one host, flat: as before
            plan = with_topology(plan, topology, mode, stats)
        return plan
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError([f"embedding.tables: {exc}"]) from None


def build_sharded(cfg: RunConfig, data, rank: int, world_size: int) -> ShardedEmbeddingCollection | None:
    """This rank's shards, or None when tables are replicated inside the engine."""
    if cfg.embedding.sharding != "sharded":
        return None
    return ShardedEmbeddingCollection(embedding_plan(cfg, data.fields, world_size, data.train), rank, cfg.seed,
                                      cfg.embedding.bad_ids, cfg.embedding.dedup,
                                      timeout_s=cfg.train.collective_timeout_s)


def eval_inner_steps(cfg: RunConfig) -> int:
    return cfg.meta.inner_steps if cfg.eval.inner_steps == "auto" else int(cfg.eval.inner_steps)


def eval_settings(cfg: RunConfig) -> EvalSettings:
    """The ``eval`` section as the evaluation's settings (`evaluate_held_out`)."""
    ev = cfg.eval
    return EvalSettings(eval_inner_steps(cfg), cfg.seed, ev.tasks_per_batch, ev.bootstrap_resamples, ev.baseline,
                        ev.baseline_finetune, ev.finetune_search, ev.popularity_baseline, ev.baseline_epochs,
                        ev.baseline_lr, ev.baseline_batch_size, tuple(ev.few_shot), tuple(ev.steps_curve),
                        synthetic=cfg.data.source == "synthetic")


def run_evaluation(cfg: RunConfig, learner: MetaLearner, data, rank: int = 0, world: int = 1,
                   out_dir: Path | None = None, per_user_file: str = PER_USER_FILE) -> dict:
    """`evaluate_held_out` of the held-out users ``eval.split`` names, as the ``eval`` section
    asks: the meta-learned model (the tasks split over the ranks), the baselines (rank 0; the
    non-meta one started from the run seed's initial weights), paired intervals, the few-shot
    and inner-steps curves, and, with the four-state split, the scores and intervals per state
    under ``states``. With ``out_dir`` (the CLI's output_dir), each held-out user's AUC (MAE)
    per model goes to ``out_dir/per_user_file`` (rank 0: per_user.csv for a training run,
    eval_per_user.csv for `gmeta-ds eval`). Collective when ``world`` > 1;
    returns {} on other ranks."""
    held_out = data.valid if cfg.eval.split == "valid" else data.test
    states = getattr(data, "states", {}) if cfg.eval.split == "test" else {}
    result, per_user = evaluate_held_out(
        learner, held_out, eval_settings(cfg), train=data.train, valid=data.valid, states=states,
        baseline_start=lambda: build_learner(cfg, data.fields, train=data.train), rank=rank, world=world,
        split=cfg.eval.split)
    if out_dir is not None and per_user is not None:
        write_per_user(out_dir / per_user_file, per_user)
    return result


def full_state(module: torch.nn.Module, tables: dict) -> dict:
    """The learner's state dict (gathered under ZeRO-3; collective then) with sharded tables
    (`ShardedEmbeddingCollection.gather_state`) under their unsharded names."""
    state = ds_engine.full_state_dict(module)
    state.update({f"{EMBEDDING_PREFIX}{key}": t for key, t in tables.items()})
    return state


def eval_learner(cfg: RunConfig, module: MetaLearner, data: SyntheticData, state: dict) -> MetaLearner:
    """A single-process learner with unsharded tables holding ``state``."""
    if model_hooks(module.net).embedding is not None and not ds_engine.is_partitioned(module):
        return module
    learner = build_learner(cfg, data.fields, with_tables=True)
    learner.load_state_dict(state)
    return learner
