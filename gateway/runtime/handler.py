"""The ASGI application that serves the route table through the shared gRPC channel.

Per request: route (404/405), check that a body is declared JSON (415, see
media_type), read it within the size limit (413), bind the gRPC request (400), forward the identity and trace headers as
metadata, then call. When tracing, each request runs in the gateway's own
SERVER span, whose context goes to the server in place of the incoming trace
headers; with metrics, each answered request is counted by route and status. Unary answers are one JSON body; streams are framed per
route. While a call runs, the client's connection is watched: a client that
goes away cancels the gRPC call at once, so the server stops generating and
frees the request's KV cache instead of finishing work nobody will read.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import grpc
from google.rpc import code_pb2

from protoserve.gateway.open_inference.routes import OpenInferenceRoutes
from protoserve.gateway.runtime import framing
from protoserve.gateway.runtime.binding import Call, bind_request
from protoserve.gateway.runtime.channel import SharedChannel
from protoserve.gateway.runtime.errors import HttpError, from_rpc_error, gateway_error
from protoserve.gateway.runtime.json_codec import dumps, message_to_json
from protoserve.gateway.runtime.media_type import body_type_error
from protoserve.gateway.runtime.metrics import GatewayMetrics
from protoserve.gateway.runtime.route import BodyCodec, ErrorStyle, Framing, Route
from protoserve.gateway.runtime.router import Router, RoutingError
from protoserve.gateway.runtime.tracing import TRACE_HEADERS, HttpTracing

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
AsgiMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[AsgiMessage]]
Send = Callable[[AsgiMessage], Awaitable[None]]

# Identity and W3C trace context travel to the server as gRPC metadata.
# x-api-key is Anthropic's way of sending the key (server.security.auth reads either).
DEFAULT_FORWARDED_HEADERS = ("authorization", "x-api-key", "x-user-id", "traceparent", "tracestate")
TIMEOUT_HEADER = "x-request-timeout"


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Limits and header policy of the gateway."""

    # Larger bodies are refused with 413 before they are read in full.
    max_body_bytes: int = 4 * 1024 * 1024
    forwarded_headers: tuple[str, ...] = DEFAULT_FORWARDED_HEADERS
    # Seconds (decimal) the client allows the call; becomes the gRPC deadline.
    timeout_header: str = TIMEOUT_HEADER
    # The longest deadline the timeout header may ask for. Larger ones are refused (400): far
    # out they overflow grpc's deadline arithmetic and the call would fail at once.
    max_request_timeout_s: float = 24 * 3600.0
    # WebSocket route (gateway.ws): requests one socket may run at once, and frames its send
    # queue holds before the streams feeding it wait for the client to read.
    ws_max_streams: int = 64
    ws_send_queue_frames: int = 256
    # Seconds a streaming client (SSE or WebSocket) may leave what it was sent unread before its
    # connection is dropped and its requests cancelled (gateway.slow_clients); also the WebSocket
    # keepalive ping's interval and timeout.
    stream_idle_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.stream_idle_timeout_s) and self.stream_idle_timeout_s > 0):
            raise ValueError(
                f"the stream idle timeout must be a positive number of seconds, got {self.stream_idle_timeout_s}"
            )


class _ClientGone(Exception):
    """The client disconnected before the gateway answered."""


@dataclass(slots=True)
class _Exchange:
    """What one request turned out to be, for its span and metrics."""

    route: Route | None = None
    status: int | None = None  # None until the response starts


class GatewayHandler:
    """ASGI app for the generated routes; one instance serves every request."""

    def __init__(
        self,
        routes: Iterable[Route],
        channel: SharedChannel,
        settings: GatewaySettings,
        tracing: HttpTracing | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.router = Router(routes)
        self.channel = channel
        self.settings = settings
        self.tracing = tracing or HttpTracing(None)
        self.metrics = metrics
        # The Open Inference Protocol's routes, whose bodies are not their messages' JSON.
        self.open_inference = OpenInferenceRoutes(self)
        forwarded = frozenset(name.lower().encode() for name in settings.forwarded_headers)
        # A tracing gateway sends its own span's context instead of the client's headers.
        self._forwarded = forwarded - TRACE_HEADERS if self.tracing.enabled else forwarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1").split("?", 1)[0]
        exchange = _Exchange()
        began = time.monotonic()

        async def tracked_send(message: AsgiMessage) -> None:
            if message["type"] == "http.response.start" and exchange.status is None:
                exchange.status = message["status"]
            await send(message)

        with self.tracing.request_span(scope, raw_path) as span:
            try:
                await self._handle(scope, raw_path, receive, tracked_send, exchange)
            except Exception:
                # A gateway bug: log it, and still answer in the API's error style when we can.
                log.exception("unexpected gateway error on %s %s", scope["method"], raw_path)
                if exchange.status is None:
                    error = gateway_error(code_pb2.INTERNAL, "internal gateway error")
                    await send_error(tracked_send, error, self.router.style_for_path(raw_path))
            finally:
                route = exchange.route.path.openapi_path() if exchange.route is not None else None
                self.tracing.finish(span, scope["method"], route, exchange.status)
                if self.metrics is not None:
                    self.metrics.observe(route, scope["method"], exchange.status, time.monotonic() - began)

    async def _handle(
        self, scope: Scope, raw_path: str, receive: Receive, send: Send, exchange: _Exchange
    ) -> None:
        style = self.router.style_for_path(raw_path)
        try:
            match = self.router.resolve(scope["method"], raw_path)
            route = match.route
            exchange.route = route
            style = route.error_style
            if route.codec is not BodyCodec.PROTO_JSON:
                await self.open_inference.serve(route, match.path_values, scope, receive, send)
                return
            body = await self._read_json_body(scope, receive) if route.body else b""
            query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            call = bind_request(route, match.path_values, query, body)
            metadata = self.call_metadata(scope)
            timeout = self.call_timeout(scope)
        except RoutingError as exc:
            await send_error(send, exc, exc.style)
            return
        except HttpError as exc:
            await send_error(send, exc, style)
            return
        except _ClientGone:
            return
        if call.server_streaming:
            await self._stream(route, call, metadata, timeout, receive, send)
        else:
            await self._unary(route, call, metadata, timeout, receive, send)

    async def _read_json_body(self, scope: Scope, receive: Receive) -> bytes:
        content_type = _header(scope, b"content-type")
        error = body_type_error(content_type, None)  # a wrong type is refused before reading
        if error is None:
            body = await self._read_body(scope, receive)
            error = body_type_error(content_type, len(body))
        if error is not None:
            raise error
        return body

    async def read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole request body, within the size limit (413 past it)."""
        return await self._read_body(scope, receive)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.settings.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def call_metadata(self, scope: Scope) -> list[tuple[str, str]]:
        """The gRPC metadata of a request (HTTP or WebSocket upgrade): forwarded headers, trace context."""
        metadata = []
        for name, value in scope["headers"]:
            if name in self._forwarded:
                # gRPC metadata values are printable ASCII; HTTP lets a tab or a control byte through,
                # which gRPC would refuse only when the call is sent (a 500, not the caller's 400).
                if not all(0x20 <= byte <= 0x7E for byte in value):
                    raise gateway_error(
                        code_pb2.INVALID_ARGUMENT, f"header {name.decode()} must be printable ASCII"
                    )
                metadata.append((name.decode(), value.decode("ascii")))
        if self.tracing.enabled:
            self.tracing.inject(metadata)
        return metadata

    def call_timeout(self, scope: Scope) -> float | None:
        """The call deadline in seconds from the timeout header (None: none); 400 when malformed."""
        raw = _header(scope, self.settings.timeout_header.encode())
        if raw is None:
            return None
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        limit = self.settings.max_request_timeout_s
        if not (math.isfinite(seconds) and 0 < seconds <= limit):
            shown = raw if len(raw) <= 32 else raw[:32] + "..."
            raise gateway_error(
                code_pb2.INVALID_ARGUMENT,
                f"header {self.settings.timeout_header} must be a positive number of seconds, "
                f"at most {limit:g}, got {shown!r}",
            )
        return seconds

    async def _unary(self, route: Route, call: Call, metadata, timeout, receive: Receive, send: Send) -> None:
        rpc = self.channel.unary_unary(call.grpc_method, call.response_type)(
            call.request, metadata=metadata, timeout=timeout
        )
        watcher = asyncio.create_task(_cancel_on_disconnect(receive, rpc))
        try:
            response = await rpc
        except asyncio.CancelledError:
            if _client_left(watcher):
                log.info("client left during %s; call cancelled", call.grpc_method)
                return
            raise
        except grpc.RpcError as exc:
            await send_error(send, from_rpc_error(exc), route.error_style)
            return
        finally:
            watcher.cancel()
        await _send_json(send, 200, response_payload(response, call.response_body))

    async def _stream(
        self, route: Route, call: Call, metadata, timeout, receive: Receive, send: Send
    ) -> None:
        stream_framing: Framing = route.framing
        rpc = self.channel.unary_stream(call.grpc_method, call.response_type)(
            call.request, metadata=metadata, timeout=timeout
        )
        watcher = asyncio.create_task(_cancel_on_disconnect(receive, rpc))
        started = False
        payload: Any = None  # the last message written (an SSE_EVENTS error event numbers after it)
        try:
            # Wait for the first message before answering, so that a request the
            # server rejects still gets a real HTTP error status (400, 429, ...).
            message = await rpc.read()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", framing.content_type(stream_framing).encode()),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),  # proxies must not buffer the events
                    ],
                }
            )
            started = True
            while message is not grpc.aio.EOF:
                payload = response_payload(message, call.response_body)
                frame = framing.message_frame(stream_framing, payload)
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                message = await rpc.read()
            await send({"type": "http.response.body", "body": framing.end_frame(stream_framing)})
        except asyncio.CancelledError:
            if _client_left(watcher):
                log.info("client left during %s stream; call cancelled", call.grpc_method)
                return
            raise
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
            if not started:
                await send_error(send, error, route.error_style)
                return
            log.warning(
                "%s stream failed after it started: %s %s",
                call.grpc_method,
                code_pb2.Code.Name(error.status.code),
                error.status.message,
            )
            event = error.stream_event(route.error_style)
            if stream_framing is Framing.SSE_EVENTS:
                event = framing.typed_error_event(route.error_style, event, payload)
            frame = framing.error_frame(stream_framing, event)
            await send({"type": "http.response.body", "body": frame})
        finally:
            watcher.cancel()
            rpc.cancel()  # a no-op for finished calls; stops the server on any other exit


async def _cancel_on_disconnect(receive: Receive, rpc: grpc.aio.Call) -> bool:
    """Cancel ``rpc`` when the client disconnects; True if that happened."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            rpc.cancel()
            return True


def _client_left(watcher: asyncio.Task[bool]) -> bool:
    current = asyncio.current_task()
    if current is not None and current.cancelling():
        return False  # the gateway itself is being cancelled (shutdown): not a client disconnect
    return watcher.done() and not watcher.cancelled() and watcher.result()


def response_payload(message, response_body: str) -> Any:
    """The JSON value a response message is written as (just ``response_body`` when the route names one)."""
    value = message_to_json(message)
    return value.get(response_body) if response_body else value


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1").strip()
    return None


def _too_large(limit: int) -> HttpError:
    # gRPC answers oversized messages with RESOURCE_EXHAUSTED; HTTP has its own status for it.
    return gateway_error(
        code_pb2.RESOURCE_EXHAUSTED, f"request body exceeds the limit of {limit} bytes", http_status=413
    )


async def _send_json(send: Send, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
    body = dumps(payload)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: HttpError, style: ErrorStyle) -> None:
    """Answer with ``error``: its HTTP status, headers and the body of the route's error style."""
    await _send_json(send, error.status_for(style), error.body(style), error.headers)
