"""Tracing setup: an OpenTelemetry SDK tracer provider from the standard ``OTEL_*`` variables, or none.

Tracing is off unless asked for: ``OTEL_TRACES_EXPORTER`` names an exporter
(``otlp``, ``console``; ``none`` keeps it off), an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), or
the caller forces it (``protoserve serve --trace``). ``OTEL_SDK_DISABLED=true``
wins over all of these. When off, no SDK provider is installed and every span
call in the code goes to the API's no-op implementation.

When on, spans go to the exporters through a batch processor. The OTLP exporter
speaks gRPC or HTTP per ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc``, the Python SDK's default, or
``http/protobuf``); endpoint, headers, timeout and compression come from the
usual ``OTEL_EXPORTER_OTLP_*`` variables, the sampler from
``OTEL_TRACES_SAMPLER``, batching from ``OTEL_BSP_*``, and the resource from
``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``, all read by the SDK.

Both the server CLI and the standalone gateway (``python -m protoserve.gateway``) call
:func:`configure_tracing`; in ``protoserve serve`` they share one provider.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

EXPORTERS = ("otlp", "console")
PROTOCOLS = ("grpc", "http/protobuf")
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def requested_exporters(env: Mapping[str, str] | None = None, *, force: bool = False) -> list[str]:
    """The exporters tracing should use; empty means tracing stays off.

    Raises ValueError for an exporter or protocol we do not support, so a typo
    in the environment fails at startup instead of silently dropping spans.
    """
    env = os.environ if env is None else env
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return []
    named = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if "none" in named:
        return []
    unknown = [e for e in named if e not in EXPORTERS]
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter(s) {unknown}; use {', '.join(EXPORTERS)}")
    if not named and (force or any(env.get(v) for v in _ENDPOINT_VARS)):
        named = ["otlp"]
    if "otlp" in named:
        otlp_protocol(env)  # validate now
    return named


def otlp_protocol(env: Mapping[str, str] | None = None) -> str:
    """``grpc`` or ``http/protobuf``, the traces-specific variable first."""
    env = os.environ if env is None else env
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported; use {' or '.join(PROTOCOLS)}")
    return protocol


def span_exporter(name: str, env: Mapping[str, str] | None = None) -> SpanExporter:
    """The exporter called ``name`` (``otlp`` over the configured protocol, or ``console``)."""
    # Imported only when used: the SDK and each OTLP transport are not free to import.
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if otlp_protocol(os.environ if env is None else env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def build_tracer_provider(
    service_name: str, env: Mapping[str, str] | None = None, *, force: bool = False
) -> TracerProvider | None:
    """A provider exporting to the requested exporters, or None when tracing is off.

    ``env`` decides whether and where to (tests pass their own); the SDK and the
    exporters read their settings from ``os.environ`` themselves.
    """
    env = os.environ if env is None else env
    exporters = requested_exporters(env, force=force)
    if not exporters:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES name the service when given; ours is the fallback.
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": service_name}))
    for name in exporters:
        provider.add_span_processor(BatchSpanProcessor(span_exporter(name, env)))
    return provider


def configure_tracing(service_name: str = "protoserve", *, force: bool = False) -> TracerProvider | None:
    """Install the global tracer provider when tracing is requested; returns it, or None (tracing off)."""
    provider = build_tracer_provider(service_name, force=force)
    if provider is None:
        return None
    from opentelemetry import trace

    trace.set_tracer_provider(provider)
    log.info("tracing on: exporting spans to %s", ", ".join(requested_exporters(force=force)))
    return provider
