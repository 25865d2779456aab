"""``gmeta-ds tune``: an Optuna search over config keys, every trial scored on validation users.

    gmeta-ds tune --config FILE.yaml --space SPACE.yaml --trials N [--study NAME] [--set ...]

Why it exists: the fine-tuned baseline's lr and steps are searched on validation users
(``eval.finetune_search``); the meta-learned model gets the same kind of budget here, so a
comparison of the two is not one tuned model against an untuned one (issue 47).

SPACE.yaml maps dotted config keys to Optuna distributions: ``{low, high}`` (float; ``log:
true`` for a log scale, ``step`` for a grid), int when low, high (and step) are integers,
``{choices: [...]}`` categorical. Each trial is one ``gmeta-ds train`` of the config with the
trial's values as ``--set`` overrides plus `FORCED` (scored on ``eval.split: valid`` only; no
baselines, curves or intervals: a trial needs only the meta-learned model's score), run as an
isolated subprocess (``python -I``: nothing is imported from the working directory) into
``OUTPUT_DIR/tune/trial-<number>``. The objective is ``eval.auc_per_task`` (maximised) for
binary labels and ``eval.mae`` (minimised) for ratings, read from the trial's summary.json.

The study lives in ``OUTPUT_DIR/tune.db`` (Optuna's RDB storage on SQLite): the same command
again continues it up to N finished trials; a trial a killed search left RUNNING is marked
failed (``interrupted``) and its values run again. Trials are not pruned: a run evaluates only
after its last meta-step (``workloads.ctr``), and the training query loss is not the objective,
so there is no honest intermediate value to prune on (docs/tuning.md).

Layer 0: no torch here; the trials import it in their own processes.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gmeta_ds.files import write_json
from gmeta_ds.processes import kill_group
from gmeta_ds.config import OLD_SHARDING, config_to_dict, load_config, load_yaml
from gmeta_ds.errors import ConfigError

# What every trial runs with, after the user's --set and the trial's values (the last wins):
# choices on the validation users only, and only the meta-learned model's score.
FORCED = ("eval.enabled=true", "eval.split=valid", "eval.few_shot=[]", "eval.steps_curve=[]",
          "eval.bootstrap_resamples=0", "eval.baseline=false", "eval.popularity_baseline=false",
          "eval.finetune_search=false", "train.progress=false", "train.tensorboard=false",
          "train.resume=null", "train.overwrite=true")
# Keys a space may not search: tune sets them, or they change which users validate.
PROTECTED = {o.split("=")[0] for o in FORCED} | {"output_dir", "seed", "data.valid_fraction",
                                                 "data.test_fraction", "task"}
METRICS = {"binary": ("auc_per_task", "maximize"), "regression": ("mae", "minimize")}
DEFAULT_STUDY = "tune"
TRIAL_TIMEOUT_S = 7200
ERROR_LINES = 20
SPEC_FIELDS = {"low", "high", "step", "log", "choices"}
# A launcher's variables: a trial is one plain process, never a rank of the caller's job.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "CROSS_RANK", "CROSS_SIZE")
INSTALL_HINT = "pip install 'gmeta-ds[tune]'"


@dataclass
class Setup:
    """One checked search: the base config (the file plus the user's ``--set``), the space,
    the objective and where the study and the trials live."""

    config: str
    overrides: list[str]
    base: dict                # the resolved base config with FORCED, flat (dotted keys)
    space: dict               # key -> normalized spec (`_check_spec`)
    metric: str
    direction: str
    out_dir: Path
    study: str
    trials: int
    timeout_s: int

    @property
    def prefix(self) -> str:
        """``tune`` for the default study, ``tune-<study>`` otherwise: a study's trial numbers
        start at 0, so two studies in one output_dir must not share trial folders."""
        return "tune" if self.study == DEFAULT_STUDY else f"tune-{self.study}"


# ------------------------------------------------------------------ the space file
def load_space(path: str) -> tuple[dict, list[str]]:
    """The space file as {key: normalized spec} and every problem found in it (not raised
    here: the caller adds the problems the config finds and reports them all at once)."""
    file = Path(path)
    if not file.is_file():
        what = "is a directory, expected a YAML file" if file.is_dir() else "does not exist"
        raise ConfigError([f"--space {path!r} {what}"])
    try:
        data = load_yaml(file.read_text())
    except Exception as exc:  # YAMLError, RecursionError, UnicodeDecodeError, OSError
        raise ConfigError([f"--space {path!r}: not valid YAML ({exc})"]) from exc
    if not isinstance(data, dict) or not data:
        raise ConfigError([f"--space {path!r}: expected a mapping of dotted config keys to distributions, "
                           "e.g. 'meta.inner_lr: {low: 0.03, high: 1.0, log: true}'"])
    problems: list[str] = []
    space = {}
    for key, spec in data.items():
        checked = _check_spec(str(key), spec, problems)
        if checked is not None:
            space[str(key)] = checked
    return space, problems


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_spec(key: str, spec: Any, problems: list[str]) -> dict | None:
    """One key's distribution, normalized (``type`` int, float or categorical), or None with
    its problems appended: a typo'd bound must fail before any trial, not as N failed runs."""
    before = len(problems)
    if not re.fullmatch(r"[A-Za-z0-9_*\-]+(\.[A-Za-z0-9_*\-]+)*", key):
        problems.append(f"{key}: not a dotted config key (e.g. meta.inner_lr)")
    elif key in PROTECTED:
        problems.append(f"{key}: tune fixes it for every trial (the validation users and the scoring "
                        "must be the same in all of them); remove it from the space")
    if not isinstance(spec, dict):
        problems.append(f"{key}: {spec!r} is not a distribution; expected {{low: L, high: H}} (optional "
                        "log: true, step: S) or {choices: [...]}")
        return None
    unknown = sorted(set(map(str, spec)) - SPEC_FIELDS)
    if unknown:
        problems.append(f"{key}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(SPEC_FIELDS))}")
    if "choices" in spec:
        out = _check_choices(key, spec, problems)
    else:
        out = _check_range(key, spec, problems)
    return out if len(problems) == before else None


def _check_choices(key: str, spec: dict, problems: list[str]) -> dict:
    """``{choices: [...]}``: scalars only (what Optuna stores and ``--set`` reads back), no repeats."""
    choices = spec["choices"]
    if set(spec) - {"choices"}:
        problems.append(f"{key}: choices cannot be combined with {', '.join(sorted(set(spec) - {'choices'}))}")
    if not isinstance(choices, list) or not choices:
        problems.append(f"{key}: choices must be a non-empty list, got {choices!r}")
        return {}
    bad = [c for c in choices if not (c is None or isinstance(c, (str, bool)) or _number(c))]
    if bad:
        problems.append(f"{key}: choices must be numbers, strings, booleans or null; got {bad!r}")
    elif len({json.dumps(c) for c in choices}) < len(choices):
        problems.append(f"{key}: choices {choices!r} repeat a value")
    return {"type": "categorical", "choices": choices}


def _check_range(key: str, spec: dict, problems: list[str]) -> dict:
    """``{low, high[, step][, log]}``: int when low, high and step are integers, else float."""
    low, high, step, log = spec.get("low"), spec.get("high"), spec.get("step"), spec.get("log", False)
    for name, value in (("low", low), ("high", high)):
        if not _number(value):
            problems.append(f"{key}: {name} {value!r} must be a finite number"
                            + (" (or give choices: [...])" if value is None else ""))
    if not isinstance(log, bool):
        problems.append(f"{key}: log {log!r} must be true or false")
    if step is not None and not (_number(step) and step > 0):
        problems.append(f"{key}: step {step!r} must be a number > 0")
    if not (_number(low) and _number(high)):
        return {}
    if low >= high:
        problems.append(f"{key}: low {low!r} must be below high {high!r}")
    if log is True and low <= 0:
        problems.append(f"{key}: log: true needs low > 0, got {low!r}")
    integer = all(isinstance(v, int) for v in (low, high, step) if v is not None)
    if log is True and step is not None and not (integer and step == 1):
        problems.append(f"{key}: log: true cannot be combined with step {step!r}")
    if _number(step) and step > 0 and low < high:
        grid = (high - low) / step
        if abs(grid - round(grid)) > 1e-9 * max(1.0, grid):
            problems.append(f"{key}: high - low ({high - low!r}) must be a multiple of step {step!r}")
    out = {"type": "int" if integer else "float", "low": low, "high": high, "log": log is True}
    return {**out, "step": step} if step is not None else out


def _endpoints(spec: dict) -> list:
    """The values a spec can take at its edges (every choice): what the config checks."""
    return list(spec["choices"]) if spec["type"] == "categorical" else [spec["low"], spec["high"]]


def set_value(key: str, value: Any) -> str:
    """``key=value`` for ``--set``: the value as JSON, which YAML reads back unchanged."""
    return f"{key}={json.dumps(value)}"


# ------------------------------------------------------------------ checks before any trial
def prepare(config: str, space_path: str, overrides: list[str], study: str, trials: int,
            timeout_s: int = TRIAL_TIMEOUT_S) -> Setup:
    """Every check that can fail before a trial runs, each a `ConfigError` (exit 2): the
    study name, the config with the user's ``--set``, validation users to score, the space
    file, and every space value at its edges through the project's own config validation."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", study):
        raise ConfigError([f"--study {study!r}: use 1-64 letters, digits, '_' or '-'"])
    cfg = load_config(config, overrides)
    if cfg.task != "ctr":
        raise ConfigError([f"task: {cfg.task!r}; gmeta-ds tune searches CTR runs (task: ctr) only"])
    if cfg.data.valid_fraction <= 0:
        raise ConfigError([f"data.valid_fraction: {cfg.data.valid_fraction!r}; gmeta-ds tune chooses on "
                           "validation users only, never the test users: set data.valid_fraction > 0 "
                           "(e.g. --set data.valid_fraction=0.1)"])
    out_dir = Path(cfg.output_dir)
    trial_dir = str(out_dir / "tune" / "trial-0")
    try:
        base = load_config(config, [*overrides, *FORCED, f"output_dir={trial_dir}"])
    except ConfigError as exc:  # the user never wrote these settings: say where they come from
        raise ConfigError([*exc.problems, "(with the settings gmeta-ds tune gives every trial: "
                           f"{' '.join(FORCED)})"], config) from None
    space, problems = load_space(space_path)
    problems += _space_config_problems(config, [*overrides, *FORCED, f"output_dir={trial_dir}"], space)
    if problems:
        raise ConfigError(problems, f"--space {space_path}")
    metric, direction = METRICS[cfg.data.label]
    flat = {k: v for k, v in _flatten(config_to_dict(base)).items() if k not in NOT_COMPARED}
    return Setup(config, list(overrides), flat, space, metric, direction, out_dir, study, trials, timeout_s)


# Settings that change where a run keeps things or how it reports, never its scores: a study
# continued from another place (a moved folder, another cache) stays the same study.
NOT_COMPARED = {"output_dir", "data.cache_dir", "data.memory_limit", "data.prefetch", "train.threads",
                "train.progress", "train.tensorboard", "train.log_every", "train.collective_timeout_s"}


def _space_config_problems(config: str, overrides: list[str], space: dict) -> list[str]:
    """What the project's config validation says about each space key on its own at each of
    its edges (an unknown key, a bound the key does not allow), each problem once."""
    found: dict[str, str] = {}  # problem -> the line reporting it (with the first value that had it)
    for key, spec in space.items():
        for value in _endpoints(spec):
            try:
                load_config(config, [*overrides, set_value(key, value)])
            except ConfigError as exc:
                for problem in exc.problems:
                    found.setdefault(problem, f"{problem} (space value {key}={json.dumps(value)})")
    return list(found.values())


def _flatten(data: Any, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: what two configs differ in, key by key."""
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    out = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def import_optuna():
    """Optuna, or one clear error naming the extra that installs it (a core install has none)."""
    try:
        import optuna
    except ImportError as exc:
        raise ConfigError([f"gmeta-ds tune needs Optuna, which is not installed ({exc}); install it with "
                           f"{INSTALL_HINT}"]) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


# ------------------------------------------------------------------ the study
@contextmanager
def search_lock(out_dir: Path):
    """One search per output_dir at a time: a second one would take the first one's running
    trial for a killed one (and SQLite serves one writer)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tune.lock"
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError([f"output_dir: another gmeta-ds tune is running in {str(out_dir)!r} ({path} is "
                               "locked); wait for it, or choose another output_dir"]) from None
        yield


def open_study(optuna, setup: Setup):
    """The study in ``OUTPUT_DIR/tune.db``, created on first use with the space, objective and
    base config in its user_attrs; a later search with another of them is refused, since its
    trials would not be comparable with the stored ones. Returns (study, storage)."""
    db = (setup.out_dir / "tune.db").resolve()
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    study = optuna.create_study(storage=storage, study_name=setup.study, direction=setup.direction,
                                load_if_exists=True)
    given = json.loads(json.dumps({"space": setup.space, "metric": setup.metric,
                                   "base": {k: v for k, v in setup.base.items() if k not in setup.space}}))
    stored = study.user_attrs
    if "space" not in stored:
        for key, value in given.items():
            study.set_user_attr(key, value)
        return study, storage
    problems = _mismatch(stored, given)
    if problems:
        raise ConfigError([f"--study {setup.study}: the study in {db} was made with another {problem}; "
                           "rerun it with the same config, --set and space to continue it, or pass --study "
                           "NAME to start another study" for problem in problems])
    return study, storage


def _mismatch(stored: dict, given: dict) -> list[str]:
    """How ``given`` (this command's space, metric, base config) differs from the study's."""
    problems = []
    spaces = stored.get("space") or {}, given["space"]
    if spaces[0] != spaces[1]:
        old, new = spaces
        keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        problems.append("space (" + "; ".join(f"{k}: {_spec_text(old.get(k))} -> {_spec_text(new.get(k))}"
                                              for k in keys) + ")")
    if stored.get("metric") != given["metric"]:
        problems.append(f"objective (eval.{stored.get('metric')}, now eval.{given['metric']})")
    old, new = dict(stored.get("base") or {}), given["base"]
    if old.get("embedding.sharding") == OLD_SHARDING:  # a study made before the rename to dense
        old["embedding.sharding"] = "dense"
    searched = spaces[0].keys() | spaces[1].keys()  # a space key's config value is never used
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k not in searched)
    if keys:
        shown = "; ".join(f"{k}: {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in keys[:8])
        problems.append(f"config ({shown}{'; ...' if len(keys) > 8 else ''})")
    return problems


def _spec_text(spec: dict | None) -> str:
    if spec is None:
        return "absent"
    return json.dumps({k: v for k, v in spec.items() if k != "type"}, separators=(", ", ": "))


def recover_interrupted(optuna, study, storage) -> list[int]:
    """Trials a killed search left RUNNING (the lock says no search is running now): marked
    failed with ``interrupted`` and their values queued to run again, so an interruption
    costs neither a slot of the budget nor the point it was trying."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for trial in running:
        mark_interrupted(optuna, study, storage, trial.number, trial.params)
    return [t.number for t in running]


def mark_interrupted(optuna, study, storage, number: int, params: dict) -> None:
    """Trial ``number`` failed as ``interrupted`` (not counted), its values queued again."""
    study_id = storage.get_study_id_from_name(study.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    storage.set_trial_user_attr(trial_id, "interrupted", True)
    storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
    study.enqueue_trial(params, user_attrs={"retry_of": number}, skip_if_exists=False)


def finished(optuna, study) -> int:
    """Trials that ran to their end, scored or failed (the budget); interrupted ones do not count."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    return sum(1 for t in study.get_trials(deepcopy=False, states=states) if not t.user_attrs.get("interrupted"))


def distribution(optuna, spec: dict):
    """The Optuna distribution of a normalized spec."""
    dist = optuna.distributions
    if spec["type"] == "categorical":
        return dist.CategoricalDistribution(spec["choices"])
    if spec["type"] == "int":
        return dist.IntDistribution(spec["low"], spec["high"], log=spec["log"], step=spec.get("step") or 1)
    return dist.FloatDistribution(spec["low"], spec["high"], log=spec["log"], step=spec.get("step"))


# ------------------------------------------------------------------ one trial
def run_trial(optuna, setup: Setup, study, storage) -> dict:
    """Ask for the next values, train and score them in a subprocess, tell the study: a
    failed trial is recorded failed (with its error) and the search goes on; an interrupted
    one (Ctrl-C) is killed, marked interrupted and queued again before the interrupt goes on."""
    trial = study.ask({key: distribution(optuna, spec) for key, spec in setup.space.items()})
    params = {key: trial.params[key] for key in setup.space}
    out = setup.out_dir / setup.prefix / f"trial-{trial.number}"
    trial.set_user_attr("output_dir", str(out))
    try:
        value, error, seconds = _train_and_score(setup, params, out)
    except BaseException:
        mark_interrupted(optuna, study, storage, trial.number, params)
        raise
    trial.set_user_attr("seconds", round(seconds, 3))
    if error is None:
        study.tell(trial, value)
    else:
        trial.set_user_attr("error", error)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return {"number": trial.number, "state": "COMPLETE" if error is None else "FAIL", "value": value,
            "seconds": round(seconds, 3), "params": params, "error": error}


def _train_and_score(setup: Setup, params: dict, out: Path) -> tuple[float | None, str | None, float]:
    """(value, None, seconds) of a trial that trained and scored, (None, why, seconds) of one
    that did not: its resolved config checked first (the project's own validation: a value
    the config refuses fails here, without starting a process), then the subprocess."""
    overrides = [*setup.overrides, *(set_value(k, v) for k, v in params.items()), *FORCED, f"output_dir={out}"]
    try:
        load_config(setup.config, overrides)
    except ConfigError as exc:
        return None, str(exc), 0.0
    command = [sys.executable, "-I", "-m", "gmeta_ds.cli", "train", "--config", setup.config]
    for item in overrides:
        command += ["--set", item]
    logs = out.parent / f"{out.name}.out", out.parent / f"{out.name}.err"
    code, seconds = _launch(command, *logs, setup.timeout_s)
    if code != 0:
        what = f"timed out after {setup.timeout_s} s" if code is None else f"exit code {code}"
        return None, f"gmeta-ds train {what}; the end of {logs[1]}:\n{_tail(logs[1])}", seconds
    value, error = _score(out / "summary.json", setup.metric)
    return value, error, seconds


def _launch(command: list[str], out_log: Path, err_log: Path, timeout_s: int) -> tuple[int | None, float]:
    """Run ``command`` in its own process group (its exit code, or None when it ran past
    ``timeout_s``, and its wall time); stdout and stderr to the two logs. The group is killed on
    a timeout or an interrupt, so no rank or compile job of a trial outlives it. A launcher's
    variables are dropped: the trial is one plain process, not a rank of the caller's job."""
    out_log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    start = time.perf_counter()
    with open(out_log, "w") as stdout, open(err_log, "w") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509 - the search starts no threads
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            code = None
        except BaseException:
            kill_group(proc)
            raise
    return code, time.perf_counter() - start


def _die_with_parent() -> None:
    """In the trial's process (Linux): SIGKILL when the search process dies, even by SIGKILL,
    so a killed search leaves no trial training on behind it (its retry would run beside it)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextmanager
def _terminate_as_exit():
    """SIGTERM (a scheduler's stop, ``kill``) ends the search like Ctrl-C: the running trial is
    killed, marked interrupted and queued again (its process group would not see the signal)."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)



def _tail(path: Path, lines: int = ERROR_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


def _score(summary_path: Path, metric: str) -> tuple[float | None, str | None]:
    """The trial's objective from its summary.json, checked to be a score of the validation
    users (never the test users) and a number."""
    try:
        ev = json.loads(summary_path.read_text())["eval"]
        split, value = ev.get("split"), ev.get(metric)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"{summary_path}: no evaluation to score ({type(exc).__name__}: {exc})"
    if split != "valid":
        return None, f"{summary_path}: eval.split is {split!r}, not the validation users"
    if not _number(value):
        why = "; ".join(map(str, ev.get("warnings") or [])) or "undefined on these users"
        return None, f"{summary_path}: eval.{metric} is {value!r} ({why})"
    return float(value), None


# ------------------------------------------------------------------ results
def set_line(params: dict, space: dict) -> str:
    """The ``--set`` overrides of ``params`` as one shell line (in the space's order)."""
    return " ".join(f"--set {shlex.quote(set_value(k, params[k]))}" for k in space if k in params)


def results(optuna, setup: Setup, study) -> dict:
    """What tune.json holds: the objective, the space, the best trial and its ``--set`` line,
    every trial, and the search's budget (trials that ran to their end, their total seconds)."""
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = None
    if complete:
        b = study.best_trial
        best = {"number": b.number, "value": b.value, "params": _in_space_order(b.params, setup.space),
                "set": set_line(b.params, setup.space), "output_dir": b.user_attrs.get("output_dir")}
    rows = [{"number": t.number, "state": t.state.name, "params": _in_space_order(t.params, setup.space),
             "value": t.value, "seconds": t.user_attrs.get("seconds"), "output_dir": t.user_attrs.get("output_dir"),
             **{k: t.user_attrs[k] for k in ("error", "interrupted", "retry_of") if k in t.user_attrs}}
            for t in trials]
    return {"study": setup.study, "storage": str((setup.out_dir / "tune.db").resolve()), "config": setup.config,
            "overrides": setup.overrides, "objective": f"eval.{setup.metric}", "direction": setup.direction,
            "split": "valid", "space": setup.space, "best": best, "trials": rows,
            "budget": {"trials": finished(optuna, study),
                       "seconds": round(sum(r["seconds"] or 0.0 for r in rows), 3)}}


def _in_space_order(params: dict, space: dict) -> dict:
    return {k: params[k] for k in space if k in params}


def _value_text(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else json.dumps(value)


def trial_line(row: dict) -> str:
    """One row of the printed table: number, state, value, seconds, values."""
    value = "-" if row["value"] is None else f"{row['value']:.4f}"
    seconds = "-" if row.get("seconds") is None else f"{row['seconds']:.1f}"
    state = "INTERRUPTED" if row.get("interrupted") else row["state"]
    values = " ".join(f"{k}={_value_text(v)}" for k, v in row["params"].items())
    return f"{row['number']:>5}  {state:<11} {value:>12} {seconds:>8}  {values}"


def table_header(setup: Setup) -> str:
    return f"{'trial':>5}  {'state':<11} {setup.metric:>12} {'seconds':>8}  values"


def report_lines(result: dict, setup: Setup) -> list[str]:
    """The table of trials and the best trial's ``--set`` line (what the command prints)."""
    lines = [table_header(setup), *map(trial_line, result["trials"])]
    budget = result["budget"]
    lines.append(f"{budget['trials']} trial(s) finished in {budget['seconds']:.1f} s of training; "
                 f"{setup.out_dir / (setup.prefix + '.json')}")
    best = result["best"]
    if best is None:
        return lines
    user = " ".join(f"--set {shlex.quote(o)}" for o in setup.overrides)
    lines += [f"best: trial {best['number']}, {result['objective']} {best['value']:.4f} on the validation users",
              best["set"],
              "train it and score the test users once: gmeta-ds train --config "
              f"{shlex.quote(setup.config)} {' '.join(filter(None, [user, best['set']]))}"]
    return lines


def tune(config: str, space: str, overrides: list[str], trials: int, study: str = DEFAULT_STUDY,
         timeout_s: int = TRIAL_TIMEOUT_S) -> int:
    """``gmeta-ds tune``: check everything, open (or continue) the study, run trials until
    ``trials`` have finished, write tune.json and print the table. 0 when a trial completed;
    2 (bad input) when none did, with the last error on stderr."""
    optuna = import_optuna()
    setup = prepare(config, space, overrides, study, trials, timeout_s)
    with search_lock(setup.out_dir), _terminate_as_exit():
        found, storage = open_study(optuna, setup)
        again = recover_interrupted(optuna, found, storage)
        if again:
            print(f"trial(s) {', '.join(map(str, again))} of an interrupted search: marked failed, run again")
        found.sampler = optuna.samplers.TPESampler(seed=_sampler_seed(setup, found))
        done = finished(optuna, found)
        print(f"study {setup.study!r} in {setup.out_dir / 'tune.db'}: {done} of {trials} trial(s) finished; "
              f"objective eval.{setup.metric} ({setup.direction}) on the validation users\n"
              f"{table_header(setup)}", flush=True)
        while finished(optuna, found) < trials:
            row = run_trial(optuna, setup, found, storage)
            print(trial_line(row) + (f"\n{row['error']}" if row["error"] else ""), flush=True)
        result = results(optuna, setup, found)
        write_json(setup.out_dir / f"{setup.prefix}.json", result)
    print("\n".join(report_lines(result, setup)))
    if result["best"] is None:
        print(f"gmeta-ds tune: no trial of study {setup.study!r} completed; each trial's error is in "
              f"{setup.out_dir / (setup.prefix + '.json')}, its output in {setup.out_dir / setup.prefix}/"
              "trial-N.out and .err", file=sys.stderr)
        return 2
    return 0


def _sampler_seed(setup: Setup, study) -> int:
    """The run's seed plus the trials so far: a fresh search repeats its draws, a continued
    one does not redraw the values it started with."""
    base = setup.base.get("seed", 0)
    return (int(base) if isinstance(base, int) else 0) + len(study.get_trials(deepcopy=False))
