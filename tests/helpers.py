"""Small builders shared by tests: a tiny MeLU model and random task batches."""
from __future__ import annotations

from pathlib import Path

import torch

from gmeta_ds.config import EmbeddingConfig
from gmeta_ds.data.tasks import TaskBatch
from gmeta_ds.models.melu import MeLU, build_melu
from gmeta_ds.sparse import FieldSpec

FIELDS = [FieldSpec("age", 5, "user"), FieldSpec("item_id", 11, "item"), FieldSpec("cat", 4, "item")]


def tiny_melu(embed_dim: int = 3, hidden=(5,), fields=FIELDS, seed: int = 0) -> MeLU:
    """A MeLU with its own (unsharded) tables."""
    return build_melu(fields, embed_dim, list(hidden), EmbeddingConfig(), seed)


def tiny_batch(tasks: int = 3, support: int = 6, query: int = 4, seed: int = 0,
               ragged: bool = True) -> TaskBatch:
    """Random padded batch; with ``ragged`` each task has fewer real rows than the padding."""
    g = torch.Generator().manual_seed(seed)

    def part(rows: int):
        ids = torch.stack([torch.randint(0, f.num_ids, (tasks, rows), generator=g) for f in FIELDS], -1)
        y = torch.randint(0, 2, (tasks, rows), generator=g).float()
        mask = torch.ones(tasks, rows)
        if ragged:
            for t in range(tasks):  # task t keeps rows - t real rows (at least one)
                mask[t, max(1, rows - t):] = 0.0
        return ids, y, mask

    s, q = part(support), part(query)
    return TaskBatch(*s, *q, torch.arange(tasks))


ML100K_GENRE_COUNT = 19


def write_ml100k(folder, users: int = 60, items: int = 80, seed: int = 0, min_len: int = 15,
                 max_len: int = 40) -> None:
    """A small ml-100k-format folder (u.data, u.user, u.item; tab / '|' separated, latin-1)
    with ratings from a latent-factor model, so there is something to learn."""
    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    zu, zi = rng.normal(size=(users, 3)), rng.normal(size=(items, 3))
    lines, t = [], 880_000_000
    for u in range(users):
        picked = rng.choice(items, size=int(rng.integers(min_len, max_len + 1)), replace=False)
        for i in picked:
            score = zu[u] @ zi[i] + rng.normal(scale=0.5)
            rating = int(np.clip(np.round(3 + score), 1, 5))
            t += int(rng.integers(1, 1000))
            lines.append(f"{u + 1}\t{i + 1}\t{rating}\t{t}")
    (folder / "u.data").write_text("\n".join(lines) + "\n", encoding="latin-1")
    occupations = ["engineer", "student", "writer", "artist"]
    (folder / "u.user").write_text("".join(
        f"{u + 1}|{int(rng.integers(18, 60))}|{'MF'[u % 2]}|{occupations[u % 4]}|{10000 + 37 * u}\n"
        for u in range(users)), encoding="latin-1")
    item_lines = []
    for i in range(items):
        flags = (rng.random(ML100K_GENRE_COUNT) < 0.15).astype(int)
        date = "" if i == 3 else f"01-Jan-{1990 + i % 9}"
        title = "Café Society (1996)" if i == 0 else f"Movie {i + 1} ({1990 + i % 9})"
        item_lines.append(f"{i + 1}|{title}|{date}||http://x|" + "|".join(map(str, flags)))
    (folder / "u.item").write_text("\n".join(item_lines) + "\n", encoding="latin-1")


def click_log(users: int = 40, seed: int = 0, items: int = 30):
    """A small click log (user, item, age, multi-hot tags, click) as a pandas DataFrame."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []
    for u in range(users):
        for i in rng.choice(items, size=16, replace=False):
            tags = "|".join(f"t{t}" for t in rng.choice(5, size=2, replace=False))
            rows.append((f"u{u}", f"i{i}", f"a{u % 3}", tags, float(rng.random() < 0.4)))
    return pd.DataFrame(rows, columns=["user", "item", "age", "tags", "click"])


def wait_ready(proc, url: str, log, wait_s: float = 90) -> None:
    """Wait until the `gmeta-ds serve` process ``proc`` answers ``url``/v2/health/ready (its
    output goes to the file ``log``, shown when it exits or is not ready within ``wait_s``)."""
    import time

    import httpx

    deadline = time.monotonic() + wait_s
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server not ready in time: " + log.read_text()
        time.sleep(0.2)


def demo_export(root) -> Path:
    """The demo config's model (examples/synthetic/config.yaml, untrained, 200 synthetic users),
    exported under ``root`` as `gmeta-ds export --config` does: what a documented request or
    the container's entry point serves (its fields and model name), in seconds."""
    from gmeta_ds.config.run import load_config
    from gmeta_ds.engine.ds_engine import save_weights
    from gmeta_ds.serving.recipe import export_run
    from gmeta_ds.workloads.ctr import build_data, build_learner

    root = Path(root)
    config = Path(__file__).resolve().parents[1] / "examples" / "synthetic" / "config.yaml"
    cfg = load_config(config, ["data.synthetic.num_users=200", f"data.cache_dir={root / 'cache'}"])
    learner = build_learner(cfg, build_data(cfg).fields)
    return export_run(cfg, save_weights(learner.state_dict(), root / "weights.safetensors"), root / "export")


def stop_process(proc) -> None:
    """Stop a server process started by a test: SIGTERM, then SIGKILL if it is not gone in 20 s."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)
