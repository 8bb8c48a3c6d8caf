"""Opt-in CORS on the REST gateway (gateway/cors.py): real preflights and cross-origin calls over HTTP.

Gateways on real ports in front of the fake backend, with and without
``cors_origins``; then ``protoserve serve --cors-origin`` itself, whose
gateway answers preflights before its model has loaded.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_fakes import gateway_thread

from protoserve.gateway.app import generated_routes

REPO = Path(__file__).resolve().parents[2]
ORIGIN = "https://app.example"
REQUEST_HEADERS = "authorization, content-type, x-user-id, x-request-timeout"
DOCUMENTED_METHODS = {"GET", "POST", "DELETE"}  # docs/api.md, CORS


@pytest.fixture(scope="module")
def cors_gateway(fake_backend) -> Iterator[str]:
    with gateway_thread(fake_backend.target, cors_origins=(ORIGIN, "http://localhost:3000")) as url:
        yield url


@pytest.fixture(scope="module")
def any_origin_gateway(fake_backend) -> Iterator[str]:
    with gateway_thread(fake_backend.target, cors_origins=("*",)) as url:
        yield url


def preflight(base: str, path: str, origin: str = ORIGIN, method: str = "POST", headers: str = REQUEST_HEADERS):
    return httpx.options(
        base + path,
        headers={
            "origin": origin,
            "access-control-request-method": method,
            "access-control-request-headers": headers,
        },
        timeout=10,
    )


def test_preflight_is_204_with_origin_methods_headers_and_max_age(cors_gateway):
    reply = preflight(cors_gateway, "/v1/chat/completions")
    assert reply.status_code == 204 and reply.content == b""
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    # Exactly the methods some route takes, as docs/api.md lists them (DELETE: UnloadAdapter).
    methods = set(reply.headers["access-control-allow-methods"].replace(" ", "").split(","))
    assert methods == {"GET"} | {route.http_method for route in generated_routes()} == DOCUMENTED_METHODS
    allowed = set(reply.headers["access-control-allow-headers"].replace(" ", "").lower().split(","))
    assert {"authorization", "content-type", "x-user-id", "x-request-timeout"} <= allowed
    # What the official JavaScript SDKs send from a page (openai-node, @anthropic-ai/sdk).
    sdk = "x-api-key, anthropic-version, anthropic-dangerous-direct-browser-access, x-stainless-lang, x-stainless-os"
    from_sdk = preflight(cors_gateway, "/v1/messages", headers=sdk)
    assert from_sdk.status_code == 204, from_sdk.text
    assert reply.headers["access-control-max-age"] == "600"
    assert "origin" in reply.headers["vary"].lower()
    assert "access-control-allow-credentials" not in reply.headers  # bearer keys, never cookies
    # Every route, GET ones too, and the second configured origin.
    other = preflight(cors_gateway, "/v1/models", origin="http://localhost:3000", method="GET")
    assert other.status_code == 204 and other.headers["access-control-allow-origin"] == "http://localhost:3000"
    unload = preflight(cors_gateway, "/v1/adapters/some-adapter", method="DELETE", headers="authorization")
    assert unload.status_code == 204 and unload.headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.parametrize(
    ("origin", "method", "headers"),
    [
        ("https://evil.example", "POST", REQUEST_HEADERS),  # not a configured origin
        (ORIGIN + ":8443", "POST", REQUEST_HEADERS),  # another port is another origin
        (ORIGIN, "PATCH", REQUEST_HEADERS),  # no route takes PATCH
        (ORIGIN, "PUT", REQUEST_HEADERS),  # nor PUT
        (ORIGIN, "POST", "authorization, x-something-else"),  # a header we do not read
    ],
)
def test_preflight_refuses_what_is_not_allowed(cors_gateway, origin, method, headers):
    reply = preflight(cors_gateway, "/v1/chat/completions", origin=origin, method=method, headers=headers)
    assert reply.status_code == 400
    assert reply.headers.get("access-control-allow-origin") in (None, ORIGIN)
    if origin != ORIGIN:
        assert "access-control-allow-origin" not in reply.headers


def test_cross_origin_error_exposes_retry_after(cors_gateway):
    reply = httpx.post(
        cors_gateway + "/v1/generate",
        json={"prompt": "error:RESOURCE_EXHAUSTED"},
        headers={"origin": ORIGIN},
        timeout=10,
    )
    assert reply.status_code == 429
    assert reply.headers["retry-after"] == "3"
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    exposed = reply.headers["access-control-expose-headers"].lower()
    assert "retry-after" in exposed and "x-request-id" in exposed


def test_cross_origin_success_and_same_origin_untouched(cors_gateway):
    reply = httpx.post(
        cors_gateway + "/v1/generate", json={"prompt": "abc"}, headers={"origin": ORIGIN}, timeout=10
    )
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == ORIGIN
    foreign = httpx.post(
        cors_gateway + "/v1/generate", json={"prompt": "abc"}, headers={"origin": "https://evil.example"}, timeout=10
    )
    # Refused, not merely left without a grant: a page's simple request would run before the
    # browser hid its answer (gateway.browser_safety).
    assert foreign.status_code == 403 and "access-control-allow-origin" not in foreign.headers
    plain = httpx.post(cors_gateway + "/v1/generate", json={"prompt": "abc"}, timeout=10)
    assert "access-control-allow-origin" not in plain.headers


def test_any_origin(any_origin_gateway):
    reply = preflight(any_origin_gateway, "/v1/completions", origin="https://anything.example")
    assert reply.status_code == 204 and reply.headers["access-control-allow-origin"] == "*"
    simple = httpx.get(any_origin_gateway + "/v1/models", headers={"origin": "https://x.example"}, timeout=10)
    assert simple.headers["access-control-allow-origin"] == "*"


def test_off_by_default_options_stays_405(fake_gateway):
    reply = preflight(fake_gateway, "/v1/chat/completions")
    assert reply.status_code == 405
    assert "access-control-allow-origin" not in reply.headers


# ---- protoserve serve --cors-origin -------------------------------------------------------------


def test_serve_cors_origin_flag(spawn_server):
    server = spawn_server("--cors-origin", ORIGIN, wait_ready=False)
    try:
        reply = preflight(f"http://127.0.0.1:{server.http_port}", "/v1/chat/completions")
        assert reply.status_code == 204 and reply.headers["access-control-allow-origin"] == ORIGIN
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cors-origin", ORIGIN + "/"], "is not an origin"),
        (["--cors-origin", "app.example"], "is not an origin"),
        (["--cors-origin", ORIGIN, "--no-http"], "needs the REST gateway"),
    ],
)
def test_serve_refuses_bad_cors_flags_in_one_line(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "protoserve.server.cli", "serve", "--port", "0", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("protoserve: ") and message in lines[0], done.stderr
