"""A gRPC client that stops reading a server stream has it ended, so its engine requests stop.

``context.write`` waits while the call's HTTP/2 flow-control window is spent, for as long as
the client does not read: forever, for one that never does. Meanwhile the engine keeps
generating the request into its output queue and holds its KV cache until ``max_tokens``, and
the slot it runs in is lost to everybody else.

:class:`StreamWriteTimeoutInterceptor` gives every response-streaming method a context whose
``write`` may wait at most ``stream_idle_timeout`` seconds (``protoserve serve
--stream-idle-timeout``). A write that waits longer ends the call with DEADLINE_EXCEEDED
(reason ``DEADLINE_EXCEEDED``, a message naming the timeout): the error unwinds the handler
like any other, so its in-flight call closes its engine generators (the engine aborts the
requests and frees their KV) and the status goes to the client after the messages it has not
read yet. The handler itself still writes as before; a handler written as an async generator
is driven here, each message written through the same bounded write.

The gateway is such a client too: an SSE or WebSocket client that stops reading stops the
gateway reading the call, and whichever notices first (the gateway's own watch of its socket,
gateway.slow_clients, or this one) ends the request.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

import grpc

from protoserve.server import errors
from protoserve.v1 import inference_pb2

log = logging.getLogger(__name__)

# Seconds a streaming client may leave a message unread (``--stream-idle-timeout``).
DEFAULT_STREAM_IDLE_TIMEOUT_S = 30.0


class BoundedWriteContext:
    """A ServicerContext whose ``write`` gives up after ``timeout_s``; everything else is the call's own.

    One timer per call watches the write in progress, instead of an ``asyncio.timeout`` per write:
    a stream writes once per token, and arming and cancelling a timeout each time cost the
    event loop more than the rest of the write's Python around grpc's own."""

    def __init__(self, context: grpc.aio.ServicerContext, timeout_s: float, method: str) -> None:
        self._context = context
        self._timeout_s = timeout_s
        self._method = method
        self.stalled = False
        self._writing_since: float | None = None  # loop time the write in progress began
        self._writer: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, message: Any) -> None:
        """Write ``message``; raise the DEADLINE_EXCEEDED ServiceError when the client takes none for too long."""
        if self._writing_since is not None:
            # Two tasks writing at once (grpc queues the second): each gets its own timeout.
            await self._write_alone(message)
            return
        loop = asyncio.get_running_loop()
        self._writing_since = since = loop.time()
        self._writer = asyncio.current_task()
        if self._timer is None:
            self._timer = loop.call_at(since + self._timeout_s, self._check)
        try:
            await self._context.write(message)
        except asyncio.CancelledError:
            # Our own cancel (and nobody else's) is the timeout; any other cancel goes on up.
            if self.stalled and self._writer is not None and self._writer.uncancel() == 0:
                log.info(
                    "%s: the client read nothing for %g s (--stream-idle-timeout); ending its stream",
                    self._method, self._timeout_s,
                )  # fmt: skip
                raise self.error() from None
            raise
        finally:
            self._writing_since = None

    async def _write_alone(self, message: Any) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._context.write(message)
        except TimeoutError:
            self.stalled = True
            log.info(
                "%s: the client read nothing for %g s (--stream-idle-timeout); ending its stream",
                self._method, self._timeout_s,
            )  # fmt: skip
            raise self.error() from None

    def _check(self) -> None:
        """The timer: cancel a write that has waited ``timeout_s``, else watch the current one, if any."""
        self._timer = None
        since = self._writing_since
        if since is None or self._writer is None:
            return  # no write in progress: the next one arms the timer again
        loop = asyncio.get_running_loop()
        if loop.time() - since >= self._timeout_s:
            self.stalled = True
            self._writer.cancel()
        else:
            self._timer = loop.call_at(since + self._timeout_s, self._check)

    def close(self) -> None:
        """The call is over: stop watching."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._writer = None

    def error(self) -> errors.ServiceError:
        """What the call ends with once a write has timed out."""
        return errors.ServiceError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            inference_pb2.ERROR_REASON_DEADLINE_EXCEEDED,
            f"the client read nothing of this stream for {self._timeout_s:g} s (the server's "
            "--stream-idle-timeout); the stream was ended and its requests cancelled",
        )


def _bounded(behavior, timeout_s: float, method: str):
    async def drive(request, bounded: BoundedWriteContext) -> Any:
        if inspect.isasyncgenfunction(behavior):
            async for response in behavior(request, bounded):
                await bounded.write(response)
            return None
        return await behavior(request, bounded)

    async def handler(request, context):
        bounded = BoundedWriteContext(context, timeout_s, method)
        try:
            return await drive(request, bounded)
        except grpc.aio.AbortError:
            raise
        except Exception:
            # A handler that turns errors into statuses (server.errors.reports_errors) never gets
            # here; one that does not (health, reflection) must not end in a traceback for this.
            if not bounded.stalled:
                raise
            await errors.abort(context, bounded.error())
        finally:
            bounded.close()

    return handler


_FACTORIES = {
    False: ("unary_stream", grpc.unary_stream_rpc_method_handler),
    True: ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class StreamWriteTimeoutInterceptor(grpc.aio.ServerInterceptor):
    """Bounds each write of every response-streaming method by ``timeout_s`` seconds."""

    def __init__(self, timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the stream idle timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler.response_streaming:
            return handler
        attribute, factory = _FACTORIES[handler.request_streaming]
        behavior = getattr(handler, attribute)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a synchronous method: none is registered on this server
        return factory(
            _bounded(behavior, self.timeout_s, handler_call_details.method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
