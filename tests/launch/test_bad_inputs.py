"""The bad-input matrix: the real ``gmeta-ds`` CLI, as a subprocess, on one bad input per case
(config, DeepSpeed config, launch arguments, data, output paths, checkpoints, weights, run
directories). Every case exits 2 with ``gmeta-ds <cmd>: ...`` naming the key or file and what
was expected, and no traceback. Three run as two ranks of one job, which must each fail the same
way before any collective; one runs under ``deepspeed --num_gpus 2``.

Most cases fail before torch is imported; the only training run is the tiny checkpoint that
the checkpoint and weights cases start from (built once per module)."""
from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, REPO, deepspeed_cmd, free_port, gmeta_ranks, run, text_config, tiny_config

pytestmark = [pytest.mark.launcher]

NOT_JSON = "{not json"
# DeepSpeed's CPU ops are built and found with the venv's ninja: keep its bin first on PATH.
VENV_PATH = {"PATH": f"{BIN}:{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> dict[str, str]:
    """Bad files for every case, and the names the case commands refer to."""
    root = tmp_path_factory.mktemp("bad_inputs")
    cfg = tiny_config(root)
    files = {
        "inf.yaml": "train: {lr: .inf}\n", "list.yaml": "- model\n- meta\n", "empty.yaml": "",
        "broken.yaml": "meta: [unclosed\n", "bad.json": NOT_JSON, "list.json": "[1, 2]",
        "afile": "not a directory\n", "hostfile": "node0 slots=x\n", "hostfile1": "node0 slots=1\n",
        "ratings.csv": "user_id,item_id,rating\n1,2,five\n", "empty.safetensors": "",
        "plot_bad/metrics.jsonl": '{"step": 1, "query_loss": 1, "support_loss": 1, "tasks_per_s": 1}\n'
                                  "garbage\n",
        "plot_keys/metrics.jsonl": '{"step": 1}\n',
        "text.csv": "sentence,label\nhello,a\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    rng = random.Random(0)
    (root / "random.safetensors").write_bytes(rng.randbytes(256))
    (root / "garbage").mkdir()
    for name in ("ratings.bin", "notes.txt"):
        (root / "garbage" / name).write_bytes(rng.randbytes(512))
    (root / "emptydir").mkdir()
    good = ["user_id,item_id,rating"] + [f"{u},{rng.randrange(30)},{rng.randrange(1, 6)}"
                                          for u in range(40) for _ in range(16)]
    (root / "good.csv").write_text("\n".join(good) + "\n")
    text_cfg = text_config(root / "text")
    return {"ws": str(root), "cfg": str(cfg), "text": str(text_cfg)}


@pytest.fixture(scope="module")
def ckpt(ws) -> dict[str, str]:
    """A tiny trained run with one checkpoint, and broken copies of that checkpoint."""
    root = Path(ws["ws"]) / "ckpt"
    cfg = tiny_config(root, train={"meta_steps": 2, "checkpoint_every": 2, "tensorboard": False})
    run([str(BIN / "gmeta-ds"), "train", "--config", str(cfg)], env=VENV_PATH)
    checkpoints = root / "run" / "checkpoints"
    step = (checkpoints / "latest").read_text().strip()
    copies = {}
    for name, damage in (("tampered", lambda d: (d / "dense.safetensors").open("ab").write(b"x")),
                         ("notjson", lambda d: (d / "manifest.json").write_text(NOT_JSON)),
                         ("listed", lambda d: (d / "manifest.json").write_text("[1]")),
                         ("nomanifest", lambda d: (d / "manifest.json").unlink()),
                         ("faketable", _add_table_to_manifest)):
        copy = root / name
        shutil.copytree(checkpoints, copy)
        damage(copy / step)
        copies[name] = str(copy)
    weights = root / "run" / "model.safetensors"
    (root / "truncated.safetensors").write_bytes(weights.read_bytes()[:300])
    return {"run": str(root / "run"), "ck": str(checkpoints), "weights": str(weights),
            "truncated": str(root / "truncated.safetensors"), **copies}


def _add_table_to_manifest(ckpt: Path) -> None:
    """The manifest (not itself hashed) names a table no rank file holds."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["tables"] = {**manifest.get("tables", {}), "ghost": [3, 4]}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def mounts(ws) -> dict[str, str]:
    """A read-only tmpfs and a full one (root may write anywhere else: chmod stops nobody)."""
    ro, full = Path(ws["ws"]) / "ro", Path(ws["ws"]) / "full"
    mounted = []
    try:
        for path, options in ((ro, "size=1m,ro"), (full, "size=64k")):
            path.mkdir()
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                  capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                pytest.skip(f"mounting a tmpfs is not permitted here ({proc.stderr.strip()})")
            mounted.append(path)
        fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: the disk is full
            pass
        finally:
            os.close(fd)
        yield {"ro": str(ro), "full": str(full)}
    finally:
        for path in mounted:
            subprocess.run(["umount", str(path)], timeout=30)


# id, command (after gmeta-ds), words the message must hold. {name} is a path from the fixtures.
CASES = [
    # ---- config file and --set
    ("nan-via-set", "validate --config {cfg} --set meta.inner_lr=.nan",
     ["gmeta-ds validate:", "meta.inner_lr: nan is not a finite number"]),
    ("inf-in-yaml", "validate --config {ws}/inf.yaml", ["inf.yaml", "train.lr: inf is not a finite number"]),
    ("minus-inf-via-set", "validate --config {cfg} --set embedding.lr=-.inf",
     ["embedding.lr: -inf is not a finite number"]),
    ("number-as-string", "validate --config {cfg} --set 'train.meta_steps=\"5\"'",
     ["train.meta_steps: expected int, got '5'"]),
    ("unknown-key", "validate --config {cfg} --set meta.inner_stepz=2",
     ["meta.inner_stepz: unknown key; valid keys here:", "inner_steps"]),
    ("set-without-equals", "validate --config {cfg} --set meta.inner_lr",
     ["--set 'meta.inner_lr': expected dotted.key=value"]),
    ("set-into-a-value", "validate --config {cfg} --set model.embed_dim.x=3",
     ["'embed_dim' is not a section"]),
    ("set-empty-key-part", "validate --config {cfg} --set meta..inner_lr=1",
     ["empty key part in 'meta..inner_lr'"]),
    ("set-bad-yaml-value", "validate --config {cfg} --set 'meta.adapt=[x'",
     ["meta.adapt=[x", "not valid YAML"]),
    ("section-not-a-mapping", "validate --config {cfg} --set model=3", ["model: expected a mapping, got 3"]),
    ("config-is-a-list", "validate --config {ws}/list.yaml", ["list.yaml", "expected a mapping of sections"]),
    ("config-is-empty", "validate --config {ws}/empty.yaml", ["empty.yaml", "the file is empty"]),
    ("config-is-a-directory", "validate --config {ws}", ["is a directory, expected a YAML file"]),
    ("config-missing", "train --config {ws}/nope.yaml", ["config file", "nope.yaml' does not exist"]),
    ("config-bad-yaml", "validate --config {ws}/broken.yaml", ["broken.yaml", "not valid YAML"]),
    ("keep-last-negative", "validate --config {cfg} --set train.keep_last=-1",
     ["train.keep_last: -1 must be an integer >= 0"]),
    ("seed-negative", "validate --config {cfg} --set seed=-1", ["seed: -1 must be an integer >= 0"]),
    ("unknown-algorithm", "train --config {cfg} --set meta.algorithm=protonet",
     ["meta.algorithm: 'protonet' is not one of maml"]),
    ("adapt-matches-nothing", "validate --config {cfg} --set 'meta.adapt=[decoder.*]'",
     ["meta.adapt: ['decoder.*'] matches nothing; candidates are: mlp.0.weight"]),
    ("dynamic-capacity-below-a-micro-batch", "validate --config {cfg} --set embedding.sharding=sharded "
     "--set 'embedding.tables={{item_id: {{kind: dynamic, capacity: 5}}}}'",
     ["embedding.tables.item_id.capacity: 5 rows per rank, but one lookup can bring up to 120 distinct ids",
      "raise it to at least 120"]),
    ("dynamic-without-sharding", "validate --config {cfg} --set 'embedding.tables={{item_id: {{kind: dynamic, "
     "capacity: 500}}}}'", ["dynamic tables need embedding.sharding: sharded"]),
    ("dynamic-bad-eviction", "validate --config {cfg} --set embedding.sharding=sharded --set "
     "'embedding.tables={{item_id: {{kind: dynamic, capacity: 500, eviction: fifo}}}}'",
     ["embedding.tables.item_id.eviction: 'fifo' is not one of lru, lfu"]),
    ("accelerator-table-without-one", "train --config {cfg} --set embedding.sharding=sharded "
     "--set 'embedding.tables={{item_id: {{device: accelerator}}}}'",
     ["table 'item_id': device accelerator, but this rank has no accelerator", "to host or auto"]),
    ("raw-ids-on-a-static-table", "validate --config {cfg} --set data.source=table --set data.path={ws}/good.csv "
     "--set 'data.raw_ids=[item_id]'", ["data.raw_ids: field 'item_id' keeps its raw ids, but its table is static"]),
    # ---- DeepSpeed config
    ("ds-not-json", "validate --config {cfg} --set deepspeed={ws}/bad.json", ["bad.json is not valid JSON"]),
    ("ds-json-list", "validate --config {cfg} --set deepspeed={ws}/list.json",
     ["list.json must hold a JSON object, got list"]),
    ("ds-contradicts-meta", "validate --config {cfg} --set 'deepspeed={{train_batch_size: 7}}'",
     ["meta.tasks_per_meta_step (8) contradicts deepspeed.train_batch_size (7)"]),
    ("ds-section-not-object", "validate --config {cfg} --set 'deepspeed={{zero_optimization: 2}}'",
     ["deepspeed.zero_optimization: expected a JSON object, got 2"]),
    ("ds-refused-by-deepspeed", "train --config {cfg} --set "
     "'deepspeed={{optimizer: {{type: Adam}}, zero_optimization: {{stage: 1, bogus: 3}}}}'",
     ["DeepSpeed rejects the config", "bogus"]),
    ("ds-no-optimizer", "train --config {cfg} --set 'deepspeed={{zero_optimization: {{stage: 0}}}}'",
     ["deepspeed.optimizer: missing"]),
    ("ds-path-is-a-directory", "validate --config {cfg} --set deepspeed={ws}",
     ["deepspeed:", "is a directory, expected a DeepSpeed JSON file"]),
    # ---- launch arguments
    ("world-size-negative", "validate --config {cfg} --world-size -2", ["--world-size: -2 must be >= 1"]),
    ("world-size-zero", "validate --config {cfg} --world-size 0", ["--world-size: 0 must be >= 1"]),
    ("num-gpus-zero", "validate --config {cfg} --hostfile {ws}/hostfile1 --num_gpus 0",
     ["--num_gpus: 0 must be >= 1"]),
    ("num-gpus-without-hostfile", "validate --config {cfg} --num_gpus 2",
     ["--num_gpus 2: only applies with --hostfile"]),
    ("deepspeed-config-missing", "train --config {cfg} --deepspeed --deepspeed_config {ws}/nope.json",
     ["--deepspeed_config: DeepSpeed config file", "nope.json' does not exist"]),
    ("hostfile-missing", "validate --config {cfg} --hostfile {ws}/nohosts",
     ["hostfile", "nohosts' does not exist"]),
    ("hostfile-is-a-directory", "validate --config {cfg} --hostfile {ws}/emptydir",
     ["emptydir' is a directory, expected a file of 'HOST slots=N' lines"]),
    ("hostfile-bad-line", "validate --config {cfg} --hostfile {ws}/hostfile",
     ["hostfile:1: 'node0 slots=x' is not 'HOSTNAME slots=N'"]),
    ("local-rank-garbage", "--local_rank=abc train --config {cfg}",
     ["argument --local_rank/--local-rank: invalid int value: 'abc'"]),
    ("unknown-argument", "train --config {cfg} --bogus", ["unrecognized arguments: --bogus"]),
    ("unknown-subcommand", "frob --config {cfg}", ["invalid choice: 'frob'"]),
    # ---- data
    ("table-without-path", "validate --config {cfg} --set data.source=table",
     ["data.path: required for data.source 'table'"]),
    ("table-missing-file", "validate --config {cfg} --set data.source=table --set data.path={ws}/nope.csv",
     ["nope.csv: file does not exist"]),
    ("table-folder-of-garbage", "validate --config {cfg} --set data.source=table "
     "--set data.path={ws}/garbage",
     ["garbage/notes.txt: cannot read as CSV", "expected UTF-8 text with a header line"]),
    ("movielens-dir-of-garbage", "validate --config {cfg} --set data.source=movielens-100k "
     "--set data.path={ws}/garbage", ["garbage: no u.data", "the folder holds: notes.txt, ratings.bin"]),
    ("table-non-numeric-label", "validate --config {cfg} --set data.source=table "
     "--set data.path={ws}/ratings.csv",
     ["ratings.csv: row 1 below the header: column 'rating' must be a number, got 'five'"]),
    ("cache-dir-is-a-file", "validate --config {cfg} --set data.source=table --set data.path={ws}/good.csv "
     "--set data.cache_dir={ws}/afile", ["data.cache_dir: cannot make the task cache folder", "afile"]),
    ("text-data-missing", "validate --config {text} --set text.data.path={ws}/nope.csv",
     ["text.data.path:", "nope.csv is not a file"]),
    ("text-bad-column", "validate --config {text} --set text.data.path={ws}/text.csv",
     ["text.csv: no column 'text' (columns: sentence, label)", "text.data.text_column"]),
    # ---- output paths
    ("output-dir-is-a-file", "train --config {cfg} --set output_dir={ws}/afile",
     ["output_dir:", "afile' exists and is not a directory"]),
    ("output-dir-under-a-file", "train --config {cfg} --set output_dir={ws}/afile/run",
     ["output_dir:", "afile/run' is under", "a file"]),
    ("output-dir-read-only", "train --config {cfg} --set output_dir={ro}/run",
     ["output_dir:", "ro/run' is not writable: Read-only file system"]),
    ("output-dir-disk-full", "train --config {cfg} --set output_dir={full}",
     ["output_dir:", "is not writable: No space left on device"]),
    ("validate-output-dir-read-only", "validate --config {cfg} --set output_dir={ro}/run",
     ["output_dir:", "Read-only file system"]),
    ("eval-output-dir-is-a-file", "eval --config {cfg} --set output_dir={ws}/afile",
     ["gmeta-ds eval:", "output_dir:", "afile' exists and is not a directory"]),
    # ---- checkpoints (resume)
    ("resume-missing-dir", "validate --config {cfg} --set train.resume={ws}/nockpt",
     ["train.resume:", "nockpt' is not a complete checkpoint (no manifest.json"]),
    ("resume-without-manifest", "train --config {cfg} --set train.resume={nomanifest}",
     ["train.resume:", "is not a complete checkpoint (no manifest.json"]),
    ("resume-manifest-not-json", "train --config {cfg} --set train.resume={notjson}",
     ["manifest.json: not valid JSON"]),
    ("resume-tampered-file", "train --config {cfg} --set train.resume={tampered}",
     ["dense.safetensors: contents differ from the manifest's SHA-256"]),
    ("resume-manifest-a-list", "train --config {cfg} --set train.resume={listed}",
     ["manifest.json: expected a JSON object with a 'files' mapping", "got list"]),
    ("resume-other-model", "train --config {cfg} --set train.resume={ck} --set model.embed_dim=8",
     ["manifest.json (the run config does not match the checkpoint)", "dense_shapes"]),
    # ---- checkpoints (export)
    ("export-missing-dir", "export {ws}/nockpt {ws}/out.safetensors",
     ["gmeta-ds export:", "CHECKPOINT", "nockpt' does not exist"]),
    ("export-without-manifest", "export {nomanifest} {ws}/out.safetensors",
     ["CHECKPOINT", "is not a complete checkpoint (no manifest.json"]),
    ("export-manifest-not-json", "export {notjson} {ws}/out.safetensors", ["manifest.json: not valid JSON"]),
    ("export-manifest-a-list", "export {listed} {ws}/out.safetensors",
     ["manifest.json: expected a JSON object with a 'files' mapping"]),
    ("export-manifest-names-a-missing-table", "export {faketable} {ws}/out.safetensors",
     ["its manifest and files do not make one gmeta-ds checkpoint", "table.ghost.ids"]),
    ("export-tampered-file", "export {tampered} {ws}/out.safetensors",
     ["dense.safetensors: contents differ from the manifest's SHA-256"]),
    ("export-out-is-a-directory", "export {ck} {ws}/emptydir", ["OUT", "emptydir' is a directory"]),
    ("export-out-read-only", "export {ck} {ro}/out.safetensors",
     ["OUT's folder:", "is not writable: Read-only file system"]),
    # ---- weights
    ("weights-missing", "eval --config {cfg} --weights {ws}/nope.safetensors",
     ["weights file", "nope.safetensors does not exist"]),
    ("weights-random-bytes", "eval --config {cfg} --weights {ws}/random.safetensors",
     ["random.safetensors: not a readable safetensors file"]),
    ("weights-empty", "eval --config {cfg} --weights {ws}/empty.safetensors",
     ["empty.safetensors: not a readable safetensors file"]),
    ("weights-truncated", "eval --config {cfg} --weights {truncated}",
     ["truncated.safetensors: not a readable safetensors file"]),
    ("weights-directory", "eval --config {cfg} --weights {ws}/emptydir",
     ["emptydir is a directory, expected a .safetensors file"]),
    ("weights-other-model", "eval --config {cfg} --weights {weights} --set model.embed_dim=8",
     ["model.safetensors does not match the model built from the config", "net.embedding.weights"]),
    # ---- run directories (plot)
    ("plot-missing-dir", "plot {ws}/norun", ["RUN_DIR", "norun' does not exist"]),
    ("plot-empty-dir", "plot {ws}/emptydir", ["emptydir/metrics.jsonl: no metrics.jsonl here"]),
    ("plot-malformed-line", "plot {ws}/plot_bad", ["plot_bad/metrics.jsonl:2: not a JSON object"]),
    ("plot-record-missing-keys", "plot {ws}/plot_keys",
     ["plot_keys/metrics.jsonl:1: expected a JSON object with numbers step, query_loss"]),
]
assert len({c[0] for c in CASES}) == len(CASES)
CHECKPOINT_NAMES = ("ck", "run", "weights", "truncated", "tampered", "notjson", "listed", "nomanifest",
                    "faketable")


def _names(command: str, request) -> dict[str, str]:
    """The fixture values a command template refers to (the checkpoint and mounts only when used)."""
    names = dict(request.getfixturevalue("ws"))
    if any("{" + n + "}" in command for n in CHECKPOINT_NAMES):
        names.update(request.getfixturevalue("ckpt"))
    if "{ro}" in command or "{full}" in command:
        names.update(request.getfixturevalue("mounts"))
    return names


def assert_bad_input(proc: subprocess.CompletedProcess, words: list[str], ranks: int = 0) -> None:
    """Exit 2, no traceback, every word on stderr (with ``ranks``: in the messages of the
    launcher's output, at least that many times)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    messages = "\n".join(ln for ln in out.splitlines() if ln.startswith(("gmeta-ds ", "  - ")))
    for word in words:
        if ranks:
            assert messages.count(word) >= ranks, f"{word!r} not {ranks}x in the output:\n{out[-3000:]}"
        else:
            assert word in proc.stderr, f"{word!r} not in stderr:\n{proc.stderr[-3000:]}"


# The first case of each subcommand runs the console script as a fresh process; the others run
# the same `gmeta_ds.cli.main` on a warm rank of the test pool (tests/pool.py: its own process,
# environment and working folder restored per job, uncaught errors printed as tracebacks), which
# spares each case the interpreter's start-up and imports (~1.5 s of the ~2 s a case took).
FRESH = {next(c[0] for c in CASES if c[1].split()[0] == sub) for sub in {c[1].split()[0] for c in CASES}}


@pytest.mark.parametrize("case, command, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error(request, case, command, words):
    names = _names(command, request)
    words = [w.format(**names) for w in words]
    argv = shlex.split(command.format(**names))
    if case in FRESH:
        proc = run([str(BIN / "gmeta-ds"), *argv], expect_ok=False, timeout=180)
    else:
        proc = gmeta_ranks(1, *argv, expect_ok=False, timeout=180)
    assert_bad_input(proc, words)


RANK_CASES = [
    ("output-dir-is-a-file", "train --config {cfg} --set output_dir={ws}/afile",
     ["afile' exists and is not a directory"]),
    ("ds-refused-by-deepspeed", "train --config {cfg} --set "
     "'deepspeed={{optimizer: {{type: Adam}}, zero_optimization: {{bogus: 1}}}}'",
     ["DeepSpeed rejects the config", "bogus"]),
    ("resume-tampered-file", "train --config {cfg} --set train.resume={tampered}",
     ["contents differ from the manifest's SHA-256"]),
    ("dynamic-capacity-below-a-micro-batch", "train --config {cfg} --set embedding.sharding=sharded "
     "--set 'embedding.tables={{item_id: {{kind: dynamic, capacity: 100}}}}'",
     ["embedding.tables.item_id.capacity: 100 rows per rank, but one lookup can bring up to 240"]),
]


@pytest.mark.parametrize("command, words", [c[1:] for c in RANK_CASES], ids=[c[0] for c in RANK_CASES])
def test_bad_input_fails_the_same_on_every_rank(request, command, words):
    """Two ranks of one job (RANK / WORLD_SIZE / MASTER_* as a launcher sets them): each exits
    2 with the message on its own, so none waits in a collective for a rank that left."""
    names = _names(command, request)
    port = str(free_port())
    procs = [subprocess.Popen([str(BIN / "gmeta-ds"), *shlex.split(command.format(**names))], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **VENV_PATH, "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert_bad_input(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                             ["gmeta-ds train: ", *words])
    finally:
        for proc in procs:
            proc.kill()


def test_bad_input_under_the_deepspeed_launcher_exits_2(ws):
    """``deepspeed --num_gpus 2``: the ranks refuse a config DeepSpeed would reject (before the
    check it failed inside ``deepspeed.initialize``, after the process group was up) and the
    launcher exits 2. It ends the job when the first rank exits, so the message may come from
    one rank only; `test_bad_input_fails_the_same_on_every_rank` checks each rank."""
    bad = "deepspeed={optimizer: {type: Adam}, zero_optimization: {stage: 1, bogus: 3}}"
    cmd = deepspeed_cmd(2, str(BIN / "gmeta-ds"), "train", "--config", ws["cfg"], "--set", bad)
    proc = run(cmd, expect_ok=False, timeout=180, env=VENV_PATH)
    assert_bad_input(proc, ["gmeta-ds train: ", "DeepSpeed rejects the config", "bogus"], ranks=1)


def test_the_matrix_covers_every_command():
    assert {c[1].split()[0] for c in CASES} >= {"train", "validate", "eval", "export", "plot"}
    assert len(CASES) >= 40


@pytest.mark.parametrize("env, words", [
    ({"RANK": "zero", "WORLD_SIZE": "2"}, ["environment variable RANK='zero': expected an integer >= 0"]),
    ({"RANK": "0", "WORLD_SIZE": "-1"}, ["environment variable WORLD_SIZE='-1': expected an integer >= 1"]),
    ({"RANK": "3", "WORLD_SIZE": "2"}, ["RANK=3 and WORLD_SIZE=2: the rank must be below the world size"]),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": ""},
     ["environment variable LOCAL_WORLD_SIZE='': expected an integer >= 1"]),
], ids=["rank-not-a-number", "negative-world", "rank-outside-world", "empty-local-world"])
def test_garbage_launcher_environment_is_a_clear_error(ws, env, words):
    """What a broken launcher wrapper (or a hand-written job script) exports is named, exit 2."""
    proc = run([str(BIN / "gmeta-ds"), "train", "--config", ws["cfg"]], expect_ok=False, timeout=180,
               env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **env})
    assert_bad_input(proc, ["gmeta-ds train: ", *words])
