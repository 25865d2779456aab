"""The files ``gmeta-ds report`` reads, checked before any section is drawn: ``summary.json``'s
parts the report shows (run facts, ``eval.intervals``, the curves), ``splits.json`` of
``gmeta-ds eval --splits`` and ``per_user.csv``. A file that is not as gmeta-ds writes it is a
`ConfigError` naming the file, the key (or line and column) and what was expected; parts a
run did not produce (absent keys) stay the report's "not evaluated" sentences."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from gmeta_ds.errors import ConfigError

# The metrics a difference or a curve may name (report.METRIC_LABELS' keys).
METRICS = ("auc", "auc_per_task", "logloss", "mae", "rmse")


def _json_text(value) -> str:
    """``value`` as a message quotes it, cut to 80 characters."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _a_number(value) -> bool:
    """A finite number (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _expect(problems: list[str], where: str, key: str, value, ok: bool, expected: str) -> bool:
    """Add "WHERE: key 'KEY': expected EXPECTED, got VALUE" unless ``ok``; returns ``ok``."""
    if not ok:
        problems.append(f"{where}: key {key!r}: expected {expected}, got {_json_text(value)}")
    return ok


def _differences(problems: list[str], where: str, key: str, differences) -> None:
    """{baseline: {metric: {diff, low, high}}}, each a number or null."""
    if not _expect(problems, where, key, differences, isinstance(differences, dict) and all(
            isinstance(d, dict) for d in differences.values()), "an object {baseline: {metric: interval}}"):
        return
    for baseline, per_metric in differences.items():
        for metric, d in per_metric.items():
            name = f"{key}.{baseline}.{metric}"
            if _expect(problems, where, name, metric, metric in METRICS, f"a metric among {', '.join(METRICS)}"):
                _expect(problems, where, name, d, isinstance(d, dict) and all(
                    k in d and (d[k] is None or _a_number(d[k])) for k in ("diff", "low", "high")),
                    "an object with diff, low and high, each a number or null")


def _intervals(problems: list[str], where: str, key: str, intervals) -> None:
    """``eval.intervals`` (or a state's): level, users, resamples and the differences."""
    if not _expect(problems, where, key, intervals, isinstance(intervals, dict), "an object"):
        return
    if not intervals.get("differences"):
        return
    _expect(problems, where, f"{key}.level", intervals.get("level"), _a_number(intervals.get("level")),
            "a number (the interval's level, e.g. 0.95)")
    _differences(problems, where, f"{key}.differences", intervals["differences"])


def _curve(problems: list[str], where: str, key: str, curve, along: str) -> None:
    """A few-shot or inner-steps curve: the points ``along``, per model a list per metric, and
    one interval object per point."""
    if not _expect(problems, where, key, curve, isinstance(curve, dict), "an object with "
                   f"{along}, metrics and intervals"):
        return
    points = curve.get(along)
    if not _expect(problems, where, f"{key}.{along}", points, isinstance(points, list) and all(
            _a_number(p) or isinstance(p, str) for p in points), "a list of points (numbers, or 'all')"):
        return
    metrics = curve.get("metrics")
    if _expect(problems, where, f"{key}.metrics", metrics, isinstance(metrics, dict) and all(
            isinstance(m, dict) for m in metrics.values()), "an object {model: {metric: values}}"):
        for model, values in metrics.items():
            for metric, series in values.items():
                _expect(problems, where, f"{key}.metrics.{model}.{metric}", series, isinstance(series, list)
                        and len(series) == len(points) and all(v is None or _a_number(v) for v in series),
                        f"a list of {len(points)} numbers or nulls (one per point)")
    intervals = curve.get("intervals", [])
    if _expect(problems, where, f"{key}.intervals", intervals, isinstance(intervals, list) and all(
            isinstance(p, dict) for p in intervals), "a list of objects (one per point)"):
        for n, point in enumerate(intervals):
            _differences(problems, where, f"{key}.intervals[{n}]", point)


def check_summary(summary: dict, path: Path) -> None:
    """The parts of ``summary.json`` the report draws (see the module)."""
    where, problems = str(path), []
    config = summary.get("config") or {}
    if _expect(problems, where, "config", config, isinstance(config, dict), "an object (the run config)"):
        for section in ("model", "meta"):
            _expect(problems, where, f"config.{section}", config.get(section), isinstance(
                config.get(section) or {}, dict), "an object")
    elapsed = summary.get("elapsed_s")
    _expect(problems, where, "elapsed_s", elapsed, elapsed is None or _a_number(elapsed), "a number of seconds")
    evaluation = summary.get("eval") or {}
    _intervals(problems, where, "eval.intervals", evaluation.get("intervals") or {})
    for name, scores in (evaluation.get("states") or {}).items():  # a state's: differences only
        differences = (scores.get("intervals") or {}).get("differences") if isinstance(scores.get("intervals"), dict) else None
        if differences:
            _differences(problems, where, f"eval.states.{name}.intervals.differences", differences)
    for key, along in (("few_shot", "support"), ("inner_steps_curve", "inner_steps")):
        if evaluation.get(key):
            _curve(problems, where, f"eval.{key}", evaluation[key], along)
    if problems:
        raise ConfigError(problems)


def read_splits(path: Path) -> dict:
    """``splits.json`` of ``gmeta-ds eval --splits``: an object with a non-empty list of
    splits (seed, scores, differences), the combined differences, level and method."""
    try:
        result = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError([(f"{path}: not valid JSON ({str(exc)[:120]}); expected the splits.json "
                            "'gmeta-ds eval --splits' writes")]) from None
    where, problems = str(path), []
    if not isinstance(result, dict):
        raise ConfigError([(f"{path}: expected a JSON object (splits, differences, level, method), got "
                            f"{type(result).__name__}")])
    splits = result.get("splits")
    if _expect(problems, where, "splits", splits, isinstance(splits, list) and splits and all(
            isinstance(s, dict) for s in splits), "a non-empty list of objects (one per split)"):
        for n, split in enumerate(splits):
            _expect(problems, where, f"splits[{n}].scores", split.get("scores"),
                    isinstance(split.get("scores"), dict), "an object of metrics")
            _differences(problems, where, f"splits[{n}].differences", split.get("differences"))
    _differences(problems, where, "differences", result.get("differences"))
    _expect(problems, where, "level", result.get("level"), _a_number(result.get("level")), "a number (e.g. 0.95)")
    if result.get("few_shot"):
        _curve(problems, where, "few_shot", result["few_shot"], "support")
    if problems:
        raise ConfigError(problems)
    return result


def read_per_user(path: Path) -> dict[str, list[float]]:
    """per_user.csv's model columns (``*_auc`` / ``*_mae``): {model: its defined values}; a
    cell that is neither empty nor a finite number, a short row or undecodable bytes are a
    `ConfigError` naming the line and column."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError([(f"{path}: not a CSV table of UTF-8 text ({str(exc)[:120]}); expected the "
                            "per_user.csv an evaluation writes")]) from None
    columns = [c for c in (rows[0] if rows else {}) if isinstance(c, str) and c.endswith(("_auc", "_mae"))]
    out: dict[str, list[float]] = {c: [] for c in columns}
    for line, row in enumerate(rows, start=2):
        for c in columns:
            cell = row.get(c)
            try:
                value = float(cell) if cell != "" else None
            except (TypeError, ValueError):
                value = math.nan
            if value is not None and not math.isfinite(value):
                raise ConfigError([(f"{path}:{line}: column {c!r}: expected a number or an empty cell, got "
                                    f"{'a short row' if cell is None else repr(cell[:40])}")])
            if value is not None:
                out[c].append(value)
    return out
