"""Envoy carries WebSocket upgrades on /v1/ws/completions to a replica's gateway, and nowhere else.

The gateway here is a stand-in (a websockets server answering /health and echoing frames with the
headers it got), so this checks Envoy's route config on its own; the real route's tests run through
the same config.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect
from websockets.sync.server import serve

from protoserve.gateway.envoy.config import Balancing, Replica
from protoserve.gateway.envoy.launcher import EnvoyGateway, running_envoy


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def envoy() -> Iterator[EnvoyGateway]:
    def process_request(connection, request):
        if request.path == "/health":
            return connection.respond(HTTPStatus.OK, "ok\n")
        return None

    def echo(websocket) -> None:
        headers = {k: websocket.request.headers.get(k) for k in ("x-user-id", "traceparent")}
        for message in websocket:
            websocket.send(json.dumps({"path": websocket.request.path, "headers": headers, "echo": message}))

    with serve(echo, "127.0.0.1", 0, process_request=process_request) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.socket.getsockname()[1]
        # No gRPC server at all: the WebSocket route needs only the gateways' cluster.
        replica = Replica(f"127.0.0.1:{_closed_port()}", f"127.0.0.1:{port}")
        with running_envoy([replica], balancing=Balancing(health_check_interval_s=0.2)) as gateway:
            deadline = time.monotonic() + 20
            while gateway.healthy_hosts("protoserve_http") != 1:
                assert time.monotonic() < deadline, gateway.log()
                time.sleep(0.05)
            yield gateway
        server.shutdown()


def test_websocket_upgrade_passes_through_with_headers(envoy):
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    url = f"ws://127.0.0.1:{envoy.http_port}/v1/ws/completions"
    with connect(url, additional_headers={"x-user-id": "ws-user", "traceparent": traceparent}) as ws:
        for text in ("one", "two"):
            ws.send(text)
            reply = json.loads(ws.recv(timeout=10))
            assert reply == {
                "path": "/v1/ws/completions",
                "headers": {"x-user-id": "ws-user", "traceparent": traceparent},
                "echo": text,
            }


def test_no_upgrade_on_other_paths(envoy):
    with pytest.raises(InvalidStatus) as refused:
        with connect(f"ws://127.0.0.1:{envoy.http_port}/v1/completions"):
            pass
    assert refused.value.response.status_code != 101
    # A plain request on the WebSocket path is proxied as HTTP, not upgraded.
    reply = httpx.get(f"http://127.0.0.1:{envoy.http_port}/v1/ws/completions", timeout=10)
    assert reply.status_code != 101
