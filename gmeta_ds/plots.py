"""``gmeta-ds plot RUN_DIR``: PNG charts of a run from its ``metrics.jsonl`` and ``summary.json``
(matplotlib, headless). No torch: runs anywhere the files are copied to."""
from __future__ import annotations

import json
from pathlib import Path

from gmeta_ds.errors import ConfigError

# Cold-start bars: metric suffix -> label, for AUC (binary) and MAE (regression) runs.
_BARS = (("{m}_no_adapt", "meta, no adaptation"), ("{m}", "meta + adaptation"),
         ("baseline_{m}", "non-meta baseline"), ("baseline_finetune_{m}", "baseline + fine-tune"))


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError([f"{path}: no metrics.jsonl here; expected the output_dir of a "
                           "'gmeta-ds train' run"])
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError([f"{path}:{number}: not a JSON object ({exc.msg})"]) from exc
    if not records:
        raise ConfigError([f"{path}: empty (the run logged no meta-step yet)"])
    return records


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write loss, throughput, communication and (when the run evaluated) cold-start charts;
    returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out_dir = Path(out) if out else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    written = []

    def save(fig, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["query_loss"] for r in records], label="query loss (outer)")
    ax.plot(steps, [r["support_loss"] for r in records], label="support loss (inner, before adaptation)")
    ax.set(xlabel="meta-step", ylabel="loss", title="meta-training loss")
    ax.legend()
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["tasks_per_s"] for r in records])
    ax.set(xlabel="meta-step", ylabel="tasks / s", title="throughput (all ranks)")
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r.get("dense_allreduce_bytes", 0) / 2**20 for r in records],
            label="dense gradients (all-reduce model)")
    ax.plot(steps, [r.get("embedding_comm_bytes", 0) / 2**20 for r in records],
            label="sharded embeddings (all-to-all, measured)")
    ax.set(xlabel="meta-step", ylabel="MiB sent per rank per log window", title="communication")
    ax.legend()
    save(fig, "communication.png")

    summary_path = run_dir / "summary.json"
    evaluation = json.loads(summary_path.read_text()).get("eval") if summary_path.is_file() else None
    if evaluation:
        sets = {"held-out users": evaluation, **evaluation.get("states", {})}
        metric = "auc" if "auc" in evaluation else "mae"
        fig, ax = plt.subplots(figsize=(max(6, 2 * len(sets)), 4))
        width = 0.8 / len(_BARS)
        for i, (key, label) in enumerate(_BARS):
            values = [s.get(key.format(m=metric), float("nan")) for s in sets.values()]
            ax.bar([j + i * width for j in range(len(sets))], values, width, label=label)
        ax.set_xticks([j + width * (len(_BARS) - 1) / 2 for j in range(len(sets))], list(sets))
        ax.set(ylabel=metric.upper(), title=f"cold-start {metric.upper()} before / after adaptation")
        if metric == "auc":
            ax.set_ylim(0.4, 1.0)
        ax.legend(fontsize=8)
        save(fig, "coldstart.png")
    return written
