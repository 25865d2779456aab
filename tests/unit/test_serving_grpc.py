"""Open Inference Protocol v2 over gRPC (issue 51 item 2): Triton's own gRPC client
(tritonclient.grpc) against the session's real `gmeta-ds serve --grpc-port` (tests/unit/
conftest.py's ``server``; 127.0.0.1 only, every call with a timeout). Scores equal the HTTP
JSON path's, raw and typed tensors alike; health, metadata and the repository index answer;
malformed requests are INVALID_ARGUMENT naming the input, an unknown model NOT_FOUND, a message
past --max-body-bytes RESOURCE_EXHAUSTED, and the server stays up. The requests built by hand
use tritonclient's own messages (its copy of the protocol: what we serve must read them)."""
from __future__ import annotations

import asyncio
import math
import socket

import grpc
import httpx
import numpy as np
import pytest

tritonclient_grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the dev extra")
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gmeta_ds.errors import ConfigError
from gmeta_ds.serving.grpc_server import InferenceService, grpc_service
from tests.unit.test_serving_adapter import requests
from tests.unit.test_serving_server import _oip_body
from tests.unit.test_serving_triton import _arrays, _inputs

MODEL = "dcnv2"
TIMEOUT = 30.0


def _typed_request(body: dict, model: str = MODEL) -> service_pb2.ModelInferRequest:
    """An OIP JSON body as a ModelInferRequest with typed ``contents`` (no raw bytes)."""
    request = service_pb2.ModelInferRequest(model_name=model, id=body.get("id", ""))
    for key, value in body.get("parameters", {}).items():
        request.parameters[key].string_param = value
    for tensor in body["inputs"]:
        grpc_tensor = request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        if tensor["datatype"] == "BYTES":
            grpc_tensor.contents.bytes_contents.extend(str(v).encode() for v in tensor["data"])
        else:
            grpc_tensor.contents.fp32_contents.extend(tensor["data"])
    return request


def _json_scores(url: str, user, user_id: str) -> dict:
    body = {**_oip_body(user), "parameters": {"user_id": user_id}}
    return httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=TIMEOUT).json()


def test_tritonclient_grpc_scores_as_the_json_path_raw_and_typed(server, grpc_address):
    url, _, data = server
    users = requests(data, data.test)[:3]
    client = tritonclient_grpc.InferenceServerClient(grpc_address)
    for i, user in enumerate(users[:2]):  # raw_input_contents in, raw_output_contents back (the defaults)
        # other user ids: each path adapts its user itself (a cached result would hide a decoding error)
        result = client.infer(MODEL, _inputs(_arrays(user), tritonclient_grpc), parameters={"user_id": f"grpc-{i}"},
                              request_id=f"req-{i}", client_timeout=TIMEOUT)
        reply = _json_scores(url, user, f"grpc-json-{i}")
        scores = result.as_numpy("scores")
        assert scores.dtype == np.float32 and scores.shape == (len(user.candidates["item"]),)
        np.testing.assert_allclose(scores, reply["outputs"][0]["data"], rtol=0, atol=1e-6)
        response = result.get_response()
        assert response.model_version == reply["model_version"] and response.id == f"req-{i}"
        assert response.parameters["adapted"].bool_param and len(response.raw_output_contents) == 1
    with grpc.insecure_channel(grpc_address) as channel:  # typed contents in, typed contents back
        body = {**_oip_body(users[2]), "parameters": {"user_id": "grpc-typed"}}
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(_typed_request(body), timeout=TIMEOUT)
    reply = _json_scores(url, users[2], "grpc-json-typed")
    assert not response.raw_output_contents and response.outputs[0].datatype == "FP32"
    np.testing.assert_allclose(response.outputs[0].contents.fp32_contents, reply["outputs"][0]["data"], rtol=0,
                               atol=1e-6)
    metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    assert 'gmeta_serve_requests_total{endpoint="grpc/ModelInfer",status="OK"}' in metrics


def test_live_ready_metadata_and_the_repository_index(server, grpc_address):
    url = server[0]
    client = tritonclient_grpc.InferenceServerClient(grpc_address)
    assert client.is_server_live(client_timeout=TIMEOUT) and client.is_server_ready(client_timeout=TIMEOUT)
    assert client.is_model_ready(MODEL, client_timeout=TIMEOUT)
    http = httpx.get(f"{url}/v2/models/{MODEL}", timeout=TIMEOUT).json()
    metadata = client.get_model_metadata(MODEL, as_json=True, client_timeout=TIMEOUT)
    assert metadata["name"] == MODEL and metadata["versions"] == http["versions"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == \
        [(t["name"], t["datatype"], [str(d) for d in t["shape"]]) for t in http["inputs"]]  # JSON's int64: text
    server_metadata = client.get_server_metadata(as_json=True, client_timeout=TIMEOUT)
    assert server_metadata["name"] == "gmeta-ds" and "model_repository" in server_metadata["extensions"]
    index = client.get_model_repository_index(as_json=True, client_timeout=TIMEOUT)
    assert index["models"] == [{"name": MODEL, "version": http["versions"][0], "state": "READY"}]


def _request_with(server, change) -> service_pb2.ModelInferRequest:
    """A good typed request of the first test user, then ``change(request)``."""
    _, _, data = server
    request = _typed_request(_oip_body(requests(data, data.test)[0]))
    change(request)
    return request


def _raw(request):
    """The request with every input's values as raw_input_contents (as tritonclient sends them)."""
    for tensor in request.inputs:
        if tensor.datatype == "BYTES":
            values = list(tensor.contents.bytes_contents)
            raw = b"".join(len(v).to_bytes(4, "little") + v for v in values)
        else:
            raw = np.asarray(tensor.contents.fp32_contents, np.float32).tobytes()
        request.raw_input_contents.append(raw)
        tensor.ClearField("contents")


def _label(value: float):
    def change(request):
        request.inputs[1].contents.fp32_contents[0] = value
    return change


BAD = [  # (change to a good request, the gRPC code, words the details hold)
    (lambda r: (_raw(r), r.raw_input_contents.__setitem__(1, b"\0" * 3)), "INVALID_ARGUMENT",
     "raw_input_contents[1]: 'support.label': 3 bytes"),
    (lambda r: (_raw(r), r.raw_input_contents.pop()), "INVALID_ARGUMENT", "raw_input_contents: "),
    (lambda r: (_raw(r), r.inputs[0].contents.bytes_contents.append(b"x")), "INVALID_ARGUMENT",
     "inputs[0].contents: 'user.age': contents and raw_input_contents"),
    (lambda r: r.inputs[1].contents.fp32_contents.append(1.0), "INVALID_ARGUMENT",
     "inputs[1].contents.fp32_contents: 'support.label'"),
    (lambda r: r.inputs[0].contents.bytes_contents.__setitem__(0, b"\xff"), "INVALID_ARGUMENT",
     "inputs[0].contents.bytes_contents: 'user.age': not UTF-8"),
    (lambda r: setattr(r.inputs[2], "name", "support.colour"), "INVALID_ARGUMENT", "inputs[2].name: 'support.colour'"),
    (lambda r: setattr(r.inputs[1], "datatype", "UINT8"), "INVALID_ARGUMENT", "inputs[1].datatype: 'UINT8'"),
    (lambda r: r.outputs.add(name="probabilities"), "INVALID_ARGUMENT",
     "outputs[0].name: 'probabilities': not an output of this model (outputs: scores)"),
    (_label(math.nan), "INVALID_ARGUMENT", "support[0].label: expected a finite number"),
    (lambda r: setattr(r, "model_name", "no-such-model"), "NOT_FOUND", "model name: no model 'no-such-model'"),
    (lambda r: setattr(r, "model_version", "0"), "NOT_FOUND", "model_version: no version '0'"),
]


@pytest.mark.parametrize("change,code,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_request_is_its_status_naming_the_input(server, grpc_address, change, code, words):
    with grpc.insecure_channel(grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(_request_with(server, change), timeout=TIMEOUT)
        assert caught.value.code().name == code and words in caught.value.details(), caught.value.details()
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=TIMEOUT).live


def test_tritonclient_sees_not_found_and_a_message_past_the_limit_is_refused(server, grpc_address):
    _, _, data = server
    client = tritonclient_grpc.InferenceServerClient(grpc_address)
    arrays = _arrays(requests(data, data.test)[0])
    with pytest.raises(InferenceServerException) as caught:
        client.infer("no-such-model", _inputs(arrays, tritonclient_grpc), client_timeout=TIMEOUT)
    assert caught.value.status() == "StatusCode.NOT_FOUND" and "no model 'no-such-model'" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("no-such-model", client_timeout=TIMEOUT)
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    arrays["candidates.item"] = np.array(["x" * 300_000], dtype=object)  # past the server's 200,000 bytes
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, _inputs(arrays, tritonclient_grpc), client_timeout=TIMEOUT)
    assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert client.is_server_ready(client_timeout=TIMEOUT)


class _Context:
    """What `InferenceService` uses of grpc.aio's context: ``abort`` raises."""

    async def abort(self, code, details):
        raise grpc.RpcError(code, details)


class _Counted:
    def __init__(self):
        self.seen = []

    def count(self, endpoint, status):
        self.seen.append((endpoint, status))


def test_a_service_not_ready_answers_unavailable_and_says_so():
    """In process: while the service is stopping (``ready`` false), ModelInfer is UNAVAILABLE
    before anything is read, ServerReady says false, and the call is counted."""
    app = type("App", (), {"metrics": _Counted()})()
    service = InferenceService(app)
    with pytest.raises(grpc.RpcError) as caught:
        asyncio.run(service.ModelInfer(service_pb2.ModelInferRequest(model_name=MODEL), _Context()))
    assert caught.value.args == (grpc.StatusCode.UNAVAILABLE, "server: not ready: the server is stopping")
    assert app.metrics.seen == [("grpc/ModelInfer", "UNAVAILABLE")]
    assert not asyncio.run(service.ServerReady(None, _Context())).ready


def test_a_taken_grpc_port_is_refused_naming_it():
    """In process: ``--grpc-port`` on a port another socket listens on is a one-line
    `ConfigError` when the service is made (the CLI's exit 2), before any export loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--grpc-port {port}: cannot listen on 127.0.0.1:{port}"):
            grpc_service("127.0.0.1", port)


def test_a_taken_http_port_is_refused_naming_it_before_the_export_loads(tmp_path):
    """``gmeta-ds serve --port`` on a taken port: a one-line `ConfigError` naming ``--port``
    before the export is read (here there is none: the port's error comes first), not uvicorn's
    bind failure after seconds of loading."""
    from gmeta_ds.serving.server import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"- --port {port}: cannot listen on 127.0.0.1:{port} \(Address already"):
            serve(tmp_path / "no-export", "127.0.0.1", port)


def test_the_checked_in_generated_modules_equal_a_fresh_generation():
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the dev extra")
    from gmeta_ds.serving.proto.generate import stale

    assert stale() == [], "run make proto (python -m gmeta_ds.serving.proto.generate) and commit its output"
