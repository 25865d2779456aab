"""Checkpoint trust (issue 32): what a checkpoint's ``manifest.json`` and ``latest`` may name,
checked before any file is hashed, and a conversion subprocess that imports nothing from the
working directory. Hand-made checkpoint directories (fake files, a real manifest): no training.

Every refusal is a `ConfigError` naming the file and the key, and leaves every file as it was."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

from gmeta_ds import checkpoint
from gmeta_ds.cli import main
from gmeta_ds.errors import ConfigError

TAG = "step_00000002"


def _manifest(ckpt: Path, world: int = 1, sizes: bool = True) -> dict:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != checkpoint.MANIFEST)
    manifest = {"format": checkpoint.FORMAT_VERSION, "step": 2, "world_size": world,
                "loader": {"next_step": 2, "seed": 3, "tasks": 64},
                "tables": {"item": [50, 4], "user": ["dynamic", 4]}, "fields": ["user", "item"],
                "algorithm": "maml", "dense_shapes": {"net.w": [8, 4], "net.b": [8]},
                "files": {p.relative_to(ckpt).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                          for p in files}}
    if sizes:
        manifest["sizes"] = {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in files}
    return manifest


def _write(ckpt: Path, manifest: dict) -> None:
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """OUTPUT_DIR with checkpoints/latest -> step_00000002 holding fake files of one rank."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints" / TAG
    ckpt.mkdir(parents=True)
    for name, size in (("dense.safetensors", 300), ("rank00000.safetensors", 500),
                       ("mp_rank_00_model_states.pt", 200)):
        (ckpt / name).write_bytes(os.urandom(size))
    _write(ckpt, _manifest(ckpt))
    (out / "checkpoints" / "latest").write_text(TAG + "\n")
    return out


def _snapshot(root: Path) -> dict:
    """Every entry under ``root``: file bytes (size and times of huge sparse ones), link
    targets, folders."""
    seen = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            seen[path] = ("link", os.readlink(path))
        elif path.is_file():
            info = path.stat()
            seen[path] = path.read_bytes() if info.st_size < 1 << 20 else (info.st_size, info.st_mtime_ns)
        else:
            seen[path] = "dir"
    return seen


@pytest.fixture
def no_hashing(monkeypatch):
    """Fail the test if any file is hashed (the refusal must come first)."""
    hashed = []
    monkeypatch.setattr(checkpoint.manifest, "sha256", lambda path: hashed.append(path) or "0" * 64)
    return hashed


def _refused(ckpt: Path, *words: str) -> str:
    before = _snapshot(ckpt.parent.parent)
    with pytest.raises(ConfigError) as err:
        checkpoint.read_manifest(ckpt)
    text = str(err.value)
    for word in words:
        assert word in text, (word, text)
    assert _snapshot(ckpt.parent.parent) == before
    return text


def test_an_intact_checkpoint_reads_and_a_manifest_without_sizes_still_verifies(run_dir):
    ckpt = run_dir / "checkpoints" / TAG
    assert checkpoint.find("auto", run_dir) == ckpt
    assert checkpoint.read_manifest(ckpt)["step"] == 2
    old = _manifest(ckpt, sizes=False)  # written before sizes were recorded
    _write(ckpt, old)
    assert checkpoint.read_manifest(ckpt)["files"] == old["files"]


# (what is changed in the manifest, the words of the refusal besides the manifest's path)
BAD_KEYS = [
    ({"step": -3}, ["key 'step'", "an integer >= 0", "-3"]),
    ({"step": "2"}, ["key 'step'", "an integer >= 0"]),
    ({"step": 2.5}, ["key 'step'"]),
    ({"step": True}, ["key 'step'"]),
    ({"step": None}, ["key 'step'"]),
    ({"world_size": "2"}, ["key 'world_size'", "an integer >= 1"]),
    ({"world_size": 0}, ["key 'world_size'"]),
    ({"world_size": 10**12}, ["key 'world_size'", "<= 1048576", "1000000000000"]),
    ({"loader": [1]}, ["key 'loader'"]),
    ({"loader": {"next_step": -1}}, ["key 'loader'"]),
    ({"loader": {"next_step": 2, "seed": "x"}}, ["key 'loader'"]),
    ({"algorithm": 7}, ["key 'algorithm'", "a string"]),
    ({"fields": "user"}, ["key 'fields'", "a list of strings"]),
    ({"fields": [1, 2]}, ["key 'fields'"]),
    ({"tables": [["item", 50, 4]]}, ["key 'tables'", "an object"]),
    ({"tables": {"item": [50]}}, ["key 'tables.item'", "[rows"]),
    ({"tables": {"item": [-50, 4]}}, ["key 'tables.item'"]),
    ({"tables": {"item": ["static", 4]}}, ["key 'tables.item'"]),
    ({"tables": {"item": [50, 1e3]}}, ["key 'tables.item'"]),
    ({"tables": {"item": "50x4"}}, ["key 'tables.item'"]),
    ({"dense_shapes": {"net.w": [8, -4]}}, ["key 'dense_shapes.net.w'", "an integer >= 0"]),
    ({"dense_shapes": {"net.w": "8x4"}}, ["key 'dense_shapes.net.w'"]),
    ({"dense_shapes": [8, 4]}, ["key 'dense_shapes'"]),
    ({"files": ["dense.safetensors"]}, ["key 'files'", "expected an object"]),
    ({"format": 99}, ["format 99, expected 1"]),
    ({"sizes": {"dense.safetensors": 300}}, ["key 'sizes'", "for each file of 'files'"]),
    ({"sizes": "300"}, ["key 'sizes'"]),
]


@pytest.mark.parametrize("change, words", BAD_KEYS, ids=[json.dumps(c)[:40] for c, _ in BAD_KEYS])
def test_a_bad_key_is_a_clear_error_before_any_file_is_hashed(run_dir, no_hashing, change, words):
    ckpt = run_dir / "checkpoints" / TAG
    _write(ckpt, {**_manifest(ckpt), **change})
    _refused(ckpt, str(ckpt / "manifest.json"), *words)
    assert no_hashing == []


@pytest.mark.parametrize("key", ["step", "world_size", "loader", "tables", "fields", "algorithm",
                                 "dense_shapes", "files"])
def test_a_missing_key_is_named(run_dir, no_hashing, key):
    ckpt = run_dir / "checkpoints" / TAG
    manifest = _manifest(ckpt)
    del manifest[key]
    _write(ckpt, manifest)
    _refused(ckpt, str(ckpt / "manifest.json"), f"key '{key}'", "missing")
    assert no_hashing == []


@pytest.mark.parametrize("name", ["/etc/passwd", "../../outside.bin", "../step_00000001/dense.safetensors",
                                  "./dense.safetensors", "sub//x", "", "manifest.json"])
def test_a_file_outside_the_checkpoint_is_refused_unread(run_dir, no_hashing, name):
    """Listed files may only be the checkpoint's own: a manifest naming /etc/passwd or a
    ``..`` path is refused before anything is opened."""
    ckpt = run_dir / "checkpoints" / TAG
    (run_dir / "outside.bin").write_bytes(b"secret")
    manifest = _manifest(ckpt)
    manifest["files"][name] = hashlib.sha256(b"secret").hexdigest()
    manifest["sizes"][name] = 6
    _write(ckpt, manifest)
    _refused(ckpt, str(ckpt / "manifest.json"), f"key 'files': {name!r} is not a file inside {ckpt}")
    assert no_hashing == []


def test_a_symbolic_link_in_the_checkpoint_is_refused_even_with_matching_hashes(run_dir, no_hashing):
    ckpt = run_dir / "checkpoints" / TAG
    outside = run_dir / "elsewhere.safetensors"
    outside.write_bytes((ckpt / "dense.safetensors").read_bytes())
    (ckpt / "dense.safetensors").unlink()
    (ckpt / "dense.safetensors").symlink_to(outside)  # same bytes: the manifest's hash matches
    _refused(ckpt, str(ckpt / "dense.safetensors"), "a symbolic link")
    (ckpt / "dense.safetensors").unlink()
    (ckpt / "dense.safetensors").write_bytes(outside.read_bytes())
    (run_dir / "linked").mkdir()
    (ckpt / "sub").symlink_to(run_dir / "linked", target_is_directory=True)
    _refused(ckpt, str(ckpt / "sub"), "a symbolic link")
    assert no_hashing == []


def test_sizes_are_checked_before_hashing_a_huge_file(run_dir, no_hashing):
    """A 300 GB (sparse) file in place of a listed one: refused by its size at once, never
    hashed; an unlisted huge file is refused unread too."""
    ckpt = run_dir / "checkpoints" / TAG
    big = ckpt / "rank00000.safetensors"
    os.truncate(big, 300 << 30)
    start = time.perf_counter()
    _refused(ckpt, str(big), "322122547200 bytes, the manifest's 'sizes' records 500")
    os.truncate(big, 0)
    big.write_bytes(b"\0" * 500)
    extra = ckpt / "huge.bin"
    extra.touch()
    os.truncate(extra, 300 << 30)
    _refused(ckpt, str(extra), "not part of the checkpoint (not in the manifest)")
    assert time.perf_counter() - start < 10 and no_hashing == []


@pytest.mark.parametrize("name", ["huge.bin", "rank00000.safetensors.bak", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                  "sub/mp_rank_00_model_states.pt", "latest"])
def test_a_planted_file_listed_with_its_size_is_refused_by_name_unread(run_dir, no_hashing, name):
    """A file a save never writes (or a rank's file beyond the world size), listed in the
    manifest with its true size: refused by its name before any byte is hashed, even 300 GB."""
    ckpt = run_dir / "checkpoints" / TAG
    manifest = _manifest(ckpt)
    planted = ckpt / name
    planted.parent.mkdir(exist_ok=True)
    planted.touch()
    os.truncate(planted, 300 << 30)  # sparse: instant, no disk used
    manifest["files"][name], manifest["sizes"][name] = "0" * 64, 300 << 30
    _write(ckpt, manifest)
    start = time.perf_counter()
    _refused(ckpt, str(planted), "not a file a checkpoint of world_size=1 writes", "refused unread")
    assert time.perf_counter() - start < 5 and no_hashing == []


@pytest.mark.parametrize("name", ["dense.safetensors", "rank00000.safetensors", "mp_rank_00_model_states.pt"])
def test_a_listed_file_larger_than_a_save_of_the_model_writes_is_refused_unread(run_dir, no_hashing, name):
    """A real file name grown to 300 GB with the manifest's sizes to match: refused by the
    model's bound (tables, dense shapes, dynamic capacities) before any byte is hashed."""
    ckpt = run_dir / "checkpoints" / TAG
    manifest = _manifest(ckpt) | {"capacities": {"user": 100}}
    os.truncate(ckpt / name, 300 << 30)
    manifest["sizes"][name] = 300 << 30
    _write(ckpt, manifest)
    start = time.perf_counter()
    _refused(ckpt, str(ckpt / name), "322122547200 bytes, more than a save of this model writes there")
    assert time.perf_counter() - start < 5 and no_hashing == []


def test_the_bound_follows_the_loading_model_not_the_manifests_claims(run_dir, no_hashing):
    """A manifest that claims a model big enough for its planted bytes is refused when the
    loading run's model (``meta``) is smaller: the match is checked before the sizes."""
    ckpt = run_dir / "checkpoints" / TAG
    meta = {k: _manifest(ckpt)[k] for k in ("tables", "fields", "algorithm", "dense_shapes")}
    manifest = _manifest(ckpt) | {"dense_shapes": {"net.w": [10**6, 10**6], "net.b": [8]}}
    os.truncate(ckpt / "dense.safetensors", 300 << 30)
    manifest["sizes"]["dense.safetensors"] = 300 << 30
    _write(ckpt, manifest)
    with pytest.raises(ConfigError, match=r"dense_shapes: checkpoint has .*1000000.*the config builds"):
        checkpoint.read_manifest(ckpt, meta)
    manifest["dense_shapes"] = meta["dense_shapes"]
    _write(ckpt, manifest)
    with pytest.raises(ConfigError, match="more than a save of this model writes"):
        checkpoint.read_manifest(ckpt, meta)
    assert no_hashing == []


def test_the_file_list_is_the_expected_set(run_dir, no_hashing):
    ckpt = run_dir / "checkpoints" / TAG
    manifest = _manifest(ckpt, world=2)  # a world of 2 needs rank00001.safetensors
    _write(ckpt, manifest)
    _refused(ckpt, "key 'files' lacks 1 of the files a checkpoint of world_size=2 holds: "
                   "rank00001.safetensors")
    (ckpt / "rank00003.safetensors").write_bytes(b"x")
    _write(ckpt, _manifest(ckpt, world=1))
    _refused(ckpt, "key 'files.rank00003.safetensors': a rank file beyond world_size=1")
    (ckpt / "rank00003.safetensors").unlink()
    manifest = _manifest(ckpt)
    manifest["files"]["dense.safetensors"] = "not a digest"
    _write(ckpt, manifest)
    _refused(ckpt, "key 'files.dense.safetensors': expected a SHA-256")
    manifest = _manifest(ckpt)
    (ckpt / "dense.safetensors").unlink()
    _write(ckpt, manifest)
    _refused(ckpt, str(ckpt / "dense.safetensors"), "listed in the manifest but missing")
    assert no_hashing == []


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"[" * 100_000, b"{" + b'"a": 1, ' * 3 + b"}",
                                     b'{"format": 1, "files": {}, "step": ' + b"9" * 5000 + b"}"])
def test_a_manifest_that_is_not_json_is_a_clear_error(run_dir, content):
    ckpt = run_dir / "checkpoints" / TAG
    (ckpt / "manifest.json").write_bytes(content)
    _refused(ckpt, str(ckpt / "manifest.json"), "not valid JSON")


def test_a_linked_manifest_is_refused(run_dir):
    ckpt = run_dir / "checkpoints" / TAG
    (ckpt / "manifest.json").rename(run_dir / "m.json")
    (ckpt / "manifest.json").symlink_to(run_dir / "m.json")
    _refused(ckpt, str(ckpt / "manifest.json"), "a symbolic link or not a regular file")


@pytest.mark.parametrize("content", [b"../step_00000002", b"/etc", b"step_00000002/../../..", b"",
                                     b"\n", b"\xff\xfe\xfd", b"step_2", b"latest", b"step_00000002 x"])
def test_latest_names_only_a_step_directory_of_its_folder(run_dir, content):
    latest = run_dir / "checkpoints" / "latest"
    latest.write_bytes(content)
    before = _snapshot(run_dir)
    for resume in ("auto", str(run_dir / "checkpoints")):
        with pytest.raises(ConfigError) as err:
            checkpoint.find(resume, run_dir)
        text = str(err.value)
        assert str(latest) in text and "expected one line naming a step_* directory" in text
    assert _snapshot(run_dir) == before


def test_latest_may_not_be_or_name_a_link(run_dir, tmp_path):
    root = run_dir / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").symlink_to(root / TAG)
    with pytest.raises(ConfigError, match="latest: a symbolic link or not a regular file"):
        checkpoint.find("auto", run_dir)
    (root / "latest").unlink()
    (root / "latest").mkdir()  # not a file: never taken for "no checkpoint" (a fresh start)
    with pytest.raises(ConfigError, match="latest: a symbolic link or not a regular file"):
        checkpoint.find("auto", run_dir)
    (root / "latest").rmdir()
    (root / "latest").write_text("step_00000009\n")
    (root / "step_00000009").symlink_to(root / TAG, target_is_directory=True)
    with pytest.raises(ConfigError, match="a symbolic link"):
        checkpoint.find("auto", run_dir)


def test_hashes_are_reused_only_for_unchanged_files(run_dir, monkeypatch):
    """The CLI checks a checkpoint before the process group starts and again after: the second
    check hashes nothing, unless a file changed (same size, same mtime: the ctime tells)."""
    ckpt = run_dir / "checkpoints" / TAG
    checkpoint.read_manifest(ckpt)
    real, hashed = checkpoint.sha256, []
    monkeypatch.setattr(checkpoint.manifest, "sha256", lambda path: hashed.append(path.name) or real(path))
    checkpoint.read_manifest(ckpt)
    assert hashed == []
    dense = ckpt / "dense.safetensors"
    info = dense.stat()
    time.sleep(0.01)
    dense.write_bytes(bytes(b ^ 1 for b in dense.read_bytes()))
    os.utime(dense, ns=(info.st_atime_ns, info.st_mtime_ns))
    with pytest.raises(ConfigError, match="dense.safetensors: contents differ from the manifest's SHA-256"):
        checkpoint.read_manifest(ckpt)
    assert hashed == ["dense.safetensors"]


def test_export_of_a_forged_manifest_is_exit_2_and_writes_nothing(run_dir, tmp_path, capsys):
    ckpt = run_dir / "checkpoints" / TAG
    manifest = _manifest(ckpt)
    manifest["files"]["../../../../../../etc/passwd"] = "0" * 64
    _write(ckpt, manifest)
    before = _snapshot(run_dir)
    assert main(["export", str(run_dir / "checkpoints"), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gmeta-ds export:")
    assert "key 'files': '../../../../../../etc/passwd' is not a file inside" in err
    assert "Traceback" not in err and not (tmp_path / "out.safetensors").exists()
    assert _snapshot(run_dir) == before


# ---------------------------------------------------------------- the conversion subprocess
PLANTED = "from pathlib import Path\nPath({marker!r}).write_text('ran')\n"


def _plant(folder: Path, marker: Path) -> None:
    """A ``deepspeed`` package that writes ``marker`` when imported (the converter module too,
    as the variant that would hand over to the real DeepSpeed and exit 0)."""
    (folder / "deepspeed" / "checkpoint").mkdir(parents=True)
    for name in ("deepspeed/__init__.py", "deepspeed/checkpoint/__init__.py",
                 "deepspeed/checkpoint/ds_to_universal.py"):
        (folder / name).write_text(PLANTED.format(marker=str(marker)))


def test_the_conversion_imports_nothing_from_the_working_directory(run_dir, tmp_path, monkeypatch):
    """Resuming at another world size runs DeepSpeed's converter as a subprocess: a planted
    ``deepspeed/`` in the directory the run was started from never runs; the real converter
    does (here it refuses the fake checkpoint, which has no ZeRO optimizer files)."""
    planted, marker = tmp_path / "shared_run_folder", tmp_path / "MARKER"
    _plant(planted, marker)
    monkeypatch.chdir(planted)
    # relative entries of PYTHONPATH ('.', and '' at the end) would also name the working directory
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([".", os.environ.get("PYTHONPATH", "")]))
    ckpt = Path("..") / "run" / "checkpoints" / TAG  # relative, as a user may give it
    with pytest.raises(ConfigError) as err:
        checkpoint.to_universal(ckpt, os.path.relpath(run_dir), {"world_size": 2, "step": 2})
    assert not marker.exists()
    assert "converting it to a universal checkpoint" in str(err.value)
    assert "optim_states" in str(err.value)  # the real ds_to_universal looked at the checkpoint
    assert not (run_dir / "checkpoints" / "universal").exists() or not any(
        (run_dir / "checkpoints" / "universal").iterdir())


def test_a_conversion_is_killed_at_its_bound(tmp_path, monkeypatch):
    """Rank 0 gives the converter less than the collective timeout the other ranks wait with."""
    from gmeta_ds.engine import ds_internals

    script, pid_file = tmp_path / "slow.py", tmp_path / "worker.pid"
    script.write_text("import subprocess, sys, time\n"
                      "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
                      "time.sleep(60)\n")
    monkeypatch.setattr(ds_internals, "universal_conversion_command", lambda src, dst: [
        sys.executable, str(script)])
    start = time.perf_counter()
    why = checkpoint.convert_to_universal(tmp_path, tmp_path / "out", 3.0, 20)
    assert time.perf_counter() - start < 15
    assert why == ("DeepSpeed's universal checkpoint converter did not finish within 3 s, what "
                   "train.collective_timeout_s=20 s leaves while the other ranks wait; raise it")
    worker = Path(f"/proc/{pid_file.read_text()}/status")
    deadline = time.monotonic() + 10
    while worker.exists() and "State:\tZ" not in worker.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)  # the converter's own workers are killed with it
    assert not worker.exists() or "State:\tZ" in worker.read_text()
