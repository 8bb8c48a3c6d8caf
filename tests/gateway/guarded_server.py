"""The ``guarded_server`` fixture's flags and handle (the fixture itself is in conftest.py).

One ``protoserve serve`` process for the browser-safety and slow-client tests: a short
``--stream-idle-timeout``, one ``--cors-origin`` (a page server's port, chosen before the
server starts) and both ``--allowed-host`` forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.conftest import LiveServer

STREAM_IDLE_TIMEOUT_S = 2.0
ALLOWED_HOST = "api.protoserve.test"
ALLOWED_DOMAIN = ".corp.protoserve.test"


@dataclass
class GuardedServer:
    """The server process and the page origin it lets in."""

    server: LiveServer
    allowed_origin_port: int  # the port of the page origin given with --cors-origin

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    @property
    def allowed_origin(self) -> str:
        return f"http://127.0.0.1:{self.allowed_origin_port}"
