"""A request the server cannot decode is the caller's error: INVALID_ARGUMENT, not UNKNOWN.

grpc runs a method's request deserializer before any servicer code; when it raises (bytes
that are not protobuf wire format, a message whose messages nest deeper than protobuf's
decoder allows), grpc ends the call UNKNOWN with the exception's class in the message and
logs a traceback. :class:`RequestDecodingInterceptor` gives every method a deserializer
that does not raise: what it cannot decode becomes an :class:`UndecodableRequest`, and the
method answers INVALID_ARGUMENT naming the message type, without running the servicer.
A request to one of our services that decodes but holds fields our protos do not define
becomes an :class:`UnknownFieldsRequest`, refused the same way naming each of them
(calls.unknown_fields).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from protoserve.server import errors
from protoserve.server.calls.unknown_fields import unknown_field_violations
from protoserve.server.limits import MAX_MESSAGE_DEPTH
from protoserve.v1 import inference_pb2

log = logging.getLogger(__name__)
# Methods whose requests must hold only known fields: ours and the Open Inference Protocol's
# (tritonclient sends only fields its protos define), not grpc's health or reflection.
_CHECKED_PREFIXES = ("/protoserve.", "/inference.")


@dataclass(frozen=True, slots=True)
class UndecodableRequest:
    """Stands in for a request message whose bytes could not be decoded."""

    method: str
    size: int  # bytes received
    cause: str  # the decoder's own words

    def error(self) -> errors.ServiceError:
        """INVALID_ARGUMENT for this request (no field to name: the message as a whole is bad)."""
        return errors.ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            inference_pb2.ERROR_REASON_INVALID_PARAMETER,
            f"request message could not be decoded: {self.cause} ({self.size} bytes; not protobuf "
            f"wire format for this method, or messages nested deeper than {MAX_MESSAGE_DEPTH} levels)",
        )

    def describe(self) -> str:
        """What the log says of it."""
        return f"an undecodable request to {self.method} ({self.size} bytes): {self.cause}"


@dataclass(frozen=True, slots=True)
class UnknownFieldsRequest:
    """Stands in for a request message holding fields this server's protos do not define."""

    method: str
    violations: list[tuple[str, str]]

    def error(self) -> errors.ServiceError:
        """INVALID_ARGUMENT naming each unknown field."""
        return errors.invalid_argument(self.violations)

    def describe(self) -> str:
        """What the log says of it."""
        shown = ", ".join(f for f, _ in self.violations[: errors.MAX_VIOLATIONS])
        more = len(self.violations) - errors.MAX_VIOLATIONS
        return f"a request to {self.method} with unknown fields {shown}" + (f" and {more} more" if more > 0 else "")


RefusedRequest = UndecodableRequest | UnknownFieldsRequest


def _tolerant(method: str, deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    checked = method.startswith(_CHECKED_PREFIXES)

    def deserialize(data: bytes) -> Any:
        if deserializer is None:
            return data
        try:
            request = deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever else the bytes made it raise
            return UndecodableRequest(method, len(data), str(exc) or type(exc).__name__)
        violations = unknown_field_violations(request, data) if checked else []
        return UnknownFieldsRequest(method, violations) if violations else request

    return deserialize


async def _refuse(request: RefusedRequest, context: grpc.aio.ServicerContext) -> None:
    log.info("refused %s", request.describe())
    await errors.abort(context, request.error())


def _checked_unary(behavior):
    if inspect.iscoroutinefunction(behavior):

        async def unary(request, context):
            if isinstance(request, RefusedRequest):
                await _refuse(request, context)
            return await behavior(request, context)

        return unary
    if inspect.isasyncgenfunction(behavior):

        async def unary_to_stream(request, context):
            if isinstance(request, RefusedRequest):
                await _refuse(request, context)
            async for response in behavior(request, context):
                yield response

        return unary_to_stream
    return None


def _checked_stream(behavior):
    async def checked(requests: AsyncIterator[Any], context) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, RefusedRequest):
                await _refuse(request, context)
            yield request

    if inspect.iscoroutinefunction(behavior):

        async def stream(requests, context):
            return await behavior(checked(requests, context), context)

        return stream
    if inspect.isasyncgenfunction(behavior):

        async def stream_to_stream(requests, context):
            async for response in behavior(checked(requests, context), context):
                yield response

        return stream_to_stream
    return None


_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT for request messages that cannot be decoded, on every method.

    Placed outside the interceptors that read the request (the request scope), so they
    only ever see decoded messages.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        attribute, factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, attribute)
        checked = (_checked_stream if handler.request_streaming else _checked_unary)(behavior)
        if checked is None:
            return handler  # a synchronous method: none is registered on this server
        return factory(
            checked,
            request_deserializer=_tolerant(handler_call_details.method, handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
