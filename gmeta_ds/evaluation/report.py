"""``gmeta-ds report RUN_DIR``: one self-contained HTML page of a run's evidence.

Sections: the run (what was trained, on how many users), the comparison table (every model's
cold-start metrics) and each baseline's difference with its 95% paired interval and a verdict
(better, worse or undecided at 95%), per-user AUC first, then global AUC, then logloss (MAE
first for ratings), the four cold-start states (``eval.states``), the few-shot curve
(``eval.few_shot``), the per-user AUC distribution (``per_user.csv``), the user splits
(``splits.json`` of ``gmeta-ds eval --splits``), the training curves (``metrics.jsonl``) and the
configuration. Charts are matplotlib PNGs inlined as base64 ``data:`` URIs: the page loads no
other file and nothing from the network, so it can be mailed or attached as it is. No torch:
runs anywhere the run's files are copied to. A part the run did not produce (no evaluation, no
four-state split, a run from before per_user.csv) is a sentence saying so, not an error.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from gmeta_ds.errors import ConfigError
from gmeta_ds.evaluation.plots import coldstart_chart, few_shot_chart, loss_chart, read_metrics, read_summary
from gmeta_ds.evaluation.report_inputs import check_summary, read_per_user, read_splits

REPORT_FILE = "report.html"
# Rows of the comparison table: (model, key prefix of its metrics in summary.json's eval).
MODELS = (("meta-learned + adaptation", ""), ("meta-learned, no adaptation", "*_no_adapt"),
          ("non-meta baseline", "baseline_"), ("baseline + fine-tune", "baseline_finetune_"),
          ("baseline + tuned fine-tune", "baseline_finetune_tuned_"),
          ("popularity + user offset", "baseline_popularity_"))
NAMES = {"baseline": "non-meta baseline", "baseline_finetune": "baseline + fine-tune",
         "baseline_finetune_tuned": "baseline + tuned fine-tune", "baseline_popularity": "popularity + user offset",
         "meta": "meta-learned + adaptation", "meta_no_adapt": "meta-learned, no adaptation"}
METRIC_LABELS = {"auc": "AUC", "auc_per_task": "per-user AUC", "logloss": "logloss", "mae": "MAE", "rmse": "RMSE"}
# The order of the metric columns and of each verdict row: the mean per-user AUC first (the
# metric a cold-start user decides on), then the global AUC, then logloss; MAE, RMSE for ratings.
METRIC_ORDER = ("auc_per_task", "auc", "logloss", "mae", "rmse")
STATES = {"warm": "warm (existing users, existing items)", "user_cold": "user cold (new users, existing items)",
          "item_cold": "item cold (existing users, new items)", "user_item_cold": "user and item cold"}
STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
         "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:4px 8px;text-align:right}"
         "th:first-child,td:first-child{text-align:left}img{max-width:100%}pre{background:#f4f4f4;padding:1em;"
         "overflow:auto}.better{color:#060}.worse{color:#a00}.undecided{color:#666}")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` (a run's output_dir, or that of ``eval --splits``) to
    ``out`` (default RUN_DIR/report.html); returns its path."""
    run_dir = Path(run_dir)
    summary_path, splits_path = run_dir / "summary.json", run_dir / "splits.json"
    if not summary_path.is_file() and not splits_path.is_file():
        what = "does not exist" if not run_dir.exists() else "holds neither summary.json nor splits.json"
        raise ConfigError([f"RUN_DIR {str(run_dir)!r} {what}; expected the output_dir of a 'gmeta-ds train' "
                           "or 'gmeta-ds eval --splits' run"])
    summary = read_summary(summary_path) if summary_path.is_file() else {}
    check_summary(summary, summary_path)
    splits = read_splits(splits_path) if splits_path.is_file() else None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    body = [f"<h1>gmeta-ds report: {_e(run_dir.resolve().name)}</h1>"]
    if summary:
        evaluation = summary.get("eval") or {}
        body += [_run_section(summary), *_comparison_section(evaluation), *_budget_section(evaluation, run_dir)]
        if evaluation.get("tasks"):
            body += [*_states_section(plt, evaluation), *_few_shot_section(plt, evaluation.get("few_shot")),
                     *_few_shot_section(plt, evaluation.get("inner_steps_curve"), along="inner_steps"),
                     *_per_user_section(plt, run_dir / "per_user.csv")]
    if splits is not None:
        body += _splits_section(plt, splits)
    if summary:
        body += [*_training_section(plt, run_dir), *_config_section(summary.get("config"))]
    page = (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>gmeta-ds report: "
            f"{_e(run_dir.name)}</title><style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    path = Path(out) if out else run_dir / REPORT_FILE
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"--out: cannot write {str(path)!r} ({exc.strerror})"]) from exc
    return path


def _e(value) -> str:
    return html.escape(str(value))


def _num(value, signed: bool = False) -> str:
    """A metric as text: 4 decimals, "n/a" for null (undefined) or missing."""
    if value is None or isinstance(value, str):
        return "n/a"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    """An HTML table; cells are HTML already (escape text with `_e`)."""
    head = "".join(f"<th>{h}</th>" for h in header)
    lines = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{lines}</tbody></table>"


def _chart(plt, fig, alt: str) -> str:
    """A matplotlib figure as an inline PNG ``<img>`` (base64 data URI)."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<p><img alt="{_e(alt)}" src="data:image/png;base64,{data}"></p>'


def _run_section(summary: dict) -> str:
    """What ran: task, model, algorithm, steps, ranks, time, held-out users."""
    config, ev = summary.get("config") or {}, summary.get("eval") or {}
    facts = [("task", summary.get("task")), ("model", config.get("model", {}).get("name")),
             ("algorithm", config.get("meta", {}).get("algorithm")), ("meta-steps", summary.get("meta_steps")),
             ("ranks", summary.get("world_size")), ("seed", config.get("seed")),
             ("held-out users scored", ev.get("tasks")), ("held-out set", ev.get("split")),
             ("wall time (s)", None if summary.get("elapsed_s") is None else f"{summary['elapsed_s']:.1f}")]
    return "<h2>Run</h2>" + _table(["", "value"], [[_e(k), _e("n/a" if v is None else v)] for k, v in facts])


def _metric_names(evaluation: dict) -> list[str]:
    """The metrics of ``evaluation`` (summary.json's ``eval``, or a state's), in `METRIC_ORDER`."""
    return [m for m in METRIC_ORDER if m in evaluation]


def _ordered(metrics) -> list[str]:
    """``metrics`` (the keys of one baseline's differences) in `METRIC_ORDER`; others last."""
    metrics = list(metrics)
    return [m for m in METRIC_ORDER if m in metrics] + [m for m in metrics if m not in METRIC_ORDER]


def _score_rows(evaluation: dict) -> list[list[str]]:
    """One row per model present in ``evaluation``: its value of each metric."""
    rows = []
    for label, prefix in MODELS:
        keys = {m: (m + prefix[1:] if prefix.startswith("*") else prefix + m) for m in _metric_names(evaluation)}
        if any(k in evaluation for k in keys.values()):
            rows.append([_e(label), *(_num(evaluation.get(k)) for k in keys.values())])
    return rows


def _comparison_section(evaluation: dict) -> list[str]:
    """Every model's metrics, and each baseline's paired difference with its verdict."""
    if not evaluation or not evaluation.get("tasks"):
        return ["<h2>Comparison with the baselines</h2><p>The run was not evaluated (eval.enabled: false, "
                "or no held-out user).</p>"]
    metrics = _metric_names(evaluation)
    out = ["<h2>Comparison with the baselines</h2>",
           f"<p>Held-out users: {_e(evaluation['tasks'])}; query rows: {_e(evaluation.get('query_rows'))}.</p>",
           _table(["model", *(METRIC_LABELS[m] for m in metrics)], _score_rows(evaluation))]
    intervals = evaluation.get("intervals") or {}
    if intervals.get("differences"):
        out.append(f"<p>Meta-learned minus each baseline, with the {intervals['level']:.0%} interval of a paired "
                   f"bootstrap over the {_e(intervals['users'])} held-out users ({_e(intervals['resamples'])} "
                   "resamples), and the verdict: per-user AUC first (the mean AUC of each held-out user's own "
                   "query rows: what a cold-start user sees), then the global AUC, then logloss (MAE, then RMSE "
                   "for ratings). For the AUCs higher is better, for logloss, MAE and RMSE lower is.</p>")
        out.append(_differences_table(intervals["differences"]))
    return out


def _budget_section(evaluation: dict, run_dir: Path) -> list[str]:
    """How much each side was tuned (issue 47: a tuned model against an untuned one is no
    comparison): the fine-tune search's grid, and ``gmeta-ds tune``'s trials when its
    tune.json sits in the run's folder (the config's own output_dir)."""
    grid = evaluation.get("baseline_finetune_grid")
    lines = []
    if grid:
        lines.append(f"baseline + tuned fine-tune: lr {_e(evaluation.get('baseline_finetune_lr'))}, "
                     f"{_e(evaluation.get('baseline_finetune_steps'))} steps, the best of {len(grid)} settings on the "
                     "validation users (eval.finetune_search)")
    path = run_dir / "tune.json"
    try:
        tuned = json.loads(path.read_text())
        lines.append(f"meta-learned model: gmeta-ds tune, {_e(tuned['budget']['trials'])} trials on the validation "
                     f"users (best {_e(tuned['objective'])} {_num((tuned.get('best') or {}).get('value'))})")
    except FileNotFoundError:
        lines.append("meta-learned model: no gmeta-ds tune search in this folder; its settings are the configuration's")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        lines.append(f"meta-learned model: {_e(path.name)} is not a gmeta-ds tune result ({_e(type(exc).__name__)}); "
                     "its tuning budget is unknown")
    return ["<h2>Tuning budgets</h2><ul>" + "".join(f"<li>{line}</li>" for line in lines) + "</ul>"]


def _verdict(metric: str, d: dict) -> str:
    """better / worse / undecided at the interval's level, for the meta-learned model."""
    if d.get("low") is None:
        return '<span class="undecided">undefined</span>'
    if d["low"] <= 0 <= d["high"]:
        return '<span class="undecided">undecided</span>'
    good = (d["low"] > 0) == metric.startswith("auc")
    return '<span class="better">better</span>' if good else '<span class="worse">worse</span>'


def _differences_table(differences: dict) -> str:
    """baseline x metric: difference [low, high] and the verdict; per-user AUC first
    (`METRIC_ORDER`)."""
    metrics = _ordered(next(iter(differences.values())))
    rows = [[_e(NAMES.get(b, b)), *(f"{_num(d[m]['diff'], True)} [{_num(d[m]['low'], True)}, "
                                    f"{_num(d[m]['high'], True)}] {_verdict(m, d[m])}" for m in metrics)]
            for b, d in differences.items()]
    return _table(["vs baseline", *(METRIC_LABELS[m] for m in metrics)], rows)


def _states_section(plt, evaluation: dict) -> list[str]:
    """MeLU's four cold-start states (``eval.states``), or why there are none."""
    out = ["<h2>Cold-start states</h2>"]
    states = evaluation.get("states") or {}
    if not states:
        return out + ["<p>Not evaluated: the four cold-start states need a log with item release years and "
                      "data.four_state: true (MeLU's warm / user cold / item cold / user and item cold split); "
                      "this run scored its held-out users only.</p>"]
    metrics = _metric_names(evaluation)
    for name, scores in states.items():
        out.append(f"<h3>{_e(STATES.get(name, name))}</h3>")
        if not scores.get("tasks"):
            out.append("<p>No user in this state.</p>")
            continue
        out.append(f"<p>Users: {_e(scores['tasks'])}.</p>")
        out.append(_table(["model", *(METRIC_LABELS[m] for m in metrics)], _score_rows(scores)))
        if (scores.get("intervals") or {}).get("differences"):
            out.append(_differences_table(scores["intervals"]["differences"]))
    return out + [_chart(plt, coldstart_chart(plt, evaluation), "cold-start metric per state")]


# The two curves of an evaluation: (title, summary key, config key, column unit, what a point means).
_CURVES = {
    "support": ("Few-shot curve", "eval.few_shot", "rows", "when each held-out user adapts on only the first "
                "k rows of its support (every point scores the same query rows)"),
    "inner_steps": ("Inner-steps curve", "eval.steps_curve", "steps", "after each number of inner steps on "
                    "each held-out user's full support (0: the initialisation as is)"),
}


def _few_shot_section(plt, curve: dict | None, interval: str = "95% paired bootstrap",
                      along: str = "support") -> list[str]:
    """A curve (``along`` the support size, or the inner steps): chart and each model's value
    per point."""
    title, key, unit, meaning = _CURVES[along]
    out = [f"<h2>{title}</h2>"]
    if not curve:
        return out + [f"<p>Not computed ({key}: []).</p>"]
    metric = "auc_per_task" if "auc_per_task" in curve["metrics"].get("meta", {}) else "mae"
    header = ["model", *(f"{_e(k)} {unit}" for k in curve[along])]
    rows = [[_e(NAMES.get(n, n)), *(_num(v) for v in values[metric])] for n, values in curve["metrics"].items()]
    return out + [f"<p>{METRIC_LABELS[metric]} {meaning}.</p>", _table(header, rows),
                  _chart(plt, few_shot_chart(plt, curve, interval), title.lower())]


def _per_user_section(plt, path: Path) -> list[str]:
    """The distribution of each held-out user's AUC (MAE) per model: chart and quantiles, from
    per_user.csv, the rows of the evaluation summary.json's ``eval`` holds (never `gmeta-ds
    eval`'s eval_per_user.csv, which pairs with its eval.json)."""
    out = ["<h2>Per-user AUC distribution</h2>"]
    if not path.is_file():
        return out + ["<p>No per_user.csv in this run (a run's evaluation writes it beside summary.json; "
                      "runs from before it have none; 'gmeta-ds eval' writes its own rows to eval_per_user.csv "
                      "beside its eval.json).</p>"]
    import numpy as np

    columns = {c: v for c, v in read_per_user(path).items() if v}
    if not columns:
        return out + ["<p>No held-out user has a defined per-user metric.</p>"]
    metric = "AUC" if next(iter(columns)).endswith("_auc") else "MAE"
    rows = [[_e(NAMES.get(c.rsplit("_", 1)[0], c)), _e(len(v)), *(_num(q) for q in
            (np.mean(v), *np.quantile(v, [0.1, 0.25, 0.5, 0.75, 0.9])))] for c, v in columns.items()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(list(columns.values()), bins=20, histtype="step", label=[NAMES.get(c.rsplit("_", 1)[0], c) for c in columns])
    ax.set(xlabel=f"per-user {metric}", ylabel="users", title=f"per-user {metric} of the held-out users")
    ax.legend(fontsize=7)
    return out + [f"<p>Each held-out user's {metric} of its query rows (users whose query holds one class "
                  "only have no AUC).</p>",
                  _table(["model", "users", "mean", "10%", "25%", "median", "75%", "90%"], rows),
                  _chart(plt, fig, f"per-user {metric} distribution")]


def _splits_section(plt, result: dict) -> list[str]:
    """``eval --splits``: each split's headline metric and differences, the combined
    differences and the few-shot curve over the splits (each split's own report has the rest)."""
    splits = result["splits"]
    metric = "auc" if "auc" in splits[0]["scores"] else "mae"
    out = [f"<h2>User splits ({len(splits)})</h2>",
           _table(["seed", "held-out users", f"meta {METRIC_LABELS[metric]}",
                   *(f"vs {_e(NAMES.get(b, b))}" for b in result["differences"])],
                  [[_e(s["seed"]), _e(s["scores"].get("tasks")), _num(s["scores"].get(metric)),
                    *(_num(s["differences"].get(b, {}).get(metric, {}).get("diff"), True) for b in result["differences"])]
                   for s in splits]),
           f"<p>Mean difference over the splits, {result['level']:.0%} interval over splits and users "
           f"({_e(result['method'])}).</p>", _differences_table(result["differences"])]
    if result.get("few_shot"):
        out += ["<h3>Few-shot curve over the splits</h3>", *_few_shot_section(plt, result["few_shot"], "95%, splits and users")[1:]]
    return out


def _training_section(plt, run_dir: Path) -> list[str]:
    """The meta-training losses (metrics.jsonl)."""
    out = ["<h2>Training curves</h2>"]
    if not (run_dir / "metrics.jsonl").is_file():
        return out + ["<p>No metrics.jsonl here (each split's folder holds its own).</p>"]
    return out + [_chart(plt, loss_chart(plt, read_metrics(run_dir)), "meta-training loss")]


def _config_section(config: dict | None) -> list[str]:
    if not config:
        return []
    return ["<h2>Configuration</h2>", f"<pre>{_e(json.dumps(config, indent=2))}</pre>"]
