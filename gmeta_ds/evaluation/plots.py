"""``gmeta-ds plot RUN_DIR``: PNG charts of a run from its ``metrics.jsonl`` and ``summary.json``
(matplotlib, headless). No torch: runs anywhere the files are copied to."""
from __future__ import annotations

import json
from pathlib import Path

from gmeta_ds.errors import ConfigError

# Cold-start bars: metric suffix -> label, for AUC (binary) and MAE (regression) runs.
_BARS = (("{m}_no_adapt", "meta, no adaptation"), ("{m}", "meta + adaptation"),
         ("baseline_{m}", "non-meta baseline"), ("baseline_finetune_{m}", "baseline + fine-tune"))


# Keys every metrics.jsonl record has (run_log.StepWindow.record writes them), plotted below.
_KEYS = ("step", "query_loss", "support_loss", "tasks_per_s")


def read_metrics(run_dir: Path) -> list[dict]:
    if not run_dir.is_dir():
        what = "is a file" if run_dir.exists() else "does not exist"
        raise ConfigError([f"RUN_DIR {str(run_dir)!r} {what}; expected the output_dir of a "
                           "'gmeta-ds train' run"])
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError([f"{path}: no metrics.jsonl here; expected the output_dir of a "
                           "'gmeta-ds train' run"])
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text ({exc}); expected one JSON object per line"]) from exc
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError([f"{path}:{number}: not a JSON object ({exc.msg})"]) from exc
        if not isinstance(record, dict) or not all(isinstance(record.get(k), (int, float)) for k in _KEYS):
            raise ConfigError([f"{path}:{number}: expected a JSON object with numbers "
                               f"{', '.join(_KEYS)}, got {line.strip()[:120]}"])
        records.append(record)
    if not records:
        raise ConfigError([f"{path}: empty (the run logged no meta-step yet)"])
    return records


def read_summary(path: Path) -> dict:
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: not valid JSON ({exc})"]) from exc
    if not isinstance(summary, dict) or not isinstance(summary.get("eval") or {}, dict):
        raise ConfigError([f"{path}: expected a JSON object with an 'eval' object (a run's summary.json)"])
    _check_states(summary.get("eval") or {}, path)
    return summary


def _check_states(evaluation: dict, path: Path) -> None:
    """``eval.states`` (the cold-start chart's held-out sets) an object of objects, and each
    set's bar metrics numbers or null."""
    states = evaluation.get("states", {})
    if not isinstance(states, dict) or not all(isinstance(v, dict) for v in states.values()):
        raise ConfigError([(f"{path}: key 'eval.states': expected an object (state name -> its metrics "
                            f"object), got {json.dumps(states)[:120]}")])
    for name, scores in {"eval": evaluation, **{f"eval.states.{k}": v for k, v in states.items()}}.items():
        for key, value in scores.items():
            bar = any(key == b.format(m=m) for b, _ in _BARS for m in ("auc", "mae"))
            if bar and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError([(f"{path}: key '{name}.{key}': expected a number or null, got "
                                    f"{json.dumps(value)[:120]}")])


# Every chart `plot_run` may write (RUN_DIR/plots/ by default; `run.outputs` takes them as a run's).
PLOT_FILES = ("loss.png", "throughput.png", "communication.png", "coldstart.png", "few_shot.png", "inner_steps.png")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write loss, throughput, communication and (when the run evaluated) cold-start charts;
    returns the files written."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)  # before matplotlib: bad input fails fast
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out) if out else run_dir / "plots"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError([f"--out: cannot make the folder {str(out_dir)!r} ({exc.strerror})"]) from exc
    steps = [r["step"] for r in records]
    written = []

    def save(fig, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    save(loss_chart(plt, records), "loss.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["tasks_per_s"] for r in records])
    ax.set(xlabel="meta-step", ylabel="tasks / s", title="throughput (all ranks)")
    save(fig, "throughput.png")

    save(_communication_chart(plt, steps, records), "communication.png")
    summary_path = run_dir / "summary.json"
    evaluation = read_summary(summary_path).get("eval") if summary_path.is_file() else None
    if evaluation:
        save(coldstart_chart(plt, evaluation), "coldstart.png")
    if evaluation and evaluation.get("few_shot"):
        save(few_shot_chart(plt, evaluation["few_shot"]), "few_shot.png")
    if evaluation and evaluation.get("inner_steps_curve"):
        save(few_shot_chart(plt, evaluation["inner_steps_curve"]), "inner_steps.png")
    return written


def loss_chart(plt, records: list[dict]):
    """The meta-training losses against the meta-step (metrics.jsonl)."""
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["query_loss"] for r in records], label="query loss (outer)")
    ax.plot(steps, [r["support_loss"] for r in records], label="support loss (inner, before adaptation)")
    ax.set(xlabel="meta-step", ylabel="loss", title="meta-training loss")
    ax.legend()
    return fig


def _communication_chart(plt, steps: list[int], records: list[dict]):
    """MiB each rank sent per log window: dense gradients and sharded embeddings."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r.get("dense_allreduce_bytes", 0) / 2**20 for r in records],
            label="dense gradients (all-reduce model)")
    ax.plot(steps, [r.get("embedding_comm_bytes", 0) / 2**20 for r in records],
            label="sharded embeddings (all-to-all, measured)")
    ax.set(xlabel="meta-step", ylabel="MiB sent per rank per log window", title="communication")
    ax.legend()
    return fig


def coldstart_chart(plt, evaluation: dict):
    """Bars of the cold-start metric (AUC, else MAE) per held-out set, before and after
    adaptation and for the baselines (`_BARS`); an undefined (null) metric is a gap."""
    sets = {"held-out users": evaluation, **evaluation.get("states", {})}
    metric = "auc" if "auc" in evaluation else "mae"
    fig, ax = plt.subplots(figsize=(max(6, 2 * len(sets)), 4))
    width = 0.8 / len(_BARS)
    for i, (key, label) in enumerate(_BARS):
        values = [s.get(key.format(m=metric)) for s in sets.values()]
        values = [float("nan") if v is None else v for v in values]  # null: undefined metric
        ax.bar([j + i * width for j in range(len(sets))], values, width, label=label)
    ax.set_xticks([j + width * (len(_BARS) - 1) / 2 for j in range(len(sets))], list(sets))
    ax.set(ylabel=metric.upper(), title=f"cold-start {metric.upper()} before / after adaptation")
    if metric == "auc":
        ax.set_ylim(0.4, 1.0)
    ax.legend(fontsize=8)
    return fig


# How the few-shot chart names each model of summary.json's ``eval.few_shot``.
_MODELS = {"meta": "meta-learned + adaptation", "baseline": "non-meta baseline",
           "baseline_finetune": "baseline + fine-tune", "baseline_finetune_tuned": "baseline + tuned fine-tune",
           "baseline_popularity": "popularity + user offset"}


def few_shot_chart(plt, curve: dict, interval: str = "95% paired bootstrap"):
    """The few-shot curve (``eval.few_shot``; or the inner-steps curve, ``eval.inner_steps_curve``,
    along inner steps): left, every model's mean per-user AUC (MAE for ratings) against the
    support rows each user adapted on; right, the meta-learned model
    minus each baseline with its 95% interval (error bars; ``interval`` names how it was
    made). Null values are gaps."""
    metric = "auc_per_task" if "auc_per_task" in curve["metrics"].get("meta", {}) else "mae"
    label = "mean per-user AUC" if metric == "auc_per_task" else "MAE"
    along = "support" if "support" in curve else "inner_steps"  # eval.few_shot or eval.inner_steps_curve
    xlabel = "support interactions per user" if along == "support" else "inner steps on the full support"
    x = list(range(len(curve[along])))
    ticks = [str(k) for k in curve[along]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {name: f"C{i}" for i, name in enumerate(curve["metrics"])}  # one colour per model in both panels
    for name, values in curve["metrics"].items():
        left.plot(x, [float("nan") if v is None else v for v in values[metric]], marker="o", color=colors[name],
                  label=_MODELS.get(name, name))
    left.set(xlabel=xlabel, ylabel=label, title=f"{'few-shot' if along == 'support' else 'inner-steps'} curve: {label}")
    right.axhline(0.0, color="grey", linewidth=0.8)
    for i, name in enumerate(sorted({b for point in curve["intervals"] for b in point})):
        d = [point.get(name, {}).get(metric) or {} for point in curve["intervals"]]
        mid = [float("nan") if p.get("diff") is None else p["diff"] for p in d]
        low = [0.0 if p.get("low") is None else p["diff"] - p["low"] for p in d]
        high = [0.0 if p.get("high") is None else p["high"] - p["diff"] for p in d]
        right.errorbar([v + 0.06 * i for v in x], mid, yerr=[low, high], marker="o", capsize=3,
                       color=colors.get(name), label=f"minus {_MODELS.get(name, name)}")
    right.set(xlabel=xlabel, ylabel=f"difference in {label}",
              title=f"meta-learned minus baseline ({interval})")
    for ax in (left, right):
        ax.set_xticks(x, ticks)
        ax.legend(fontsize=7)
    return fig
