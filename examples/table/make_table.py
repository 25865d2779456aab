"""Write a small click log as a CSV (default) or Parquet file, for examples/table/config.yaml.

    python examples/table/make_table.py                       # examples/table/clicks.csv
    python examples/table/make_table.py --parquet             # examples/table/clicks.parquet
    python examples/table/make_table.py --users 2000 --out /tmp/big.csv

Nothing is downloaded: the rows come from a seeded latent-factor model. Each user has a latent
taste vector and a click propensity; each item a latent vector. A row is one impression with a
0/1 click. The user columns (age_group, device, region) and item columns (category, brand,
tags) are noisy functions of the latent vectors, so the features carry some signal and each
user's own support clicks carry the rest (what the inner loop adapts to).

Columns: user_id, item_id, clicked (0/1), ts (Unix seconds; a datetime column in Parquet),
age_group, device, region (user), category, brand (item), tags (item, several per cell:
"|"-separated in the CSV, a list column in Parquet). A few region cells are empty (read as
the value "unknown").
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
TAGS = [f"tag{i:02d}" for i in range(16)]


def make_log(users: int, items: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    dim = 4
    zu = rng.normal(size=(users, dim))
    zi = rng.normal(size=(items, dim))
    bias = rng.normal(scale=1.0, size=users)           # per-user propensity no feature reveals
    popularity = rng.zipf(1.3, size=items).astype(float)
    popularity /= popularity.sum()

    def bucket(values: np.ndarray, n: int, noise: float) -> np.ndarray:
        """A categorical code from a noisy projection (the feature reveals part of the latent)."""
        noisy = values + rng.normal(scale=noise, size=len(values))
        edges = np.quantile(noisy, np.linspace(0, 1, n + 1)[1:-1])
        return np.searchsorted(edges, noisy)

    user = pd.DataFrame({
        "user_id": [f"u{u:05d}" for u in range(users)],
        "age_group": [f"age{c}" for c in bucket(zu[:, 0], 5, 0.5)],
        "device": np.array(["ios", "android", "web"])[bucket(zu[:, 1], 3, 0.8)],
        "region": [f"r{c:02d}" for c in bucket(zu[:, 2] + zu[:, 3], 12, 0.5)],
    })
    user.loc[rng.random(users) < 0.03, "region"] = ""  # missing values -> "unknown"
    tag_weights = rng.normal(size=(len(TAGS), dim))
    item_tags = []
    for i in range(items):
        scores = tag_weights @ zi[i] + rng.normal(scale=1.0, size=len(TAGS))
        item_tags.append([TAGS[t] for t in np.argsort(-scores)[: int(rng.integers(1, 4))]])
    item = pd.DataFrame({
        "item_id": [f"i{i:04d}" for i in range(items)],
        "category": [f"cat{c}" for c in bucket(zi[:, 0], 8, 0.4)],
        "brand": [f"brand{c:02d}" for c in bucket(zi[:, 1] + 0.5 * zi[:, 2], 40, 0.3)],
        "tags": item_tags,
    })

    rows = []
    t0 = 1_700_000_000
    for u in range(users):
        n = int(rng.integers(15, 61))
        picked = rng.choice(items, size=n, replace=False, p=popularity)
        logits = zu[u] @ zi[picked].T / np.sqrt(dim) * 2.0 + bias[u] - 0.3
        clicks = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(int)
        times = t0 + np.sort(rng.integers(0, 30 * 86400, size=n))
        rows += [(u, i, c, t) for i, c, t in zip(picked, clicks, times)]
    log = pd.DataFrame(rows, columns=["u", "i", "clicked", "ts"])
    log = log.sample(frac=1.0, random_state=seed).reset_index(drop=True)  # rows in no particular order
    out = pd.concat([user.iloc[log["u"]].reset_index(drop=True),
                     item.iloc[log["i"]].reset_index(drop=True), log[["clicked", "ts"]]], axis=1)
    return out[["user_id", "item_id", "clicked", "ts", "age_group", "device", "region",
                "category", "brand", "tags"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="output file (default: clicks.csv or clicks.parquet "
                        "next to this script)")
    parser.add_argument("--parquet", action="store_true", help="write Parquet instead of CSV")
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.out or HERE / ("clicks.parquet" if args.parquet else "clicks.csv")
    log = make_log(args.users, args.items, args.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.parquet or out.suffix.lower() in (".parquet", ".pq"):
        log["ts"] = pd.to_datetime(log["ts"], unit="s", utc=True)  # typed: read back as Unix seconds
        log.to_parquet(out, index=False)
    else:
        log.assign(tags=log["tags"].str.join("|")).to_csv(out, index=False)
    print(f"wrote {out}: {len(log)} rows, {log['user_id'].nunique()} users, "
          f"{log['item_id'].nunique()} items, click rate {log['clicked'].mean():.2f}")


if __name__ == "__main__":
    main()
