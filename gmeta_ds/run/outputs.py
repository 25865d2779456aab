"""What a run leaves in ``output_dir``, and when a new run may replace it: nothing of an
earlier run is removed or overwritten until the new run has passed every check, and a run
that does not continue the folder's own checkpoint replaces a finished run's outputs only when
asked (``train.overwrite``, CLI ``--overwrite``). Read-only checks run on every rank before the
first collective (``train`` and ``validate`` alike); the removal runs on rank 0 right before
meta-step 1."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from gmeta_ds import checkpoint
from gmeta_ds.config import RunConfig, config_to_dict
from gmeta_ds.config.embedding import OLD_SHARDING
from gmeta_ds.engine.dist import collective_phase
from gmeta_ds.errors import ConfigError
from gmeta_ds.evaluation.plots import PLOT_FILES
from gmeta_ds.evaluation.report import REPORT_FILE
from gmeta_ds.evaluation.scores import EVAL_PER_USER_FILE, PER_USER_FILE
from gmeta_ds.run.profiling import TRACE_FILE

WEIGHTS_FILE = "model.safetensors"  # the final weights (rank 0, `workloads.ctr`)

# What a run leaves in output_dir (rank 0), with what later commands write there about it
# (gmeta-ds report's report.html, gmeta-ds plot's plots/, train.profile_steps' profile.json and
# train.profile_trace's profile/). A run that does not continue the folder's own checkpoint
# refuses a folder holding any of them unless train.overwrite (`check_earlier_run`), which
# removes them all: a new run's folder never shows the earlier run's report, charts or profile.
EARLIER_OUTPUTS = ("summary.json", WEIGHTS_FILE, "eval.json", EVAL_PER_USER_FILE, PER_USER_FILE, "metrics.jsonl",
                   "tensorboard", "checkpoints", REPORT_FILE, "plots", "profile.json", "profile")
_TRACE = re.compile(re.escape(TRACE_FILE).replace(r"\{rank\}", r"\d+"))


def run_phase(cfg: RunConfig, phase: str):
    """`collective_phase` for this run: a collective that exceeds ``train.collective_timeout_s``
    in it raises `CollectiveTimeout` naming ``phase`` and the last complete checkpoint in
    ``output_dir``."""
    return collective_phase(phase, cfg.train.collective_timeout_s,
                            checkpoint.checkpoint_root(cfg.output_dir) / checkpoint.LATEST)


def earlier_outputs(out_dir: Path) -> list[str]:
    """The `EARLIER_OUTPUTS` ``out_dir`` holds (a folder when it is not empty; named with a
    trailing ``/``)."""
    held = []
    for name in EARLIER_OUTPUTS:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            try:
                if next(path.iterdir(), None) is not None:
                    held.append(name + "/")
            except OSError:  # unreadable: assume it holds something
                held.append(name + "/")
        elif path.exists() or path.is_symlink():
            held.append(name)
    return held


def continues_run(cfg: RunConfig, found: Path | None) -> bool:
    """Whether resuming from ``found`` continues the run in ``output_dir`` (its own checkpoint,
    under ``OUTPUT_DIR/checkpoints``), not another run's."""
    if found is None:
        return False
    return found.resolve().is_relative_to(checkpoint.checkpoint_root(cfg.output_dir).resolve())


# The sections that say what a run trains (a requeue with any of them changed is another run).
MODEL_SECTIONS = ("task", "model", "embedding", "meta", "text")


def config_changes(recorded, cfg: RunConfig) -> list[str]:
    """The dotted keys of `MODEL_SECTIONS` whose value in ``cfg`` differs from ``recorded``
    (a finished run's summary.json ``config``); keys the recording lacks (written before they
    existed) and the old spelling of embedding.sharding are no change."""
    if not isinstance(recorded, dict):
        return []
    now, changes = config_to_dict(cfg), []

    def walk(old, new, key: str) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for k in sorted(set(old) & set(new), key=str):
                walk(old[k], new[k], f"{key}.{k}" if key else str(k))
        elif old != new and not (key == "embedding.sharding" and {old, new} == {"dense", OLD_SHARDING}):
            changes.append(f"{key}: {json.dumps(old, default=str)[:40]} -> {json.dumps(new, default=str)[:40]}")

    for section in MODEL_SECTIONS:
        if section in recorded and section in now:
            walk(recorded[section], now[section], section)
    return changes


def _ours_inside(name: str, entry: str) -> bool:
    """Whether ``entry``, found in the earlier run's folder ``name``, is one gmeta-ds writes
    there: checkpoint steps, ``latest`` and the universal conversion under ``checkpoints``, with
    the recovery scripts DeepSpeed copies beside ZeRO checkpoints (``zero_to_fp32.py``,
    ``zero_to_torch.py``); TensorBoard's event files under ``tensorboard``; `gmeta-ds plot`'s
    charts under ``plots``; each rank's Chrome trace under ``profile``."""
    if name == "checkpoints":
        return (checkpoint.TAG.fullmatch(entry) is not None or entry in (checkpoint.LATEST, "universal")
                or entry == checkpoint.LATEST + ".tmp" or (entry.startswith("zero_to_") and entry.endswith(".py")))
    if name == "plots":
        return entry in PLOT_FILES
    if name == "profile":
        return _TRACE.fullmatch(entry) is not None
    return entry.startswith("events.out.tfevents.")


def foreign_outputs(out_dir: Path, held: list[str]) -> list[str]:
    """The entries of ``held``'s folders (`earlier_outputs`) that no gmeta-ds run writes: what
    ``--overwrite`` would remove that is not ours (a user's own ``checkpoints/`` folder)."""
    foreign = []
    for name in (h.rstrip("/") for h in held if h.endswith("/")):
        try:
            foreign += [f"{name}/{e.name}" for e in sorted((out_dir / name).iterdir(), key=lambda e: e.name)
                        if not _ours_inside(name, e.name)]
        except OSError as exc:
            foreign.append(f"{name}/ (unreadable: {exc.strerror or exc})")
    return foreign


def check_earlier_run(cfg: RunConfig) -> list[str]:
    """A run that does not continue ``output_dir``'s own checkpoint (no ``train.resume``,
    ``auto`` finding none, or a checkpoint elsewhere) is refused when the folder holds an
    earlier run's outputs, unless ``train.overwrite``: nothing of a finished run is replaced
    unless asked. Read-only: every rank calls it before its first collective (``train``, and
    ``validate`` so the two agree). Returns what the run will remove once every check passed
    (`remove_earlier_outputs`), [] when nothing."""
    found = checkpoint.find(cfg.train.resume, cfg.output_dir) if cfg.train.resume else None
    held = [] if continues_run(cfg, found) else earlier_outputs(Path(cfg.output_dir))
    foreign = foreign_outputs(Path(cfg.output_dir), held) if cfg.train.overwrite else []
    if foreign:
        shown = ", ".join(foreign[:5]) + (f", ... ({len(foreign) - 5} more)" if len(foreign) > 5 else "")
        raise ConfigError([(f"output_dir: {str(cfg.output_dir)!r}: --overwrite replaces only what a "
                            f"gmeta-ds run wrote, and these are not: {shown}; nothing was changed. "
                            "Move them away or choose another output_dir")])
    if not held or cfg.train.overwrite:
        return held
    root = checkpoint.checkpoint_root(cfg.output_dir)
    resume = ("--set train.resume=auto to continue it from its last checkpoint"
              if (root / checkpoint.LATEST).is_file() else
              "--set train.resume=auto to continue it (from a complete checkpoint: this folder has "
              "none, train.checkpoint_every was 0 or no save completed)")
    raise ConfigError([f"output_dir: {str(cfg.output_dir)!r} holds an earlier run's outputs "
                       f"({', '.join(held)}) and this run would start afresh; nothing was changed. "
                       f"Pass --overwrite (train.overwrite=true) to replace them (removed only once "
                       f"this run has passed every check), {resume}, or choose another output_dir"])


def remove_earlier_outputs(out_dir: Path, names: list[str]) -> None:
    """With ``train.overwrite``: remove the earlier run's outputs `check_earlier_run` found
    (rank 0, after every check and the engine start, before meta-step 1), so that this run's
    files are never mixed with them (``gmeta-ds plot``, ``train.resume: auto``)."""
    for name in names:
        path = out_dir / name.rstrip("/")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    print(f"gmeta-ds: train.overwrite: every check passed; removed the earlier run's "
          f"{', '.join(names)} in {out_dir}", flush=True)


# What a gmeta-ds run may leave in its folder: `EARLIER_OUTPUTS` (the report, the plots and the
# profile among them). An API run's summary (`write_run_files`) goes only into a folder holding
# nothing else (a saved model's folder, `saved.is_saved_model`, is ours too).
RUN_FILES = EARLIER_OUTPUTS


def run_folder_problems(out_dir: Path) -> list[str]:
    """Why ``out_dir`` cannot take a run's summary.json and per_user.csv: a file, or a folder
    holding something a gmeta-ds run does not write (`RUN_FILES`, saved-model folders,
    leftover ``*.tmp`` of an interrupted write); new and empty folders are fine."""
    if out_dir.exists() and not out_dir.is_dir():
        return [f"out: {out_dir} is a file, expected a folder for the run's summary.json"]
    if not out_dir.is_dir():
        return []
    from gmeta_ds.saved import META, is_saved_model

    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in RUN_FILES and not p.name.endswith(".tmp")
                     and not (p.is_dir() and is_saved_model(p / META)))
    if not foreign:
        return []
    shown = ", ".join(foreign[:5]) + (f", ... ({len(foreign) - 5} more)" if len(foreign) > 5 else "")
    return [(f"out: {out_dir} holds files a gmeta-ds run does not write ({shown}); write the run into a new or "
             f"empty folder, or one of an earlier run ({', '.join(RUN_FILES)})")]


def write_run_files(out_dir: Path, files: dict[str, str | None]) -> Path:
    """Write ``files`` ({name: text}) into ``out_dir`` (made when missing; refused by
    `run_folder_problems`, untouched): every file first beside its place (``NAME.tmp``), then
    each renamed over the earlier one in the order given, so an earlier run's files are
    replaced only once every new one is complete. A name whose text is None is this run's
    absent file: an earlier run's copy is removed at its place in that order (never left
    beside this run's others). Returns ``out_dir``."""
    problems = run_folder_problems(out_dir)
    if problems:
        raise ConfigError(problems)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        tmp = None if text is None else out_dir / f"{name}.tmp"
        if tmp is not None:
            tmp.write_text(text)
        written.append((tmp, out_dir / name))
    for tmp, path in written:
        if tmp is None:
            path.unlink(missing_ok=True)
        else:
            os.replace(tmp, path)
    return out_dir
