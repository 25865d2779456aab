"""What a client may make `gmeta-ds serve` do beyond scoring (issue 49 items 4 and 6): the reload
endpoint loads only the served export or folders under the --model-root folders, and only with
--allow-reload (`ReloadPolicy`, in process); a connection that sends half a request head and
stalls is closed after --header-timeout seconds, one that sends it whole (at once, or in
pieces within the deadline) is answered, also on a kept-alive connection (a real uvicorn server
on 127.0.0.1 with a 0.5 s deadline, a few seconds in all)."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

import gmeta_ds as gm
from gmeta_ds.serving.access import Refused, ReloadPolicy, header_deadline_protocol
from gmeta_ds.serving.server import ServerOptions, options_from_arguments


def _refused(policy: ReloadPolicy, body, served, status: int, match: str) -> None:
    with pytest.raises(Refused, match=match) as caught:
        policy.target(body, served)
    assert caught.value.status == status


def test_reloading_is_off_unless_allowed(tmp_path):
    served = tmp_path / "v1"
    _refused(ReloadPolicy.of(False, ()), {}, served, 403, r"reloading is off on this server \(start gmeta-ds serve "
                                                             r"with --allow-reload")
    _refused(ReloadPolicy.of(False, ()), {"parameters": {"path": str(served)}}, served, 403, "reloading is off")
    with pytest.raises(gm.ConfigError, match=r"--model-root: the reload endpoint is off without --allow-reload"):
        ReloadPolicy.of(False, (str(tmp_path),))
    with pytest.raises(gm.ConfigError, match=r"--model-root .*nowhere: not a folder"):
        ReloadPolicy.of(True, (str(tmp_path / "nowhere"),))


def test_a_reload_loads_only_the_served_export_or_a_folder_under_a_root(tmp_path):
    root, other = tmp_path / "exports", tmp_path / "elsewhere"
    (root / "v2").mkdir(parents=True)
    other.mkdir()
    (root / "link").symlink_to(other)  # inside the root by name, outside once resolved
    served = tmp_path / "v1"
    policy = ReloadPolicy.of(True, (str(root),))
    assert policy.target({}, served) == served and policy.target({"parameters": {}}, served) == served
    assert policy.target({"parameters": {"path": str(root / "v2")}}, served) == (root / "v2").resolve()
    assert policy.target({"parameters": {"path": str(served)}}, served) == served.resolve()
    for escape in (other, root / ".." / "elsewhere", root / "link", "/etc"):
        _refused(policy, {"parameters": {"path": str(escape)}}, served, 403,
                 r"is not under a folder this server loads from \(--model-root: .*exports\)")
    _refused(ReloadPolicy.of(True, ()), {"parameters": {"path": str(root / "v2")}}, served, 403,
             r"\(--model-root: none given\)")
    for bad in (3, ["a"], "", "a\0b"):
        _refused(policy, {"parameters": {"path": bad}}, served, 400, r"expected the export folder's path")


def test_string_arguments_turn_reloading_on_only_when_they_say_so(tmp_path):
    """Ray Serve's builder passes strings: allow_reload=false must not be on (bool("false") is
    True), folders come from a list or one string joined by the path separator."""
    convert = options_from_arguments
    assert convert({"allow_reload": "false"}, "ray").allow_reload is False
    assert convert({"allow_reload": "True", "max_batch": "8"}, "ray") == ServerOptions(allow_reload=True, max_batch=8)
    assert convert({"model_roots": f"/a{os.pathsep}/b"}, "ray").model_roots == ("/a", "/b")
    assert convert({"model_roots": ["/a"], "header_timeout_s": "2.5"}, "ray") == \
        ServerOptions(model_roots=("/a",), header_timeout_s=2.5)
    with pytest.raises(gm.ConfigError, match=r"allow_reload='maybe': expected bool"):
        convert({"allow_reload": "maybe"}, "ray")
    with pytest.raises(gm.ConfigError, match=r"colour: unknown argument"):
        convert({"colour": "red"}, "ray")


@pytest.mark.parametrize("args,named", [
    ({"max_wait_ms": "inf"}, r"max_wait_ms=inf: expected a number of milliseconds in \[0, 60000\]"),
    ({"max_wait_ms": "nan"}, r"max_wait_ms=nan"), ({"threads": "0"}, r"threads=0: expected an integer >= 1"),
    ({"max_rows": "-3"}, r"max_rows=-3"), ({"cache_ttl_s": "-1"}, r"cache_ttl_s=-1.0"),
    ({"header_timeout_s": "0"}, r"header_timeout_s=0.0"),
    ({"max_body_bytes": str(2**31)}, r"max_body_bytes=2147483648: expected an integer in \[1, 2147483647\]")])
def test_option_numbers_out_of_bounds_are_refused_naming_them(args, named):
    """Ray's and KServe's string arguments met no bound: an infinite max_wait_ms made the
    batcher wait for a full batch (a request hung), threads=0 was torch's traceback."""
    with pytest.raises(gm.ConfigError, match=named):
        options_from_arguments(args, "ray")


def test_serve_refuses_an_unbounded_batch_wait_before_loading(tmp_path, capsys):
    from gmeta_ds import cli

    code = cli.main(["serve", str(tmp_path / "missing"), "--max-wait-ms", "inf", "--cache-ttl-s", "nan",
                     "--max-body-bytes", "3000000000"])  # over gRPC's int limit: its service's OverflowError
    err = capsys.readouterr().err
    assert code == 2 and "--max-wait-ms=inf: expected" in err and "--cache-ttl-s=nan: expected" in err, err
    assert "--max-body-bytes=3000000000: expected" in err
    assert "missing" not in err  # refused before the export is looked at


async def _ok(scope, receive, send) -> None:
    """The smallest ASGI application: 200 "ok" to every request."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def deadline_server():
    """A uvicorn server on 127.0.0.1 whose request heads have 0.5 s (its port)."""
    import uvicorn

    config = uvicorn.Config(_ok, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            http=header_deadline_protocol(0.5))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes ``sock`` (reading what it sends until then)."""
    start = time.monotonic()
    sock.settimeout(3)
    while sock.recv(4096):
        pass
    return time.monotonic() - start


GET = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def test_half_a_request_head_is_closed_after_the_deadline(deadline_server):
    """Issue 49 item 6: a socket that sent half a header was never closed."""
    with socket.create_connection(("127.0.0.1", deadline_server)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.")
        assert 0.3 < _closed_after(sock) < 2.5


def test_whole_heads_are_answered_and_a_kept_alive_connection_gets_the_deadline_again(deadline_server):
    with socket.create_connection(("127.0.0.1", deadline_server)) as sock:
        for piece in (GET[:10], GET[10:25], GET[25:]):  # in pieces, within the deadline
            sock.sendall(piece)
            time.sleep(0.15)
        sock.settimeout(3)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.7)  # longer than the deadline: idle between requests is keep-alive's to end
        sock.sendall(b"GET / HTTP/1.1\r\nHo")  # the next request's head, half
        assert 0.3 < _closed_after(sock) < 2.5


@pytest.mark.parametrize("flag,value", [("--port", "70000"), ("--port", "-1"), ("--grpc-port", "65536")])
def test_serve_refuses_a_port_outside_tcps_range(tmp_path, capsys, flag, value):
    """--port 70000 loaded the export and then hung without a word (uvicorn), --port -1 failed
    after loading, --grpc-port 65536 was grpc's probe's OverflowError traceback."""
    from gmeta_ds import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", str(tmp_path / "missing"), flag, value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {flag}: {value} must be" in err, err
