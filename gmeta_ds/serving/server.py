"""``gmeta-ds serve EXPORT_DIR``: adapt to each user at request time over HTTP.

FastAPI on uvicorn (one process, asyncio): the endpoints are plain async functions, request
bodies are read with a size limit and checked by `gmeta_ds.serving.protocol` (a 4xx naming the
field, never a 500 for a bad request), and the model work runs on one inference thread fed by
the dynamic batcher (`gmeta_ds.serving.batching`). A POST to the two scoring endpoints, the hot
path, is answered by `ScoringASGI` from the ASGI messages, ahead of FastAPI's middleware and
router; `gmeta_ds.serving.ray_app` runs the same application as Ray Serve replicas. LitServe
batches too, but its batching hands the model a list of decoded requests per worker process and
has no Open Inference Protocol front; here the batch is the vectorised inner loop itself and OIP
v2 is the contract.

Endpoints:

- ``POST /v2/models/{name}/infer`` (OIP v2), ``POST /v1/score`` (plain JSON): one user each;
- ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2/models/{name}`` (metadata),
  ``GET /v2/models/{name}/ready``, ``GET /v2`` (server metadata);
- ``POST /v2/repository/models/{name}/load`` (OIP's repository extension; off unless
  ``--allow-reload``): load the export again, or ``{"parameters": {"path": DIR}}`` another
  one under a ``--model-root`` (`gmeta_ds.serving.access`), while requests are served; the
  next batch runs on it, and every response names the version that scored it;
  ``POST /v2/repository/index`` lists the model served (name, version, state ``READY``);
- Triton's binary tensor extension on the infer endpoint (`gmeta_ds.serving.binary`): what
  tritonclient.http sends and asks for by default;
- ``GET /metrics``: Prometheus text (requests, batch sizes, adapt and score seconds, cache
  hits, unknown values, the model's version).

With ``--grpc-port``, the same `App` also answers OIP v2 over gRPC on the same event loop
(`gmeta_ds.serving.grpc_server`, one of `create_app`'s ``services``).

A connection whose request head is not whole ``--header-timeout`` seconds after it connected
or began its request is closed (`access.header_deadline_protocol`); a body not whole
``--body-timeout`` seconds after its head is a 408 (`App.body`), its connection closed after
the answer.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import orjson
from fastapi import Request  # at module level: the handlers' annotations are resolved by name
from fastapi.responses import Response

from gmeta_ds.errors import ConfigError
from gmeta_ds.serving import binary
from gmeta_ds.serving.access import Refused, ReloadPolicy, header_deadline_protocol
from gmeta_ds.serving.batching import Batcher, ModelHolder
from gmeta_ds.serving.encoding import RequestError
from gmeta_ds.serving.model import ServedModel
from gmeta_ds.serving.protocol import (
    json_response,
    oip_metadata,
    oip_repository_index,
    oip_response,
    oip_server_metadata,
    parse_json,
    parse_oip,
)


@dataclass
class ServerOptions:
    """`gmeta-ds serve`'s knobs (its --help)."""

    max_batch: int = 64
    max_wait_ms: float = 1.0
    max_rows: int = 1000
    max_body_bytes: int = 1 << 20
    cache_size: int = 10000
    cache_ttl_s: float = 600.0
    model: str | None = None  # MODULE:FUNCTION building the model from the saved fields
    threads: int = 1  # torch threads: a request's work is small, more threads mostly wait on each other
    allow_reload: bool = False  # the reload endpoint loads a folder a request names: off unless asked
    model_roots: tuple[str, ...] = ()  # folders whose exports a reload may load (besides the one served)
    header_timeout_s: float = 10.0  # a request head not whole this long after it began: closed
    body_timeout_s: float = 60.0  # a body not whole this long after its head: 408, then closed


def options_from_arguments(args: dict, where: str) -> ServerOptions:
    """`ServerOptions` of ``key=value`` arguments (strings from a command line such as Ray's
    ``serve run``, or typed values from a config file), each converted to its field's type: a
    switch from true/false (not Python's truth of a string: "false" is not on), folders from a
    list or one string joined by the path separator; anything else is a `ConfigError` naming it."""
    types = {f.name: type(f.default) for f in fields(ServerOptions)}
    unknown = sorted(set(args) - set(types))
    if unknown:
        raise ConfigError([(f"{', '.join(unknown)}: unknown argument(s); expected export, replicas, num_cpus or "
                            f"{', '.join(types)}")], where)
    typed = {}
    for name, value in args.items():
        kind = types[name]
        try:
            typed[name] = _typed(kind, value)
        except ValueError:
            raise ConfigError([f"{name}={value!r}: expected {kind.__name__}"], where) from None
    options = ServerOptions(**typed)
    problems = option_problems(options)
    if problems:
        raise ConfigError(problems, where)
    return options


# (low, high, what) of `ServerOptions`' numbers; a bound of None is open. An infinite or NaN
# max_wait_ms made the batcher wait for a full batch (every request after a batch of two hung).
BOUNDS = {"max_batch": (1, None, "an integer >= 1"), "max_rows": (1, None, "an integer >= 1"),
          # grpc's receive limit (set from it) is a C int: past 2**31 - 1 the gRPC service failed to start
          "max_body_bytes": (1, 2**31 - 1, "an integer in [1, 2147483647]"), "cache_size": (0, None, "an integer >= 0"),
          "threads": (1, None, "an integer >= 1"),
          "max_wait_ms": (0, 60_000, "a number of milliseconds in [0, 60000]"),
          "cache_ttl_s": (0, float("inf"), "a number of seconds >= 0 (inf: never expire)"),
          "header_timeout_s": (1e-9, 3600, "a number of seconds > 0 and at most 3600"),
          "body_timeout_s": (1e-9, 3600, "a number of seconds > 0 and at most 3600")}


def option_problems(options: ServerOptions, flags: dict[str, str] | None = None) -> list[str]:
    """One line per number of ``options`` outside `BOUNDS` (NaN included), naming the option
    as ``flags`` spell it (field name -> command-line flag; default: the field's name)."""
    problems = []
    for name, (low, high, what) in BOUNDS.items():
        value = getattr(options, name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and low <= value and (high is None or value <= high)):  # NaN fails both
            problems.append(f"{(flags or {}).get(name, name)}={value!r}: expected {what}")
    return problems


def _typed(kind: type, value):
    """``value`` as a `ServerOptions` field of type ``kind`` (`options_from_arguments`)."""
    if kind is bool and not isinstance(value, bool):
        switch = {"true": True, "1": True, "false": False, "0": False}.get(str(value).strip().lower())
        if switch is None:
            raise ValueError(value)
        return switch
    if kind is tuple:
        return tuple(map(str, value)) if isinstance(value, (list, tuple)) else \
            tuple(part for part in str(value).split(os.pathsep) if part)
    return value if kind is type(None) or isinstance(value, kind) else kind(value)


class HTTPProblem(Exception):
    """An answer other than 200: status and ``field: message``."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.status, self.field = status, field


def model_function(spec: str | None):
    """The function ``MODULE:FUNCTION`` names (the user's own model code), or None."""
    if spec is None:
        return None
    import importlib

    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError([(f"--model {spec!r}: cannot import it ({exc}); expected MODULE:FUNCTION, a "
                            "function of the saved fields returning the model")]) from None


def load(path: str | Path, options: ServerOptions) -> ServedModel:
    """The export at ``path``, warmed up: one user adapted and scored (torch's first calls of
    the vectorised inner loop take seconds; no request should wait for them)."""
    model = ServedModel(path, model_function(options.model), options.cache_size, options.cache_ttl_s)
    model.warm_up()
    return model


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, model: ServedModel):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        fast = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
        self.requests = Counter("gmeta_serve_requests", "requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self.batch = Histogram("gmeta_serve_batch_users", "users per batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128),
                               registry=self.registry)
        self.adapt = Histogram("gmeta_serve_adapt_seconds", "adaptation time per batch", buckets=fast,
                               registry=self.registry)
        self.score = Histogram("gmeta_serve_score_seconds", "scoring time per batch", buckets=fast,
                               registry=self.registry)
        self.hits = Counter("gmeta_serve_cache_hits", "users whose adapted parameters were cached",
                            registry=self.registry)
        self.adapted = Counter("gmeta_serve_users_adapted", "users adapted", registry=self.registry)
        self.unknown = Counter("gmeta_serve_unknown_values", "values mapped to a default row",
                               registry=self.registry)
        self.info = Gauge("gmeta_serve_model_info", "the model served", ["name", "version"], registry=self.registry)
        self.answered: dict[tuple[str, int], object] = {}  # (endpoint, status) -> its requests counter
        self.loaded(model, None)

    def count(self, endpoint: str, status: int | str) -> None:
        """One request answered (its labelled counter looked up once: ``labels`` costs microseconds);
        ``status``: the HTTP status, or a gRPC call's status code name (``INVALID_ARGUMENT``)."""
        counter = self.answered.get((endpoint, status))
        if counter is None:
            counter = self.answered[endpoint, status] = self.requests.labels(endpoint, str(status))
        counter.inc()

    def loaded(self, model: ServedModel, old: ServedModel | None) -> None:
        if old is not None:
            self.info.remove(old.name, old.version)
        self.info.labels(model.name, model.version).set(1)

    def observe(self, users: int, done: dict) -> None:
        self.batch.observe(users)
        self.adapted.inc(done["adapted"])
        if done["adapted"]:
            self.adapt.observe(done["adapt_s"])
        self.score.observe(done["score_s"])


class App:
    """The served model, its batcher and metrics, and the request handlers' shared steps."""

    def __init__(self, path: str | Path, options: ServerOptions, submit=None):
        self.path, self.options = Path(path), options
        self.reload_policy = ReloadPolicy.of(options.allow_reload, options.model_roots)  # before the load
        self.holder = ModelHolder(load(path, options))
        self.metrics = Metrics(self.holder.model)
        self.batcher = Batcher(self.holder, options.max_batch, options.max_wait_ms / 1000.0, self.metrics.observe)
        # one user -> (Scored, model): this batcher's queue, or another batching in front of
        # its `run_batch` (Ray Serve's ``@serve.batch``, gmeta_ds.serving.ray_app)
        self.submit = submit or self.batcher.submit
        self.reloading = threading.Lock()

    async def outcome(self, endpoint: str, work) -> tuple[int, bytes, list]:
        """Run a handler's ``work()``: (200, its dict as JSON, the headers naming its type; a
        `binary.BinaryReply` in Triton's binary form), a problem as a 4xx naming the field,
        anything else as a 500 that leaves the server up; counted in the metrics. JSON by
        orjson (several times json's speed: a response holds a float per candidate)."""
        try:
            status, content = 200, await work()
        except HTTPProblem as exc:
            status, content = exc.status, {"error": str(exc), "field": exc.field}
        except RequestError as exc:
            status, content = 400, {"error": str(exc), "field": exc.field}
        except Exception as exc:  # noqa: BLE001 - a bug answers 500; the server keeps serving
            status, content = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"}
        self.metrics.count(endpoint, status)
        if type(content) is binary.BinaryReply:
            return status, *binary.reply_body(content)
        # a 408's connection still holds the rest of a body: closed after the answer (uvicorn
        # cancels its keep-alive timer on every byte that comes, so a trickle held it open)
        return status, orjson.dumps(content), _JSON if status != 408 else [*_JSON, (b"connection", b"close")]

    async def answer(self, endpoint: str, work) -> Response:
        """`outcome` as a Starlette response."""
        status, body, headers = await self.outcome(endpoint, work)
        return Response(body, status, headers={k.decode(): v.decode() for k, v in headers})

    async def body(self, length: str, chunks, required: bool = True, header_length: str = ""):
        """The JSON body of a request (its Content-Length header, "" when none, and an async
        iterator of its bytes), refused past ``max_body_bytes`` (413) or when not JSON (400);
        with ``header_length`` (Triton's Inference-Header-Content-Length), a JSON header and the
        binary tensors after it (`gmeta_ds.serving.binary`), decoded into the header's inputs.
        A body not whole ``body_timeout_s`` after the head is a 408 (a client trickling its body
        held the connection and the handler for ever)."""
        limit = self.options.max_body_bytes
        if length.isdigit() and int(length) > limit:
            raise HTTPProblem(413, "body", f"{length} bytes; at most {limit} (gmeta-ds serve --max-body-bytes)")
        data = bytearray()
        try:
            async with asyncio.timeout(self.options.body_timeout_s):
                async for chunk in chunks:
                    data += chunk
                    if len(data) > limit:
                        raise HTTPProblem(413, "body", f"over {limit} bytes (gmeta-ds serve --max-body-bytes)")
        except TimeoutError:
            raise HTTPProblem(408, "body", f"{len(data)} bytes {self.options.body_timeout_s:g} s after the request "
                                           "head, not the whole body (gmeta-ds serve --body-timeout)") from None
        if header_length:
            header, tensors = binary.split_body(data, header_length)
            return binary.fill_inputs(_json(header), tensors)
        if not data and not required:
            return {}
        return _json(data)

    def check_name(self, name: str) -> ServedModel:
        model = self.holder.model
        if name != model.name:
            raise HTTPProblem(404, "model name", f"no model {name!r} here; this server serves {model.name!r}")
        return model

    async def score(self, length: str, chunks, parse, header_length: str = ""):
        """Parse one user's body (`body`'s arguments) with ``parse`` (`protocol.parse_json` /
        `parse_oip`) and score it."""
        body = await self.body(length, chunks, header_length=header_length)
        return body, *await self.score_body(body, parse)

    async def score_body(self, body, parse):
        """(`Scored`, the model that scored it) of one user's decoded body, read by ``parse``
        (`protocol.parse_json` / `parse_oip`) and sent through the batcher."""
        user = parse(body, self.holder.model.fields, self.options.max_rows)
        result, model = await self.submit(user)
        self.metrics.hits.inc(int(result.cached))
        self.metrics.unknown.inc(result.unknown)
        return result, model

    async def reload(self, name: str, request) -> dict:
        """Load an export (this one again, or ``parameters.path`` where `ReloadPolicy` allows it)
        beside the served one and swap."""
        self.check_name(name)
        body = await self.body(request.headers.get("content-length", ""), request.stream(), required=False)
        try:
            path = self.reload_policy.target(body, self.path)
        except Refused as exc:
            raise HTTPProblem(exc.status, exc.field, exc.message) from None
        loop = asyncio.get_running_loop()
        try:
            new = await loop.run_in_executor(None, self._load_one, path)
        except ConfigError as exc:
            raise HTTPProblem(400, "parameters.path", str(exc)) from None
        old = self.holder.swap(new)
        self.path = path
        self.metrics.loaded(new, old)
        return {"name": new.name, "version": new.version, "previous_version": old.version, "path": str(path)}

    async def score_json(self, length: str, chunks) -> dict:
        """``POST /v1/score``'s answer."""
        _, result, model = await self.score(length, chunks, parse_json)
        return json_response(result, model.name, model.version)

    async def infer(self, name: str, length: str, chunks, header_length: str = ""):
        """``POST /v2/models/{name}/infer``'s answer (binary when the request asks)."""
        self.check_name(name)
        body, result, model = await self.score(length, chunks, parse_oip, header_length)
        answer = oip_response(result, model.name, model.version, body.get("id"))
        return binary.encode_reply(answer) if binary.wants_binary(body) else answer

    def _load_one(self, path: Path) -> ServedModel:
        with self.reloading:  # one reload at a time
            return load(path, self.options)


def create_app(path: str | Path, options: ServerOptions | None = None, submit=None, services=()):
    """The FastAPI application serving the export at ``path`` (module docstring); ``submit``:
    `App`'s (default: the app's own batcher); ``services``: functions of the `App` returning an
    async context manager run for the application's life on its event loop, after the batcher
    starts (`gmeta_ds.serving.grpc_server.grpc_service`: OIP v2 over gRPC beside HTTP)."""
    from fastapi import FastAPI

    state = App(path, options or ServerOptions(), submit)

    @asynccontextmanager
    async def lifespan(_app):
        state.batcher.start()
        try:
            async with AsyncExitStack() as stack:
                for service in services:
                    await stack.enter_async_context(service(state))
                yield
        finally:
            await state.batcher.stop()

    app = FastAPI(title="gmeta-ds serve", lifespan=lifespan)
    app.state.served = state

    # a POST to the two scoring routes is answered by `ScoringASGI` before this app; these
    # (Starlette's own, left out of /docs) answer other methods with 405, as routes do
    async def score_json(request: Request):
        length = request.headers.get("content-length", "")
        return await state.answer("/v1/score", lambda: state.score_json(length, request.stream()))

    async def infer(request: Request):
        length, name = request.headers.get("content-length", ""), request.path_params["name"]
        header_length = request.headers.get(binary.HEADER, "")
        return await state.answer("/v2/models/infer", lambda: state.infer(name, length, request.stream(), header_length))

    app.add_route("/v1/score", score_json, methods=["POST"])
    app.add_route("/v2/models/{name}/infer", infer, methods=["POST"])

    @app.get("/v2/models/{name}")
    async def metadata(name: str):
        async def work():
            model = state.check_name(name)
            return oip_metadata(model.name, model.version, model.fields)
        return await state.answer("/v2/models", work)

    @app.post("/v2/repository/models/{name}/load")
    async def reload(name: str, request: Request):
        return await state.answer("/v2/repository/load", lambda: state.reload(name, request))

    @app.post("/v2/repository/index")
    async def repository_index():
        async def work():  # the repository extension's index: the one model this server serves
            return oip_repository_index(state.holder.model.name, state.holder.model.version)
        return await state.answer("/v2/repository/index", work)

    _plain_routes(app, state)
    return ScoringASGI(app, state)


class ScoringASGI:
    """The ASGI application `create_app` returns: a POST to ``/v1/score`` or
    ``/v2/models/{name}/infer`` answered from the ASGI messages themselves (the same `App`
    handlers, without a Request object, FastAPI's middleware stack and router: the server's
    hot path), everything else (and the lifespan) by the FastAPI app. ``state`` is the FastAPI
    app's (``state.served``: the `App`)."""

    def __init__(self, app, served: App):
        self.app, self.served, self.state = app, served, app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path == "/v1/score":
                return await self._answer(send, "/v1/score",
                                          lambda h, _: self.served.score_json(h, _chunks(receive)), scope)
            name = path[11:-6] if path.startswith("/v2/models/") and path.endswith("/infer") else ""
            if name and "/" not in name:
                return await self._answer(send, "/v2/models/infer",
                                          lambda h, b: self.served.infer(name, h, _chunks(receive), b), scope)
        await self.app(scope, receive, send)

    async def _answer(self, send, endpoint: str, handler, scope) -> None:
        """``handler(content_length, inference_header_content_length)``'s `App.outcome` (each
        header's value, "" when absent), sent as the response."""
        length = header_length = ""
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = value.decode("latin-1")
            elif key == _BINARY_HEADER:
                header_length = value.decode("latin-1")
        status, body, headers = await self.served.outcome(endpoint, lambda: handler(length, header_length))
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})


async def _chunks(receive):
    """A request's body chunks, from its ASGI messages (up to the last, or the client leaving)."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


def _plain_routes(app, state: App) -> None:
    """Health, readiness, server metadata and /metrics."""
    from fastapi.responses import JSONResponse, PlainTextResponse

    @app.get("/v2/health/live")
    @app.get("/v2/health/ready")
    async def health():
        return JSONResponse({"live": True, "ready": True})

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        return await state.answer("/v2/models/ready", _ready(state, name))

    @app.get("/v2")
    async def server_metadata():
        return oip_server_metadata()

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _ready(state: App, name: str):
    async def work():
        model = state.check_name(name)
        return {"name": model.name, "version": model.version, "ready": True}
    return work


def serve(path: str | Path, host: str = "127.0.0.1", port: int = 8000, options: ServerOptions | None = None,
          services=()) -> None:
    """Load the export (a bad one is refused before listening) and serve until interrupted
    (with ``services`` beside HTTP: `create_app`'s)."""
    import torch
    import uvicorn

    options = options or ServerOptions()
    if port:  # a taken port is refused now, not after the export has loaded
        check_listenable(host, port, "--port")
    torch.set_num_threads(options.threads)
    app = create_app(path, options, services=services)
    model = app.state.served.holder.model
    print(f"gmeta-ds serve: model {model.name!r} version {model.version} from {path} on http://{host}:{port} "
          f"(OIP v2: POST /v2/models/{model.name}/infer; JSON: POST /v1/score)", flush=True)
    quiet_gc()
    # no proxy-headers middleware: the server listens on its own address and logs no client
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, proxy_headers=False,
                http=header_deadline_protocol(options.header_timeout_s))


def check_listenable(host: str, port: int, flag: str) -> None:
    """A `ConfigError` naming ``flag`` when ``host:port`` cannot be listened on now (taken, or
    an address this host lacks): the CLI's exit 2 before the export loads."""
    import socket

    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and grpc bind: TIME_WAIT is fine
            probe.bind((host, port))
    except OSError as exc:
        raise ConfigError([f"{flag} {port}: cannot listen on {address} ({exc.strerror or exc})"]) from None


def quiet_gc() -> None:
    """Keep the garbage collector off the request path, for this process: what start-up built
    (torch, the libraries, the model: millions of objects) is frozen out of its reach, and the
    youngest generation is collected every 20,000 new containers instead of 700. A request
    makes about a thousand short-lived ones (its decoded rows); the full collections they
    triggered walked the whole heap: on the benchmark, 160 us of CPU per request in JSON
    decoding alone against 25 us in a bare process, and p99 at 64 clients 250 -> 55 ms."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


_JSON = [(b"content-type", b"application/json")]
_BINARY_HEADER = binary.HEADER.lower().encode()  # as ASGI gives header names


def _json(data: bytes):
    """A request's JSON (orjson; what it refuses, as the standard library reads it), or a 400."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit"):  # orjson's fixed bound: 1024 levels
            raise HTTPProblem(400, "body", f"nested deeper than the 1024 levels orjson reads ({exc})") from None
        return _json_body(data)


def _json_body(data: bytes):
    """A body orjson refuses (NaN, integers past 64 bits, invalid JSON), read as the standard
    library's json reads it, or a 400 with its reason."""
    try:
        return json.loads(data)
    except ValueError as exc:
        raise HTTPProblem(400, "body", f"not valid JSON ({exc})") from None
    except RecursionError:
        raise HTTPProblem(400, "body", "nested too deeply for the standard library's JSON reader") from None
