"""Fixtures shared by several files of tests/unit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import stop_process, wait_ready
from tests.pool import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """(base url, the export, a second export of other weights, the data) of a running
    `gmeta-ds serve` on 127.0.0.1, one per session: tests/unit/test_serving_server.py's,
    test_serving_triton.py's and (over gRPC, `grpc_address`) test_serving_grpc.py's requests
    go to it (starting one costs seconds)."""
    import gmeta_ds as gm
    from tests.helpers import click_log
    from tests.unit.test_saved_model import _engine
    from tests.unit.test_serving_adapter import KEYS
    from tests.unit.test_serving_server import dcn

    data = gm.build_tasks(click_log(users=24), **KEYS)
    root = tmp_path_factory.mktemp("serve")
    engine = _engine(dcn(data.fields), data, "maml")
    engine.save_model(root / "v1", data)
    with torch.no_grad():
        for p in engine.learner.parameters():
            p.add_(0.05)
    engine.save_model(root / "v2", data)
    port, grpc_port = free_port(), free_port()
    (root / "grpc_port").write_text(str(grpc_port))
    cmd = [sys.executable, "-m", "gmeta_ds.cli", "serve", str(root / "v1"), "--port", str(port),
           "--grpc-port", str(grpc_port),
           "--model", "tests.unit.test_serving_server:dcn", "--max-rows", "50", "--max-body-bytes", "200000",
           "--allow-reload", "--model-root", str(root), "--header-timeout", "2", "--body-timeout", "2"]
    with open(root / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(proc, url, root / "server.log")
            yield url, root, data
        finally:
            stop_process(proc)


@pytest.fixture(scope="session")
def grpc_address(server) -> str:
    """``host:port`` of the session server's OIP v2 gRPC service (``--grpc-port``)."""
    return f"127.0.0.1:{(server[1] / 'grpc_port').read_text()}"
