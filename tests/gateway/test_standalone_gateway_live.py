"""``python -m protoserve.gateway`` as its own process in front of the live server: the deployment where
the gateway and the gRPC server run apart (as Envoy would sit in front of it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from protoserve.gateway.runtime.handler import GatewaySettings
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def standalone_gateway(live_server, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("gateway") / "protoserve.gateway.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            # No --max-body-bytes: the default is what most deployments run.
            [sys.executable, "-m", "gateway", "--grpc-target", live_server.grpc_target, "--port", str(port)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"standalone gateway did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    yield base
    process.terminate()
    process.wait(30)


def test_streams_generate_as_sse(standalone_gateway: str) -> None:
    body = {"prompt": "Count: one, two,", "sampling": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
    deltas, final = 0, None
    with httpx.stream("POST", f"{standalone_gateway}/v1/generate:stream", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        *events, done = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
    assert done == "[DONE]"
    for event in map(json.loads, events):
        deltas += "delta" in event
        final = event.get("final", final)
    assert deltas == 4
    assert final is not None and final["usage"]["completion_tokens"] == 4


def test_default_body_limit_is_enforced(standalone_gateway: str) -> None:
    limit = GatewaySettings().max_body_bytes
    response = httpx.post(f"{standalone_gateway}/v1/generate", json={"prompt": "x" * limit}, timeout=30)
    assert response.status_code == 413, response.text
