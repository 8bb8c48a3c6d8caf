"""gRPC server spans: OpenTelemetry's grpc.aio interceptor, fitted to our handlers.

``opentelemetry-instrumentation-grpc``'s ``aio_server_interceptor`` starts a
SERVER span per call and continues the caller's trace from the
``traceparent``/``tracestate`` metadata. Two things in it do not fit how our
servicers are written, so a second interceptor runs inside its span:

* Streaming handlers here are coroutines that send with ``context.write``; the
  instrumentation iterates every streaming handler as an async generator and
  fails on a coroutine (client-streaming ones, ModelStreamInfer, included). The handler is wrapped in an async generator that
  yields nothing (the writes still go out through the context).
* Every error is reported with ``context.abort_with_status``, which the
  instrumentation does not see, so the span would say OK. The final status code
  is copied onto the span (and the span marked as an error for the codes the
  gRPC semantic conventions count as server errors).

Health checks and reflection are not traced, nor the services listed in
``OTEL_PYTHON_GRPC_EXCLUDED_SERVICES``.
"""

from __future__ import annotations

import inspect
import os

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
from opentelemetry.trace import Status, StatusCode, TracerProvider

EXCLUDED_SERVICES_ENV = "OTEL_PYTHON_GRPC_EXCLUDED_SERVICES"
REFLECTION_PREFIX = "grpc.reflection."
# Status codes that are the server's fault (OpenTelemetry gRPC conventions for SERVER spans).
SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def traced_calls_filter():
    """True for calls that get a span: not health, not reflection, not excluded by the environment."""
    excluded = [filters.health_check(), filters.service_prefix(REFLECTION_PREFIX)]
    for name in os.environ.get(EXCLUDED_SERVICES_ENV, "").split(","):
        if name.strip():
            excluded.append(filters.service_name(name.strip()))
    return filters.negate(filters.any_of(*excluded))


def _record_status(context: grpc.aio.ServicerContext) -> None:
    code = context.code()
    if code is None or code == grpc.StatusCode.OK:
        return
    span = trace.get_current_span()
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, context.details() or code.name))


class _StatusOnSpan(grpc.aio.ServerInterceptor):
    """Runs inside the instrumentation's span: adapts write-style streams and records the final status."""

    def __init__(self, traced) -> None:
        self._traced = traced

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self._traced(handler_call_details):
            return handler
        streaming = (handler.request_streaming, handler.response_streaming)
        behavior = getattr(handler, _BEHAVIORS[streaming])
        if not inspect.iscoroutinefunction(behavior):
            return handler  # leave anything else alone
        if handler.response_streaming:

            async def stream(request, context):
                try:
                    await behavior(request, context)
                finally:
                    _record_status(context)
                return
                yield  # an async generator that yields nothing: the handler writes for itself

            wrapped = stream
        else:

            async def unary(request, context):
                try:
                    return await behavior(request, context)
                finally:
                    _record_status(context)

            wrapped = unary
        return _FACTORIES[streaming](
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


# (request streaming, response streaming) -> the handler's behavior and the factory of its kind.
_BEHAVIORS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}
_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def tracing_interceptors(tracer_provider: TracerProvider) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors that trace the server's calls, outermost first."""
    traced = traced_calls_filter()
    return [aio_server_interceptor(tracer_provider=tracer_provider, filter_=traced), _StatusOnSpan(traced)]
