"""Clients that stop reading: their connections are dropped, so their requests are cancelled.

uvicorn holds an app's ``send`` while the socket's write buffer is over its high-water mark
(the client's receive window and the kernel's send buffer being full already), for as long as
the client does not read: forever, for one that never does. It takes a while to get there: the
kernel grows a socket's send buffer to megabytes (``tcp_wmem``), tens of thousands of tokens
of a stream nobody reads. The SSE handler or the WebSocket
session's writer waits there with it, the gRPC streams behind them stop being read, and the
server keeps generating for nobody. uvicorn's WebSocket keepalive does not end it either: its
close after an unanswered ping waits for that same unread buffer to flush first.

So the gateway serves with uvicorn's own protocols plus two things. Each connection's socket
keeps at most ``NOTSENT_LOWAT_BYTES`` of unsent data in the kernel (``TCP_NOTSENT_LOWAT``, where
the platform has it): what the client has not taken then waits in uvicorn's buffer, where it
can be seen, and throughput is untouched (data in flight is not "unsent"). And a watch on the
wait: while writing is paused, the write buffer is looked at every quarter of ``stream_idle_timeout``; once it has not
shrunk (the client took nothing from it) for the whole timeout, the connection is aborted, a TCP
reset, since a graceful close would wait on the very buffer the client does not read. uvicorn
then tells the app the client disconnected, as for any client that leaves: the SSE handler and
the WebSocket session cancel their gRPC calls, and the server aborts the engine requests and
frees their KV cache. Nothing is logged above INFO: a client that stops reading is not a fault.

WebSockets are also pinged every ``stream_idle_timeout`` seconds (uvicorn's keepalive), so an
idle socket whose client has gone silent is noticed too. A ping not answered within as long
closes the socket with 1011, the close frame queued behind what the client has not read; when
that is anything, the close could never arrive and the connection is aborted at once. After
that close the app's sends are sends to a gone client (ClientDisconnected), as after the
client's own close, where uvicorn would raise a RuntimeError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from protoserve.gateway.ws.denial import DenialEndsHandshake

log = logging.getLogger(__name__)

# How often, per timeout, a paused write buffer is looked at: the drop comes at most a quarter
# of the timeout late, and a client reading a little at a time keeps its connection.
CHECKS_PER_TIMEOUT = 4
# Unsent bytes the kernel may hold for a connection (the value HTTP/2 servers use for the same
# reason: so that the application, not the kernel, holds what the peer has not taken yet).
NOTSENT_LOWAT_BYTES = 16 * 1024


class _WriteStallWatch:
    """Mixin for a uvicorn protocol: abort the connection when a paused write makes no progress."""

    stream_idle_timeout_s: float
    transport: asyncio.Transport
    client: tuple[str, int] | None
    _stall_check: asyncio.TimerHandle | None = None
    _stall_size = 0  # bytes buffered at the last look
    _stall_progress_at = 0.0  # loop time the buffer last shrank (or writing paused)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "TCP_NOTSENT_LOWAT") and sock.family != socket.AF_UNIX:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT_BYTES)

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._stall_check is None:
            loop = asyncio.get_running_loop()
            self._stall_size = self.transport.get_write_buffer_size()
            self._stall_progress_at = loop.time()
            self._stall_check = loop.call_later(self._check_period(), self._check_stall)

    def resume_writing(self) -> None:
        self._stop_stall_watch()
        super().resume_writing()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_stall_watch()
        super().connection_lost(exc)  # type: ignore[misc]

    def _check_period(self) -> float:
        return self.stream_idle_timeout_s / CHECKS_PER_TIMEOUT

    def _check_stall(self) -> None:
        loop = asyncio.get_running_loop()
        self._stall_check = None
        size, now = self.transport.get_write_buffer_size(), loop.time()
        if size < self._stall_size:
            self._stall_progress_at = now
        self._stall_size = size
        if now - self._stall_progress_at >= self.stream_idle_timeout_s:
            log.info(
                "dropped %s: it read nothing of %d buffered bytes for %g s (--stream-idle-timeout)",
                _peer(self.client), size, self.stream_idle_timeout_s,
            )  # fmt: skip
            self.transport.abort()
            return
        self._stall_check = loop.call_later(self._check_period(), self._check_stall)

    def _stop_stall_watch(self) -> None:
        if self._stall_check is not None:
            self._stall_check.cancel()
            self._stall_check = None


class _WebSocketProtocol(_WriteStallWatch, DenialEndsHandshake, WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, watched, whose keepalive close cannot hang on an unread buffer
    (and whose refused upgrades are not logged as errors: gateway.ws.denial)."""

    def keepalive_timeout(self) -> None:
        closing = self.close_sent or self.transport.is_closing()
        super().keepalive_timeout()  # writes the 1011 close frame and closes once it is flushed
        if closing:
            return  # uvicorn leaves a socket already closing alone
        unread = self.transport.get_write_buffer_size()
        log.info(
            "closed WebSocket %s with 1011: no answer to the keepalive ping in %g s (--stream-idle-timeout)%s",
            _peer(self.client), self.stream_idle_timeout_s, f", dropping {unread} unread bytes" if unread else "",
        )  # fmt: skip
        if unread:
            self.transport.abort()

    async def send(self, message: Any) -> None:
        if message["type"] == "websocket.send" and self.handshake_complete and self.close_sent:
            raise ClientDisconnected()
        await super().send(message)


def watched_protocols(stream_idle_timeout_s: float) -> tuple[type[asyncio.Protocol], type[asyncio.Protocol]]:
    """uvicorn's HTTP and WebSocket protocol classes with the watch, for ``uvicorn.Config(http=, ws=)``."""
    timeout = {"stream_idle_timeout_s": stream_idle_timeout_s}
    http = type("WatchedHttpProtocol", (_WriteStallWatch, AutoHTTPProtocol), timeout)
    websocket = type("WatchedWebSocketProtocol", (_WebSocketProtocol,), timeout)
    return http, websocket


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
