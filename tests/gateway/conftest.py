"""Gateway test fixtures: the fake gRPC backend and a gateway in front of it (see gateway_fakes),
``protoserve serve`` with the browser-safety and idle-timeout flags (see guarded_server), and
headless Chromium (see headless_chromium)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from gateway_fakes import FakeBackend, gateway_thread, start_fake_backend
from guarded_server import ALLOWED_DOMAIN, ALLOWED_HOST, STREAM_IDLE_TIMEOUT_S, GuardedServer
from headless_chromium import HeadlessChromium, chromium_path

from protoserve.gateway.runtime.handler import GatewaySettings


@pytest.fixture(scope="session")
def fake_backend() -> Iterator[FakeBackend]:
    """The scripted fake backend, shared by the session."""
    backend = start_fake_backend()
    yield backend
    backend.server.stop(0)


@pytest.fixture(scope="session")
def fake_gateway(fake_backend: FakeBackend) -> Iterator[str]:
    """Base URL of a gateway in front of the fake backend (body limit 64 KiB to test 413 cheaply)."""
    with gateway_thread(fake_backend.target, GatewaySettings(max_body_bytes=64 * 1024)) as url:
        yield url


@pytest.fixture(scope="session")
def guarded_server(spawn_server) -> GuardedServer:
    """``protoserve serve --stream-idle-timeout 2 --cors-origin ... --allowed-host ...`` (auth off)."""
    with socket.socket() as probe:  # a port that was free a moment ago, for the page server
        probe.bind(("127.0.0.1", 0))
        allowed_origin_port = probe.getsockname()[1]
    server = spawn_server(
        "--stream-idle-timeout", str(STREAM_IDLE_TIMEOUT_S),
        "--cors-origin", f"http://127.0.0.1:{allowed_origin_port}",
        "--allowed-host", ALLOWED_HOST,
        "--allowed-host", ALLOWED_DOMAIN,
        for_session=True,
    )  # fmt: skip
    return GuardedServer(server, allowed_origin_port)


@pytest.fixture(scope="module")
def browser() -> Iterator[HeadlessChromium]:
    """Headless Chromium with one page, for the module; skips where Chromium is not installed."""
    binary = chromium_path()
    if binary is None:
        pytest.skip(
            "chromium is not installed (make install adds Debian's chromium where apt-get runs as root)"
        )
    chromium = HeadlessChromium(binary)
    yield chromium
    chromium.close()
