"""A client that goes away cancels its gRPC call, and the real engine frees the request's KV cache at once.

Runs our gateway in front of the in-process server (``inproc_server``), whose
engine is reachable for KV-cache checks.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from gateway_fakes import gateway_thread

LONG = 2000  # far more tokens than the test waits for


@pytest.fixture(scope="module")
def gateway_url(inproc_server):
    with gateway_thread(inproc_server.grpc_target) as url:
        yield url


@pytest.fixture(scope="module")
def model(gateway_url) -> str:
    return httpx.get(f"{gateway_url}/v1/models", timeout=30).json()["data"][0]["id"]


def _stats(server):
    return server.call(server.engine.stats)


def _assert_cancelled_early(server, before, at_disconnect) -> None:
    """The request was cancelled, its KV freed, long before it could have run its LONG tokens.

    Counted in tokens rather than seconds: on a loaded machine the gateway notices a closed socket late
    in wall time, but a request that went on would generate up to LONG more tokens. Counted from before
    the request, since the engine's snapshot at the disconnect may already be a step old."""
    server.wait_kv_free(timeout=120)
    after = _stats(server)
    seen = f"before {before}\nat the disconnect {at_disconnect}\nafter {after}"
    assert after.requests_cancelled_total == before.requests_cancelled_total + 1, seen
    assert after.generation_tokens_total - before.generation_tokens_total < LONG // 4, seen


def _wait_running(server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server.kv_all_free():
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)


@pytest.mark.parametrize("route", ["openai", "native"])
def test_disconnect_mid_stream_frees_kv(inproc_server, gateway_url, model, route):
    inproc_server.wait_kv_free(timeout=30)
    before = _stats(inproc_server)
    if route == "openai":
        path = "/v1/completions"
        body = {
            "model": model,
            "prompt": "Tell me a story.",
            "max_tokens": LONG,
            "stream": True,
            "ignore_eos": True,
        }
    else:
        path = "/v1/generate:stream"
        body = {"prompt": "Tell me a story.", "sampling": {"max_tokens": LONG, "ignore_eos": True}}
    with httpx.Client(base_url=gateway_url, timeout=60) as client:
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            first = next(response.iter_raw())
            assert first.startswith(b"data: {") and b'"error"' not in first
            # The first event may precede the engine's first step (an initial chunk); wait
            # until the request holds KV, then leave.
            _wait_running(inproc_server)
            at_disconnect = _stats(inproc_server)
    _assert_cancelled_early(inproc_server, before, at_disconnect)


def test_disconnect_during_unary_call_frees_kv(inproc_server, gateway_url, model):
    inproc_server.wait_kv_free(timeout=30)
    before = _stats(inproc_server)
    host, port = gateway_url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": "Once", "max_tokens": LONG, "ignore_eos": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request)
        _wait_running(inproc_server)
        at_disconnect = _stats(inproc_server)
    _assert_cancelled_early(inproc_server, before, at_disconnect)
