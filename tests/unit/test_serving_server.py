"""gmeta-ds serve (issue 36) as a real server on 127.0.0.1, talked to with a real HTTP client:
the plain JSON and OIP v2 endpoints score a user as gm.load_adapter does in process, repeats
come from the cache, concurrent users are batched, bad requests get a 4xx naming the field and
leave the server up, /metrics counts, and a new export is loaded while requests keep coming."""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import numpy as np
import pytest

import gmeta_ds as gm
from tests.unit.test_serving_adapter import requests


def dcn(fields):
    """The served model's architecture (gmeta-ds serve --model tests.unit.test_serving_server:dcn;
    the server: tests/unit/conftest.py's ``server``, one per session)."""
    return gm.DCNv2(fields, embed_dim=4, cross_layers=1)


def _json_body(user) -> dict:
    """The plain JSON form of a `UserRequest` (age given once, as a user feature)."""
    names = list(user.candidates)
    support = [{**{n: user.support[n][r] for n in names if n != "age"}, "label": y} for r, y in enumerate(user.labels)]
    candidates = [{n: user.candidates[n][r] for n in names if n != "age"} for r in range(len(user.candidates["item"]))]
    return {"user_id": user.user_id, "user": {"age": user.candidates["age"][0]}, "support": support,
            "candidates": candidates}


def _oip_body(user) -> dict:
    inputs = [{"name": "user.age", "shape": [1], "datatype": "BYTES", "data": [user.candidates["age"][0]]},
              {"name": "support.label", "shape": [len(user.labels)], "datatype": "FP32", "data": user.labels}]
    for part, columns in (("support", user.support), ("candidates", user.candidates)):
        for name, values in columns.items():
            if name != "age":
                data = ["|".join(v) for v in values] if name == "tags" else values
                inputs.append({"name": f"{part}.{name}", "shape": [len(values)], "datatype": "BYTES", "data": data})
    return {"id": "r1", "parameters": {"user_id": user.user_id}, "inputs": inputs}


def test_both_endpoints_score_as_the_adapter_does_and_repeats_are_cached(server):
    url, root, data = server
    users = requests(data, data.test)[:3]
    expected = gm.load_adapter(root / "v1", dcn).predict(users)
    with httpx.Client(base_url=url, timeout=30) as client:
        meta = client.get("/v2/models/dcnv2").json()
        assert meta["name"] == "dcnv2" and {"name": "support.label", "datatype": "FP32", "shape": [-1]} in meta["inputs"]
        first = client.post("/v1/score", json=_json_body(users[0])).json()
        assert np.allclose(first["scores"], expected[0].scores, atol=1e-5) and not first["cached"]
        assert first["model_version"] == gm.load_adapter(root / "v1", dcn).version
        assert client.post("/v1/score", json=_json_body(users[0])).json()["cached"]
        oip = client.post("/v2/models/dcnv2/infer", json=_oip_body(users[1])).json()
        assert oip["id"] == "r1" and oip["outputs"][0]["shape"] == [len(expected[1].scores)]
        assert np.allclose(oip["outputs"][0]["data"], expected[1].scores, atol=1e-5)
        cold = client.post("/v1/score", json={**_json_body(users[2]), "support": []}).json()
        assert not cold["adapted"] and len(cold["scores"]) == len(expected[2].scores)


def test_concurrent_users_are_batched(server):
    url, _, data = server
    users = requests(data, data.test)

    async def fire():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            bodies = [{**_json_body(u), "user_id": f"batch-{i}"} for i, u in enumerate(users * 2)]
            return await asyncio.gather(*(client.post("/v1/score", json=b) for b in bodies))

    def batches() -> tuple[float, float]:  # (batches run, users in them) since the server started
        lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        return tuple(float(next(line.split()[1] for line in lines if line.startswith(f"gmeta_serve_batch_users_{k}")))
                     for k in ("count", "sum"))

    before = batches()  # the session server has run other tests' single users (HTTP and gRPC) already
    replies = asyncio.run(asyncio.wait_for(fire(), 60))
    assert all(r.status_code == 200 for r in replies)
    count, total = (after - earlier for after, earlier in zip(batches(), before))
    assert total / count > 1.5  # several users per batch on average
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    for name in ("gmeta_serve_requests_total", "gmeta_serve_cache_hits_total", "gmeta_serve_adapt_seconds_bucket",
                 "gmeta_serve_unknown_values_total", 'gmeta_serve_model_info{name="dcnv2"'):
        assert name in metrics, name


BAD = [
    ({"candidates": [{"item": "i1", "tags": []}]}, 400, "candidates[0].age"),
    ({"user": {"age": "a1"}, "support": [{"item": "i1", "tags": [], "label": "yes"}],
      "candidates": [{"item": "i1", "tags": []}]}, 400, "support[0].label"),
    ({"user": {"age": "a1"}, "candidates": []}, 400, "candidates"),
    ({"user": {"age": "a1"}, "candidates": [{"item": {"x": 1}, "tags": []}]}, 400, "candidates[0].item"),
    ({"user": {"age": "a1"}, "candidates": [{"item": "i1", "tags": "t1"}]}, 400, "candidates[0].tags"),
    ({"user": {"age": "a1"}, "candidates": [{"item": "i1", "tags": [], "colour": 3}]}, 400, "candidates[0].colour"),
    ({"user": {"age": "a1"}, "candidates": [{"item": "i1", "tags": []}] * 51}, 400, "candidates"),
    ({"user": {"age": "a1"}, "candidates": [{"item": "x" * 300000, "tags": []}]}, 413, "body"),
]


@pytest.mark.parametrize("body,status,field", BAD, ids=[b[2] + f"-{i}" for i, b in enumerate(BAD)])
def test_a_bad_request_gets_a_4xx_naming_the_field(server, body, status, field):
    url = server[0]
    reply = httpx.post(f"{url}/v1/score", json=body, timeout=30)
    assert reply.status_code == status and reply.json()["field"] == field, reply.text
    assert reply.json()["error"].startswith(field)


def test_malformed_bodies_and_names_are_refused_and_the_server_stays_up(server):
    url = server[0]
    with httpx.Client(base_url=url, timeout=30) as client:
        reply = client.post("/v1/score", content=b"{not json", headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["field"] == "body"
        for nested in (b"[" * 50_000 + b"]" * 50_000, b'{"a":' + b"[" * 990 + b"NaN" + b"]" * 990 + b"}"):
            reply = client.post("/v1/score", content=nested, headers={"content-type": "application/json"})
            assert reply.status_code == 400 and reply.json()["field"] == "body", reply.text
            assert "nested" in reply.json()["error"]
        reply = client.post("/v2/models/other/infer", json={"inputs": []})
        assert reply.status_code == 404 and "'other'" in reply.json()["error"]
        bad_shape = {"inputs": [{"name": "candidates.item", "shape": [2], "datatype": "BYTES", "data": ["i1"]}]}
        reply = client.post("/v2/models/dcnv2/infer", json=bad_shape)
        assert reply.status_code == 400 and reply.json()["field"] == "inputs[0].data"
        reply = client.post("/v2/models/dcnv2/infer", json={"inputs": [{"name": "query.item", "shape": [1],
                                                                        "datatype": "BYTES", "data": ["i1"]}]})
        assert reply.status_code == 400 and reply.json()["field"] == "inputs[0].name"
        reply = client.post("/v2/repository/models/dcnv2/load", json={"parameters": {"path": "/nowhere"}})
        assert reply.status_code == 403 and reply.json()["field"] == "parameters.path", reply.text
        assert "'/nowhere'" in reply.json()["error"] and "--model-root" in reply.json()["error"]
        missing = str(server[1] / "nowhere")  # under the server's --model-root, but no export
        reply = client.post("/v2/repository/models/dcnv2/load", json={"parameters": {"path": missing}})
        assert reply.status_code == 400 and "nowhere does not exist" in reply.json()["error"], reply.text
        assert client.get("/v2/health/live").status_code == 200


def test_a_new_export_is_loaded_without_dropping_requests(server):
    url, root, data = server
    body = _json_body(requests(data, data.test)[0])

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            before = (await client.post("/v1/score", json=body)).json()["model_version"]
            load = asyncio.create_task(client.post("/v2/repository/models/dcnv2/load",
                                                   json={"parameters": {"path": str(root / "v2")}}))
            during = await asyncio.gather(*(client.post("/v1/score", json=body) for _ in range(20)))
            loaded = (await load).json()
            after = (await client.post("/v1/score", json=body)).json()
            return before, during, loaded, after

    before, during, loaded, after = asyncio.run(asyncio.wait_for(run(), 90))
    assert all(r.status_code == 200 for r in during)
    assert {r.json()["model_version"] for r in during} <= {before, loaded["version"]}
    assert loaded["previous_version"] == before != loaded["version"] == after["model_version"]
    expected = gm.load_adapter(root / "v2", dcn).predict(requests(data, data.test)[:1])[0].scores
    assert np.allclose(after["scores"], expected, atol=1e-5)


def test_a_body_not_whole_within_the_body_timeout_is_a_408_and_the_connection_closes(server):
    """A client that sends a whole head and then trickles (or stalls) its body held the
    connection and its handler for ever: after gmeta-ds serve --body-timeout (2 s here) it is
    answered 408 naming ``body``, and the connection is closed soon after; others are served."""
    import socket
    import time
    from urllib.parse import urlsplit

    url = urlsplit(server[0])
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"user")
        start = time.monotonic()
        sock.settimeout(15)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(4096)
            assert chunk, answer
            answer += chunk
        waited = time.monotonic() - start
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and 1.5 < waited < 6, (head, waited)
        assert json.loads(body) == {"field": "body", "error": "body: 6 bytes 2 s after the request head, not the "
                                                             "whole body (gmeta-ds serve --body-timeout)"}
        # a late byte of the body: it used to cancel uvicorn's keep-alive timer, holding the connection open
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"x")
        sock.settimeout(8)
        try:
            assert sock.recv(4096) == b"", "the connection stayed open after the 408"
        except ConnectionResetError:  # closed before the late byte came: reset
            pass
    assert httpx.get(f"{server[0]}/v2/health/live", timeout=10).status_code == 200


def test_a_slow_request_head_is_closed_after_the_header_timeout(server):
    """Issue 49 item 6: a client that sends half a request head and stalls is closed after
    gmeta-ds serve --header-timeout (2 s here), while whole requests keep being answered."""
    import socket
    import time
    from urllib.parse import urlsplit

    url = urlsplit(server[0])
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        start = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(4096) == b"" and 1.5 < time.monotonic() - start < 6
    assert httpx.get(f"{server[0]}/v2/health/live", timeout=10).status_code == 200
