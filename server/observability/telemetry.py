"""Telemetry: where the server reports what its requests do (metrics, the request log, traces).

The in-flight registry and the request-scope interceptor call it as requests
run and end; it fans out to :class:`ServerMetrics`, the request log and, when
tracing is on, builds the engine's :class:`RequestTrace` under the current
span (the gRPC server span of the call).
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace

from protoserve.engine.api import RequestStats, RequestTrace
from protoserve.server.calls.request_record import RequestRecord
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.observability.metrics import ServerMetrics
from protoserve.server.observability.request_log import log_request

ENGINE_TRACER_NAME = "protoserve.engine"


def installed_tracer_provider() -> trace.TracerProvider | None:
    """The global tracer provider if a real one is installed (tracing on), else None.

    Checked against the API's placeholders rather than the SDK class, so a
    server with tracing off never imports the SDK.
    """
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return provider


class Telemetry:
    """Metrics, request log and trace settings of one server."""

    def __init__(
        self,
        models: ModelRegistry,
        metrics: ServerMetrics,
        tracer_provider: trace.TracerProvider | None = None,
        capture_content: bool = False,
    ) -> None:
        self.models = models
        self.metrics = metrics
        self.tracer_provider = tracer_provider  # None: tracing off, requests carry no trace
        self.capture_content = capture_content
        self._tracer = tracer_provider.get_tracer(ENGINE_TRACER_NAME) if tracer_provider is not None else None

    @property
    def tracing(self) -> bool:
        return self._tracer is not None

    def request_trace(self, record: RequestRecord) -> RequestTrace | None:
        """How the engine traces a request of ``record`` (None when tracing is off).

        Called in the handler's task, where the gRPC server span is current.
        """
        if self._tracer is None:
            return None
        return RequestTrace(
            tracer=self._tracer,
            parent=otel_context.get_current(),
            operation=record.operation,
            model=record.model_name,
            response_id=record.request_id,
            capture_content=self.capture_content,
        )

    def tokens(self, model: str, prompt_tokens: int, generated_tokens: int) -> None:
        self.metrics.observe_tokens(model, prompt_tokens, generated_tokens)

    def engine_request_finished(self, model: str, stats: RequestStats) -> None:
        self.metrics.observe_engine_request(model, stats)

    def request_finished(self, record: RequestRecord) -> None:
        """Count and log a finished request (its status and duration already set)."""
        self.metrics.observe_request(record, self._model_label(record))
        log_request(record)  # names the model asked for, whatever the metrics' label

    def _model_label(self, record: RequestRecord) -> str:
        """A loaded model's name, so that no label value comes from the caller: the model that
        served the request, else the one it named (by name or alias, of either kind), else (refused
        before a model was chosen, or naming one that is not loaded) the default model."""
        for name in (record.served_model, record.model):
            canonical = self.models.canonical(name) if name else None
            if canonical is not None:
                return canonical
        names = self.models.names
        return names[0] if names else ""
