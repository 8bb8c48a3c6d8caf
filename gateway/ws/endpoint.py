"""``GET /v1/ws/completions``: the upgrade (authorized before it is accepted) and the open sockets.

An upgrade reaches this endpoint only past gateway.browser_safety: its Host names the server
and its Origin, if any, is the gateway's own or a ``--cors-origin`` one (403 otherwise, before
accepting), so a page elsewhere cannot open a socket and read completions.

The gateway holds no keys: the gRPC server authenticates. So before
accepting, the upgrade's forwarded headers (``authorization``, ``x-user-id``)
go to the server on its cheapest authenticated call, the OpenAI route's
ListModels; a refusal there (401 bad key, 403, 503 loading or draining, ...)
refuses the upgrade with that HTTP status and the OpenAI error body, before
any WebSocket exists. An ASGI server without the ``websocket.http.response``
extension cannot answer an upgrade with a status of its own; there the socket
is accepted and closed at once with 1008 (1013 for 429/503, 1011 for other
5xx) and the error message as the reason.

The endpoint keeps the open sessions, so that shutdown closes them with 1001.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.rpc import code_pb2
from starlette.requests import Request
from starlette.responses import Response

from protoserve.gateway.runtime.errors import HttpError, from_rpc_error, gateway_error
from protoserve.gateway.runtime.handler import GatewayHandler, Receive, Scope, Send
from protoserve.gateway.runtime.json_codec import dumps
from protoserve.gateway.runtime.route import ErrorStyle, Route
from protoserve.gateway.runtime.router import RoutingError
from protoserve.gateway.ws import close_codes
from protoserve.gateway.ws.protocol import REQUEST_PATHS
from protoserve.gateway.ws.session import WS_PATH, Session, SessionConfig
from protoserve.v1 import inference_pb2

log = logging.getLogger(__name__)

# The call that authorizes an upgrade: authenticated by the server, cheap, generates nothing.
PROBE_PATH = "/v1/models"
PROBE_TIMEOUT_S = 10.0
UPGRADE_METHOD = "GET"
HTTP_RESPONSE_EXTENSION = "websocket.http.response"


class WebSocketEndpoint:
    """The ASGI app of the WebSocket route, sharing the HTTP handler's channel, settings and telemetry."""

    def __init__(self, handler: GatewayHandler) -> None:
        self.handler = handler
        self.sessions: set[Session] = set()
        routes = {kind: _route(handler, "POST", path) for kind, path in REQUEST_PATHS.items()}
        self._routes = {kind: route for kind, route in routes.items() if route is not None}
        self._probe = _route(handler, "GET", PROBE_PATH)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            return
        if (await receive())["type"] != "websocket.connect":
            return
        began = time.monotonic()
        try:
            timeout = self.handler.call_timeout(scope)
            await self._authorize(scope)
        except HttpError as error:
            await refuse_upgrade(scope, send, error, ErrorStyle.OPENAI)
            self._observe(error.http_status, began)
            return
        await send({"type": "websocket.accept"})
        self._observe(101, began)
        config = SessionConfig(self.handler, self._routes, timeout, self.handler.settings.max_body_bytes)
        session = Session(scope, receive, send, config)
        self.sessions.add(session)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)

    async def close_all(
        self, code: int = close_codes.GOING_AWAY, reason: str = "server shutting down"
    ) -> None:
        """Close every open socket (their requests are cancelled with them); for shutdown."""
        sessions = list(self.sessions)
        if sessions:
            log.info("closing %d WebSocket(s) with %d", len(sessions), code)
            await asyncio.gather(*(session.close(code, reason) for session in sessions))

    async def _authorize(self, scope: Scope) -> None:
        """Raise the HttpError the server answers the upgrade's identity with, if any."""
        metadata = self.handler.call_metadata(scope)  # 400 for a non-ASCII identity header
        if self._probe is None:
            return  # a route table without ListModels: each request is authenticated on its own
        probe = self._probe
        rpc = self.handler.channel.unary_unary(probe.grpc_method, probe.response_type)
        try:
            await rpc(probe.request_type(), metadata=metadata, timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def _observe(self, status: int, began: float) -> None:
        if self.handler.metrics is not None:
            self.handler.metrics.observe(WS_PATH, UPGRADE_METHOD, status, time.monotonic() - began)


async def refuse_upgrade(scope: Scope, send: Send, error: HttpError, style: ErrorStyle) -> None:
    """Answer an upgrade with ``error``: its HTTP status and body if the server can, else a close code."""
    if HTTP_RESPONSE_EXTENSION in (scope.get("extensions") or {}):
        body = dumps(error.body(style))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
        await send({"type": "websocket.http.response.start", "status": error.http_status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.accept"})
    reason = close_codes.close_reason(error.status.message)
    await send({"type": "websocket.close", "code": close_code_for(error.http_status), "reason": reason})


def close_code_for(http_status: int) -> int:
    """The close code of an upgrade refused after accepting."""
    if http_status in (429, 503):
        return close_codes.TRY_AGAIN_LATER
    if http_status >= 500:
        return close_codes.INTERNAL_ERROR
    return close_codes.POLICY_VIOLATION


async def refuse_unknown_path(handler: GatewayHandler, scope: Scope, send: Send) -> None:
    """An upgrade to a path with no WebSocket route: 404 in the error style of the API it looks like."""
    path = scope.get("path", "")
    error = gateway_error(code_pb2.NOT_FOUND, f"no WebSocket route at {path}", http_status=404)
    await refuse_upgrade(scope, send, error, handler.router.style_for_path(path))


async def upgrade_required(_: Request) -> Response:
    """A plain HTTP GET of the WebSocket route: 426, naming what to do."""
    error = gateway_error(
        code_pb2.FAILED_PRECONDITION,
        f"{WS_PATH} is a WebSocket route: send an upgrade request",
        http_status=426,
        reason=inference_pb2.ERROR_REASON_UPGRADE_REQUIRED,
    )
    return Response(
        dumps(error.body(ErrorStyle.OPENAI)),
        status_code=426,
        media_type="application/json",
        headers={"upgrade": "websocket", "connection": "Upgrade"},
    )


def _route(handler: GatewayHandler, method: str, path: str) -> Route | None:
    try:
        return handler.router.resolve(method, path).route
    except RoutingError:
        return None
