"""One accepted WebSocket: its requests multiplexed by id, and one bounded queue of frames to send.

The receive loop parses each message and starts a task per request; the task
makes the same gRPC streaming call the SSE route makes and puts its frames on
the socket's send queue, which a single writer task drains into the
connection. The queue holds ``GatewaySettings.ws_send_queue_frames`` frames:
when a client reads slower than its streams produce, the queue fills, the
stream tasks wait on it and stop reading their gRPC streams, and gRPC's flow
control holds the rest on the server, so the gateway never buffers without
bound. Nothing is dropped while the client reads; one that reads nothing for the
stream idle timeout has its connection dropped under the session
(gateway.slow_clients), which then ends as for any disconnect. Once the client
is gone the writer discards frames so that nothing waits on it.

A cancel message cancels the request's task, whose gRPC call is cancelled
with it: the server aborts the engine request and frees its KV cache. The
socket closing, for any reason, does the same for every request still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import grpc
from google.rpc import code_pb2

from protoserve.gateway.runtime.binding import Call, bind_document
from protoserve.gateway.runtime.errors import HTTP_STATUS_BY_CODE, HttpError, from_rpc_error, gateway_error
from protoserve.gateway.runtime.handler import (
    AsgiMessage,
    GatewayHandler,
    Receive,
    Scope,
    Send,
    response_payload,
)
from protoserve.gateway.runtime.route import Route
from protoserve.gateway.ws import protocol
from protoserve.gateway.ws.close_codes import INTERNAL_ERROR, MESSAGE_TOO_BIG, close_reason
from protoserve.v1 import inference_pb2

log = logging.getLogger(__name__)

WS_PATH = "/v1/ws/completions"
# What requests on a socket are labelled with in metrics and spans (the upgrade itself is a GET).
WS_METHOD = "WS"
# How long a close frame may wait for a client that does not read before the socket is left to the server.
CLOSE_SEND_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """What every request on one socket shares, fixed at the upgrade."""

    handler: GatewayHandler
    routes: dict[str, Route]  # message type -> the POST route whose body it carries
    timeout: float | None  # each request's deadline, from the upgrade's x-request-timeout
    max_message_bytes: int


class Session:
    """Serves one accepted socket until it closes; ``close()`` may be called from another task."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, config: SessionConfig) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.config = config
        settings = config.handler.settings
        self._queue: asyncio.Queue[str] = asyncio.Queue(maxsize=settings.ws_send_queue_frames)
        self._max_streams = settings.ws_max_streams
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._writer: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def running(self) -> int:
        """Requests running on this socket now."""
        return len(self._streams)

    async def run(self) -> None:
        """Serve messages until the client or the server closes the socket."""
        self._writer = asyncio.create_task(self._write_frames())
        try:
            while True:
                message = await self._receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message["type"] == "websocket.receive" and not self._closing:
                    await self._on_message(message)
        except Exception:
            log.exception("WebSocket session failed")
            await self.close(INTERNAL_ERROR, "internal gateway error")
        finally:
            await self._stop_streams()
            self._writer.cancel()

    async def close(self, code: int, reason: str) -> None:
        """Close the socket with ``code`` at once, ahead of queued frames; its requests stop with it."""
        if self._closing:
            return
        self._closing = True
        if self._writer is not None:
            # Frames still queued are dropped: the close goes ahead of them.
            self._writer.cancel()
            self._writer = asyncio.create_task(self._discard_frames())
        message = {"type": "websocket.close", "code": code, "reason": close_reason(reason)}
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._send(message), CLOSE_SEND_TIMEOUT_S)

    async def _on_message(self, message: AsgiMessage) -> None:
        text = message.get("text")
        if _over_limit(text, message.get("bytes"), self.config.max_message_bytes):
            # The ASGI server enforces the limit first (uvicorn's ws_max_size); this holds behind others.
            await self.close(
                MESSAGE_TOO_BIG, f"message exceeds the limit of {self.config.max_message_bytes} bytes"
            )
            return
        try:
            parsed = protocol.parse_message(text)
            if isinstance(parsed, protocol.CancelRequest):
                await self._cancel(parsed.id)
            else:
                self._start(parsed)
        except protocol.BadMessage as exc:
            await self._put(protocol.refusal_frame(exc, self._streams))

    def _start(self, message: protocol.StartRequest) -> None:
        if message.id in self._streams:
            error = gateway_error(
                code_pb2.ALREADY_EXISTS,
                f"invalid message: id: request {message.id!r} is already running on this socket",
                violations=[("id", "already running on this socket")],
                reason=inference_pb2.ERROR_REASON_INVALID_PARAMETER,
            )
            raise protocol.BadMessage(error, message.id, message.kind)
        if len(self._streams) >= self._max_streams:
            error = gateway_error(
                code_pb2.RESOURCE_EXHAUSTED,
                f"this socket already runs {self._max_streams} requests; wait for one to end",
                http_status=429,
                reason=inference_pb2.ERROR_REASON_TOO_MANY_STREAMS,
            )
            raise protocol.BadMessage(error, message.id, message.kind)
        route = self.config.routes.get(message.kind)
        if route is None:
            error = gateway_error(code_pb2.UNIMPLEMENTED, f"this gateway serves no {message.kind} route")
            raise protocol.BadMessage(error, message.id, message.kind)
        try:
            call = bind_document(route, {}, (), message.request)
        except HttpError as exc:
            raise protocol.BadMessage(exc, message.id, message.kind) from None
        if not call.server_streaming:
            error = gateway_error(code_pb2.UNIMPLEMENTED, f"the {message.kind} route has no streaming method")
            raise protocol.BadMessage(error, message.id, message.kind)
        self._streams[message.id] = asyncio.create_task(self._stream(message.id, call))

    async def _cancel(self, request_id: str) -> None:
        task = self._streams.get(request_id)
        if task is None:
            # Never started, or its done/error frame is already queued: there is nothing to cancel.
            error = gateway_error(
                code_pb2.NOT_FOUND,
                f"invalid message: id: no request {request_id!r} is running on this socket",
                violations=[("id", "not running on this socket")],
                reason=inference_pb2.ERROR_REASON_REQUEST_NOT_FOUND,
            )
            raise protocol.BadMessage(error, request_id, protocol.CANCEL)
        task.cancel()
        await asyncio.wait({task})
        # After the task: chunks it queued go out first, and this is the id's last frame.
        await self._put(protocol.cancelled_frame(request_id))

    async def _stream(self, request_id: str, call: Call) -> None:
        handler = self.config.handler
        began = time.monotonic()
        status: int | None = None
        span_scope = {**self.scope, "method": WS_METHOD}
        try:
            with handler.tracing.request_span(span_scope, WS_PATH) as span:
                try:
                    status = await self._relay(request_id, call)
                except asyncio.CancelledError:
                    status = _CANCELLED_STATUS
                    raise
                finally:
                    handler.tracing.finish(span, WS_METHOD, WS_PATH, status)
        finally:
            if self._streams.get(request_id) is asyncio.current_task():
                del self._streams[request_id]
            if handler.metrics is not None:
                handler.metrics.observe(WS_PATH, WS_METHOD, status, time.monotonic() - began)

    async def _relay(self, request_id: str, call: Call) -> int:
        """Copy the gRPC stream to frames; returns the HTTP status the request ended with."""
        handler = self.config.handler
        # Inside the request's span: the trace context sent to the server is that span's.
        metadata = handler.call_metadata(self.scope)
        rpc = handler.channel.unary_stream(call.grpc_method, call.response_type)(
            call.request, metadata=metadata, timeout=self.config.timeout
        )
        try:
            message = await rpc.read()
            while message is not grpc.aio.EOF:
                await self._put(
                    protocol.chunk_frame(request_id, response_payload(message, call.response_body))
                )
                message = await rpc.read()
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
            log.info(
                "WebSocket request %r failed: %s %s",
                request_id,
                code_pb2.Code.Name(error.status.code),
                error.status.message,
            )
            await self._put(protocol.error_frame(request_id, error))
            return error.http_status
        finally:
            rpc.cancel()  # a no-op for finished calls; on any other exit the server stops generating
        await self._put(protocol.done_frame(request_id))
        return 200

    async def _put(self, frame: str) -> None:
        # Either queues the frame and returns without suspending again, or is cancelled without
        # queueing it: a request's terminal frame is queued exactly once.
        await self._queue.put(frame)

    async def _write_frames(self) -> None:
        while True:
            frame = await self._queue.get()
            try:
                await self._send({"type": "websocket.send", "text": frame})
            except OSError:
                break  # the client is gone; the receive loop sees the disconnect and stops the streams
            except Exception:
                log.exception("WebSocket send failed")
                self._closer = asyncio.create_task(self.close(INTERNAL_ERROR, "internal gateway error"))
                break
        await self._discard_frames()

    async def _discard_frames(self) -> None:
        # Once nothing can be sent, keep the queue moving so that neither a stream nor the
        # receive loop waits on it until the socket's end stops them.
        while True:
            await self._queue.get()

    async def _stop_streams(self) -> None:
        tasks = list(self._streams.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


_CANCELLED_STATUS = HTTP_STATUS_BY_CODE[code_pb2.CANCELLED]


def _over_limit(text: str | None, data: bytes | None, limit: int) -> bool:
    if data is not None:
        return len(data) > limit
    if text is None or len(text) * 4 <= limit:
        return False  # n characters are at most 4n bytes in UTF-8: no need to encode
    return len(text.encode("utf-8")) > limit
