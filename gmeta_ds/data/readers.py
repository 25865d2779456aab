"""Readers: interaction logs as users have them on disk -> one common `InteractionLog`.

Every reader returns one row per interaction, in file order, with the task key (user id),
item id, label, timestamp and every user and item feature joined in. Column types: ids and
categorical features are strings (vocabularies are built later; a missing value becomes
``MISSING``), multi-hot features are lists of strings, the label and dense features are float32
(labels are *not* thresholded here), timestamps are int64 (Unix seconds).

Bad data raises `DataError` naming the file, the line (row, or column) and what was expected.

Example::

    log = read_movielens_100k("data/ml-100k")
    log.frame[0]  # {'user_id': '196', 'item_id': '242', 'rating': 3.0, 'timestamp': 881250949,
                  #  'age': '49', 'gender': 'M', 'occupation': 'writer', 'zip3': '551',
                  #  'release_year': '1997', 'genres': ['Comedy']}
"""
from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from gmeta_ds.data.vocab import MISSING
from gmeta_ds.errors import DataError
from gmeta_ds.files import data_file_problem, not_a_file
from gmeta_ds.registry import DATA_SOURCES

# The 19 0/1 flags ending each u.item line follow this order (that of ml-100k's u.genre).
ML100K_GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
                 "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
                 "Romance", "Sci-Fi", "Thriller", "War", "Western")
RATING_FIELDS = ["user_id", "item_id", "rating", "timestamp"]
RECBOLE_TYPES = ("token", "token_seq", "float", "float_seq")
if TYPE_CHECKING:
    import datasets  # imported where a log is built (`_to_log`): 1-2 s a process without logs skips


@dataclass
class LogSchema:
    """Which column plays which role in an `InteractionLog` (see the module docstring).
    ``release_year`` may also be listed in ``item_features``; no other column has two roles."""

    task_key: str
    item_key: str
    label: str
    timestamp: str | None = None
    user_features: list[str] = field(default_factory=list)
    item_features: list[str] = field(default_factory=list)
    multi_hot: dict[str, str] = field(default_factory=dict)
    dense: list[str] = field(default_factory=list)
    release_year: str | None = None

    def __post_init__(self) -> None:
        roles = [self.task_key, self.item_key, self.label, self.timestamp, *self.user_features,
                 *self.item_features, *self.multi_hot, *self.dense]
        twice = sorted({c for c in roles if c is not None and roles.count(c) > 1})
        if twice:
            raise DataError(f"schema names column(s) {', '.join(twice)} in more than one role")

    def columns(self) -> list[str]:
        """Every column in frame order: keys, label, timestamp, features."""
        cols = [self.task_key, self.item_key, self.label, self.timestamp, *self.user_features,
                *self.item_features, self.release_year, *self.multi_hot, *self.dense]
        return list(dict.fromkeys(c for c in cols if c is not None))

    def features(self) -> datasets.Features:
        """The Arrow type of every column."""
        import datasets

        list_of = getattr(datasets, "List", datasets.Sequence)  # datasets < 4 has only Sequence
        types = {self.label: datasets.Value("float32"), self.timestamp: datasets.Value("int64")}
        types |= {c: list_of(datasets.Value("string")) for c in self.multi_hot}
        types |= {c: datasets.Value("float32") for c in self.dense}
        return datasets.Features({c: types.get(c, datasets.Value("string")) for c in self.columns()})


@dataclass
class InteractionLog:
    """One row per interaction, with the columns ``schema.columns()``; ``source`` says where
    it was read from (e.g. "ml-100k at /data/ml-100k")."""

    frame: datasets.Dataset
    schema: LogSchema
    source: str

    def __len__(self) -> int:
        return len(self.frame)


# ---------------------------------------------------------------- reading files
@dataclass
class _Table:
    """A parsed file. Its index is kept through filtering and joins so that ``where`` names the
    file line of a row: index + ``first_line``, or "row N" for Parquet (``first_line`` None)."""

    path: Path
    frame: pd.DataFrame
    first_line: int | None

    def where(self, index: int) -> str:
        return f"row {index + 1}" if self.first_line is None else f"line {index + self.first_line}"


def _fail_first(table: _Table, bad: pd.Series, problem: Callable[[int], str]) -> None:
    """If any of ``bad``: raise naming the file, the first bad line and ``problem(position)``."""
    if bad.any():
        pos = int(np.flatnonzero(bad.to_numpy())[0])
        raise DataError(f"{table.path}: {table.where(int(table.frame.index[pos]))}: {problem(pos)}")


def _wrong_separator(path: Path, encoding: str, sep: str, expected: str) -> DataError:
    """``expected`` names the separator as ``{sep}``; the error shows the file's first line."""
    with open(path, encoding=encoding, errors="replace") as fh:
        first = fh.readline().rstrip("\r\n")[:200]
    expected = expected.format(sep="tabs" if sep == "\t" else repr(sep))
    return DataError(f"{path}: expected {expected}; line 1 is {first!r} (wrong separator?)")


def _require_is_file(path: Path) -> None:
    what = not_a_file(path)
    if what not in (None, "is empty"):  # an empty file: the reader's own message
        raise DataError(f"{path}: {data_file_problem(what)}")


def _read_csv(path: Path, encoding: str, **kwargs) -> pd.DataFrame:
    """pandas.read_csv with every cell a string and every failure a `DataError`."""
    _require_is_file(path)
    try:
        # Blank lines are read (as empty rows) and dropped below, so the index counts file lines.
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, skip_blank_lines=False,
                            encoding=encoding, **kwargs)
    except pd.errors.EmptyDataError:
        raise DataError(f"{path}: file is empty") from None
    except pd.errors.ParserError as exc:
        raise DataError(f"{path}: rows have different numbers of fields ({str(exc).strip()}); "
                        "check the separator and quoting") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid {encoding} text ({exc}); pass the file's encoding, "
                        "e.g. encoding='latin-1'") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc})") from None
    frame = frame.fillna("")  # short rows: NaN with the python engine, "" with the C engine
    frame = frame[~(frame == "").all(axis=1)]
    if frame.empty:
        raise DataError(f"{path}: file holds no values, only a header or blank lines")
    return frame


def _read_fields(path: Path, sep: str, names: list[str]) -> _Table:
    """A header-less, latin-1 GroupLens file whose lines hold exactly ``len(names)`` fields."""
    frame = _read_csv(path, "latin-1", sep=sep, header=None, quoting=csv.QUOTE_NONE,
                      engine="python" if len(sep) > 1 else "c")
    if frame.shape[1] != len(names):
        raise _wrong_separator(path, "latin-1", sep, f"{len(names)} fields separated by {{sep}} "
                               f"({', '.join(names)}), found {frame.shape[1]}")
    frame.columns = names
    return _Table(path, frame, first_line=1)


def _read_header_csv(path: Path, sep: str, encoding: str, quoting: int) -> _Table:
    """A delimited file with a header line (a single column means the separator is wrong)."""
    frame = _read_csv(path, encoding, sep=sep, header=0, quoting=quoting)
    if frame.shape[1] < 2:
        raise _wrong_separator(path, encoding, sep, "columns separated by {sep}, found one column")
    return _Table(path, frame, first_line=2)


def _require_file(folder: Path, name: str, what: str) -> Path:
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder; expected the folder holding {name}")
    if not (folder / name).is_file():
        held = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise DataError(f"{folder}: no {name} ({what}); the folder holds: {held}")
    return folder / name


def _require_columns(table: _Table, columns: list[str]) -> None:
    missing = [c for c in columns if c not in table.frame.columns]
    if missing:
        raise DataError(f"{table.path}: missing column(s) {', '.join(missing)}; columns found: "
                        f"{', '.join(map(str, table.frame.columns))}")


def _require_values(table: _Table, columns: list[str]) -> None:
    """Raise on the first empty cell among ``columns`` (keys and fixed-format fields)."""
    for col in columns:
        empty = table.frame[col].isna() | (table.frame[col].astype("string") == "")
        problem = f"column {col!r} is empty ({int(empty.sum())} empty value(s) in all); expected a value"
        _fail_first(table, empty, lambda _, problem=problem: problem)


# ---------------------------------------------------------------- column conversion
def _numeric(table: _Table, col: str, what: str, allow_empty: bool = False, finite: bool = False) -> pd.Series:
    """``col`` as numbers; the first non-number (with ``finite``: or inf, nan or beyond
    float32) is reported with its line and value."""
    raw = table.frame[col]
    if pd.api.types.is_numeric_dtype(raw) or pd.api.types.is_datetime64_any_dtype(raw):
        values, bad = raw, raw.isna() & (not allow_empty)  # typed Parquet column
    else:
        values = pd.to_numeric(raw.where(raw != ""), errors="coerce")
        bad = values.isna() & ((raw != "") if allow_empty else True)
    if finite:
        bad = bad | ~(values.abs() <= 3.4e38)

    def problem(pos: int) -> str:
        got = repr(raw.iloc[pos]) if isinstance(raw.iloc[pos], str) else "a missing value"
        if pd.notna(values.iloc[pos]):  # a number, but inf or beyond float32
            got, what_ = repr(raw.iloc[pos]) if isinstance(raw.iloc[pos], str) else str(raw.iloc[pos]), (
                "a finite number within float32 (a label)")
        else:
            what_ = what
        return f"column {col!r} must be {what_}, got {got} ({int(bad.sum())} such value(s))"
    _fail_first(table, bad, problem)
    return values


def _int64(table: _Table, col: str) -> pd.Series:
    """Integer timestamps; datetimes (Parquet) become Unix seconds, fractions are dropped."""
    values = _numeric(table, col, "an integer timestamp (e.g. Unix seconds)")
    if pd.api.types.is_datetime64_any_dtype(values):
        return ((values - pd.Timestamp(0, tz=values.dt.tz)) // pd.Timedelta(seconds=1)).astype("int64")
    return (np.floor(values) if pd.api.types.is_float_dtype(values) else values).astype("int64")


def _categorical(series: pd.Series) -> pd.Series:
    """Strings, with missing and empty values ``MISSING``; integral floats (a Parquet int column
    with nulls) are written without ".0"."""
    if pd.api.types.is_float_dtype(series) and (series.dropna() % 1 == 0).all():
        series = series.astype("Int64")
    out = series.astype("string").fillna(MISSING)
    return out.where(out != "", MISSING).astype(str)


def _split(series: pd.Series, sep: str) -> list[list[str]]:
    """Multi-hot cells -> lists of strings: strings are split on ``sep``, lists (Parquet) kept."""
    def one(value) -> list[str]:
        if isinstance(value, str):
            return [v for v in value.split(sep) if v]
        if value is None or value is pd.NA or (isinstance(value, float) and np.isnan(value)):
            return []
        return [str(v) for v in value]
    try:  # split each distinct cell once: multi-hot cells repeat (one per item, many ratings)
        codes, uniques = pd.factorize(series, use_na_sentinel=False)
    except TypeError:  # list cells (Parquet) are unhashable
        return [one(v) for v in series]
    lists = [one(v) for v in uniques]
    return [lists[c] for c in codes]


def _join(left: _Table, right: _Table, key: str) -> _Table:
    """Left-join ``right`` (one line per ``key``) onto ``left``; every key must be found."""
    ids = right.frame[key]
    _fail_first(right, ids.duplicated(), lambda pos: f"{key} {ids.iloc[pos]!r} appears twice; "
                f"expected one line per {key}")
    absent = ~left.frame[key].isin(ids)
    if absent.any():
        some = ", ".join(map(str, pd.unique(left.frame[key][absent])[:5]))
        raise DataError(f"{left.path}: {int(absent.sum())} interaction(s) have a {key} missing "
                        f"from {right.path.name} (e.g. {some}); expected every {key} of "
                        f"{left.path.name} to have a line in {right.path.name}")
    frame = left.frame.merge(right.frame, on=key, how="left", sort=False, suffixes=("", "_dup"))
    frame.index = left.frame.index  # a many-to-one left merge keeps the left order
    return _Table(left.path, frame, left.first_line)


def _to_log(table: _Table, schema: LogSchema, source: str) -> InteractionLog:
    """Give every column its type (see `LogSchema.features`) and build the Dataset."""
    _require_columns(table, schema.columns())
    _require_values(table, [schema.task_key, schema.item_key])
    typed = {schema.label, schema.timestamp, *schema.multi_hot, *schema.dense}
    out = {c: _categorical(table.frame[c]).to_numpy() for c in schema.columns() if c not in typed}
    out[schema.label] = _numeric(table, schema.label, "a number", finite=True).to_numpy("float32")
    if schema.timestamp:
        out[schema.timestamp] = _int64(table, schema.timestamp).to_numpy()
    out |= {c: _split(table.frame[c], sep) for c, sep in schema.multi_hot.items()}
    out |= {c: _numeric(table, c, "a number", allow_empty=True).to_numpy("float32") for c in schema.dense}
    frame = pd.DataFrame({c: out[c] for c in schema.columns()})
    import datasets

    dataset = datasets.Dataset.from_pandas(frame, features=schema.features(), preserve_index=False)
    return InteractionLog(dataset, schema, source)


# ---------------------------------------------------------------- MovieLens
def _movielens_join(ratings: _Table, users: _Table, items: _Table, source: str) -> InteractionLog:
    """Ratings joined with users (..., zip) and items (item_id, release_year, genres as "a|b")."""
    _require_values(users, list(users.frame.columns))
    # MeLU-style papers bucket zip codes by their first 3 characters (the US sectional center),
    # coarse enough that a cold user's bucket was seen in training.
    users.frame["zip3"] = users.frame["zip"].str[:3]
    users.frame = users.frame.drop(columns="zip")  # joined columns are copied to every rating
    schema = LogSchema(task_key="user_id", item_key="item_id", label="rating", timestamp="timestamp",
                       user_features=["age", "gender", "occupation", "zip3"],
                       item_features=["release_year"], multi_hot={"genres": "|"},
                       release_year="release_year")
    return _to_log(_join(_join(ratings, users, "user_id"), items, "item_id"), schema, source)


def _ml100k_items(folder: Path) -> _Table:
    """u.item -> item_id, release_year (from "01-Jan-1995"), genres (names of the set flags)."""
    genres = list(ML100K_GENRES)
    items = _read_fields(_require_file(folder, "u.item", "'|'-separated movie lines"), "|",
                         ["item_id", "title", "release_date", "video_release_date", "url", *genres])
    _require_values(items, ["item_id", *genres])
    flags = items.frame[genres]
    _fail_first(items, ~flags.isin(["0", "1"]).all(axis=1),
                lambda pos: f"genre flags must be 0 or 1, got {'|'.join(flags.iloc[pos])!r}")
    dates = items.frame["release_date"].str.strip()
    years = dates.str.extract(r"-(\d{4})$", expand=False)
    _fail_first(items, years.isna() & (dates != ""), lambda pos: "cannot read a release year "
                f"from release_date {dates.iloc[pos]!r}; expected e.g. '01-Jan-1995'")
    names = np.array(genres, dtype=object)
    items.frame = pd.DataFrame({"item_id": items.frame["item_id"], "release_year": years.fillna(MISSING),
                                "genres": ["|".join(names[row]) for row in flags.to_numpy() == "1"]},
                               index=items.frame.index)
    return items


def read_movielens_100k(path: str | Path) -> InteractionLog:
    """GroupLens ml-100k folder: ``u.data``, ``u.user``, ``u.item`` (genre flags in the fixed
    order of ``ML100K_GENRES``, which is u.genre's; u.genre itself is not read).

    User features: age, gender, occupation, zip3 (first 3 characters of the zip code). Item
    features: release_year (``MISSING`` without a release date) and genres (multi-hot).
    """
    folder = Path(path)
    ratings = _read_fields(_require_file(folder, "u.data", "tab-separated 'user item rating timestamp'"),
                           "\t", RATING_FIELDS)
    users = _read_fields(_require_file(folder, "u.user", "'|'-separated 'user|age|gender|occupation|zip'"),
                         "|", ["user_id", "age", "gender", "occupation", "zip"])
    return _movielens_join(ratings, users, _ml100k_items(folder), f"ml-100k at {folder}")


def read_movielens_1m(path: str | Path) -> InteractionLog:
    """GroupLens ml-1m folder: ``ratings.dat``, ``users.dat``, ``movies.dat`` (``::``, latin-1).

    The columns of `read_movielens_100k`; age and occupation are ml-1m's codes, the release year
    is the "(1995)" ending the title (``MISSING`` without one), genres are split on ``|``.
    """
    folder = Path(path)
    ratings = _read_fields(_require_file(folder, "ratings.dat", "'UserID::MovieID::Rating::Timestamp'"),
                           "::", RATING_FIELDS)
    users = _read_fields(_require_file(folder, "users.dat", "'UserID::Gender::Age::Occupation::Zip-code'"),
                         "::", ["user_id", "gender", "age", "occupation", "zip"])
    movies = _read_fields(_require_file(folder, "movies.dat", "'MovieID::Title::Genres'"),
                          "::", ["item_id", "title", "genres"])
    _require_values(movies, ["item_id", "title"])
    year = movies.frame["title"].str.strip().str.extract(r"\((\d{4})\)$", expand=False)
    movies.frame = movies.frame.assign(release_year=year.fillna(MISSING)).drop(columns="title")
    return _movielens_join(ratings, users, movies, f"ml-1m at {folder}")


# ---------------------------------------------------------------- RecBole atomic files
def _read_atomic(path: Path, encoding: str) -> tuple[_Table, dict[str, str]]:
    """A RecBole atomic file (tab-separated, header ``name:type``): the table with plain column
    names, and ``{name: type}``."""
    table = _read_header_csv(path, "\t", encoding, csv.QUOTE_NONE)
    types = {}
    for header in table.frame.columns:
        name, _, kind = str(header).rpartition(":")
        if not name or kind not in RECBOLE_TYPES:
            raise DataError(f"{path}: column header {header!r} must be 'name:type' with type one "
                            f"of {', '.join(RECBOLE_TYPES)}")
        if kind == "float_seq":
            raise DataError(f"{path}: column {name!r} is float_seq, which no InteractionLog "
                            "column holds; remove the column from the file")
        types[name] = kind
    table.frame.columns = list(types)
    return table, types


def _add_fields(schema: LogSchema, types: dict[str, str], tokens: list[str] | None) -> None:
    """Give each new field a role: token -> ``tokens`` (dropped if None), token_seq ->
    multi-hot (space-separated), float -> dense."""
    for col, kind in types.items():
        if col in schema.columns():
            continue
        if kind == "token" and tokens is not None:
            tokens.append(col)
        elif kind == "token_seq":
            schema.multi_hot[col] = " "
        elif kind == "float":
            schema.dense.append(col)


def read_recbole(path: str | Path, dataset_name: str, encoding: str = "utf-8") -> InteractionLog:
    """RecBole atomic files ``<name>.inter`` (required), ``<name>.user``, ``<name>.item``.

    ``user_id`` is the task key, ``item_id`` the item, ``rating`` (else ``label``) the label,
    ``timestamp`` is kept when present. Token fields of ``.user`` / ``.item`` become user / item
    features; token_seq fields multi-hot, float fields dense, in any file. Token fields of
    ``.inter`` (interaction context) are dropped. A field name may appear in one file only.
    An item token field ``release_year`` becomes ``schema.release_year``.
    """
    folder = Path(path)
    inter, types = _read_atomic(_require_file(folder, f"{dataset_name}.inter",
                                              "tab-separated, header 'name:type'"), encoding)
    label = next((c for c in ("rating", "label") if c in types), "rating (or label)")
    _require_columns(inter, ["user_id", "item_id", label])
    schema = LogSchema("user_id", "item_id", label, "timestamp" if "timestamp" in types else None)
    _add_fields(schema, types, None)
    inter.frame = inter.frame[schema.columns()]
    for suffix, key, tokens in (("user", "user_id", schema.user_features),
                                ("item", "item_id", schema.item_features)):
        if (folder / f"{dataset_name}.{suffix}").is_file():
            side, side_types = _read_atomic(folder / f"{dataset_name}.{suffix}", encoding)
            _require_columns(side, [key])
            clash = [c for c in side_types if c != key and c in schema.columns()]
            if clash:
                raise DataError(f"{side.path}: column(s) {', '.join(clash)} also in another file")
            _add_fields(schema, side_types, tokens)
            side.frame = side.frame[[c for c in side_types if c == key or c in schema.columns()]]
            inter = _join(inter, side, key)
    if "release_year" in schema.item_features:  # RecBole's MovieLens .item files have one
        schema.release_year = "release_year"
    return _to_log(inter, schema, f"recbole {dataset_name} at {folder}")


# ---------------------------------------------------------------- generic tables
def _read_parquet(path: Path, columns: list[str]) -> _Table:
    """The ``columns`` of a Parquet file (checked against its schema before reading)."""
    _require_is_file(path)
    try:  # pyarrow's ArrowInvalid is a ValueError; the schema is checked before the data is read
        table = _Table(path, pd.DataFrame(columns=pq.read_schema(path).names), first_line=None)
        _require_columns(table, columns)
        table.frame = pd.read_parquet(path, columns=columns).reset_index(drop=True)
        return table
    except (OSError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{path}: cannot read as Parquet ({exc})") from None


def read_table(path: str | Path, schema: LogSchema, fmt: str = "auto", sep: str = ",",
               encoding: str = "utf-8") -> InteractionLog:
    """One CSV (TSV: ``sep="\\t"``) or Parquet file holding the columns ``schema`` names.

    ``fmt``: "csv", "parquet" or "auto" (Parquet for ``.parquet``/``.pq``, else CSV). A CSV has
    a header line; multi-hot cells are split on their declared separator (Parquet list columns
    are taken as they are). Other columns in the file are ignored.
    """
    path = Path(path)
    if fmt == "auto":
        fmt = "parquet" if path.suffix.lower() in (".parquet", ".pq") else "csv"
    if fmt not in ("csv", "parquet"):
        raise DataError(f"{path}: format {fmt!r} is not one of auto, csv, parquet")
    table = (_read_parquet(path, schema.columns()) if fmt == "parquet"
             else _read_header_csv(path, sep, encoding, csv.QUOTE_MINIMAL))
    return _to_log(table, schema, f"{fmt} table at {path}")


def log_from_frame(frame: pd.DataFrame, schema: LogSchema, source: str = "in-memory table") -> InteractionLog:
    """An `InteractionLog` from rows already in memory (a pandas DataFrame), with the same
    checks and typing as the file readers; errors name ``source`` and the row."""
    table = _Table(Path(source), frame.reset_index(drop=True), first_line=None)
    return _to_log(table, schema, source)


def get_reader(name: str) -> Callable[..., InteractionLog]:
    """The reader of data source ``name`` (``gmeta_ds.registry.DATA_SOURCES``: a file reader,
    not the synthetic generator), or a `ValueError` listing the valid names."""
    readers = [n for n in DATA_SOURCES.names() if n != "synthetic"]
    if name not in readers:
        raise ValueError(f"unknown reader {name!r}; valid readers: {', '.join(readers)}")
    return DATA_SOURCES[name]


DATA_SOURCES.bind({"synthetic": "gmeta_ds.data.synthetic:generate_synthetic", "movielens-100k": read_movielens_100k,
                   "movielens-1m": read_movielens_1m, "recbole": read_recbole, "table": read_table})


# The click threshold when data.threshold is left at its default (`DataConfig.threshold`).
DEFAULT_THRESHOLD = 4.0


def click_threshold(threshold: float, zero_one: bool) -> float:
    """The threshold that turns a label column into clicks (label >= threshold): a column whose
    values are all 0 or 1 is already clicks, so with ``data.threshold`` left at its default
    (a rating's 4.0) it is read as it is (threshold 1); any other threshold applies as given.
    Without this, a click column under the rating default becomes all zeros, silently."""
    return 1.0 if zero_one and threshold == DEFAULT_THRESHOLD else float(threshold)


def check_two_classes(source: str, column: str, threshold: float, clicks: int, rows: int) -> None:
    """A `DataError` when thresholding left one class only (no click, or only clicks): a model
    trained on it learns a constant, and no AUC can be measured."""
    if rows and clicks in (0, rows):
        every = "0 (no click)" if clicks == 0 else "1 (a click)"
        raise DataError(f"{source}: every label is {every} after thresholding column {column!r} at "
                        f"data.threshold {threshold:g} (a click is {column} >= threshold), over {rows} "
                        "interactions; set data.threshold (threshold= in gm.build_tasks) to a value "
                        "between the column's values, or data.label: regression to keep them")
