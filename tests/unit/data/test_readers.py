"""Tests for the interaction-log readers: small fixture files in the real on-disk formats
(GroupLens ml-100k / ml-1m, RecBole atomic files, CSV, Parquet) written into tmp_path."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gmeta_ds.data.readers import (MISSING, ML100K_GENRES, DataError, InteractionLog,
                                   LogSchema, get_reader, read_movielens_1m, read_movielens_100k,
                                   read_recbole, read_table)


def _write(path: Path, lines: list[str], encoding: str = "latin-1") -> Path:
    path.write_bytes("".join(line + "\n" for line in lines).encode(encoding))
    return path


def _flags(*genres: str) -> str:
    return "|".join("1" if g in genres else "0" for g in ML100K_GENRES)


ML100K = {
    "u.data": ["196\t242\t3\t881250949", "186\t302\t3\t891717742",
               "196\t302\t4\t881250950", "22\t377\t1\t878887116"],
    "u.user": ["196|49|M|writer|55105", "186|39|F|executive|00000", "22|25|M|writer|T8H1N"],
    "u.item": ["242|Kolya (1996)|24-Jan-1997||http://us.imdb.com/M/title-exact?Kolya|" + _flags("Comedy"),
               "302|Café Society (1997)|01-Jan-1997||http://x|" + _flags("Crime", "Mystery", "Thriller"),
               "377|unknown||||" + _flags("unknown")],
    "u.genre": [f"{g}|{i}" for i, g in enumerate(ML100K_GENRES)] + [""],
}
ML1M = {
    "ratings.dat": ["1::1193::5::978300760", "1::661::3::978302109", "2::1193::4::978298413",
                    "2::999::2::978298500"],
    "users.dat": ["1::F::1::10::48067", "2::M::56::16::70072-1234"],
    "movies.dat": ["1193::One Flew Over the Cuckoo's Nest (1975)::Drama",
                   "661::Café James and the Giant Peach (1996)::Animation|Children's|Musical",
                   "999::Untitled::Comedy"],
}


def _folder(tmp_path: Path, files: dict[str, list[str]], **replace: list[str]) -> Path:
    for name, lines in {**files, **{k.replace("_", "."): v for k, v in replace.items()}}.items():
        if lines is not None:
            _write(tmp_path / name, lines)
    return tmp_path


def _rows(log: InteractionLog) -> list[dict]:
    return [log.frame[i] for i in range(len(log.frame))]


# ---------------------------------------------------------------- MovieLens 100k
def test_ml100k_joins_user_and_item_features_per_interaction(tmp_path):
    log = read_movielens_100k(_folder(tmp_path, ML100K))
    assert len(log) == 4 and log.source == f"ml-100k at {tmp_path}"
    first, second = _rows(log)[:2]
    assert first == {"user_id": "196", "item_id": "242", "rating": 3.0, "timestamp": 881250949,
                     "age": "49", "gender": "M", "occupation": "writer", "zip3": "551",
                     "release_year": "1997", "genres": ["Comedy"]}
    assert second["genres"] == ["Crime", "Mystery", "Thriller"]
    assert (second["zip3"], second["occupation"]) == ("000", "executive")
    assert log.frame["user_id"] == ["196", "186", "196", "22"]  # file order kept
    assert log.frame["rating"] == [3.0, 3.0, 4.0, 1.0]


def test_ml100k_missing_release_date_and_non_us_zip(tmp_path):
    last = _rows(read_movielens_100k(_folder(tmp_path, ML100K)))[3]
    assert last["release_year"] == MISSING and last["genres"] == ["unknown"]
    assert last["zip3"] == "T8H"


def test_ml100k_schema_and_dtypes(tmp_path):
    log = read_movielens_100k(_folder(tmp_path, ML100K))
    s = log.schema
    assert (s.task_key, s.item_key, s.label, s.timestamp) == ("user_id", "item_id", "rating", "timestamp")
    assert s.user_features == ["age", "gender", "occupation", "zip3"]
    assert s.item_features == ["release_year"] and s.release_year == "release_year"
    assert s.multi_hot == {"genres": "|"} and s.dense == []
    types = {k: str(v) for k, v in log.frame.features.items()}
    assert types["rating"] == "Value('float32')" and types["timestamp"] == "Value('int64')"
    assert types["user_id"] == types["zip3"] == "Value('string')"
    assert types["genres"] == "List(Value('string'))"
    assert list(log.frame.column_names) == s.columns()


def test_ml100k_reads_latin1_title_without_error(tmp_path):
    # "Café" is one byte (0xE9) in latin-1: invalid UTF-8, so a utf-8 read would fail.
    assert b"Caf\xe9" in _write(tmp_path / "u.item", ML100K["u.item"]).read_bytes()
    assert len(read_movielens_100k(_folder(tmp_path, ML100K))) == 4


# ---------------------------------------------------------------- MovieLens 1m
def test_ml1m_joins_features_years_and_genres(tmp_path):
    log = read_movielens_1m(_folder(tmp_path, ML1M))
    rows = _rows(log)
    assert len(rows) == 4 and log.frame["user_id"] == ["1", "1", "2", "2"]
    assert rows[0] == {"user_id": "1", "item_id": "1193", "rating": 5.0, "timestamp": 978300760,
                       "age": "1", "gender": "F", "occupation": "10", "zip3": "480",
                       "release_year": "1975", "genres": ["Drama"]}
    assert rows[1]["genres"] == ["Animation", "Children's", "Musical"]
    assert rows[1]["release_year"] == "1996"
    assert rows[3]["release_year"] == MISSING and rows[3]["zip3"] == "700"


# ---------------------------------------------------------------- RecBole
RB_INTER = ["user_id:token\titem_id:token\trating:float\ttimestamp:float",
            "u1\ti1\t4\t881250949", "u1\ti2\t2.5\t881250950.7", "u2\ti1\t5\t881250951"]
RB_USER = ["user_id:token\tage:token\tgender:token", "u1\t24\tM", "u2\t53\tF"]
RB_ITEM = ["item_id:token\trelease_year:token\tclass:token_seq\tprice:float",
           "i1\t1995\tAnimation Comedy\t9.5", "i2\t1994\t\t"]


def test_recbole_maps_typed_headers_to_schema(tmp_path):
    folder = _folder(tmp_path, {"x.inter": RB_INTER, "x.user": RB_USER, "x.item": RB_ITEM})
    log = read_recbole(folder, "x")
    s = log.schema
    assert (s.task_key, s.item_key, s.label, s.timestamp) == ("user_id", "item_id", "rating", "timestamp")
    assert s.user_features == ["age", "gender"] and s.item_features == ["release_year"]
    assert s.release_year == "release_year"
    assert s.multi_hot == {"class": " "} and s.dense == ["price"]
    rows = _rows(log)
    assert rows[0] == {"user_id": "u1", "item_id": "i1", "rating": 4.0, "timestamp": 881250949,
                       "age": "24", "gender": "M", "release_year": "1995",
                       "class": ["Animation", "Comedy"], "price": 9.5}
    assert rows[1]["class"] == [] and rows[1]["rating"] == 2.5 and rows[1]["timestamp"] == 881250950
    assert rows[1]["price"] is None  # an empty float is null: NaN in numpy / torch format
    assert np.isnan(log.frame.with_format("numpy")["price"][1])
    assert rows[2]["gender"] == "F" and log.frame.features["price"].dtype == "float32"


def test_recbole_label_column_no_timestamp_no_side_files(tmp_path):
    folder = _folder(tmp_path, {"c.inter": ["user_id:token\titem_id:token\tlabel:float\tctx:token",
                                            "1\t7\t1", "1\t8\t0"]})
    log = read_recbole(folder, "c")
    assert log.schema.label == "label" and log.schema.timestamp is None and log.schema.release_year is None
    assert log.frame.column_names == ["user_id", "item_id", "label"]  # token context dropped
    assert log.frame["label"] == [1.0, 0.0]


def test_recbole_bad_header_type_names_file_and_column(tmp_path):
    folder = _folder(tmp_path, {"x.inter": ["user_id:token\titem_id:token\trating:number", "1\t2\t3"]})
    with pytest.raises(DataError, match=r"x\.inter: column header 'rating:number' must be 'name:type'"):
        read_recbole(folder, "x")


def test_recbole_missing_item_id_column(tmp_path):
    folder = _folder(tmp_path, {"x.inter": ["user_id:token\titem:token\tscore:float", "1\t2\t3"]})
    with pytest.raises(DataError, match=r"x\.inter: missing column\(s\) item_id, rating \(or label\); "
                                        r"columns found: user_id, item, score"):
        read_recbole(folder, "x")


def test_recbole_float_seq_and_clashing_side_columns_are_errors(tmp_path):
    item = ["item_id:token\temb:float_seq", "i1\t0.1 0.2"]
    folder = _folder(tmp_path, {"x.inter": RB_INTER, "x.item": item})
    with pytest.raises(DataError, match=r"x\.item: column 'emb' is float_seq"):
        read_recbole(folder, "x")
    _write(tmp_path / "x.item", ["item_id:token\tage:token", "i1\t3", "i2\t4"])
    _write(tmp_path / "x.user", RB_USER)
    with pytest.raises(DataError, match=r"x\.item: column\(s\) age also in another file"):
        read_recbole(folder, "x")


def test_recbole_side_file_missing_a_user(tmp_path):
    folder = _folder(tmp_path, {"x.inter": RB_INTER, "x.user": RB_USER[:2]})
    with pytest.raises(DataError, match=r"x\.inter: 1 interaction\(s\) have a user_id missing from "
                                        r"x\.user \(e\.g\. u2\)"):
        read_recbole(folder, "x")


def test_recbole_missing_inter_file_lists_folder(tmp_path):
    folder = _folder(tmp_path, {"y.inter": RB_INTER})
    with pytest.raises(DataError, match=r"no x\.inter .*the folder holds: y\.inter"):
        read_recbole(folder, "x")


# ---------------------------------------------------------------- generic tables
SCHEMA = LogSchema(task_key="user", item_key="item", label="click", timestamp="ts",
                   user_features=["age"], item_features=["brand"], multi_hot={"tags": ";"},
                   dense=["price"])
TABLE = pd.DataFrame({"user": ["a", "a", "b"], "item": ["x", "y", "x"], "click": ["1", "0", "1"],
                      "ts": ["10", "11", "12"], "age": ["20", "20", "30"], "brand": ["n", "", "n"],
                      "tags": ["red;big", "", "red"], "price": ["1.5", "2", "1.5"], "extra": ["q"] * 3})


def _check_table_log(log: InteractionLog) -> None:
    assert len(log) == 3 and log.frame.column_names == SCHEMA.columns()
    assert log.frame["user"] == ["a", "a", "b"] and log.frame["click"] == [1.0, 0.0, 1.0]
    assert log.frame["tags"] == [["red", "big"], [], ["red"]]
    assert log.frame["brand"] == ["n", MISSING, "n"] and log.frame["age"] == ["20", "20", "30"]
    assert log.frame["ts"] == [10, 11, 12] and log.frame["price"] == [1.5, 2.0, 1.5]
    types = {k: str(v) for k, v in log.frame.features.items()}
    assert types["click"] == types["price"] == "Value('float32')" and types["ts"] == "Value('int64')"


def test_read_table_csv_and_tsv(tmp_path):
    TABLE.to_csv(tmp_path / "log.csv", index=False)
    _check_table_log(read_table(tmp_path / "log.csv", SCHEMA))
    TABLE.to_csv(tmp_path / "log.tsv", index=False, sep="\t")
    _check_table_log(read_table(tmp_path / "log.tsv", SCHEMA, sep="\t"))


def test_read_table_parquet_with_typed_and_list_columns(tmp_path):
    typed = TABLE.assign(click=[1, 0, 1], ts=pd.to_datetime([10, 11, 12], unit="s"), age=[20, 20, 30],
                         price=[1.5, 2.0, 1.5], brand=["n", None, "n"])
    typed.to_parquet(tmp_path / "log.parquet")
    _check_table_log(read_table(tmp_path / "log.parquet", SCHEMA))
    typed.assign(tags=[["red", "big"], [], ["red"]]).to_parquet(tmp_path / "lists.data")
    _check_table_log(read_table(tmp_path / "lists.data", SCHEMA, fmt="parquet"))


def test_read_table_parquet_null_label_names_row(tmp_path):
    TABLE.assign(click=[1.0, None, 0.0]).to_parquet(tmp_path / "log.parquet")
    with pytest.raises(DataError, match=r"log\.parquet: row 2: column 'click' must be a number, "
                                        r"got a missing value"):
        read_table(tmp_path / "log.parquet", SCHEMA)


def test_read_table_missing_column_names_file_and_found_columns(tmp_path):
    TABLE.drop(columns=["ts", "tags"]).to_csv(tmp_path / "log.csv", index=False)
    with pytest.raises(DataError, match=r"log\.csv: missing column\(s\) ts, tags; columns found: user, "):
        read_table(tmp_path / "log.csv", SCHEMA)
    TABLE.drop(columns=["ts"]).to_parquet(tmp_path / "log.parquet")
    with pytest.raises(DataError, match=r"log\.parquet: missing column\(s\) ts; columns found: user"):
        read_table(tmp_path / "log.parquet", SCHEMA)


def test_read_table_non_numeric_label_names_line_and_value(tmp_path):
    TABLE.assign(click=["1", "yes", "0"]).to_csv(tmp_path / "log.csv", index=False)
    with pytest.raises(DataError, match=r"log\.csv: line 3: column 'click' must be a number, got 'yes'"):
        read_table(tmp_path / "log.csv", SCHEMA)


def test_read_table_unreadable_files(tmp_path):
    (tmp_path / "bad.csv").write_bytes(b"user,item\n\xff\xfe,\x00\x81\n")
    with pytest.raises(DataError, match=r"bad\.csv: not valid utf-8"):
        read_table(tmp_path / "bad.csv", SCHEMA)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as Parquet"):
        read_table(tmp_path / "bad.parquet", SCHEMA)
    with pytest.raises(DataError, match=r"nope\.csv: file does not exist"):
        read_table(tmp_path / "nope.csv", SCHEMA)
    with pytest.raises(DataError, match="a folder, expected a file"):
        read_table(tmp_path, SCHEMA, fmt="csv")
    with pytest.raises(DataError, match="format 'json' is not one of auto, csv, parquet"):
        read_table(tmp_path / "x.json", SCHEMA, fmt="json")


def test_read_table_comma_file_read_with_tabs_is_a_separator_error(tmp_path):
    TABLE.to_csv(tmp_path / "log.tsv", index=False)
    with pytest.raises(DataError, match=r"log\.tsv: expected columns separated by tabs, found one "
                                        r"column; line 1 is 'user,item,click"):
        read_table(tmp_path / "log.tsv", SCHEMA, sep="\t")


def test_schema_rejects_a_column_in_two_roles():
    with pytest.raises(DataError, match="schema names column.s. price in more than one role"):
        LogSchema("user", "item", "click", dense=["price"], item_features=["price"])
    LogSchema("user", "item", "click", item_features=["year"], release_year="year")  # allowed


def test_read_table_header_only_csv(tmp_path):
    (tmp_path / "log.csv").write_text(",".join(TABLE.columns) + "\n")
    with pytest.raises(DataError, match=r"log\.csv: file holds no values, only a header"):
        read_table(tmp_path / "log.csv", SCHEMA)


# ---------------------------------------------------------------- GroupLens bad data
def _error_100k(tmp_path: Path, **replace) -> str:
    with pytest.raises(DataError) as info:
        read_movielens_100k(_folder(tmp_path, ML100K, **replace))
    return str(info.value)


def test_missing_file_names_expected_file_and_folder_contents(tmp_path):
    msg = _error_100k(tmp_path, u_user=None)
    assert "no u.user ('|'-separated 'user|age|gender|occupation|zip')" in msg
    assert "the folder holds: u.data, u.genre, u.item" in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no ratings\.dat .*the folder holds: nothing"):
        read_movielens_1m(tmp_path / "empty")
    with pytest.raises(DataError, match="not a folder"):
        read_movielens_100k(tmp_path / "absent")


def test_comma_separated_u_data_is_a_separator_error(tmp_path):
    msg = _error_100k(tmp_path, u_data=[line.replace("\t", ",") for line in ML100K["u.data"]])
    assert "u.data: expected 4 fields separated by tabs (user_id, item_id, rating, timestamp), found 1" in msg
    assert "line 1 is '196,242,3,881250949' (wrong separator?)" in msg


def test_ml1m_wrong_separator_shows_first_line(tmp_path):
    folder = _folder(tmp_path, ML1M, ratings_dat=["1,1193,5,978300760"])
    with pytest.raises(DataError, match=r"ratings\.dat: expected 4 fields separated by '::'.*"
                                        r"line 1 is '1,1193,5,978300760'"):
        read_movielens_1m(folder)


def test_non_numeric_rating_names_line_and_value(tmp_path):
    data = list(ML100K["u.data"])
    data[2] = "196\t302\tfour\t881250950"
    msg = _error_100k(tmp_path, u_data=data)
    assert re.search(r"u\.data: line 3: column 'rating' must be a number, got 'four' \(1 such value", msg)


def test_line_numbers_count_blank_lines(tmp_path):
    data = [ML100K["u.data"][0], "", "196\t302\tbad\t881250950"]
    assert "u.data: line 3: column 'rating'" in _error_100k(tmp_path, u_data=data)


def test_non_integer_timestamp(tmp_path):
    data = [ML100K["u.data"][0], "196\t302\t3\tyesterday"]
    msg = _error_100k(tmp_path, u_data=data)
    assert "u.data: line 2: column 'timestamp' must be an integer timestamp" in msg and "'yesterday'" in msg


def test_empty_file(tmp_path):
    assert "u.data: file is empty" in _error_100k(tmp_path, u_data=[])
    assert "u.user: file is empty" in _error_100k(tmp_path, u_user=["", ""])
    msg = _error_100k(tmp_path, u_data=["\t\t\t", ""])  # only empty fields
    assert "u.data: file holds no values, only a header or blank lines" in msg


def test_ragged_rows_and_short_rows(tmp_path):
    data = ML100K["u.data"] + ["1\t2\t3\t4\t5"]
    assert "u.data: rows have different numbers of fields" in _error_100k(tmp_path, u_data=data)
    users = ML100K["u.user"][:2] + ["22|25|M|writer|"]
    msg = _error_100k(tmp_path, u_user=users)
    assert "u.user: line 3: column 'zip' is empty (1 empty value(s) in all); expected a value" in msg


def test_rating_user_missing_from_u_user(tmp_path):
    msg = _error_100k(tmp_path, u_user=ML100K["u.user"][:2])
    assert "u.data: 1 interaction(s) have a user_id missing from u.user (e.g. 22)" in msg


def test_duplicate_user_line(tmp_path):
    msg = _error_100k(tmp_path, u_user=ML100K["u.user"] + ["196|50|M|writer|55105"])
    assert "u.user: line 4: user_id '196' appears twice" in msg


def test_bad_genre_flag_and_bad_release_date(tmp_path):
    items = list(ML100K["u.item"])
    items[0] = items[0][:-1] + "2"
    assert "u.item: line 1: genre flags must be 0 or 1" in _error_100k(tmp_path, u_item=items)
    items = list(ML100K["u.item"])
    items[1] = items[1].replace("01-Jan-1997", "sometime")
    assert "u.item: line 2: cannot read a release year from release_date 'sometime'" in \
        _error_100k(tmp_path, u_item=items)


# ---------------------------------------------------------------- registry
def test_registry_names_and_unknown_reader():
    assert get_reader("movielens-100k") is read_movielens_100k and get_reader("table") is read_table
    with pytest.raises(ValueError, match="valid readers: movielens-100k, movielens-1m, recbole, table$"):
        get_reader("synthetic")  # a data source, not a file reader
    assert get_reader("recbole") is read_recbole
    with pytest.raises(ValueError, match="unknown reader 'ml'; valid readers: movielens-100k"):
        get_reader("ml")
