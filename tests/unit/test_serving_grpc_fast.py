"""The gRPC front's column-wise read of a ModelInferRequest (`grpc_server.read_user`, through
`protocol.fast_oip`), in process: for every well-formed request it takes the fast path and
gives the `UserRequest` that `parse_oip` gives of the request's JSON form (`request_body`); for
every malformed one it declines (None) and the error is `parse_oip`'s own, word for word."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gmeta_ds.serving.encoding import RequestError
from gmeta_ds.serving.grpc_server import read_user, request_body, request_tensors
from gmeta_ds.serving.proto import grpc_predict_v2_pb2 as pb
from gmeta_ds.serving.protocol import fast_oip, parse_oip
from gmeta_ds.sparse import FieldSpec

FIELDS = [FieldSpec("age", 10, "user"), FieldSpec("item", 100, "item"), FieldSpec("tags", 20, "item", multi_hot=True),
          FieldSpec("price", 5, "item")]
MAX_ROWS = 50
# (name, datatype, values) of a good request: a user field given once, support and candidates
GOOD = [("user.age", "BYTES", [b"25-34"]),
        ("support.item", "INT64", [3, 7, 9]), ("support.tags", "BYTES", [b"drama|comedy", b"", b"x"]),
        ("support.price", "INT64", [1, 2, 3]), ("support.label", "FP32", [1.0, 0.0, 1.0]),
        ("candidates.item", "INT64", [4, 5]), ("candidates.tags", "BYTES", [b"a", b"b|c"]),
        ("candidates.price", "INT64", [0, 4])]
FORMATS = {"INT64": ("<i8", "int64_contents"), "INT32": ("<i4", "int_contents"), "FP32": ("<f4", "fp32_contents"),
           "FP64": ("<f8", "fp64_contents")}


def _request(tensors=GOOD, raw: bool = True, user_id=None, outputs=(), request_id: str = "") -> pb.ModelInferRequest:
    """A ModelInferRequest of ``tensors``, each input in ``raw_input_contents`` (as tritonclient
    sends it) or in its typed ``contents``."""
    request = pb.ModelInferRequest(model_name="m", id=request_id)
    if user_id is not None:
        key = "string_param" if isinstance(user_id, str) else "bool_param" if isinstance(user_id, bool) else \
            "int64_param" if isinstance(user_id, int) else "double_param"
        setattr(request.parameters["user_id"], key, user_id)
    for name in outputs:
        request.outputs.add(name=name)
    for name, datatype, values in tensors:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[len(values)])
        if datatype == "BYTES":
            if raw:
                request.raw_input_contents.append(b"".join(len(v).to_bytes(4, "little") + v for v in values))
            else:
                tensor.contents.bytes_contents.extend(values)
        elif raw:
            request.raw_input_contents.append(np.asarray(values, FORMATS[datatype][0]).tobytes())
        else:
            getattr(tensor.contents, FORMATS[datatype][1]).extend(values)
    return request


def _replace(name: str, datatype: str, values: list) -> list:
    return [(n, datatype, values) if n == name else (n, d, v) for n, d, v in GOOD]


def _fast(request_: pb.ModelInferRequest):
    """`fast_oip` of the request's decoded inputs, user id and requested outputs."""
    user_id = request_.parameters.get("user_id")
    user_id = None if user_id is None else getattr(user_id, user_id.WhichOneof("parameter_choice"))
    return fast_oip(request_tensors(request_), user_id, [o.name for o in request_.outputs], FIELDS, MAX_ROWS)


WELL_FORMED = {
    "raw": _request(),
    "typed": _request(raw=False),
    "string user id, asked for scores, an id": _request(user_id="u7", outputs=["scores"], request_id="r1"),
    "integer user id": _request(user_id=17),
    "user field also in the rows": _request([*GOOD, ("candidates.age", "BYTES", [b"18-24", b"25-34"])]),
    "no support": _request([t for t in GOOD if not t[0].startswith("support.")]),
    "integer labels, INT32 and FP64 ids": _request(
        [*_replace("support.label", "INT64", [1, 0, 1])[:5], ("candidates.item", "INT32", [4, 5]), GOOD[6],
         ("candidates.price", "FP64", [0.0, 4.0])], raw=False),
    "a tensor given twice (the last counts)": _request([*GOOD, ("candidates.price", "INT64", [1, 1])]),
    "user field given in every part": _request([*GOOD, ("support.age", "BYTES", [b"a", b"b", b"c"])], raw=False),
}


@pytest.mark.parametrize("request_", WELL_FORMED.values(), ids=WELL_FORMED.keys())
def test_a_well_formed_request_is_read_by_columns_as_parse_oip_reads_it(request_):
    expected = parse_oip(request_body(request_), FIELDS, MAX_ROWS)
    fast = _fast(request_)
    assert fast is not None, "a well-formed request left the fast path"
    assert fast == expected and read_user(request_, FIELDS, MAX_ROWS) == expected
    assert list(fast.support) == list(expected.support) and type(fast.labels[0] if fast.labels else 0.0) is float


def _without(name: str) -> list:
    return [t for t in GOOD if t[0] != name]


MALFORMED = {
    "unknown output": _request(outputs=["probabilities"]),
    "unknown field": _request([*GOOD, ("support.colour", "INT64", [1, 2, 3])]),
    "unknown part": _request([*GOOD, ("query.item", "INT64", [1])]),
    "label of candidates": _request([*GOOD, ("candidates.label", "FP32", [1.0, 0.0])]),
    "NaN label": _request(_replace("support.label", "FP32", [1.0, math.nan, 0.0])),
    "infinite label": _request(_replace("support.label", "FP64", [1.0, math.inf, 0.0])),
    "text label": _request(_replace("support.label", "BYTES", [b"1", b"0", b"1"])),
    "no labels": _request(_without("support.label")),
    "a field missing from the candidates": _request(_without("candidates.price")),
    "rows of different lengths": _request(_replace("candidates.price", "INT64", [0, 4, 2])),
    "two values for a user field": _request(_replace("user.age", "BYTES", [b"a", b"b"])),
    "no candidates": _request([t for t in GOOD if not t[0].startswith("candidates.")]),
    "rows past --max-rows": _request([(n, d, v * 30) for n, d, v in GOOD if n.startswith("candidates.")] + GOOD[:5]),
    "a boolean user id": _request(user_id=True),
    "a float user id": _request(user_id=2.5),
}


def _unknown_datatype() -> pb.ModelInferRequest:
    request = _request(raw=False)
    request.inputs[1].datatype = "UINT8"
    return request


def _two_dimensions() -> pb.ModelInferRequest:
    request = _request(raw=False)
    request.inputs[5].shape[:] = [1, 2]
    return request


MALFORMED["an unknown datatype"] = _unknown_datatype()
MALFORMED["a shape of two dimensions"] = _two_dimensions()


@pytest.mark.parametrize("request_", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_request_leaves_the_fast_path_and_gets_parse_oips_error(request_):
    with pytest.raises(RequestError) as expected:
        parse_oip(request_body(request_), FIELDS, MAX_ROWS)
    assert _fast(request_) is None
    with pytest.raises(RequestError) as caught:
        read_user(request_, FIELDS, MAX_ROWS)
    assert str(caught.value) == str(expected.value) and caught.value.field == expected.value.field


def test_a_malformed_tensor_is_refused_before_the_fast_path_as_before():
    """Raw bytes that disagree with the shape: `request_tensors` raises `request_body`'s error."""
    request = _request()
    request.raw_input_contents[1] = b"\0" * 3
    with pytest.raises(RequestError) as expected:
        request_body(request)
    with pytest.raises(RequestError) as caught:
        read_user(request, FIELDS, MAX_ROWS)
    assert str(caught.value) == str(expected.value) == \
        "raw_input_contents[1]: 'support.item': 3 bytes, but shape [3] of INT64 takes 24"
