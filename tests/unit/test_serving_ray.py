"""gmeta-ds serve on Ray Serve (issue 36, item 4): the export served by 2 replicas of
`gmeta_ds.serving.ray_app` on a local Ray cluster (2 CPUs, 127.0.0.1 only, no dashboard),
talked to over HTTP through Ray's proxy: both endpoints score users as gm.load_adapter does in
process (to 1e-5), concurrent users are answered by both replicas, and a bad request gets the
same 4xx naming the field as the plain server's. Skipped without the ``ray`` extra."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

import gmeta_ds as gm
from gmeta_ds.errors import ConfigError
from tests.helpers import click_log
from tests.pool import free_port
from tests.unit.test_saved_model import _engine
from tests.unit.test_serving_adapter import KEYS, requests
from tests.unit.test_serving_server import BAD, _json_body, _oip_body, dcn

serve = pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[ray]')")
ray = pytest.importorskip("ray")
ray_app = pytest.importorskip("gmeta_ds.serving.ray_app")

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120
MODEL = "tests.unit.test_serving_server:dcn"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(base url, the export, the data) of the export served by 2 replicas on a local Ray cluster."""
    data = gm.build_tasks(click_log(users=24), **KEYS)
    root = tmp_path_factory.mktemp("ray-serve")
    _engine(dcn(data.fields), data, "maml").save_model(root / "v1", data)
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    # replicas import the test's model function; no usage report, no token file written under ~/.ray
    env = {"PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    port = free_port()
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 _temp_dir=temp, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = ray_app.build({"export": str(root / "v1"), "replicas": "2", "model": MODEL, "max_rows": "50",
                             "max_body_bytes": "200000", "max_wait_ms": "5"})
        serve.run(app, name="gmeta", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url)
        yield url, root, data
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the Ray Serve application is not ready in time"
        time.sleep(0.5)


@pytest.mark.timeout(400)
def test_two_replicas_score_as_the_adapter_does(cluster):
    url, root, data = cluster
    status = serve.status().applications["gmeta"].deployments["GmetaServe"]
    assert status.replica_states.get("RUNNING") == 2, status
    users = requests(data, data.test)
    expected = gm.load_adapter(root / "v1", dcn).predict(users)
    with httpx.Client(base_url=url, timeout=60) as client:
        first = client.post("/v1/score", json=_json_body(users[0])).json()
        assert np.allclose(first["scores"], expected[0].scores, atol=1e-5), first
        oip = client.post("/v2/models/dcnv2/infer", json=_oip_body(users[1])).json()
        assert oip["id"] == "r1" and np.allclose(oip["outputs"][0]["data"], expected[1].scores, atol=1e-5)

    async def fire():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/score", json={**_json_body(u), "user_id": f"c-{i}"})
                                          for i, u in enumerate(users)))

    replies = asyncio.run(asyncio.wait_for(fire(), 120))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    for reply, want in zip(replies, expected):
        assert np.allclose(reply.json()["scores"], want.scores, atol=1e-5)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("body,status,field", BAD, ids=[b[2] + f"-{i}" for i, b in enumerate(BAD)])
def test_a_bad_request_gets_a_4xx_naming_the_field(cluster, body, status, field):
    reply = httpx.post(f"{cluster[0]}/v1/score", json=body, timeout=60)
    assert reply.status_code == status and reply.json()["field"] == field, reply.text
    assert reply.json()["error"].startswith(field)


@pytest.mark.parametrize("args,named", [({}, "export"), ({"export": "x", "colour": "red"}, "colour"),
                                        ({"export": "x", "max_batch": "many"}, "max_batch")])
def test_the_builder_names_a_bad_argument(args, named):
    with pytest.raises(ConfigError, match=named):
        ray_app.build(args)


def test_the_builder_types_its_arguments():
    app = ray_app.build({"export": "x", "replicas": "3", "max_wait_ms": "2.5", "model": MODEL})
    assert isinstance(app, serve.Application)
    assert ray_app.options_from_arguments({"max_batch": "8", "max_wait_ms": "2.5"}, "ray") == \
        ray_app.ServerOptions(max_batch=8, max_wait_ms=2.5)
