"""``gmeta-ds serve``'s model as a ``kserve.Model``, run by KServe's own ``ModelServer``.

KServe's Python model server brings its own OIP v2 fronts (REST on ``--http_port``, gRPC on
``--grpc_port``: FastAPI, uvicorn and grpc.aio of its own) and calls a model's ``predict`` with
each request decoded into a ``kserve.InferRequest``. `GmetaKServeModel` turns that request into
the OIP v2 tensors `gmeta_ds.serving.protocol.parse_oip` reads (the same tensor names, checks
and messages as `gmeta-ds serve`), sends the user through the same dynamic `Batcher` (concurrent
users adapted in one vectorised inner loop) and answers the FP32 output ``scores`` with
``cached`` / ``adapted`` / ``unknown_values`` as the response's parameters. A bad request is
KServe's ``InvalidInput``: its REST front answers 400, its gRPC front ``INVALID_ARGUMENT``,
each naming the field.

Run it as KServe's Python predictors run::

    python -m gmeta_ds.serving.kserve_model --model_dir runs/demo-export --http_port 8080 --grpc_port 8081

Every option of KServe's ``ModelServer`` parser is accepted (``--workers``,
``--enable_grpc``, ...), and ``gmeta-ds serve``'s batching and cache options under the same
names with underscores (``--max_batch``, ``--max_wait_ms``, ``--max_rows``, ``--cache_size``,
``--cache_ttl_s``, ``--threads``, ``--model MODULE:FUNCTION``). KServe's server listens on every
interface (``0.0.0.0`` and ``[::]``; it has no host option): what a pod needs, not a laptop.
Only this module imports ``kserve`` (the ``kserve`` extra); docs/serving.md, "Deploying on
KServe", compares it with `gmeta-ds serve` and says which path the project recommends.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from kserve import model_server as kserve_server
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import to_http_parameters

from gmeta_ds.errors import ConfigError
from gmeta_ds.serving.batching import Batcher, ModelHolder
from gmeta_ds.serving.encoding import RequestError
from gmeta_ds.serving.protocol import oip_metadata, parse_oip
from gmeta_ds.serving.server import ServerOptions, load, options_from_arguments, quiet_gc


class GmetaKServeModel(Model):
    """One export served through KServe (module docstring): loaded and warmed up at
    construction, registered under the export's model name, ready at once."""

    def __init__(self, path: str, options: ServerOptions | None = None):
        self.options = options or ServerOptions()
        served = load(path, self.options)
        super().__init__(served.name)
        self.holder = ModelHolder(served)
        # KServe's /metrics already times preprocess, predict and postprocess per model
        self.batcher = Batcher(self.holder, self.options.max_batch, self.options.max_wait_ms / 1000.0,
                               lambda users, done: None)
        self.ready = True

    def load(self) -> bool:
        return self.ready

    def get_input_types(self) -> list[dict]:
        """The inputs ``GET /v2/models/{name}`` lists: `gmeta-ds serve`'s own metadata."""
        model = self.holder.model
        return oip_metadata(model.name, model.version, model.fields)["inputs"]

    def get_output_types(self) -> list[dict]:
        return [{"name": "scores", "datatype": "FP32", "shape": [-1]}]

    async def predict(self, payload: InferRequest, headers: dict | None = None) -> InferResponse:
        """One user's scores (the request's tensors as `parse_oip` reads them), adapted in the
        batch of the users that arrived with it."""
        if not isinstance(payload, InferRequest):  # KServe's v1 route hands over the JSON body as it came
            raise InvalidInput("body: this model speaks the Open Inference Protocol v2; POST the request to "
                               f"/v2/models/{self.name}/infer")
        if self.batcher.worker is None:  # KServe starts its event loop after the model is built
            self.batcher.start()
        model = self.holder.model
        try:
            user = parse_oip(oip_body(payload), model.fields, self.options.max_rows)
            result, model = await self.batcher.submit(user)
        except RequestError as exc:
            raise InvalidInput(str(exc)) from None  # "field: message", as gmeta-ds serve says it
        scores = InferOutput("scores", [len(result.scores)], "FP32")
        scores.set_data_from_numpy(np.asarray(result.scores, np.float32), binary_data=payload.use_binary_outputs)
        return InferResponse(payload.id, model.name, [scores], model_version=model.version,
                             parameters={"cached": result.cached, "adapted": result.adapted,
                                         "unknown_values": result.unknown},
                             use_binary_outputs=payload.use_binary_outputs)


def oip_body(payload: InferRequest) -> dict:
    """KServe's decoded request as the OIP v2 JSON body `parse_oip` reads: each input's values
    flat (raw or binary tensors decoded by KServe; BYTES elements as UTF-8 text, else a 400),
    the user id from the request's parameters (a gRPC request's typed parameters made plain),
    the outputs it asks for."""
    inputs = []
    for i, tensor in enumerate(payload.inputs):
        try:
            values = tensor.as_numpy().ravel()
        except (ValueError, TypeError) as exc:  # a raw tensor whose size disagrees with its shape
            raise RequestError(f"inputs[{i}]", f"{tensor.name!r}: {exc}") from None
        if tensor.datatype == "BYTES":
            values = _texts(values, tensor.name, i)
        inputs.append({"name": tensor.name, "shape": list(tensor.shape), "datatype": tensor.datatype,
                       "data": values if isinstance(values, list) else values.tolist()})
    parameters = to_http_parameters(payload.parameters) if payload.parameters else {}
    outputs = [{"name": output.name} for output in payload.request_outputs or ()]
    return {"inputs": inputs, "parameters": parameters, **({"outputs": outputs} if outputs else {})}


def _texts(values, name: str, i: int) -> list:
    """A BYTES input's elements as text; an element that is not UTF-8 is a `RequestError`
    naming it (`gmeta-ds serve` answers the same 400 for the same bytes)."""
    texts = []
    for k, value in enumerate(values):
        try:
            texts.append(value.decode() if isinstance(value, bytes) else value)
        except UnicodeDecodeError:
            raise RequestError(f"inputs[{i}].data", f"{name!r}: element {k} is not UTF-8 text") from None
    return texts


KNOBS = ("max_batch", "max_wait_ms", "max_rows", "cache_size", "cache_ttl_s", "threads", "model")


def _argument_parser() -> argparse.ArgumentParser:
    """KServe's ModelServer arguments, with the export folder and `gmeta-ds serve`'s knobs."""
    parser = argparse.ArgumentParser(parents=[kserve_server.parser], description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True,
                        help="the export folder (gmeta-ds export --config; /mnt/models under KServe's storageUri)")
    defaults = ServerOptions()
    for name in KNOBS:
        parser.add_argument(f"--{name}", default=None, help=f"as gmeta-ds serve's (default {getattr(defaults, name)})")
    return parser


def serve_on_kserve(argv: list[str] | None = None) -> int:
    """Parse, load the export (a bad one is refused before listening), serve until stopped."""
    args = _argument_parser().parse_args(argv)
    knobs = {k: getattr(args, k) for k in KNOBS if getattr(args, k) is not None}
    try:
        options = options_from_arguments(knobs, "gmeta_ds.serving.kserve_model")
        torch.set_num_threads(options.threads)
        model = GmetaKServeModel(args.model_dir, options)
    except ConfigError as exc:  # a bad option or export: its message, not a traceback
        print(f"gmeta_ds.serving.kserve_model: {exc}", file=sys.stderr)
        return 2
    quiet_gc()
    ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, workers=args.workers,
                enable_grpc=args.enable_grpc).start([model])
    return 0


if __name__ == "__main__":
    sys.exit(serve_on_kserve())
