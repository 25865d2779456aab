"""Request bodies -> `UserRequest`, checked field by field, and results -> response bodies.

Two forms carry one user each:

- the plain JSON form (``POST /v1/score``)::

    {"user_id": "u17", "user": {"age": "25-34"},
     "support": [{"item": "i3", "tags": ["drama"], "label": 1}, ...],
     "candidates": [{"item": "i9", "tags": []}, ...]}

  ``user`` holds fields given once for every row (the user's own features); a row may also
  give them itself. ``support`` may be empty or absent: the candidates are then scored by the
  meta-initialisation (a user with no history yet).

- the Open Inference Protocol v2 (``POST /v2/models/{name}/infer``, as KServe and Triton speak
  it): one tensor per field and part, named ``user.<field>`` (shape [1]),
  ``support.<field>`` and ``support.label`` (shape [S]), ``candidates.<field>`` (shape [C]);
  a multi-hot field's value per row is one string of its values joined by ``|``; the user id
  goes in ``parameters.user_id``. The scores come back as the FP32 output ``scores`` (shape [C]).

Every problem is a `RequestError` naming where (``support[2].label``, ``inputs[1].shape``),
which the server answers with a 4xx.
"""
from __future__ import annotations

import math
from itertools import chain
from operator import itemgetter

from gmeta_ds.serving.encoding import RequestError
from gmeta_ds.serving.model import Scored, UserRequest
from gmeta_ds.sparse import FieldSpec

SCALARS = (str, int, float, bool)
OIP_TYPES = {"BYTES": str, "FP32": float, "FP64": float, "INT64": int, "INT32": int}
# the JSON values each datatype's data may hold (exact types: a boolean is neither a number nor
# an integer), and how an error says it; as KServe's and Triton's JSON readers take them
_OIP_VALUES = {"BYTES": (frozenset({str}), "strings"), "FP32": (frozenset({int, float}), "numbers"),
               "FP64": (frozenset({int, float}), "numbers"), "INT64": (frozenset({int}), "integers"),
               "INT32": (frozenset({int}), "integers")}
# the values an integer datatype can hold (Triton refuses a JSON value past them)
_INT_RANGE = {"INT32": (-(1 << 31), (1 << 31) - 1), "INT64": (-(1 << 63), (1 << 63) - 1)}
OUTPUTS = ("scores",)  # the outputs an infer request may ask for (`oip_metadata`)


def _rows(body: dict, part: str, fields: dict[str, FieldSpec], user: dict, labels: bool, max_rows: int):
    """The columns of ``body[part]`` (a list of row objects), user fields filled from ``user``."""
    rows = body.get(part, [])
    if not isinstance(rows, list):
        raise RequestError(part, f"expected a list of row objects, got {type(rows).__name__}")
    if len(rows) > max_rows:
        raise RequestError(part, f"{len(rows)} rows; at most {max_rows} per request (gmeta-ds serve --max-rows)")
    columns: dict[str, list] = {name: [] for name in fields}
    ys = []
    for i, row in enumerate(rows):
        where = f"{part}[{i}]"
        if not isinstance(row, dict):
            raise RequestError(where, f"expected an object of field values, got {type(row).__name__}")
        for key in row:
            if key not in fields and not (labels and key == "label"):
                raise RequestError(f"{where}.{key}", f"not a field of this model (fields: {', '.join(fields)}"
                                                      f"{', label' if labels else ''})")
        for name, spec in fields.items():
            value = row[name] if name in row else user.get(name, _MISSING)
            if value is _MISSING:
                raise RequestError(f"{where}.{name}", "missing (give it in the row, or once in 'user')")
            columns[name].append(_value(value, spec, f"{where}.{name}"))
        if labels:
            ys.append(_label(row.get("label", _MISSING), f"{where}.label"))
    return columns, ys


_MISSING = object()
_PLAIN = frozenset({str, int, float, bool, type(None)})  # what JSON decodes a single-hot value to
_SCALAR = _PLAIN - {type(None)}  # what a multi-hot field's list may hold
_NUMBER = frozenset({int, float})
_DICT, _LIST = frozenset({dict}), frozenset({list})


def _fast_rows(body: dict, part: str, fields: dict[str, FieldSpec], user: dict, labels: bool, max_rows: int):
    """`_rows` of a well-formed part, a column at a time in C-level passes (the server's hot path:
    the per-value Python checks cost more than adapting the user); None when any check fails,
    and then `_rows` finds the first problem and names it, so the errors are `_rows`'s own."""
    rows = body.get(part, [])
    if type(rows) is not list or len(rows) > max_rows or not _DICT.issuperset(map(type, rows)):
        return None
    keys = set(chain.from_iterable(rows))  # every key of every row
    if not (fields.keys() | ({"label"} if labels else set())).issuperset(keys):
        return None
    overridden = not user.keys().isdisjoint(keys)  # a row giving a user field itself
    try:
        columns = {name: _user_column(rows, name, user[name], overridden) if name in user
                   else list(map(itemgetter(name), rows)) for name in fields}
        ys = list(map(itemgetter("label"), rows)) if labels else []
        if not (_NUMBER.issuperset(map(type, ys)) and all(map(math.isfinite, ys))):
            return None
    except (KeyError, OverflowError):
        return None
    for name, spec in fields.items():
        values = columns[name]
        if spec.multi_hot:
            if not (_LIST.issuperset(map(type, values)) and _SCALAR.issuperset(map(type, chain.from_iterable(values)))):
                return None
        elif not _PLAIN.issuperset(map(type, values)):
            return None
    return columns, list(map(float, ys))


def _user_column(rows: list[dict], name: str, value, overridden: bool) -> list:
    """A user field's column: its value once per row, or a row's own where it gives one."""
    return [row.get(name, value) for row in rows] if overridden else [value] * len(rows)


def _value(value, spec: FieldSpec, where: str):
    """A raw value checked against its field: a scalar, or for a multi-hot field a list of them."""
    if spec.multi_hot:
        if not isinstance(value, list) or not all(isinstance(v, SCALARS) for v in value):
            raise RequestError(where, "expected a list of values (a multi-hot field)")
        return value
    if value is not None and not isinstance(value, SCALARS):
        raise RequestError(where, f"expected a string or a number, got {type(value).__name__}")
    return value


def _label(value, where: str) -> float:
    if value is _MISSING:
        raise RequestError(where, "missing: every support row needs its label")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise RequestError(where, f"expected a finite number, got {value!r}")
    return float(value)


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float (an integer past float's range is not: a 400, not a 500)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def parse_json(body, fields: list[FieldSpec], max_rows: int) -> UserRequest:
    """A plain JSON body (module docstring) -> `UserRequest`."""
    if not isinstance(body, dict):
        raise RequestError("body", f"expected a JSON object, got {type(body).__name__}")
    known = {"user_id", "user", "support", "candidates"}
    for key in body:
        if key not in known:
            raise RequestError(key, f"unknown key (expected {', '.join(sorted(known))})")
    specs = {f.name: f for f in fields}
    user = body.get("user", {})
    if not isinstance(user, dict):
        raise RequestError("user", f"expected an object of the user's field values, got {type(user).__name__}")
    for name in user:
        if name not in specs:
            raise RequestError(f"user.{name}", f"not a field of this model (fields: {', '.join(specs)})")
    user_id = body.get("user_id")
    if user_id is not None and type(user_id) not in (str, int):  # True is an int, not an id
        raise RequestError("user_id", f"expected a string or an integer, got {type(user_id).__name__}")
    if "candidates" not in body:
        raise RequestError("candidates", "missing: the items to score")
    support, labels = (_fast_rows(body, "support", specs, user, True, max_rows)
                       or _rows(body, "support", specs, user, True, max_rows))
    candidates, _ = (_fast_rows(body, "candidates", specs, user, False, max_rows)
                     or _rows(body, "candidates", specs, user, False, max_rows))
    if not body["candidates"]:
        raise RequestError("candidates", "empty: give at least one item to score")
    return UserRequest(support, labels, candidates, None if user_id is None else str(user_id))


def _oip_tensor(i: int, tensor) -> tuple[str, list]:
    """(name, flat data) of one OIP v2 input tensor, its shape and datatype checked."""
    where = f"inputs[{i}]"
    if not isinstance(tensor, dict):
        raise RequestError(where, "expected a tensor object (name, shape, datatype, data)")
    for key in ("name", "shape", "datatype", "data"):
        if key not in tensor:
            raise RequestError(f"{where}.{key}", "missing")
    name, shape, data = tensor["name"], tensor["shape"], tensor["data"]
    if not isinstance(name, str):
        raise RequestError(f"{where}.name", "expected a string")
    if not isinstance(tensor["datatype"], str) or tensor["datatype"] not in OIP_TYPES:  # a list is unhashable
        raise RequestError(f"{where}.datatype", f"{tensor['datatype']!r}; expected one of {', '.join(OIP_TYPES)}")
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0):
        raise RequestError(f"{where}.shape", f"{shape!r}; expected [rows] (one dimension, a non-negative "
                                             "integer, not a boolean)")
    if not isinstance(data, list) or len(data) != shape[0]:
        raise RequestError(f"{where}.data", f"expected a flat list of {shape[0]} values (its shape)")
    allowed, kind = _OIP_VALUES[tensor["datatype"]]
    if not allowed.issuperset(map(type, data)):  # one C-level pass over a well-formed tensor
        k, bad = next((k, v) for k, v in enumerate(data) if type(v) not in allowed)
        raise RequestError(f"{where}.data", f"{name!r}: element {k} is {bad!r:.40}; datatype {tensor['datatype']} "
                                            f"holds {kind}")
    bounds = _INT_RANGE.get(tensor["datatype"])
    if bounds and data and (min(data) < bounds[0] or max(data) > bounds[1]):
        k, bad = next((k, v) for k, v in enumerate(data) if not bounds[0] <= v <= bounds[1])
        raise RequestError(f"{where}.data", f"{name!r}: element {k} is {bad!r:.40}; past datatype "
                                            f"{tensor['datatype']}'s range [{bounds[0]}, {bounds[1]}]")
    return name, data


def _check_outputs(outputs) -> None:
    """The outputs an infer request asks for: each an object naming one of `OUTPUTS` (Triton
    answers 400 for an unknown output name)."""
    if not isinstance(outputs, list):
        raise RequestError("outputs", f"expected a list of requested outputs, got {type(outputs).__name__}")
    for i, output in enumerate(outputs):
        name = output.get("name") if isinstance(output, dict) else None
        if not isinstance(name, str):
            raise RequestError(f"outputs[{i}].name", "missing: a requested output is an object with a name")
        if name not in OUTPUTS:
            raise RequestError(f"outputs[{i}].name", f"{name!r:.80}: not an output of this model "
                                                     f"(outputs: {', '.join(OUTPUTS)})")


def parse_oip(body, fields: list[FieldSpec], max_rows: int) -> UserRequest:
    """An Open Inference Protocol v2 infer request (module docstring) -> `UserRequest`."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise RequestError("inputs", "missing: an OIP v2 request holds a list of input tensors")
    if "outputs" in body:
        _check_outputs(body["outputs"])
    specs = {f.name: f for f in fields}
    parts: dict[str, dict[str, list]] = {"user": {}, "support": {}, "candidates": {}}
    for i, tensor in enumerate(body["inputs"]):
        name, data = _oip_tensor(i, tensor)
        part, _, field = name.partition(".")
        if part not in parts or (field not in specs and name != "support.label"):
            raise RequestError(f"inputs[{i}].name", f"{name!r}; expected user.<field>, support.<field>, "
                                                    f"support.label or candidates.<field> (fields: {', '.join(specs)})")
        if field in specs and specs[field].multi_hot:
            data = [str(v).split("|") if v != "" else [] for v in data]
        parts[part][field] = data
    for field, values in parts["user"].items():
        if len(values) != 1:
            raise RequestError(f"user.{field}", f"{len(values)} values; a user field holds one (shape [1])")
    user = {k: v[0] for k, v in parts["user"].items()}
    rows = {}
    for part in ("support", "candidates"):
        lengths = {len(v) for v in parts[part].values()}
        if len(lengths) > 1:
            raise RequestError(part, f"its inputs hold different numbers of rows: {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        rows[part] = [{k: v[r] for k, v in parts[part].items()} for r in range(n)]
    params = body.get("parameters") or {}
    user_id = params.get("user_id") if isinstance(params, dict) else None
    if user_id is not None and type(user_id) not in (str, int):  # True is an int, not an id
        raise RequestError("parameters.user_id", f"expected a string or an integer, got {type(user_id).__name__}")
    plain = {"user": user, "support": rows["support"], "candidates": rows["candidates"],
             **({"user_id": user_id} if user_id is not None else {})}
    return parse_json(plain, fields, max_rows)


def fast_oip(tensors: list[tuple], user_id, outputs: list, fields: list[FieldSpec], max_rows: int) -> UserRequest | None:
    """`parse_oip`'s `UserRequest` of a well-formed request given as its inputs (``(name,
    datatype, shape, data)`` each, ``data`` a flat list), its ``parameters.user_id`` (None
    when absent) and the names of the outputs it asks for, read column by column without the
    row objects `parse_oip` builds for `parse_json` (most of its time on a 120-row user);
    None when anything is not plainly well-formed, and then `parse_oip` of the same request
    finds the problem and names it (the errors are its own). The gRPC front's hot path."""
    specs = {f.name: f for f in fields}
    if not _OUTPUT_NAMES.issuperset(outputs) or "label" in specs:
        return None
    parts: dict[str, dict[str, list]] = {"user": {}, "support": {}, "candidates": {}}
    for name, datatype, shape, data in tensors:
        allowed = _OIP_VALUES.get(datatype) if type(datatype) is str else None
        part, _, field = name.partition(".") if type(name) is str else ("", "", "")
        if (allowed is None or type(shape) is not list or len(shape) != 1 or type(shape[0]) is not int
                or type(data) is not list or len(data) != shape[0] or part not in parts
                or (field not in specs and name != "support.label") or not allowed[0].issuperset(map(type, data))):
            return None
        if field in specs and specs[field].multi_hot:
            data = [str(v).split("|") if v != "" else [] for v in data]
        parts[part][field] = data
    if any(len(values) != 1 for values in parts["user"].values()) or type(user_id) not in (str, int, type(None)):
        return None
    user = {k: v[0] for k, v in parts["user"].items()}
    support = _fast_columns(parts["support"], specs, user, True, max_rows)
    candidates = _fast_columns(parts["candidates"], specs, user, False, max_rows)
    if support is None or candidates is None or not candidates[2]:
        return None
    return UserRequest(support[0], support[1], candidates[0], None if user_id is None else str(user_id))


_OUTPUT_NAMES = frozenset(OUTPUTS)


def _fast_columns(given: dict[str, list], specs: dict[str, FieldSpec], user: dict, labels: bool, max_rows: int):
    """(columns, labels, rows) of one part's tensors as `parse_json` reads its rows (a user
    field filled from ``user`` where the part does not give it), or None where `parse_json`
    would refuse them or not read them so (`fast_oip`)."""
    lengths = set(map(len, given.values()))
    n = lengths.pop() if len(lengths) == 1 else 0 if not lengths else -1
    if not 0 <= n <= max_rows:
        return None
    if n == 0:
        return {name: [] for name in specs}, [], 0
    ys = given.get("label", []) if labels else []
    try:
        if len(ys) != n * labels or not (_NUMBER.issuperset(map(type, ys)) and all(map(math.isfinite, ys))):
            return None
    except OverflowError:
        return None
    # every value came from a tensor whose datatype `fast_oip` checked (strings and numbers; a
    # multi-hot field's, lists of strings): what `parse_json` checks each column for
    columns = {name: given[name] if name in given else [user[name]] * n for name in specs if name in given or name in user}
    return (columns, list(map(float, ys)), n) if len(columns) == len(specs) else None


def json_response(result: Scored, name: str, version: str) -> dict:
    return {"model_name": name, "model_version": version, "scores": result.scores, "cached": result.cached,
            "adapted": result.adapted, "unknown_values": result.unknown}


def oip_response(result: Scored, name: str, version: str, request_id) -> dict:
    out = {"model_name": name, "model_version": version,
           "outputs": [{"name": "scores", "datatype": "FP32", "shape": [len(result.scores)], "data": result.scores}],
           "parameters": {"cached": result.cached, "adapted": result.adapted, "unknown_values": result.unknown}}
    return {**out, "id": request_id} if isinstance(request_id, str) else out


def oip_metadata(name: str, version: str, fields: list[FieldSpec]) -> dict:
    """``GET /v2/models/{name}``: the inputs a request may send and the output it gets."""
    inputs = [{"name": f"{part}.{f.name}", "datatype": "BYTES", "shape": [-1]}
              for part in ("user", "support", "candidates") for f in fields]
    inputs.insert(len(fields) * 2, {"name": "support.label", "datatype": "FP32", "shape": [-1]})
    return {"name": name, "versions": [version], "platform": "gmeta_ds", "inputs": inputs,
            "outputs": [{"name": name, "datatype": "FP32", "shape": [-1]} for name in OUTPUTS]}


def oip_server_metadata() -> dict:
    """``GET /v2`` (and gRPC's ServerMetadata): the server's name, version and extensions."""
    from gmeta_ds import __version__

    return {"name": "gmeta-ds", "version": __version__, "extensions": ["model_repository"]}


def oip_repository_index(name: str, version: str) -> list[dict]:
    """The repository extension's index (HTTP ``POST /v2/repository/index``, gRPC's
    RepositoryIndex): the one model this server serves, ready."""
    return [{"name": name, "version": version, "state": "READY"}]
