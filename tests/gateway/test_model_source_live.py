"""The weights' path on the server is shown to admin keys only (``ModelInfo.source``).

``/v1/inference/models`` and ``/v1/inference/models/{name}`` answer every caller, so an ordinary key
gets the file's name and an admin key (or anyone, with auth off, where anyone may load adapters
from server paths too) the full path. A server with an admin key shares ``inproc_server``'s engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from gateway_fakes import gateway_thread

USER_KEY = "source-user-key"
ADMIN_KEY = "source-admin-key"


@dataclass(frozen=True)
class Served:
    auth_url: str  # a gateway in front of a server with USER_KEY and ADMIN_KEY
    open_url: str  # a gateway in front of a server with auth off
    name: str
    path: str  # where the weights are on the server


@pytest.fixture(scope="module")
def served(inproc_server) -> Iterator[Served]:
    from protoserve.server.app import ServerApp, ServerConfig
    from protoserve.server.security.auth import Authenticator

    [model] = inproc_server.call(lambda: inproc_server.apps[0].models.all())

    async def start() -> ServerApp:
        app = ServerApp(
            ServerConfig(port=0, http_port=None, grace_period_s=2.0),
            auth=Authenticator([USER_KEY], admin_keys=[ADMIN_KEY]),
        )
        await app.start()
        await app.attach_engine(inproc_server.engine, model.card)
        return app

    app = inproc_server.run(start())
    try:
        with (
            gateway_thread(app.grpc_target) as auth_url,
            gateway_thread(inproc_server.grpc_target) as open_url,
        ):
            yield Served(auth_url, open_url, model.name, model.card.source)
    finally:
        inproc_server.run(app.stop())


def sources(base: str, name: str, key: str | None) -> tuple[list[str], str]:
    """``source`` of each listed model and of the one named, and every models route's text."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
        listed = client.get("/v1/inference/models")
        one = client.get(f"/v1/inference/models/{name}")
        openai_routes = [client.get("/v1/models"), client.get(f"/v1/models/{name}")]
    for reply in (listed, one, *openai_routes):
        assert reply.status_code == 200, reply.text
    found = [m["source"] for m in listed.json()["models"]] + [one.json()["model"]["source"]]
    return found, "".join(r.text for r in (listed, one, *openai_routes))


def test_an_ordinary_key_sees_the_file_name_not_the_server_path(served):
    assert os.path.isabs(served.path)
    found, text = sources(served.auth_url, served.name, USER_KEY)
    assert found == [os.path.basename(served.path)] * 2
    assert os.path.dirname(served.path) not in text


def test_an_admin_key_and_auth_off_see_the_full_path(served):
    assert sources(served.auth_url, served.name, ADMIN_KEY)[0] == [served.path] * 2
    assert sources(served.open_url, served.name, None)[0] == [served.path] * 2
