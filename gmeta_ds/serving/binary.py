"""Triton's binary tensor data extension on ``POST /v2/models/{name}/infer``.

What tritonclient.http sends and asks for by default (``InferInput.set_data_from_numpy``):
the request body is a JSON header of ``Inference-Header-Content-Length`` bytes, then each
input's raw bytes, in the order of ``inputs``, for the inputs whose
``parameters.binary_data_size`` gives their size (the others keep their JSON ``data``)::

    {"inputs": [{"name": "candidates.item_id", "shape": [2], "datatype": "INT64",
                 "parameters": {"binary_data_size": 16}}, ...]}<16 bytes: 2 int64, little-endian>...

A ``BYTES`` tensor's elements are each a 4-byte little-endian length, then that many bytes.
Outputs come back the same way when the request's ``parameters.binary_data_output`` is true or
the output's own ``parameters.binary_data`` says so (the output's word wins): the JSON header
(with the response header ``Inference-Header-Content-Length``), ``binary_data_size`` in place of
``data``, then the raw little-endian bytes.

`split_body` and `fill_inputs` turn a binary request into the JSON form `protocol.parse_oip`
reads (``data`` lists of Python values, as JSON would give them), so every later check is the
JSON path's; `wants_binary` and `encode_reply` write the answer. Every malformed body is a
`RequestError` naming the header or the input, which the server answers with a 400.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import orjson

from gmeta_ds.serving.encoding import RequestError

HEADER = "Inference-Header-Content-Length"
# the fixed-size datatypes `protocol.OIP_TYPES` accepts, as little-endian numpy dtypes; BYTES apart
NUMPY_TYPES = {"FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"), "INT64": np.dtype("<i8"), "INT32": np.dtype("<i4")}
_LENGTH = struct.Struct("<I")


class BinaryReply:
    """An infer answer whose outputs go as raw bytes: ``header`` (the OIP response dict, each
    output's ``data`` replaced by ``parameters.binary_data_size``) and ``raw`` (those bytes)."""

    __slots__ = ("header", "raw")

    def __init__(self, header: dict, raw: bytes):
        self.header, self.raw = header, raw


def split_body(data: bytes, header_length: str) -> tuple[bytes, bytes]:
    """(JSON header, the tensors' bytes) of a request body, ``header_length`` being its
    ``Inference-Header-Content-Length`` header as sent."""
    text = header_length.strip()
    # ASCII digits only: str.isdigit also takes '²', which int() refuses
    if not (text.isascii() and text.isdigit()):
        raise RequestError(HEADER, f"{header_length!r:.80}; expected the JSON header's length in bytes, "
                                   "a non-negative integer")
    digits = text.lstrip("0") or "0"
    # more digits than the body's length has is past it (and int() refuses over 4,300 digits)
    if len(digits) > len(str(len(data))) or int(digits) > len(data):
        raise RequestError(HEADER, f"{digits:.40} bytes, past the body's {len(data)}")
    size = int(digits)
    return data[:size], data[size:]


def fill_inputs(body, tensors: bytes) -> dict:
    """``body`` (the decoded JSON header) with each binary input's ``data`` decoded from
    ``tensors`` (their bytes, in the order of ``inputs``); every byte must belong to one."""
    inputs = body.get("inputs") if isinstance(body, dict) else None
    if not isinstance(inputs, list):
        raise RequestError("inputs", "missing: an OIP v2 request holds a list of input tensors")
    offset = 0
    for i, tensor in enumerate(inputs):
        size = _binary_size(i, tensor)
        if size is None:
            continue
        if offset + size > len(tensors):
            raise RequestError(f"inputs[{i}].parameters.binary_data_size",
                               f"{_name(tensor)}: {size} bytes from byte {offset}, past the "
                               f"{len(tensors)} bytes that follow the JSON header")
        where = f"inputs[{i}].parameters.binary_data_size"
        tensor["data"] = decode_tensor(tensors[offset:offset + size], tensor, i, where)
        offset += size
    if offset != len(tensors):
        raise RequestError("inputs", f"the binary inputs' binary_data_size add up to {offset} bytes, but "
                                     f"{len(tensors)} follow the JSON header")
    return body


def _binary_size(i: int, tensor) -> int | None:
    """An input's ``parameters.binary_data_size``, or None for an input whose data is JSON."""
    params = tensor.get("parameters") if isinstance(tensor, dict) else None
    if not isinstance(params, dict) or "binary_data_size" not in params:
        return None
    size = params["binary_data_size"]
    where = f"inputs[{i}].parameters.binary_data_size"
    if type(size) is not int or size < 0:
        raise RequestError(where, f"{_name(tensor)}: {size!r}; expected a non-negative integer (bytes)")
    if "data" in tensor:
        raise RequestError(f"inputs[{i}].data", f"{_name(tensor)}: both data and binary_data_size; give one")
    return size


def decode_tensor(raw: bytes, tensor: dict, i: int, where: str) -> list:
    """The flat values of input ``i``'s raw bytes, checked against its shape and datatype;
    ``where`` names the bytes in an error (its ``binary_data_size`` here, gRPC's
    ``raw_input_contents[i]`` in `gmeta_ds.serving.grpc_server`)."""
    shape, datatype = tensor.get("shape"), tensor.get("datatype")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise RequestError(f"inputs[{i}].shape", f"{_name(tensor)}: {shape!r}; expected a list of "
                                                 "non-negative integers")
    count = math.prod(shape)
    if datatype == "BYTES":
        return _decode_bytes(raw, count, where, _name(tensor))
    dtype = NUMPY_TYPES.get(datatype) if isinstance(datatype, str) else None  # a list is unhashable
    if dtype is None:
        raise RequestError(f"inputs[{i}].datatype", f"{_name(tensor)}: {datatype!r}; expected one of "
                                                    f"{', '.join([*NUMPY_TYPES, 'BYTES'])}")
    if len(raw) != count * dtype.itemsize:
        raise RequestError(where, f"{_name(tensor)}: {len(raw)} bytes, but shape {shape} of {datatype} "
                                  f"takes {count * dtype.itemsize}")
    return np.frombuffer(raw, dtype).tolist()


def _decode_bytes(raw: bytes, count: int, where: str, name: str) -> list[str]:
    """``count`` BYTES elements, each a 4-byte little-endian length then its UTF-8 text."""
    values, offset = [], 0
    for k in range(count):
        if offset + 4 > len(raw):
            raise RequestError(where, f"{name}: {len(raw)} bytes end inside element {k} of {count} "
                                      "(each is a 4-byte little-endian length, then its bytes)")
        (length,) = _LENGTH.unpack_from(raw, offset)
        start, offset = offset + 4, offset + 4 + length
        if offset > len(raw):
            raise RequestError(where, f"{name}: element {k} says {length} bytes, past the tensor's {len(raw)}")
        try:
            values.append(raw[start:offset].decode())
        except UnicodeDecodeError:
            raise RequestError(where, f"{name}: element {k} is not UTF-8 text") from None
    if offset != len(raw):
        raise RequestError(where, f"{name}: {len(raw)} bytes, but its {count} elements (its shape) "
                                  f"take {offset}")
    return values


def _name(tensor) -> str:
    name = tensor.get("name") if isinstance(tensor, dict) else None
    return repr(name) if isinstance(name, str) else "an input without a name"


def wants_binary(body: dict) -> bool:
    """Whether the answer's ``scores`` go as raw bytes: the output's ``parameters.binary_data``
    when the request lists it, else the request's ``parameters.binary_data_output``."""
    params, outputs = body.get("parameters"), body.get("outputs")
    default = params.get("binary_data_output") is True if isinstance(params, dict) else False
    if not isinstance(outputs, list):
        return default
    for output in outputs:
        if isinstance(output, dict) and output.get("name") == "scores":
            own = output.get("parameters")
            if isinstance(own, dict) and "binary_data" in own:
                return own["binary_data"] is True
    return default


def encode_reply(answer: dict) -> BinaryReply:
    """An OIP response dict (`protocol.oip_response`) with its FP32 outputs as raw bytes."""
    outputs, raw = [], []
    for output in answer["outputs"]:
        data = np.asarray(output["data"], NUMPY_TYPES[output["datatype"]]).tobytes()
        rest = {k: v for k, v in output.items() if k != "data"}
        outputs.append({**rest, "parameters": {**rest.get("parameters", {}), "binary_data_size": len(data)}})
        raw.append(data)
    return BinaryReply({**answer, "outputs": outputs}, b"".join(raw))


def reply_body(reply: BinaryReply) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """(body, headers) of a `BinaryReply`: the JSON header, then the raw outputs."""
    header = orjson.dumps(reply.header)
    return header + reply.raw, [(b"content-type", b"application/octet-stream"),
                                (HEADER.lower().encode(), b"%d" % len(header))]
