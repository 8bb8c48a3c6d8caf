"""Gateway test fixtures: the fake gRPC backend and a gateway in front of it (see gateway_fakes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_fakes import FakeBackend, gateway_thread, start_fake_backend

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
