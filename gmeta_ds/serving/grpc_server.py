"""Open Inference Protocol v2 over gRPC, beside ``gmeta-ds serve``'s HTTP (``--grpc-port``).

KServe's and Triton's service ``inference.GRPCInferenceService`` (gmeta_ds/serving/proto/
grpc_predict_v2.proto): ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata,
ModelInfer, and Triton's RepositoryIndex (tritonclient.grpc's ``get_model_repository_index``).
grpc.aio serves it on the event loop uvicorn runs, through the HTTP server's `App`: a gRPC user
joins the same batches as HTTP users, and the cache, metrics (endpoint ``grpc/<Call>``, status
the gRPC code's name) and request checks are the same. A ModelInferRequest's inputs are
decoded (`request_tensors`: each input's typed ``contents``, or its entry of
``raw_input_contents`` as Triton's binary extension lays it out) and read column by column into
the user (`read_user`, `protocol.fast_oip`); a request that is not plainly well-formed is read
from its JSON form (`request_body`) by `protocol.parse_oip`, as for HTTP, so an error names the
same field. The scores go back
raw (``raw_output_contents``) when the request came raw, as tritonclient.grpc sends by
default, else in ``contents.fp32_contents``.

A failure is the call's status, its details the HTTP answer's ``field: message``:
INVALID_ARGUMENT for a bad request, NOT_FOUND for a model name (or version) this server does not
serve, UNAVAILABLE while the service is not ready (stopping), RESOURCE_EXHAUSTED for a message
over ``--max-body-bytes`` (grpc's own receive limit), INTERNAL for a bug (the server keeps serving).
"""
from __future__ import annotations

import math
from contextlib import asynccontextmanager

import grpc
import numpy as np
from google.protobuf import json_format

from gmeta_ds.errors import ConfigError
from gmeta_ds.serving import binary
from gmeta_ds.serving.encoding import RequestError
from gmeta_ds.serving.model import UserRequest
from gmeta_ds.serving.proto import grpc_predict_v2_pb2 as pb
from gmeta_ds.serving.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from gmeta_ds.serving.protocol import (
    fast_oip,
    oip_metadata,
    oip_repository_index,
    oip_response,
    oip_server_metadata,
    parse_oip,
)
from gmeta_ds.serving.server import App, HTTPProblem, check_listenable

# each OIP datatype the server reads -> its field of InferTensorContents
CONTENTS = {"INT64": "int64_contents", "INT32": "int_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}
# the HTTP statuses of `HTTPProblem` -> gRPC's codes (any other 4xx: INVALID_ARGUMENT)
CODES = {403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
         413: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


def request_body(request: pb.ModelInferRequest) -> dict:
    """The OIP v2 JSON form of ``request`` (what `protocol.parse_oip` reads): each input's
    values from its typed ``contents`` or its ``raw_input_contents`` entry, the request's
    parameters as plain values, the outputs it asks for and its id when it has them."""
    body = {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}
                       for name, datatype, shape, data in request_tensors(request)],
            "parameters": {key: _parameter_value(p) for key, p in request.parameters.items()}}
    if request.outputs:  # the outputs asked for (`parse_oip` refuses a name the model lacks)
        body["outputs"] = [{"name": output.name} for output in request.outputs]
    return {**body, "id": request.id} if request.id else body


def request_tensors(request: pb.ModelInferRequest) -> list[tuple[str, str, list, list]]:
    """(name, datatype, shape, flat values) of each input of ``request``, its values from its
    typed ``contents`` or its ``raw_input_contents`` entry."""
    raw, inputs = request.raw_input_contents, request.inputs
    if raw and len(raw) != len(inputs):
        raise RequestError("raw_input_contents", f"{len(raw)} entries for {len(inputs)} inputs; give one per "
                                                 "input, in the order of inputs")
    return [(t.name, t.datatype, list(t.shape), _from_raw(raw[i], t, i) if raw else _from_contents(t, i))
            for i, t in enumerate(inputs)]


def read_user(request: pb.ModelInferRequest, fields: list, max_rows: int) -> UserRequest:
    """The user of a ModelInferRequest, as `protocol.parse_oip` reads `request_body`'s form of
    it: by `protocol.fast_oip` from its decoded inputs when it is plainly well-formed (no row
    objects), else by `parse_oip` itself, which names the problem."""
    tensors = request_tensors(request)  # a malformed tensor: its error, as request_body raises it
    user_id = request.parameters.get("user_id")  # .get: indexing a message map adds the key
    user_id = None if user_id is None else _parameter_value(user_id)
    user = fast_oip(tensors, user_id, [output.name for output in request.outputs], fields, max_rows)
    return user if user is not None else parse_oip(request_body(request), fields, max_rows)


def _from_raw(data: bytes, tensor, i: int) -> list:
    """Input ``i``'s values from its raw bytes (row-major, little-endian; BYTES length-prefixed)."""
    if tensor.HasField("contents"):
        raise RequestError(f"inputs[{i}].contents", f"{tensor.name!r}: contents and raw_input_contents; give one")
    dtype, shape = binary.NUMPY_TYPES.get(tensor.datatype), tensor.shape
    if dtype is not None and len(shape) == 1 and len(data) == shape[0] * dtype.itemsize:
        return np.frombuffer(data, dtype).tolist()  # decode_tensor's values of a flat tensor, without its checks' dict
    where = f"raw_input_contents[{i}]"
    return binary.decode_tensor(data, {"name": tensor.name, "shape": list(tensor.shape), "datatype": tensor.datatype},
                         i, where)


def _from_contents(tensor, i: int) -> list:
    """Input ``i``'s values from the ``contents`` field of its datatype; [] for a datatype the
    server does not read (`parse_oip` names it) or a shape it refuses (`parse_oip` names it)."""
    field, shape = CONTENTS.get(tensor.datatype), list(tensor.shape)
    if field is None or any(d < 0 for d in shape):
        return []
    values = list(getattr(tensor.contents, field))
    if len(values) != math.prod(shape):
        raise RequestError(f"inputs[{i}].contents.{field}", f"{tensor.name!r}: {len(values)} values, but shape "
                                                            f"{shape} of {tensor.datatype} takes {math.prod(shape)}")
    if field != "bytes_contents":
        return values
    try:
        return [v.decode() for v in values]
    except UnicodeDecodeError:
        raise RequestError(f"inputs[{i}].contents.bytes_contents", f"{tensor.name!r}: not UTF-8 text") from None


def _parameter_value(parameter: pb.InferParameter):
    """An InferParameter's value (bool, int, float or str), None when it holds none."""
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def _set_parameter(parameter: pb.InferParameter, value) -> None:
    """``parameter`` holding ``value`` in the field of its type (a bool is not an int here)."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)


def infer_response(answer: dict, raw: bool) -> pb.ModelInferResponse:
    """`protocol.oip_response`'s dict as a ModelInferResponse: each output's values in
    ``raw_output_contents`` (little-endian bytes) when ``raw``, else in its typed ``contents``."""
    reply = pb.ModelInferResponse(model_name=answer["model_name"], model_version=answer["model_version"],
                                  id=answer.get("id", ""))
    for key, value in answer["parameters"].items():
        _set_parameter(reply.parameters[key], value)
    for output in answer["outputs"]:
        tensor = reply.outputs.add(name=output["name"], datatype=output["datatype"], shape=output["shape"])
        if raw:
            dtype = binary.NUMPY_TYPES[output["datatype"]]
            reply.raw_output_contents.append(np.asarray(output["data"], dtype).tobytes())
        else:
            getattr(tensor.contents, CONTENTS[output["datatype"]]).extend(output["data"])
    return reply


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """The service's calls over an `App` (module docstring); ``ready`` while it takes requests."""

    def __init__(self, app: App):
        self.app, self.ready = app, False

    async def _call(self, context, endpoint: str, work):
        """``await work()``'s reply, or the call aborted with the status of what it raised;
        counted in the metrics either way."""
        try:
            code, reply = grpc.StatusCode.OK, await work()
        except HTTPProblem as exc:
            code, message = CODES.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT), str(exc)
        except RequestError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except Exception as exc:  # noqa: BLE001 - a bug is this call's INTERNAL; the server keeps serving
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
        self.app.metrics.count(f"grpc/{endpoint}", code.name)
        if code is not grpc.StatusCode.OK:
            await context.abort(code, message)
        return reply

    def _model(self, name: str, version: str = ""):
        """The model served, when ``name`` (and ``version``, if given) are its; else NOT_FOUND."""
        model = self.app.check_name(name)
        if version and version != model.version:
            raise HTTPProblem(404, "model_version", f"no version {version!r} of {name!r} here; this server "
                                                    f"serves {model.version!r}")
        return model

    def _check_ready(self) -> None:
        if not self.ready:
            raise HTTPProblem(503, "server", "not ready: the server is stopping")

    async def ServerLive(self, request, context):  # the protocol's names
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.ready)

    async def ModelReady(self, request, context):
        async def work():
            self._model(request.name, request.version)
            return pb.ModelReadyResponse(ready=self.ready)
        return await self._call(context, "ModelReady", work)

    async def ServerMetadata(self, request, context):
        return json_format.ParseDict(oip_server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, request, context):
        async def work():
            model = self._model(request.name, request.version)
            return json_format.ParseDict(oip_metadata(model.name, model.version, model.fields),
                                         pb.ModelMetadataResponse())
        return await self._call(context, "ModelMetadata", work)

    async def RepositoryIndex(self, request, context):
        model = self.app.holder.model
        index = oip_repository_index(model.name, model.version) if self.ready or not request.ready else []
        return json_format.ParseDict({"models": index}, pb.RepositoryIndexResponse())

    async def ModelInfer(self, request, context):
        async def work():
            self._check_ready()
            self._model(request.model_name, request.model_version)
            result, model = await self.app.score_body(request, read_user)
            answer = oip_response(result, model.name, model.version, request.id or None)
            return infer_response(answer, raw=bool(request.raw_input_contents))
        return await self._call(context, "ModelInfer", work)


def grpc_service(host: str, port: int):
    """`server.create_app`'s service serving `InferenceService` on ``host:port`` (0: a free
    port, printed) for the application's life; grpc refuses a message over the app's
    ``max_body_bytes`` before it is decoded. A port it cannot listen on is a `ConfigError`,
    here already when it is taken (before the export loads and uvicorn starts)."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if port:
        check_listenable(host, port, "--grpc-port")

    @asynccontextmanager
    async def run(app: App):
        # no SO_REUSEPORT (grpc's default): a second server on a taken port fails, not shares it
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", app.options.max_body_bytes),
                                          ("grpc.so_reuseport", 0)])
        service = InferenceService(app)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ConfigError([f"--grpc-port {port}: cannot listen on {address} ({exc})"]) from None
        await server.start()
        service.ready = True
        print(f"gmeta-ds serve: OIP v2 over gRPC (inference.GRPCInferenceService) on {host}:{bound}", flush=True)
        try:
            yield service
        finally:
            service.ready = False  # new calls: UNAVAILABLE; those under way finish within the grace
            await server.stop(grace=5)
    return run


