"""``gmeta-ds eval --splits K``: the configured run repeated over K user splits, and the mean
difference to every baseline with an interval over splits and users.

Split i is the configured run with ``seed`` + i (i = 0..K-1; split 0 is the run ``gmeta-ds
train`` makes): the seed draws which users train, validate and are held out (for a log, the
task store of that seed under ``data.cache_dir``, built once and reused by every later
command; for synthetic data, the data themselves), and the model's initialisation and task
order. Each split trains and evaluates as configured into ``OUTPUT_DIR/splits/seed-<seed>/``
(its own summary.json, metrics.jsonl, model.safetensors, per_user.csv): every choice (the
fine-tune search) is still made on that split's validation users only. A split whose folder
already holds a finished run of the same config is read, not retrained, so an interrupted
command continues where it stopped.

``OUTPUT_DIR/splits.json`` then holds each split's scores and paired intervals, and for each
baseline and metric the mean difference over splits with the interval of
`gmeta_ds.evaluation.intervals.split_interval` (splits' spread plus the user sampling they share); the
same for every point of the few-shot curve.
"""
from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path
from typing import Any, Callable

from gmeta_ds.config import RunConfig, config_to_dict, renew_sharding
from gmeta_ds.errors import ConfigError
from gmeta_ds.evaluation.intervals import LEVEL, split_interval
from gmeta_ds.run.outputs import check_earlier_run
from gmeta_ds.files import write_json
from gmeta_ds.run.trainer import train
from gmeta_ds.workloads.ctr import BASELINE_NAMES, METRIC_NAMES, difference_lines, difference_text

SPLITS_DIR = "splits"
RESULT_FILE = "splits.json"
METHOD = ("mean over splits of meta-learned minus baseline; interval mean +- sqrt(t(K-1)^2 s^2 / K + z^2 f w): "
          "s^2 the splits' variance, w their mean paired-bootstrap variance, f the held-out fraction of the "
          "users the splits share (gmeta_ds/evaluation/intervals.py split_interval)")


@dataclasses.dataclass
class Split:
    """One split's run: its config, its finished summary when reused (else None) and what
    the workload's preflight returned for it."""

    cfg: RunConfig
    summary: dict | None
    prepared: Any = None


def split_configs(cfg: RunConfig, k: int) -> list[RunConfig]:
    """The K runs: ``seed`` + i into ``OUTPUT_DIR/splits/seed-<seed>``."""
    if cfg.train.resume:
        raise ConfigError([f"train.resume: {cfg.train.resume!r}; eval --splits trains every split from its "
                           "start (a finished split is reused); drop train.resume"])
    if not cfg.eval.enabled:
        raise ConfigError(["eval.enabled: false, but eval --splits compares the splits' evaluations"])
    root = Path(cfg.output_dir) / SPLITS_DIR
    return [dataclasses.replace(cfg, seed=cfg.seed + i, output_dir=str(root / f"seed-{cfg.seed + i}"))
            for i in range(k)]


def finished_summary(cfg: RunConfig) -> dict | None:
    """The summary.json of a finished run of exactly ``cfg`` in its output_dir, else None."""
    path = Path(cfg.output_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    same = renew_sharding(summary.get("config"), warn=False) == json.loads(json.dumps(config_to_dict(cfg)))
    return summary if same and summary.get("eval") else None


def prepare_splits(cfg: RunConfig, k: int, world: int, workload, check_dir: Callable[[str], None]) -> list[Split]:
    """Every split's checks before the first collective (every rank): a finished one is
    reused; the others' folders may not hold another run (unless ``train.overwrite``), must be
    writable (``check_dir``) and pass the workload's preflight."""
    splits = []
    for one in split_configs(cfg, k):
        summary = finished_summary(one)
        if summary is None:
            check_earlier_run(one)
            check_dir(one.output_dir)
            splits.append(Split(one, None, workload.preflight(one, world)))
        else:
            splits.append(Split(one, summary))
    return splits


def train_splits(cfg: RunConfig, splits: list[Split], ds_config: dict, plan, rank: int, workload,
                 runtime_rss_mib: float | None) -> list[str]:
    """Train (in the process group already started) every split not reused, rank 0 printing
    each one's report; then write ``splits.json`` (rank 0) and return its lines ([] elsewhere)."""
    summaries = []
    for i, split in enumerate(splits):
        summary = split.summary
        if summary is None:
            summary = train(split.cfg, ds_config, plan, rank, workload, split.prepared, runtime_rss_mib)
            gc.collect()  # the split's engine and data, before the next one's
        if rank == 0:
            how = "reused" if split.summary is not None else "trained"
            print(f"split {i + 1}/{len(splits)} (seed {split.cfg.seed}, {how}):")
            print("\n".join("  " + line for line in workload.report(summary, split.cfg.output_dir)), flush=True)
        summaries.append(summary)
    if rank != 0:
        return []
    result = combine(summaries, held_out_fraction(cfg))
    path = Path(cfg.output_dir) / RESULT_FILE
    write_json(path, result)
    return [*split_lines(result), f"outputs: {path}, {Path(cfg.output_dir) / SPLITS_DIR}/seed-*/"]


def held_out_fraction(cfg: RunConfig) -> float:
    """The share of the users the splits draw from that each split holds out and scores (0:
    synthetic data, where every seed draws new users)."""
    if cfg.data.source == "synthetic":
        return 0.0
    return cfg.data.valid_fraction if cfg.eval.split == "valid" else cfg.data.test_fraction


def combine(summaries: list[dict], fraction: float, level: float = LEVEL) -> dict:
    """splits.json's content (module docstring): per split, its seed, folder, scalar scores and
    paired differences; per baseline and metric the `split_interval`; the few-shot curve's
    mean metrics and intervals per point when every split has one."""
    per_split = [{"seed": s["config"]["seed"], "output_dir": s["config"]["output_dir"],
                  "scores": {k: v for k, v in s["eval"].items() if v is None or isinstance(v, (int, float))},
                  "differences": (s["eval"].get("intervals") or {}).get("differences", {})} for s in summaries]
    out = {"splits": per_split, "level": level, "held_out_fraction": fraction, "method": METHOD,
           "differences": _combined([p["differences"] for p in per_split], fraction, level)}
    curves = [s["eval"].get("few_shot") for s in summaries]
    if all(curves) and all(c["support"] == curves[0]["support"] for c in curves):
        out["few_shot"] = _few_shot(curves, fraction, level)
    return out


def _combined(differences: list[dict], fraction: float, level: float) -> dict:
    """{baseline: {metric: split_interval}} over the baselines and metrics every split has."""
    names = [n for n in differences[0] if all(n in d for d in differences)]
    return {n: {m: split_interval([d[n][m] for d in differences], fraction, level) for m in differences[0][n]}
            for n in names}


def _few_shot(curves: list[dict], fraction: float, level: float) -> dict:
    """The few-shot curve over splits: each model's mean metric per point, and each point's
    combined differences."""
    metrics = {}
    for model, values in curves[0]["metrics"].items():
        for metric in values:
            columns = zip(*(c["metrics"].get(model, {}).get(metric, [None] * len(values[metric])) for c in curves))
            metrics.setdefault(model, {})[metric] = [None if None in col else sum(col) / len(col) for col in columns]
    points = [_combined([c["intervals"][i] for c in curves], fraction, level) if curves[0]["intervals"][i] else {}
              for i in range(len(curves[0]["support"]))]
    return {"support": curves[0]["support"], "metrics": metrics, "intervals": points}


def split_lines(result: dict) -> list[str]:
    """The printed summary of splits.json: the combined differences per baseline, and at the
    few-shot curve's smallest supports the per-user AUC (MAE) difference to each baseline."""
    k = len(result["splits"])
    lines = [f"meta-learned minus baseline over {k} user splits (mean, {result['level']:.0%} interval over "
             f"splits and users; held-out fraction {result['held_out_fraction']:g}):"]
    lines += difference_lines(result["differences"])
    curve = result.get("few_shot")
    if curve:
        metric = "auc_per_task" if "auc_per_task" in curve["metrics"].get("meta", {}) else "mae"
        for support, point in zip(curve["support"], curve["intervals"]):
            parts = [f"{BASELINE_NAMES.get(n, n)} {difference_text(d[metric])}" for n, d in point.items()]
            if parts:
                lines.append(f"  few-shot, {support} support row(s), {METRIC_NAMES[metric]}: " + " | ".join(parts))
    return lines

