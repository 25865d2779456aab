"""The served path's fast checks (issue 36's speed work): a well-formed body is read a column at
a time and the plain-id fields are encoded in one array conversion; both give exactly what the
value-by-value paths give, and anything those would refuse makes the fast path step aside so
that the value-by-value path names the problem."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gmeta_ds.serving import protocol
from gmeta_ds.serving.encoding import Encoder, RequestError
from gmeta_ds.sparse import FieldSpec

FIELDS = {"age": FieldSpec("age", 7, "user"), "item": FieldSpec("item", 50, "item"),
          "tags": FieldSpec("tags", 9, "item", multi_hot=True)}
USER = {"age": 3}


def _body(**change) -> dict:
    support = [{"item": i, "tags": ["a", 2], "label": i % 2} for i in range(5)]
    support[2] = {**support[2], "age": "override", "label": 0.25}
    return {"support": support, "candidates": [{"item": 40 + i, "tags": []} for i in range(3)], **change}


@pytest.mark.parametrize("part,labels", [("support", True), ("candidates", False)])
def test_a_well_formed_part_reads_as_the_value_by_value_path(part, labels):
    fast = protocol._fast_rows(_body(), part, FIELDS, USER, labels, 100)
    assert fast is not None and fast == protocol._rows(_body(), part, FIELDS, USER, labels, 100)


BAD_PARTS = [
    ("support", [{"item": 1, "tags": [], "label": True}]),  # a bool label
    ("support", [{"item": 1, "tags": [], "label": float("nan")}]),
    ("support", [{"item": 1, "tags": []}]),  # no label
    ("support", [{"item": 1, "tags": [], "label": 10 ** 400}]),  # too large for a float
    ("candidates", [{"item": 1}]),  # a missing field
    ("candidates", [{"item": 1, "tags": [], "colour": 3}]),  # an unknown key
    ("candidates", [{"item": [1], "tags": []}]),  # a list for a single-hot field
    ("candidates", [{"item": 1, "tags": "a"}]),  # a string for a multi-hot field
    ("candidates", [{"item": 1, "tags": [None]}]),  # None inside a multi-hot list
    ("candidates", [[1, []]]),  # a row that is not an object
    ("candidates", {"item": 1}),  # not a list of rows
    ("candidates", [{"item": 1, "tags": []}] * 101),  # past max_rows
]


@pytest.mark.parametrize("part,rows", BAD_PARTS)
def test_anything_the_value_by_value_path_refuses_leaves_it_to_that_path(part, rows):
    assert protocol._fast_rows({part: rows}, part, FIELDS, USER, part == "support", 100) is None
    with pytest.raises(RequestError):
        protocol._rows({part: rows}, part, FIELDS, USER, part == "support", 100)


def _encoder(kind: str = "binary") -> Encoder:
    export = SimpleNamespace(fields=[FIELDS["age"], FIELDS["item"]], vocab={}, state={},
                             meta={"tables": [], "algorithm": {"kind": kind}})
    return Encoder(export)


@pytest.mark.parametrize("columns", [
    {"age": [0, 6, 7, -1], "item": [49, 50, 3, 0]},  # integers, some out of range
    {"age": ["1", 2, "3", 4], "item": [1, 2, 3, 4]},  # values the field-by-field path converts
])
def test_the_plain_id_block_encodes_as_field_by_field(columns):
    encoder = _encoder()
    encoded = encoder.encode(columns, [1.0, 0.0, 1.0, 0.0], "support")
    expected = [encoder._column(f, columns[f.name], f.name) for f in encoder.single]
    assert np.array_equal(encoded.ids, np.stack([ids for ids, _ in expected], 1))
    assert encoded.unknown == sum(missed for _, missed in expected)


def test_a_bad_column_is_still_named_in_field_order():
    with pytest.raises(RequestError, match=r"^support\.age: expected integer ids"):
        _encoder().encode({"age": ["x", 1], "item": [1]}, [1.0, 0.0], "support")


@pytest.mark.parametrize("poison", [3.7, 3.0, True, False])
@pytest.mark.parametrize("others", [[1, 2], ["1", 2]], ids=["block", "field-by-field"])
def test_a_boolean_or_a_float_id_is_refused_not_converted(poison, others):
    """Issue 49 item 6: a plain id field took 3.7 as id 3 and true as id 1; both are a
    `RequestError` naming the field, through the one-array block and the field-by-field path."""
    with pytest.raises(RequestError, match=r"^support\.item: expected integer ids in \[0, 50\) \(not a boolean"):
        _encoder().encode({"age": [1, 2], "item": [others[0], poison]}, [1.0, 0.0], "support")


@pytest.mark.parametrize("poison", [10**30, -(10**30), float("inf"), float("-inf"), float("nan"), "9" * 5000])
def test_an_id_past_int64_or_not_finite_is_a_request_error_naming_the_field(poison):
    """Issue 49: values that overflow int64 (or are +-Infinity / NaN) raised OverflowError inside
    the encoder; they are a `RequestError` naming the field, like any non-integer id."""
    with pytest.raises(RequestError, match=r"^support\.item: expected integer ids in \[0, 50\)"):
        _encoder().encode({"age": [1, 2], "item": [3, poison]}, [1.0, 0.0], "support")


@pytest.mark.parametrize("kind,label,expected", [
    ("binary", 7, "0 or 1"), ("binary", -1, "0 or 1"), ("binary", 0.5, "0 or 1"), ("binary", 1e300, "0 or 1"),
    ("binary", 1 + 1e-9, "0 or 1"),  # float32 would round it to a click
    ("regression", 1e300, "a finite rating within"), ("regression", -1e13, "a finite rating within"),
    ("regression", float("nan"), "a finite rating within"), ("regression", float("inf"), "a finite rating within"),
])
def test_a_label_outside_the_models_kind_is_refused_naming_the_row(kind, label, expected):
    """Issue 49 item 6: a binary model took labels 7 and -1, and label 1e300 scored null (inf in
    float32); a binary model's labels are 0 or 1, a regression model's finite within +-1e12,
    else a `RequestError` naming the row's label (the server's 400)."""
    with pytest.raises(RequestError, match=rf"^support\[1\]\.label: expected {expected}"):
        _encoder(kind).encode({"age": [1, 2, 3], "item": [3, 4, 5]}, [1.0, label, 0.0], "support")


def test_labels_of_the_models_kind_are_kept():
    ratings = _encoder("regression").encode({"age": [1, 2, 3], "item": [3, 4, 5]}, [4.5, -2, 1e12], "support")
    assert ratings.labels.dtype == np.float32 and ratings.labels.tolist() == [4.5, -2.0, np.float32(1e12)]
    clicks = _encoder().encode({"age": [1, 2], "item": [3, 4]}, [1, 0.0], "support")
    assert clicks.labels.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("datatype", [["BYTES"], {"a": 1}, None, 3])
def test_an_oip_datatype_that_is_not_a_string_is_a_request_error_naming_it(datatype):
    """A list or object as an input's datatype raised TypeError (unhashable) in the lookup of
    the known datatypes: a 500 instead of a 400 naming ``inputs[i].datatype``."""
    body = {"inputs": [{"name": "user.age", "shape": [1], "datatype": "BYTES", "data": ["a"]},
                       {"name": "candidates.item", "shape": [1], "datatype": datatype, "data": [1]}]}
    with pytest.raises(RequestError, match=r"^inputs\[1\]\.datatype: .*expected one of BYTES"):
        protocol.parse_oip(body, list(FIELDS.values()), 100)


def _oip(*inputs, **body) -> dict:
    """An OIP v2 body of one user: age, one support row, one candidate; ``inputs`` replace the
    tensor of the same name, ``body`` adds top-level keys."""
    tensors = {t["name"]: t for t in [
        {"name": "user.age", "shape": [1], "datatype": "INT64", "data": [3]},
        {"name": "support.item", "shape": [1], "datatype": "INT64", "data": [4]},
        {"name": "support.tags", "shape": [1], "datatype": "BYTES", "data": ["a|b"]},
        {"name": "support.label", "shape": [1], "datatype": "FP32", "data": [1]},
        {"name": "candidates.item", "shape": [1], "datatype": "INT64", "data": [9]},
        {"name": "candidates.tags", "shape": [1], "datatype": "BYTES", "data": [""]}, *inputs]}
    return {"inputs": list(tensors.values()), **body}


def test_an_oip_body_of_the_declared_datatypes_is_read():
    user = protocol.parse_oip(_oip(outputs=[{"name": "scores", "parameters": {"binary_data": True}}],
                                   parameters={"user_id": 17}), list(FIELDS.values()), 100)
    assert user.support == {"age": [3], "item": [4], "tags": [["a", "b"]]} and user.labels == [1.0]
    assert user.candidates == {"age": [3], "item": [9], "tags": [[]]} and user.user_id == "17"


@pytest.mark.parametrize("tensor,words", [
    ({"name": "support.label", "shape": [1], "datatype": "FP32", "data": ["1"]},
     r"^inputs\[3\]\.data: 'support\.label': element 0 is '1'; datatype FP32 holds numbers"),
    ({"name": "candidates.item", "shape": [2], "datatype": "BYTES", "data": ["9", 9]},
     r"^inputs\[4\]\.data: 'candidates\.item': element 1 is 9; datatype BYTES holds strings"),
    ({"name": "candidates.item", "shape": [1], "datatype": "INT64", "data": [9.5]},
     r"^inputs\[4\]\.data: 'candidates\.item': element 0 is 9\.5; datatype INT64 holds integers"),
    ({"name": "user.age", "shape": [1], "datatype": "INT32", "data": [True]},
     r"^inputs\[0\]\.data: 'user\.age': element 0 is True; datatype INT32 holds integers"),
    ({"name": "support.label", "shape": [1], "datatype": "FP64", "data": [False]},
     r"^inputs\[3\]\.data: 'support\.label': element 0 is False; datatype FP64 holds numbers"),
    ({"name": "user.age", "shape": [True], "datatype": "INT64", "data": [3]},
     r"^inputs\[0\]\.shape: \[True\]; expected \[rows\] \(one dimension, a non-negative integer, not a boolean"),
    ({"name": "user.age", "shape": [2], "datatype": "INT32", "data": [3, 2 ** 31]},
     (r"^inputs\[0\]\.data: 'user\.age': element 1 is 2147483648; past datatype INT32's range "
      r"\[-2147483648, 2147483647\]")),
    ({"name": "candidates.item", "shape": [1], "datatype": "INT64", "data": [-(2 ** 63) - 1]},
     r"^inputs\[4\]\.data: 'candidates\.item': element 0 is -9223372036854775809; past datatype INT64's"),
])
def test_oip_data_not_of_its_declared_datatype_is_refused_naming_the_input(tensor, words):
    """Issue review (fixes2 item 1): FP32 data holding strings, BYTES holding numbers and a shape
    of [true] (read as [1]) passed; the Open Inference Protocol's data are of the tensor's
    datatype (strings for BYTES, numbers for FP*, integers for INT* within the datatype's range,
    never a boolean): a `RequestError` naming ``inputs[i].data`` (or ``.shape``) and the datatype,
    the server's 400."""
    with pytest.raises(RequestError, match=words):
        protocol.parse_oip(_oip(tensor), list(FIELDS.values()), 100)


@pytest.mark.parametrize("body,where", [
    (_oip(parameters={"user_id": True}), r"^parameters\.user_id: expected a string or an integer, got bool"),
    ({**_body(), "user_id": True}, r"^user_id: expected a string or an integer, got bool"),
])
def test_a_boolean_user_id_is_refused_not_read_as_an_id(body, where):
    """``user_id: true`` became the id "True"; ids are strings or integers."""
    parse = protocol.parse_oip if "inputs" in body else protocol.parse_json
    with pytest.raises(RequestError, match=where):
        parse(body, list(FIELDS.values()), 100)


@pytest.mark.parametrize("outputs,words", [
    ([{"name": "scores"}, {"name": "probabilities"}],
     r"^outputs\[1\]\.name: 'probabilities': not an output of this model \(outputs: scores\)"),
    ([{"parameters": {"binary_data": True}}], r"^outputs\[0\]\.name: missing"),
    ({"name": "scores"}, r"^outputs: expected a list of requested outputs, got dict"),
])
def test_an_output_the_model_does_not_have_is_refused_naming_it(outputs, words):
    """Triton answers 400 for an unknown output name; an unknown name was ignored here."""
    with pytest.raises(RequestError, match=words):
        protocol.parse_oip(_oip(outputs=outputs), list(FIELDS.values()), 100)
