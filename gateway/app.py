"""The REST/JSON gateway: ASGI app factory and ways to run it with uvicorn.

``create_app(grpc_target)`` builds the app from the generated route table
(``protoserve.generated.routes``) and OpenAPI document (``gen/python/protoserve/generated/openapi.json``,
served with the WebSocket and Open Inference routes added), plus ``GET /metrics`` in Prometheus text format, the
WebSocket route ``GET /v1/ws/completions`` (gateway.ws) and the ``/docs`` pages
(gateway.swagger_ui), all behind the Host and Origin checks of gateway.browser_safety. uvicorn serves it
with protocols that drop clients that stop reading (gateway.slow_clients);
``start_gateway`` starts it in the running event loop and returns its stop
function (the server CLI's hook, next to the gRPC server); ``serve_gateway``
serves until cancelled; ``GatewayServer`` starts and stops it explicitly; ``run_gateway`` blocks and handles signals
(``python -m protoserve.gateway``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute
from starlette.routing import WebSocketRoute

from protoserve.gateway.browser_safety import BrowserPolicy, BrowserSafety, check_allowed_hosts
from protoserve.gateway.cors import check_origins, cors_middleware
from protoserve.gateway.open_inference.openapi import with_open_inference_routes
from protoserve.gateway.runtime.channel import SharedChannel
from protoserve.gateway.runtime.handler import GatewayHandler, GatewaySettings
from protoserve.gateway.runtime.metrics import GatewayMetrics
from protoserve.gateway.runtime.route import Route
from protoserve.gateway.runtime.tracing import HttpTracing, installed_tracer_provider
from protoserve.gateway.slow_clients import watched_protocols
from protoserve.gateway.swagger_ui import DocsPages
from protoserve.gateway.ws.endpoint import WebSocketEndpoint, refuse_unknown_path, upgrade_required
from protoserve.gateway.ws.openapi import with_websocket_route
from protoserve.gateway.ws.session import WS_PATH

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger(__name__)


def generated_routes() -> tuple[Route, ...]:
    """The route table ``make proto`` generated from the protos."""
    from protoserve.generated import routes

    return routes.ROUTES


def generated_openapi_path() -> Path:
    """``openapi.json``, written beside the route table by the same protoc run."""
    from protoserve.generated import routes

    return Path(routes.__file__).with_name("openapi.json")


def served_openapi(openapi_path: Path | None = None) -> dict:
    """The document ``GET /openapi.json`` serves: the generated one with the WebSocket route and the
    Open Inference Protocol's REST routes (KServe's schemas, not proto JSON) added."""
    generated = json.loads((openapi_path or generated_openapi_path()).read_text(encoding="utf-8"))
    return with_open_inference_routes(with_websocket_route(generated), generated_routes())


def create_app(
    grpc_target: str,
    *,
    settings: GatewaySettings | None = None,
    routes: Iterable[Route] | None = None,
    openapi_path: Path | None = None,
    metrics_registry: CollectorRegistry | None = None,
    tracer_provider: TracerProvider | None = None,
    cors_origins: Sequence[str] = (),
    listen_host: str = "127.0.0.1",
    allowed_hosts: Sequence[str] = (),
) -> Starlette:
    """The gateway ASGI app calling the gRPC server at ``grpc_target`` (``host:port``).

    Besides the generated routes it serves ``GET /openapi.json``, the interactive
    ``GET /docs`` page (with the static ``/docs/reference``) and ``GET /metrics``. The gRPC channel
    opens on the first request and closes with the app's lifespan.

    ``/metrics`` serves ``metrics_registry`` (inside ``protoserve serve``, the
    server's: engine, request and latency metrics) with the gateway's own HTTP
    metrics added to it. Standalone, without one, it serves a registry of the
    gateway's HTTP and process metrics only; scrape the server's engine metrics
    from ``protoserve serve --metrics-port``. ``tracer_provider`` None traces
    with the global provider when one is installed, else not at all.
    ``cors_origins`` turns on CORS for those origins (``"*"``: any; see gateway.cors), and lets
    pages there send state-changing requests. ``listen_host`` (the bound address) and
    ``allowed_hosts`` are the names the app answers to besides IP literals and localhost
    (gateway.browser_safety).
    """
    channel = SharedChannel(grpc_target)
    registry = metrics_registry
    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
    provider = tracer_provider if tracer_provider is not None else installed_tracer_provider()
    route_table = tuple(generated_routes() if routes is None else routes)
    settings = settings or GatewaySettings()
    gateway_metrics = GatewayMetrics(registry)
    handler = GatewayHandler(
        route_table,
        channel,
        settings,
        tracing=HttpTracing(provider),
        metrics=gateway_metrics,
    )
    policy = BrowserPolicy(
        listen_host,
        check_allowed_hosts(allowed_hosts),
        tuple(origin.lower() for origin in check_origins(cors_origins)),
    )
    websockets = WebSocketEndpoint(handler)
    document = served_openapi(openapi_path)
    openapi_text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    docs_pages = DocsPages.for_document(document)

    async def openapi(_: Request) -> Response:
        return Response(openapi_text, media_type="application/json")

    async def metrics(request: Request) -> Response:
        # Prometheus text, or OpenMetrics when the scraper asks for it.
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), headers={"content-type": content_type})

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        # uvicorn closes them before this (GatewayServer); other ASGI servers get 1001 here.
        await websockets.close_all()
        await channel.close()

    async def fallback(scope, receive, send) -> None:
        if scope["type"] == "websocket":
            await refuse_unknown_path(handler, scope, send)
        else:
            await handler(scope, receive, send)

    app = Starlette(
        routes=[
            StarletteRoute("/openapi.json", openapi, methods=["GET"]),
            *docs_pages.routes(),
            StarletteRoute("/metrics", metrics, methods=["GET"]),
            WebSocketRoute(WS_PATH, websockets),
            StarletteRoute(WS_PATH, upgrade_required, methods=["GET"]),
            # Everything else is ours: the handler answers 404/405 in the route's error style.
            StarletteRoute("/{path:path}", handler),
        ],
        lifespan=lifespan,
        middleware=[
            # Outermost: a refused Host or Origin reaches no route, preflight or WebSocket.
            Middleware(
                BrowserSafety,
                policy=policy,
                style_for_path=handler.router.style_for_path,
                metrics=gateway_metrics,
            ),
            *(
                [
                    cors_middleware(
                        cors_origins,
                        {"GET"} | {r.http_method for r in route_table},
                        (*settings.forwarded_headers, settings.timeout_header, "content-type"),
                    )
                ]
                if cors_origins
                else []
            ),
        ],
    )
    # Starlette's `{path:path}` stops at a newline, so a path variable holding one (`/v1/models/a%0Ab`)
    # matches no route; the handler answers those too, in the route's error style.
    # WebSocket upgrades to other paths land here too (404 before accepting).
    app.router.default = fallback
    app.state.channel = channel
    app.state.websockets = websockets
    return app


class _Server(uvicorn.Server):
    """uvicorn.Server that leaves signal handling to whoever embeds it and closes WebSockets with 1001."""

    def __init__(
        self,
        config: uvicorn.Config,
        handle_signals: bool,
        close_websockets: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(config)
        self.handle_signals = handle_signals
        self._close_websockets = close_websockets

    async def shutdown(self, sockets=None) -> None:
        # uvicorn's own shutdown closes open WebSockets with 1012 (service restart); ours go first,
        # with 1001 (going away), after the listeners stop taking new connections.
        for server in self.servers:
            server.close()
        if self._close_websockets is not None:
            await self._close_websockets()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self.handle_signals:
            with super().capture_signals():
                yield
        else:
            yield


class GatewayServer:
    """The gateway on a uvicorn server in the current event loop: ``await start()``, ``await stop()``."""

    def __init__(
        self,
        host: str,
        port: int,
        grpc_target: str,
        *,
        settings: GatewaySettings | None = None,
        handle_signals: bool = False,
        log_level: str = "warning",
        metrics_registry: CollectorRegistry | None = None,
        tracer_provider: TracerProvider | None = None,
        cors_origins: Sequence[str] = (),
        allowed_hosts: Sequence[str] = (),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """``ssl_context``: serve HTTPS with it (the caller keeps its certificate current); None: HTTP."""
        settings = settings or GatewaySettings()
        app = create_app(
            grpc_target,
            settings=settings,
            metrics_registry=metrics_registry,
            tracer_provider=tracer_provider,
            cors_origins=cors_origins,
            listen_host=host,
            allowed_hosts=allowed_hosts,
        )
        http_protocol, ws_protocol = watched_protocols(settings.stream_idle_timeout_s)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            # Leave logging configuration to the embedding process (the server CLI configures it).
            log_config=None,
            access_log=False,
            lifespan="on",
            # Streams (WatchMetrics, long generations) must not hold shutdown forever.
            timeout_graceful_shutdown=5,
            # A WebSocket message is a request body: the same limit, enforced while reading (1009).
            ws_max_size=settings.max_body_bytes,
            http=http_protocol,
            ws=ws_protocol,
            # A client that answers no ping for as long has read nothing for as long (1011).
            ws_ping_interval=settings.stream_idle_timeout_s,
            ws_ping_timeout=settings.stream_idle_timeout_s,
            ssl_context_factory=None if ssl_context is None else (lambda _config, _default: ssl_context),
        )
        self._server = _Server(config, handle_signals, app.state.websockets.close_all)
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when 0 was asked for)."""
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        """``http://host:port`` (``https``) of the running server."""
        scheme = "https" if self._server.config.ssl is not None else "http"
        return f"{scheme}://{self._server.config.host}:{self.port}"

    async def start(self) -> None:
        """Bind and start serving; returns once the port accepts connections."""
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                # uvicorn reports bind failures by exiting the serve task.
                exc = self._task.exception() if not self._task.cancelled() else None
                raise RuntimeError(f"the HTTP gateway failed to start: {exc!r}")
            await asyncio.sleep(0.01)
        log.info("HTTP gateway listening on %s", self.url)

    async def wait(self) -> None:
        """Until the server stops (a signal, when it handles them, or stop())."""
        if self._task is not None:
            # Shielded: cancelling the waiter must not abort uvicorn mid-request; stop() drains.
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Stop accepting, let running requests finish briefly, close the gRPC channel."""
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, SystemExit):
                await self._task


async def serve_gateway(
    host: str,
    port: int,
    grpc_target: str,
    *,
    settings: GatewaySettings | None = None,
    handle_signals: bool = False,
    cors_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
) -> None:
    """Serve the gateway until cancelled (or stopped by a signal when ``handle_signals``)."""
    server = GatewayServer(
        host,
        port,
        grpc_target,
        settings=settings,
        handle_signals=handle_signals,
        cors_origins=cors_origins,
        allowed_hosts=allowed_hosts,
    )
    await server.start()
    try:
        await server.wait()
    finally:
        await asyncio.shield(server.stop())


async def start_gateway(
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
) -> Callable[[], Awaitable[None]]:
    """Start the gateway in the running loop and return the coroutine function that stops it.

    This is the hook ``protoserve serve --http-port`` calls (server.app.HttpGatewayStarter),
    passing the server's metrics registry, tracer provider, CORS origins, allowed hosts,
    stream idle timeout (None: GatewaySettings' default) and, with TLS on, its SSLContext.
    """
    settings = GatewaySettings()
    if stream_idle_timeout_s is not None:
        settings = dataclasses.replace(settings, stream_idle_timeout_s=stream_idle_timeout_s)
    server = GatewayServer(
        host,
        port,
        grpc_target,
        settings=settings,
        metrics_registry=metrics_registry,
        tracer_provider=tracer_provider,
        cors_origins=cors_origins,
        allowed_hosts=allowed_hosts,
        ssl_context=ssl_context,
    )
    await server.start()
    return server.stop


def run_gateway(
    host: str,
    port: int,
    grpc_target: str,
    *,
    settings: GatewaySettings | None = None,
    cors_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
) -> None:
    """Blocking runner: serve until SIGINT/SIGTERM."""
    asyncio.run(
        serve_gateway(
            host,
            port,
            grpc_target,
            settings=settings,
            handle_signals=True,
            cors_origins=cors_origins,
            allowed_hosts=allowed_hosts,
        )
    )
