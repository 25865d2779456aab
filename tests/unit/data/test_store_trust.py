"""Issue 32: a task store is trusted only after its files pass their build-time checksums and
value checks, its manifest names only files inside it, the cache key sees the log's content,
and a wait on another process's build is bounded and names the builder."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gmeta_ds.config import DataConfig, SchemaConfig
from gmeta_ds.data import store_check, store_lock
from gmeta_ds.data.builder import build_tasks, cache_key, store_path
from gmeta_ds.data.readers import DataError
from gmeta_ds.data.store_check import HASH, content_fingerprint, file_digest
from gmeta_ds.data.store_lock import build_lock
from gmeta_ds.data.stream import open_store

SCHEMA = {"task_key": "user", "item_key": "item", "label": "rating", "user_features": ["age"],
          "item_features": [], "multi_hot": {"tags": "|"}}


def write_log(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    user = np.repeat(np.arange(24), 10)
    n = len(user)
    pd.DataFrame({"user": [f"u{u}" for u in user], "item": rng.integers(0, 30, n),
                  "rating": rng.integers(1, 6, n), "age": rng.choice(["a", "b"], n),
                  "tags": ["|".join(rng.choice(list("pqr"), 2)) for _ in range(n)]}).to_csv(path, index=False)


def config(path: Path, cache: Path, **kw) -> DataConfig:
    base = {"source": "table", "path": str(path), "cache_dir": str(cache), "schema": SchemaConfig(**SCHEMA),
            "min_interactions": 5, "max_interactions": 50, "query_size": 3, "test_fraction": 0.25}
    return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One tiny store, built once; each test tampers with its own copy."""
    root = tmp_path_factory.mktemp("store")
    write_log(root / "log.csv")
    cfg = config(root / "log.csv", root / "cache")
    build_tasks(cfg, seed=0)
    return store_path(cfg, 0)


@pytest.fixture
def store(built, tmp_path) -> Path:
    copy = tmp_path / built.name
    shutil.copytree(built, copy)
    return copy


def manifest(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())


def rewrite(store: Path, m: dict) -> None:
    (store / "manifest.json").write_text(json.dumps(m))


def test_a_verified_store_opens(store):
    data = open_store(store)
    assert data.train.num_interactions > 0 and set(np.unique(np.asarray(data.train.labels))) <= {0.0, 1.0}


def test_a_flipped_label_is_refused_naming_the_file(store):
    labels = store / manifest(store)["splits"]["train"]["labels"]["file"]
    y = np.fromfile(labels, np.float32)
    y[3] = 1.0 - y[3]  # still a valid label: only the checksum sees it
    y.tofile(labels)
    with pytest.raises(DataError, match=rf"{labels.name}: its content does not match the checksum"):
        open_store(store)


def test_pickle_bytes_in_an_array_are_refused(store):
    import pickle

    ids = store / manifest(store)["splits"]["test"]["ids"]["file"]
    raw = bytearray(ids.read_bytes())
    payload = pickle.dumps(["not", "ids"])
    raw[:len(payload)] = payload
    ids.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=ids.name):
        open_store(store)


def retamper(store: Path, split: str, key: str, change) -> Path:
    """Change an array and record its new checksum too (a consistent edit: the value checks
    must catch it)."""
    m = manifest(store)
    entry = m["splits"][split][key]
    path = store / entry["file"]
    a = np.fromfile(path, np.dtype(entry["dtype"])).reshape(entry["shape"])
    change(a, m)
    a.tofile(path)
    entry[HASH] = file_digest(path)
    rewrite(store, m)
    return path


def test_out_of_range_ids_are_refused_even_with_a_matching_checksum(store):
    def big_id(a, m):
        a[5, 0] = m["fields"][0]["num_ids"]
    path = retamper(store, "train", "ids", big_id)
    with pytest.raises(DataError, match=rf"{path.name}: row 5: id \d+ of field 'age' is outside \[0, \d+\)"):
        open_store(store)


def test_a_label_outside_binary_is_refused(store):
    def two(a, m):
        a[7] = 2.0
    path = retamper(store, "test", "labels", two)
    with pytest.raises(DataError, match=rf"{path.name}: row 7: label 2.0 is not 0 or 1"):
        open_store(store)


def test_bag_values_out_of_range_are_refused(store):
    def negative(a, m):
        a[0] = -1
    path = retamper(store, "train", "multi.tags.values", negative)
    with pytest.raises(DataError, match=rf"{path.name}: row 0: id -1 of field 'tags'"):
        open_store(store)


@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "sub/ids.bin", "link.bin", "fifo.bin"])
def test_manifest_names_only_plain_files_inside_the_store(store, name):
    m = manifest(store)
    real = store / m["splits"]["train"]["ids"]["file"]
    if name == "link.bin":
        (store / name).symlink_to(real)
    if name == "fifo.bin":
        os.mkfifo(store / name)  # opening it would block
    m["splits"]["train"]["ids"]["file"] = name
    rewrite(store, m)
    with pytest.raises(DataError, match=r"splits\.train\.ids: names .* must be a plain file directly inside"):
        open_store(store)


@pytest.mark.parametrize("change, words", [
    (lambda m: m["splits"]["train"]["labels"].update(dtype="|O"), "dtype '|O' in manifest.json, expected '<f4'"),
    (lambda m: m["splits"]["train"]["ids"].update(shape=[3, 1]), r"shape \[3, 1\] in manifest.json, expected"),
    (lambda m: m["splits"]["train"].pop("task_keys"), r"splits.train: lists .*, expected"),
    (lambda m: m["fields"][0].update(num_ids="9"), r"fields\[0\] is"),
    (lambda m: m.update(label="multiclass"), "'label' is 'multiclass'"),
])
def test_a_damaged_manifest_is_a_data_error(store, change, words):
    m = manifest(store)
    change(m)
    rewrite(store, m)
    with pytest.raises(DataError, match=words):
        open_store(store)


def test_bad_task_offsets_are_refused(store):
    def swap(a, m):
        a[1], a[2] = a[2], a[1]
    path = retamper(store, "train", "offsets", swap)
    with pytest.raises(DataError, match=rf"{path.name}: task offsets must rise"):
        open_store(store)


def test_a_store_of_the_old_version_is_rebuilt(tmp_path):
    write_log(tmp_path / "log.csv")
    cfg = config(tmp_path / "log.csv", tmp_path / "cache")
    build_tasks(cfg, seed=0)
    store = store_path(cfg, 0)
    m = manifest(store)
    m["version"] = 1
    for entries in m["splits"].values():
        for entry in entries.values():
            entry.pop(HASH)
    rewrite(store, m)
    data = build_tasks(cfg, seed=0)
    assert "cache" not in data.stats  # built again, not reused
    from gmeta_ds.data.stream import STORE_VERSION

    assert manifest(store)["version"] == STORE_VERSION == 3 and HASH in manifest(store)["splits"]["train"]["ids"]
    assert set(manifest(store)["vocab"]) == {f.name for f in data.fields if not f.raw}  # version 3: vocabularies


# ---------------------------------------------------------------- the cache key
def test_changed_content_with_size_and_mtime_restored_is_a_cache_miss(tmp_path):
    log = tmp_path / "log.csv"
    write_log(log)
    cfg = config(log, tmp_path / "cache")
    first = build_tasks(cfg, seed=0)
    key = cache_key(cfg, 0)
    assert cache_key(cfg, 0) == key  # stable for an unchanged log
    st = log.stat()
    text = log.read_text().splitlines()
    head = text[0].split(",")
    flipped = 0
    for n in range(1, len(text)):  # ratings 1 <-> 5: same size, other labels
        cells = text[n].split(",")
        r = head.index("rating")
        if cells[r] in ("1", "5"):
            cells[r] = "5" if cells[r] == "1" else "1"
            text[n], flipped = ",".join(cells), flipped + 1
    log.write_text("\n".join(text) + "\n")
    os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert flipped and log.stat().st_size == st.st_size and log.stat().st_mtime_ns == st.st_mtime_ns
    assert cache_key(cfg, 0) != key
    again = build_tasks(cfg, seed=0)
    assert "cache" not in again.stats  # rebuilt from the new content, not the stale store
    assert not np.array_equal(np.asarray(first.train.labels), np.asarray(again.train.labels))


def test_a_huge_log_is_fingerprinted_by_samples_and_the_parquet_footer(tmp_path, monkeypatch):
    monkeypatch.setattr(store_check, "FULL_HASH_BYTES", 1024)
    monkeypatch.setattr(store_check, "SAMPLE_BYTES", 64)
    path = tmp_path / "big.parquet"
    write_log(tmp_path / "log.csv")
    pd.read_csv(tmp_path / "log.csv").to_parquet(path)
    data = bytearray(path.read_bytes())
    base = content_fingerprint(path)
    assert content_fingerprint(path) == base
    footer = int.from_bytes(data[-8:-4], "little")
    for at in (10, len(data) - 8 - footer // 2):  # the first block; the footer (beyond the last block)
        changed = bytearray(data)
        changed[at] ^= 0xFF
        path.write_bytes(bytes(changed))
        assert content_fingerprint(path) != base, at


# ---------------------------------------------------------------- the build lock
HOLDER = """
import sys, time
from pathlib import Path
from gmeta_ds.data.store_lock import build_lock
with build_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_a_stopped_builder_makes_the_waiter_fail_within_the_timeout_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(store_lock, "HEARTBEAT_S", 0.2)  # this waiter allows 0.6 s at least
    store = tmp_path / "tasks-x"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(store)], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 60)
        assert ready and holder.stdout.readline().strip() == "locked"
        os.kill(holder.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(DataError) as err, build_lock(store, stall_s=1.0):
            pass
        waited = time.monotonic() - start
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=30)
    assert waited < 1.0 + 4.0
    message = str(err.value)
    assert f"pid {holder.pid} on host" in message and "now stopped" in message
    assert "train.collective_timeout_s" in message and "delete" in message
    told = capsys.readouterr().err
    assert told.count("gmeta_ds: waiting for the task store tasks-x") == 1 and f"pid {holder.pid}" in told


def test_a_live_builder_is_waited_for_past_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(store_lock, "HEARTBEAT_S", 0.2)
    store = tmp_path / "tasks-y"
    locked, done = threading.Event(), []

    def build():
        with build_lock(store):
            locked.set()
            time.sleep(2.0)  # twice the waiter's bound, beating all along
            done.append(True)
    t = threading.Thread(target=build)
    t.start()
    try:
        assert locked.wait(30)
        with build_lock(store, stall_s=1.0):
            assert done == [True]
    finally:
        t.join(30)
    assert (store.parent / "tasks-y.lock").read_bytes() == b""  # the holder record is cleared on release


def test_a_run_bounds_the_wait_by_its_collective_timeout(tmp_path, monkeypatch):
    from gmeta_ds.config import config_from_dict
    from gmeta_ds.workloads import ctr

    write_log(tmp_path / "log.csv")
    cfg = config_from_dict({"data": {"source": "table", "path": str(tmp_path / "log.csv"), "schema": SCHEMA,
                                     "cache_dir": str(tmp_path / "cache")},
                            "train": {"collective_timeout_s": 77}})
    seen = []
    monkeypatch.setattr(ctr, "build_tasks", lambda data, seed, timeout_s=None: seen.append(timeout_s))
    ctr.build_data(cfg)
    assert seen == [77]
