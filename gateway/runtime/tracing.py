"""HTTP server spans for the gateway, and the trace context it hands on to the gRPC call.

With a tracer provider, every HTTP request gets a SERVER span, named
``"{method} {route}"`` per the HTTP semantic conventions, that continues an
incoming W3C ``traceparent``/``tracestate``. The span's own context then
replaces those headers in the gRPC metadata, so the server's span is the
gateway span's child. Without a provider nothing is created and the headers
are forwarded as they came, so a traced client still reaches a traced server
through an untraced gateway.

Propagation uses the globally configured propagators (``OTEL_PROPAGATORS``,
W3C trace context and baggage by default), as the gRPC instrumentation does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

TRACER_NAME = "protoserve.gateway"
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


def installed_tracer_provider() -> trace.TracerProvider | None:
    """The global tracer provider if a real one is installed, else None (API check; no SDK import)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return provider


class HttpTracing:
    """Starts the gateway's span per request and injects its context into gRPC metadata."""

    def __init__(self, tracer_provider: trace.TracerProvider | None) -> None:
        self._tracer = tracer_provider.get_tracer(TRACER_NAME) if tracer_provider is not None else None

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @contextlib.contextmanager
    def request_span(self, scope: MutableMapping[str, Any], raw_path: str) -> Iterator[Span | None]:
        """The request's SERVER span, current for the block; None when tracing is off."""
        if self._tracer is None:
            yield None
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        attributes: dict[str, Any] = {
            "http.request.method": scope["method"],
            "url.path": raw_path,
            "url.scheme": scope.get("scheme", "http"),
        }
        server = scope.get("server")
        if server:
            attributes["server.address"], attributes["server.port"] = server[0], server[1]
        client = scope.get("client")
        if client:
            attributes["client.address"] = client[0]
        if "user-agent" in headers:
            attributes["user_agent.original"] = headers["user-agent"]
        with self._tracer.start_as_current_span(
            scope["method"], context=propagate.extract(headers), kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            yield span

    @staticmethod
    def finish(span: Span | None, method: str, route: str | None, status: int | None) -> None:
        """Name the span after its route and record the response status (5xx is an error)."""
        if span is None:
            return
        if route:
            span.update_name(f"{method} {route}")
            span.set_attribute("http.route", route)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))

    def inject(self, metadata: list[tuple[str, str]]) -> None:
        """Add the current (gateway span's) trace context to outgoing gRPC metadata."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        metadata.extend(carrier.items())
