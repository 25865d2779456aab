"""Triton's own HTTP client against `gmeta-ds serve` (issue 51 items 1 and 3): tritonclient.http
with its defaults (binary tensors in, binary outputs back) scores a user as the OIP v2 JSON path
does, the repository index lists the model, and malformed binary bodies are 400s naming the
header or the input, with the server still up. The codec itself (gmeta_ds.serving.binary) is
checked in process against tritonclient's own encoders and decoders."""
from __future__ import annotations

import httpx
import numpy as np
import orjson
import pytest

tritonclient_http = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the dev extra")
from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

from gmeta_ds.serving import binary, protocol
from gmeta_ds.serving.encoding import RequestError
from tests.unit.test_serving_adapter import requests
from tests.unit.test_serving_server import _oip_body

MODEL = "dcnv2"


def _arrays(user) -> dict[str, np.ndarray]:
    """A `UserRequest` as the numpy arrays a tritonclient user sends (_oip_body's tensors)."""
    arrays = {"user.age": np.array([user.candidates["age"][0]], dtype=object),
              "support.label": np.array(user.labels, np.float32)}
    for part, columns in (("support", user.support), ("candidates", user.candidates)):
        for name, values in columns.items():
            if name != "age":
                data = ["|".join(v) for v in values] if name == "tags" else values
                arrays[f"{part}.{name}"] = np.array(data, dtype=object)
    return arrays


def _inputs(arrays: dict[str, np.ndarray], client=tritonclient_http) -> list:
    """tritonclient inputs with its defaults: `set_data_from_numpy` sends binary data (over
    ``client``, tritonclient.http or tritonclient.grpc: its raw_input_contents)."""
    inputs = []
    for name, array in arrays.items():
        tensor = client.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _host(url: str) -> str:
    return url.removeprefix("http://")


def test_tritonclient_defaults_score_as_the_json_path(server):
    url, _, data = server
    users = requests(data, data.test)[:3]
    client = tritonclient_http.InferenceServerClient(_host(url), network_timeout=30.0)
    outputs = [None, [tritonclient_http.InferRequestedOutput("scores")],  # both binary, as the client defaults
               [tritonclient_http.InferRequestedOutput("scores", binary_data=False)]]  # binary in, JSON out
    for i, (user, wanted) in enumerate(zip(users, outputs)):
        # other user ids: each path adapts its user itself (a cached result would hide a decoding error)
        result = client.infer(MODEL, _inputs(_arrays(user)), outputs=wanted, parameters={"user_id": f"triton-{i}"})
        body = {**_oip_body(user), "parameters": {"user_id": f"json-{i}"}}
        reply = httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=30).json()
        scores = result.as_numpy("scores")
        assert scores.dtype == np.float32 and scores.shape == (len(user.candidates["item"]),)
        np.testing.assert_allclose(scores, reply["outputs"][0]["data"], rtol=0, atol=1e-6)
        response = result.get_response()
        assert response["model_version"] == reply["model_version"] and response["parameters"]["adapted"]
        assert ("binary_data_size" in response["outputs"][0].get("parameters", {})) == (i < 2)


def test_the_repository_index_lists_the_served_model(server):
    url = server[0]
    client = tritonclient_http.InferenceServerClient(_host(url), network_timeout=30.0)
    version = httpx.get(f"{url}/v2/models/{MODEL}", timeout=10).json()["versions"][0]
    assert client.get_model_repository_index() == [{"name": MODEL, "version": version, "state": "READY"}]
    assert "model_repository" in client.get_server_metadata()["extensions"]


def _binary_body(tensors: list[tuple[dict, bytes]], header_length: int | None = None, tail: bytes = b""):
    """(content, headers) of a binary request: each (input's JSON, its raw bytes)."""
    header = orjson.dumps({"inputs": [t for t, _ in tensors]})
    length = len(header) if header_length is None else header_length
    content = header + b"".join(raw for _, raw in tensors) + tail
    return content, {binary.HEADER: str(length), "content-type": "application/octet-stream"}


def _item(raw: bytes, shape=(1,), size: int | None = None) -> tuple[dict, bytes]:
    size = len(raw) if size is None else size
    return {"name": "candidates.item", "shape": list(shape), "datatype": "BYTES",
            "parameters": {"binary_data_size": size}}, raw


def _label(raw: bytes, size: int | None = None, datatype: str = "FP32") -> tuple[dict, bytes]:
    size = len(raw) if size is None else size
    return {"name": "support.label", "shape": [2], "datatype": datatype,
            "parameters": {"binary_data_size": size}}, raw


ITEM = serialize_byte_tensor(np.array(["i1"], dtype=object)).item()
MALFORMED = [  # (content and headers, the field named, words of the message)
    (_binary_body([_item(ITEM)], header_length=10_000), binary.HEADER, "past the body"),
    (_binary_body([_item(ITEM)], header_length=-1), binary.HEADER, "non-negative integer"),
    (_binary_body([_item(ITEM)])[:1] + ({binary.HEADER: "12.5"},), binary.HEADER, "non-negative integer"),
    # digits int() would take or choke on: a superscript two (latin-1), past Python's 4,300-digit bound
    (_binary_body([_item(ITEM)])[:1] + ({binary.HEADER: b"\xb2"},), binary.HEADER, "non-negative integer"),
    (_binary_body([_item(ITEM)])[:1] + ({binary.HEADER: "9" * 5000},), binary.HEADER, "past the body"),
    (_binary_body([_label(b"\0" * 12)]), "inputs[0].parameters.binary_data_size", "'support.label': 12 bytes"),
    (_binary_body([_label(b"\0" * 16, datatype="INT32")]), "inputs[0].parameters.binary_data_size",
     "shape [2] of INT32 takes 8"),
    (_binary_body([_item(ITEM, shape=(2,))]), "inputs[0].parameters.binary_data_size", "'candidates.item'"),
    (_binary_body([_item(b"\x10\0\0\0i1")]), "inputs[0].parameters.binary_data_size", "past the tensor"),
    (_binary_body([_item(b"\2\0\0\0\xff\xfe")]), "inputs[0].parameters.binary_data_size", "not UTF-8"),
    (_binary_body([_item(ITEM)], tail=b"\0" * 4), "inputs", "add up to 6 bytes, but 10"),
    (_binary_body([_item(ITEM, size=100)]), "inputs[0].parameters.binary_data_size", "past the 6 bytes"),
    (_binary_body([_item(ITEM, size=-6)]), "inputs[0].parameters.binary_data_size", "non-negative integer"),
    (_binary_body([_label(b"\0" * 8, datatype="UINT8")]), "inputs[0].datatype", "'UINT8'"),
    (_binary_body([_label(b"\0" * 8, datatype=["FP32"])]), "inputs[0].datatype", "['FP32']"),
    (_binary_body([({"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0],
                     "parameters": {"binary_data_size": 4}}, b"\0" * 4)]), "inputs[0].data", "both"),
    ((b"\xff\xfe{", {binary.HEADER: "3"}), "body", "not valid JSON"),
]


@pytest.mark.parametrize("request_,field,words", MALFORMED, ids=[f"{m[1]}-{i}" for i, m in enumerate(MALFORMED)])
def test_a_malformed_binary_body_is_a_400_naming_the_input(server, request_, field, words):
    url = server[0]
    content, headers = request_
    reply = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=content, headers=headers, timeout=30)
    assert reply.status_code == 400 and reply.json()["field"] == field, reply.text
    assert words in reply.json()["error"], reply.text


def test_a_binary_body_past_the_limit_is_refused_before_it_is_read_and_the_server_stays_up(server):
    url = server[0]
    content, headers = _binary_body([_item(serialize_byte_tensor(np.array(["x" * 300_000], dtype=object)).item())])
    reply = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=content, headers=headers, timeout=30)
    assert reply.status_code == 413 and reply.json()["field"] == "body", reply.text
    assert httpx.get(f"{url}/v2/health/live", timeout=10).status_code == 200


def test_the_codec_reads_tritonclients_bytes_as_the_json_path_reads_json():
    """In process: every input tritonclient can send for this protocol decodes to the `data`
    list its JSON form holds, and parse_oip then builds the same request from either."""
    arrays = {"user.age": np.array(["a1"], dtype=object), "support.item": np.array(["i1", "ü", ""], dtype=object),
              "support.label": np.array([1.0, 0.0, 0.5], np.float32), "candidates.item": np.array([3, 4], np.int64),
              "candidates.n": np.array([5], np.int32), "candidates.x": np.array([0.25], np.float64)}
    assert set(binary.NUMPY_TYPES) | {"BYTES"} == set(protocol.OIP_TYPES)
    inputs = _inputs(arrays)
    body, header_length = tritonclient_http._utils._get_inference_request(
        inputs, "", None, 0, False, False, 0, None, None)
    header, tensors = binary.split_body(bytearray(body), str(header_length))
    decoded = binary.fill_inputs(orjson.loads(header), tensors)
    for tensor, (name, array) in zip(decoded["inputs"], arrays.items()):
        assert tensor["name"] == name and tensor["data"] == array.tolist(), name
    with pytest.raises(RequestError, match=r"^inputs: the binary inputs' binary_data_size add up"):
        binary.fill_inputs(orjson.loads(header), tensors + b"\0")


def test_a_binary_reply_reads_back_in_tritonclient():
    answer = {"model_name": "m", "model_version": "v", "id": "r1", "parameters": {"cached": False},
              "outputs": [{"name": "scores", "datatype": "FP32", "shape": [3], "data": [0.5, 0.125, 1e-3]}]}
    body, headers = binary.reply_body(binary.encode_reply(answer))
    length = int(dict(headers)[binary.HEADER.lower().encode()])
    result = tritonclient_http.InferResult.from_response_body(body, header_length=length)
    np.testing.assert_array_equal(result.as_numpy("scores"), np.float32([0.5, 0.125, 1e-3]))
    assert result.get_response()["id"] == "r1" and result.get_response()["parameters"] == {"cached": False}


@pytest.mark.parametrize("body,binary_out", [
    ({}, False), ({"parameters": {"binary_data_output": True}}, True),
    ({"parameters": {"binary_data_output": True}, "outputs": [{"name": "scores", "parameters": {"binary_data": False}}]},
     False),
    ({"outputs": [{"name": "scores", "parameters": {"binary_data": True}}]}, True),
    ({"parameters": {"binary_data_output": True}, "outputs": [{"name": "scores"}]}, True),
    ({"parameters": {"binary_data_output": "yes"}}, False),
])
def test_the_output_form_follows_the_request(body, binary_out):
    assert binary.wants_binary(body) is binary_out
