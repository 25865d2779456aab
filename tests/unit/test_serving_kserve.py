"""The KServe deployment (issue 51 item 4), tested without a cluster and without Docker.

- The container recipe (deploy/kserve/Dockerfile): its entry point's argv, run directly on
  127.0.0.1 (only the export path, the host and the ports replaced), serves a CLI export and
  answers the manifest's probes and an OIP v2 request with `gm.load_adapter`'s scores; the
  manifest (deploy/kserve/inferenceservice.yaml, shown as written in docs/serving.md) names the
  port, the mount path and the probe paths the entry point serves, so a change to either side
  fails here.
- KServe's own ModelServer running `gmeta_ds.serving.kserve_model` (the ``kserve`` extra; skipped
  without it): tritonclient over HTTP with its defaults and over gRPC, and plain OIP v2 JSON,
  score 12 users as `gm.load_adapter` does to 1e-5, and a bad request is a 400 (over gRPC
  INVALID_ARGUMENT) naming the input.
  KServe's server listens on every interface (it has no host option); the test talks to
  127.0.0.1 only.

Cost: two servers started once each per module (a few seconds each), one export built once.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

import gmeta_ds as gm
from gmeta_ds.serving.export import open_export
from gmeta_ds.serving.protocol import parse_json
from tests.helpers import demo_export, stop_process, wait_ready
from tests.pool import free_port

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "kserve" / "Dockerfile"
MANIFEST = REPO / "deploy" / "kserve" / "inferenceservice.yaml"
MOUNT = "/mnt/models"  # where KServe's storage initializer puts what STORAGE_URI names


def entry_point() -> list[str]:
    """The Dockerfile's ENTRYPOINT, as the image runs it (exec form: a JSON array)."""
    line = next(ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("ENTRYPOINT "))
    return json.loads(line.removeprefix("ENTRYPOINT "))


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def predictor() -> dict:
    """The manifest's predictor container."""
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert manifest["kind"] == "InferenceService" and manifest["apiVersion"] == "serving.kserve.io/v1beta1"
    (container,) = manifest["spec"]["predictor"]["containers"]
    return container


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return demo_export(tmp_path_factory.mktemp("kserve"))


def _start(cmd: list[str], url: str, log: Path):
    """``cmd`` in a process, once ``url``/v2/health/ready answers (its output in ``log``)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_ready(proc, url, log)
    except BaseException:
        stop_process(proc)
        raise
    return proc


@pytest.fixture(scope="module")
def image_server(export):
    """The image's entry point run directly: its export path, host and ports replaced."""
    argv, port = entry_point(), free_port()
    values = {MOUNT: str(export), "0.0.0.0": "127.0.0.1", _option(argv, "--port"): str(port),
              _option(argv, "--grpc-port"): str(free_port())}
    # the console script beside this interpreter (its virtualenv's), else the one on PATH
    program = shutil.which(argv[0], path=str(Path(sys.executable).parent)) or shutil.which(argv[0])
    assert program, f"{argv[0]} (the image's entry point) is not installed beside {sys.executable} or on PATH"
    cmd = [program, *(values.get(a, a) for a in argv[1:])]
    url = f"http://127.0.0.1:{port}"
    proc = _start(cmd, url, export.parent / "image.log")
    yield url
    stop_process(proc)


def users(export: Path, count: int, seed: int = 0) -> list[dict]:
    """``count`` plain JSON bodies of random ids (each a new user id, adapting on 6 support rows)."""
    fields, rng = open_export(export).fields, np.random.default_rng(seed)
    bodies = []
    for u in range(count):
        def rows(n):
            return [{f.name: int(rng.integers(f.num_ids)) for f in fields if f.side != "user"} for _ in range(n)]
        user = {f.name: int(rng.integers(f.num_ids)) for f in fields if f.side == "user"}
        support = [{**r, "label": float(rng.random() < 0.4)} for r in rows(6)]
        bodies.append({"user_id": f"u{seed}-{u}", "user": user, "support": support, "candidates": rows(5)})
    return bodies


def expected_scores(export: Path, bodies: list[dict]) -> tuple[list[list[float]], str]:
    """What `gm.load_adapter` scores for the bodies, in process, and its model version."""
    adapter = gm.load_adapter(export)
    return [s.scores for s in adapter.predict([parse_json(b, adapter.fields, 1000) for b in bodies])], adapter.version


def arrays(body: dict) -> dict[str, np.ndarray]:
    """A plain JSON body as OIP v2 tensors (the demo's fields are integer ids: INT64)."""
    out = {f"user.{k}": np.array([v], np.int64) for k, v in body["user"].items()}
    for part in ("support", "candidates"):
        for name in body[part][0]:
            dtype = np.float32 if name == "label" else np.int64
            out[f"{part}.{name}"] = np.array([row[name] for row in body[part]], dtype)
    return out


def oip_json(body: dict, user_id: str) -> dict:
    """The OIP v2 JSON request of a plain body, under ``user_id``."""
    datatypes = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}
    return {"id": user_id, "parameters": {"user_id": user_id},
            "inputs": [{"name": k, "shape": list(v.shape), "datatype": datatypes[v.dtype], "data": v.tolist()}
                       for k, v in arrays(body).items()]}


def test_the_manifest_matches_what_the_images_entry_point_serves(image_server):
    """Port, mount path, storage variable and container name as KServe needs them, and each
    probe path answered 200 by the running entry point."""
    argv, container = entry_point(), predictor()
    assert argv[:3] == ["gmeta-ds", "serve", MOUNT]
    assert container["name"] == "kserve-container"  # KServe's storage initializer fills this one's /mnt/models
    assert any(e["name"] == "STORAGE_URI" for e in container["env"])
    (port,) = container["ports"]
    assert port["name"] == "http1" and str(port["containerPort"]) == _option(argv, "--port")
    exposed = next(ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("EXPOSE ")).split()[1:]
    assert _option(argv, "--port") in exposed and _option(argv, "--grpc-port") in exposed
    assert _option(argv, "--host") == "0.0.0.0"  # reachable from the pod's network, not only its loopback
    for probe in ("readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert str(check["port"]) == _option(argv, "--port")
        assert httpx.get(image_server + check["path"], timeout=10).status_code == 200, probe


def test_the_docs_show_the_manifest_and_the_entry_point_as_shipped():
    doc = (REPO / "docs" / "serving.md").read_text()
    assert MANIFEST.read_text() in re.findall(r"```yaml\n(.*?)```", doc, re.DOTALL)
    assert f"```\n{' '.join(entry_point())}\n```" in doc


def test_the_images_entry_point_scores_as_the_adapter(image_server, export):
    bodies = users(export, 4, seed=1)
    with httpx.Client(base_url=image_server, timeout=30) as client:
        for body, expected in zip(bodies, expected_scores(export, bodies)[0]):
            answer = client.post("/v2/models/melu/infer", json=oip_json(body, body["user_id"])).json()
            assert np.allclose(answer["outputs"][0]["data"], expected, atol=1e-5)
            assert answer["parameters"]["adapted"]


@pytest.fixture(scope="module")
def kserve_server(export):
    """KServe's ModelServer serving the export (`gmeta_ds.serving.kserve_model`): (url, grpc address)."""
    # found, not imported: kserve's and tritonclient.grpc's protos both define inference.* messages,
    # which one process cannot hold twice
    if importlib.util.find_spec("kserve") is None:
        pytest.skip("kserve is not installed: the kserve extra (pip install -e '.[kserve]'), not in the dev one")
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "gmeta_ds.serving.kserve_model", "--model_dir", str(export),
           "--http_port", str(port), "--grpc_port", str(grpc_port), "--enable_latency_logging", "false"]
    url = f"http://127.0.0.1:{port}"
    proc = _start(cmd, url, export.parent / "kserve.log")
    yield url, f"127.0.0.1:{grpc_port}"
    stop_process(proc)


def test_kserves_model_server_scores_as_the_adapter_over_rest_and_grpc(kserve_server, export):
    http = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the dev extra")
    grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the dev extra")
    from tritonclient.utils import np_to_triton_dtype

    url, grpc_address = kserve_server
    bodies = users(export, 12, seed=2)
    expected, version = expected_scores(export, bodies)
    clients = {"http": (http, http.InferenceServerClient(url.removeprefix("http://"), network_timeout=30.0)),
               "grpc": (grpc, grpc.InferenceServerClient(grpc_address))}
    for i, (body, want) in enumerate(zip(bodies, expected)):
        for path, (module, client) in clients.items():  # each path its own user id: adapted, not cached
            inputs = []
            for name, array in arrays(body).items():
                tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
                tensor.set_data_from_numpy(array)  # the client's default: binary / raw_input_contents
                inputs.append(tensor)
            result = client.infer("melu", inputs, parameters={"user_id": f"{path}-{i}"})
            assert np.allclose(result.as_numpy("scores"), want, atol=1e-5), (path, i)
        answer = httpx.post(f"{url}/v2/models/melu/infer", json=oip_json(body, f"json-{i}"), timeout=30).json()
        assert np.allclose(answer["outputs"][0]["data"], want, atol=1e-5)
        assert answer["parameters"]["adapted"] and answer["model_version"] == version


def test_kserves_model_server_answers_a_bad_request_with_a_400_naming_the_input(kserve_server, export):
    grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the dev extra")
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    url, grpc_address = kserve_server
    user = users(export, 1, seed=3)[0]
    body = oip_json(user, "bad")
    body["inputs"] = [t for t in body["inputs"] if t["name"] != "support.label"]
    answer = httpx.post(f"{url}/v2/models/melu/infer", json=body, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"].startswith("support[0].label: missing")
    inputs = []
    for name, array in arrays(user).items():
        if name != "support.label":
            inputs.append(grpc.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
            inputs[-1].set_data_from_numpy(array)
    with pytest.raises(InferenceServerException) as refused:
        grpc.InferenceServerClient(grpc_address).infer("melu", inputs)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert refused.value.message().startswith("support[0].label: missing")
    v1 = httpx.post(f"{url}/v1/models/melu:predict", json={"instances": [[1, 2]]}, timeout=30)  # KServe's v1 route
    assert v1.status_code == 400 and "/v2/models/melu/infer" in v1.json()["error"]
    assert httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200  # still serving


def test_kserves_model_server_refuses_bytes_that_are_not_utf8_and_an_unknown_output(kserve_server, export):
    """Invalid UTF-8 in a BYTES input (gRPC's raw_input_contents, tritonclient's default) became
    replacement characters and was scored, where `gmeta-ds serve` refuses it: INVALID_ARGUMENT
    naming the input and the element, as `gmeta-ds serve` names it; an output name the model
    lacks is a 400 naming it (as `gmeta-ds serve` and Triton answer). (Over HTTP, KServe's own
    binary decoder refuses such bytes before the model sees them.)"""
    grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the dev extra")
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    url, grpc_address = kserve_server
    user = users(export, 1, seed=4)[0]
    inputs = []
    for name, array in arrays(user).items():
        if name == "user.age":
            array = np.array([b"\xff\xfe"], dtype=object)  # not UTF-8
        inputs.append(grpc.InferInput(name, list(array.shape), "BYTES" if array.dtype == object
                                      else np_to_triton_dtype(array.dtype)))
        inputs[-1].set_data_from_numpy(array)
    with pytest.raises(InferenceServerException) as refused:
        grpc.InferenceServerClient(grpc_address).infer("melu", inputs)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert refused.value.message().startswith("inputs[0].data: 'user.age': element 0 is not UTF-8 text")
    body = {**oip_json(user, "outputs"), "outputs": [{"name": "probabilities"}]}
    answer = httpx.post(f"{url}/v2/models/melu/infer", json=body, timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("outputs[0].name: 'probabilities': not an output of this model")
