"""docs/serving.md's tritonclient examples run as written against a real `gmeta-ds serve
--grpc-port` of the demo's model (issue 51 item 5): over HTTP and over gRPC, the client's defaults
(binary tensors in and out; raw_input_contents and raw_output_contents) give the scores the plain
JSON endpoint gives for the same user, and the repository index lists the model. The export holds the demo config's untrained model (a small synthetic dataset): the
example's requests need the demo's fields and model name, not its training (seconds, not the
doc's full training run)."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the dev extra")
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the dev extra")
from tests.helpers import demo_export, wait_ready
from tests.pool import free_port

pytestmark = [pytest.mark.docs]

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "serving.md"


def _python_block(marker: str) -> str:
    """The first ```python block of the doc holding ``marker``."""
    return next(b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL) if marker in b)


def _run(block: str, ports: dict[str, int], cwd: Path) -> subprocess.CompletedProcess:
    """The doc's python block holding ``block``, its documented ports replaced by ``ports``."""
    script = _python_block(block)
    for documented, port in ports.items():
        script = script.replace(documented, f"127.0.0.1:{port}")
    (cwd / "example.py").write_text(script)
    return subprocess.run([sys.executable, "-I", "example.py"], check=False, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def test_the_tritonclient_examples_score_as_the_json_endpoint(tmp_path):
    export, port, grpc_port = demo_export(tmp_path), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-I", "-m", "gmeta_ds.cli", "serve", str(export), "--port", str(port),
           "--grpc-port", str(grpc_port)]
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, url, tmp_path / "server.log")
            # the doc's plain JSON request for the same user (another user id: adapted, not cached)
            curl = next(line for line in DOC.read_text().splitlines() if line.startswith("curl") and "/v1/score" in line)
            body = curl.split(" -d '", 1)[1].rstrip("'")
            expected = httpx.post(f"{url}/v1/score", content=body.replace("new-user-1", "json-user"),
                                  headers={"content-type": "application/json"}, timeout=30).json()
            runs = [_run(block, {"127.0.0.1:8000": port, "127.0.0.1:8001": grpc_port}, tmp_path)
                    for block in ("tritonclient.http", "tritonclient.grpc")]
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
        assert ast.literal_eval(lines["scores"]) == pytest.approx(expected["scores"], abs=1e-6)
        assert ast.literal_eval(lines["models"]) == [{"name": "melu", "version": expected["model_version"],
                                                      "state": "READY"}]
    assert ast.literal_eval(dict(line.split(" ", 1) for line in runs[1].stdout.splitlines())["ready"]) is True
