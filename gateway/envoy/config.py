"""Envoy's config for protoserve replicas: ``envoy.yaml.template`` rendered with the ports, the replicas
(each a gRPC address and, optionally, its REST gateway's for the OpenAI routes), how to balance over
them, the browser rules and a descriptor set. gateway/envoy/launcher.py runs Envoy with it and prints
it for deployments (deploy/envoy, deploy/k8s).

The template keeps the config's shape and its comments; the parts that vary are built here as data and
written into its placeholders as YAML (one line of flow style each, or a block list of such lines).
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from protoserve.gateway.browser_safety import is_ip_literal
from protoserve.gateway.envoy.browser_routes import NO_TRANSCODING, browser_refusals

TEMPLATE = Path(__file__).with_name("envoy.yaml.template")
# Not OpenAIService: Envoy refuses to load RetrieveModel's `response_body: "model"` (only
# google.api.HttpBody fields are supported there), and the OpenAI routes need
# our gateway anyway (see gateway/README.md).
DEFAULT_SERVICES = (
    "protoserve.v1.InferenceService",
    "protoserve.v1.MetricsService",
    "protoserve.v1.EmbeddingService",
    "protoserve.v1.RagService",
    "protoserve.v1.AgentService",
    "protoserve.v1.AdapterService",
)


@dataclass(frozen=True)
class Replica:
    """One protoserve process behind Envoy: its gRPC address and, when it runs one, its REST gateway's."""

    grpc: str  # host:port
    http: str | None = None  # host:port of the replica's own gateway (OpenAI and WebSocket routes)

    def __post_init__(self) -> None:
        for name in ("grpc", "http"):
            value = getattr(self, name)
            if value is not None:
                _split_address(value, f"Replica.{name}")


@dataclass(frozen=True)
class Balancing:
    """How Envoy spreads calls over replicas and takes them out of rotation."""

    # RING_HASH keeps an identity on one replica; ROUND_ROBIN is the comparison the bench makes.
    lb_policy: str = "RING_HASH"
    health_check_interval_s: float = 2.0
    # Consecutive failed checks before a replica leaves rotation, and passed ones before it returns.
    unhealthy_threshold: int = 1
    healthy_threshold: int = 1
    # Ejection for replicas that answer 502/503/504 or fail to connect between health checks.
    ejection_s: float = 10.0

    def __post_init__(self) -> None:
        if self.lb_policy not in LB_POLICIES:
            raise ValueError(
                f"Balancing.lb_policy must be one of {', '.join(LB_POLICIES)}, got {self.lb_policy!r}"
            )
        if not self.health_check_interval_s > 0:
            raise ValueError(
                f"Balancing.health_check_interval_s must be positive, got {self.health_check_interval_s}"
            )
        for name in ("unhealthy_threshold", "healthy_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"Balancing.{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EnvoyTls:
    """TLS at Envoy, from PEM files (a Kubernetes Secret mounted into its pod), read when Envoy starts.

    Clients get ``cert_file``; with ``client_ca_file`` they must present a certificate from it. The
    replicas (``protoserve serve --tls-cert-file``) are reached over TLS and their certificates checked
    against ``upstream_ca_file``, for the name ``upstream_server_name`` (also sent as SNI); Envoy presents
    ``upstream_cert_file`` to replicas that run with ``--tls-client-ca-file``.
    """

    cert_file: str
    key_file: str
    upstream_ca_file: str
    upstream_server_name: str
    client_ca_file: str | None = None
    upstream_cert_file: str | None = None
    upstream_key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.upstream_cert_file is None) != (self.upstream_key_file is None):
            raise ValueError("EnvoyTls.upstream_cert_file and upstream_key_file go together")
        if not self.upstream_server_name:
            raise ValueError("EnvoyTls.upstream_server_name must name the replicas' certificate")


TLS_SOCKET = "envoy.transport_sockets.tls"
TLS_TYPES = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."


def _certificate(cert_file: str, key_file: str) -> dict:
    return {"certificate_chain": {"filename": cert_file}, "private_key": {"filename": key_file}}


def _downstream_tls(tls: EnvoyTls | None) -> str:
    if tls is None:
        return "# plaintext: h2c and HTTP/1.1 (TLS: EnvoyTls)"
    context: dict = {
        "@type": TLS_TYPES + "DownstreamTlsContext",
        # gRPC clients negotiate h2, browsers and SDKs either.
        "common_tls_context": {
            "alpn_protocols": ["h2", "http/1.1"],
            "tls_certificates": [_certificate(tls.cert_file, tls.key_file)],
        },
    }
    if tls.client_ca_file is not None:
        context["common_tls_context"]["validation_context"] = {"trusted_ca": {"filename": tls.client_ca_file}}
        context["require_client_certificate"] = True
    return "transport_socket: " + flow_yaml({"name": TLS_SOCKET, "typed_config": context})


def _upstream_tls(tls: EnvoyTls | None, alpn: str) -> str:
    if tls is None:
        return "# plaintext to the replicas"
    common: dict = {
        # The gRPC port speaks h2, the replicas' REST gateways HTTP/1.1.
        "alpn_protocols": [alpn],
        "validation_context": {
            "trusted_ca": {"filename": tls.upstream_ca_file},
            "match_typed_subject_alt_names": [
                {"san_type": "DNS", "matcher": {"exact": tls.upstream_server_name}}
            ],
        },
    }
    if tls.upstream_cert_file is not None and tls.upstream_key_file is not None:
        common["tls_certificates"] = [_certificate(tls.upstream_cert_file, tls.upstream_key_file)]
    context = {"@type": TLS_TYPES + "UpstreamTlsContext", "sni": tls.upstream_server_name, "common_tls_context": common}
    return "transport_socket: " + flow_yaml({"name": TLS_SOCKET, "typed_config": context})


LB_POLICIES = ("RING_HASH", "MAGLEV", "ROUND_ROBIN", "LEAST_REQUEST")
# The caller's identity as the replicas compute it (server/security/auth.py): API key and user id.
# (x-api-key: Anthropic's clients send the key there; the server reads it when no authorization is sent.)
AFFINITY_HEADERS = ("authorization", "x-api-key", "x-user-id")
# Paths proxied to the replicas' gateways rather than transcoded by Envoy: OpenAI's routes, the Responses
# and Messages APIs (their SSE events and, for Messages, Anthropic's error bodies are the gateway's), and
# the Open Inference Protocol's REST side (KServe's tensor JSON and binary bodies, not proto JSON).
GATEWAY_PREFIXES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/models",
    "/v1/responses",
    "/v1/messages",
    "/v2/",
)
WEBSOCKET_PATH = "/v1/ws/completions"
# Unary calls that never run the model: a short timeout turns a wedged replica into a quick error.
SHORT_GRPC_METHODS = (
    "/grpc.health.v1.Health/Check",
    "/protoserve.v1.InferenceService/Tokenize",
    "/protoserve.v1.InferenceService/Detokenize",
    "/protoserve.v1.InferenceService/ListModels",
    "/protoserve.v1.InferenceService/GetModel",
    "/protoserve.v1.InferenceService/CheckHealth",
    "/protoserve.v1.MetricsService/GetMetrics",
)
SHORT_TIMEOUT = "10s"
# A stream that sends nothing for this long is dead (a long prefill still sends nothing for seconds).
STREAM_IDLE_TIMEOUT = "300s"
# Retry only what the replica cannot have started: no connection, a refused HTTP/2 stream, a reset
# before the request was sent, or a trailers-only UNAVAILABLE (draining or loading). Once any
# response byte reached the client Envoy never retries, so a stream is never replayed.
GRPC_RETRY_ON = "connect-failure,refused-stream,reset-before-request,unavailable"
# Our gateway answers 503 for the replica's UNAVAILABLE (draining or loading) before any body byte.
HTTP_RETRY_ON = "connect-failure,refused-stream,reset-before-request,retriable-status-codes"


def flow_yaml(value: object) -> str:
    """``value`` as one line of YAML flow style (PyYAML: strings that would read as numbers are quoted)."""
    return yaml.safe_dump(value, default_flow_style=True, width=float("inf"), sort_keys=False).strip()


def block_list(items: Sequence[object], indent: int) -> str:
    """A YAML block list, one flow-style item a line, for a placeholder that starts a line at ``indent``."""
    if not items:
        return " " * indent + "[]"
    return "\n".join(" " * indent + "- " + flow_yaml(item) for item in items)


def _split_address(address: str, field: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field} must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _endpoint(address: str, field: str, hash_key: str | None = None) -> dict:
    host, port = _split_address(address, field)
    endpoint: dict = {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
    if hash_key is not None and is_ip_literal(host):
        # The ring position of a host comes from this key, not its address: a replica's gateway and
        # its gRPC port sit at the same place on both rings, so an identity's OpenAI and native calls
        # land on the same replica. A DNS name stands for many hosts (a headless Service's pods),
        # which one key would pile onto one ring position; those keep their addresses as keys.
        endpoint["metadata"] = {"filter_metadata": {"envoy.lb": {"hash_key": hash_key}}}
    return endpoint


def _cluster_type(addresses: Sequence[str]) -> str:
    # Names (a Kubernetes headless Service) resolve to every pod address, each a host of its own.
    return "STATIC" if all(is_ip_literal(_split_address(a, "address")[0]) for a in addresses) else "STRICT_DNS"


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _health_checks(balancing: Balancing, check: dict) -> list[dict]:
    return [
        {
            "timeout": "1s",
            "interval": _seconds(balancing.health_check_interval_s),
            # Probe a replica that gets no traffic just as often, so it re-enters rotation promptly.
            "no_traffic_interval": _seconds(balancing.health_check_interval_s),
            "unhealthy_threshold": balancing.unhealthy_threshold,
            "healthy_threshold": balancing.healthy_threshold,
            **check,
        }
    ]


# "" is the whole server: NOT_SERVING while loading and from the start of a drain.
GRPC_HEALTH_CHECK = {"grpc_health_check": {"service_name": ""}}
# The gateway's /health is CheckHealth, which answers UNAVAILABLE (503) while loading or draining.
# Envoy would send the cluster's name as Host, which the gateway refuses (gateway.browser_safety).
HTTP_HEALTH_CHECK = {"http_health_check": {"path": "/health", "host": "localhost"}}


# Envoy's default allows 3 retries in flight per cluster: when a replica dies under load, its
# refused calls overflow that and fail although another replica is free. A budget scales with load.
CIRCUIT_BREAKERS = {
    "thresholds": [{"retry_budget": {"budget_percent": {"value": 25.0}, "min_retry_concurrency": 16}}]
}


def _outlier_detection(balancing: Balancing) -> dict:
    return {
        "interval": "1s",
        "base_ejection_time": _seconds(balancing.ejection_s),
        "max_ejection_percent": 50,
        # Application 500s (a bad request, a model error) say nothing about the replica's health.
        "consecutive_5xx": 5,
        "enforcing_consecutive_5xx": 0,
        "consecutive_gateway_failure": 3,
        "enforcing_consecutive_gateway_failure": 100,
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 2,
        "enforcing_consecutive_local_origin_failure": 100,
    }


@dataclass(frozen=True)
class BrowserRules:
    """Which Host values Envoy serves and which pages may send it state-changing requests
    (browser_routes.py): ``--allowed-host`` names and ``--allowed-origin`` origins."""

    listen_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()


def _route(match: dict, action: dict) -> dict:
    return {"match": match, "route": action}


def _routes(browser: BrowserRules) -> list[dict]:
    """The browser refusals first; then OpenAI and WebSocket paths to the gateways, everything gRPC (native
    or transcoded) to the servers."""
    hash_policy = [{"header": {"header_name": name}} for name in AFFINITY_HEADERS]
    no_transcoding = NO_TRANSCODING
    http_retry = {
        "retry_on": HTTP_RETRY_ON,
        "retriable_status_codes": [503],
        "num_retries": 2,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }
    grpc_retry = {**http_retry, "retry_on": GRPC_RETRY_ON}
    del grpc_retry["retriable_status_codes"]
    routes = browser_refusals(browser.listen_host, browser.allowed_hosts, browser.allowed_origins)
    routes += [
        {
            **_route(
                {"path": WEBSOCKET_PATH},
                {
                    "cluster": "protoserve_http",
                    "timeout": "0s",
                    "idle_timeout": STREAM_IDLE_TIMEOUT,
                    "hash_policy": hash_policy,
                    "upgrade_configs": [{"upgrade_type": "websocket"}],
                },
            ),
            "typed_per_filter_config": no_transcoding,
        }
    ]
    for prefix in GATEWAY_PREFIXES:
        # Listing models is quick; loading one (POST, ModelService) takes as long as the load.
        if prefix == "/v1/models":
            routes.append({
                **_route({"prefix": prefix, "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
                         {"cluster": "protoserve_http", "timeout": SHORT_TIMEOUT, "hash_policy": hash_policy,
                          "retry_policy": http_retry}),
                "typed_per_filter_config": no_transcoding,
            })
        # Completions stream as SSE for as long as they generate: no overall timeout, an idle one.
        routes.append(
            {
                **_route(
                    {"prefix": prefix},
                    {
                        "cluster": "protoserve_http",
                        "timeout": "0s",
                        "idle_timeout": STREAM_IDLE_TIMEOUT,
                        "hash_policy": hash_policy,
                        "retry_policy": http_retry,
                    },
                ),
                "typed_per_filter_config": no_transcoding,
            }
        )
    grpc_action = {"cluster": "protoserve_grpc", "hash_policy": hash_policy, "retry_policy": grpc_retry}
    for method in SHORT_GRPC_METHODS:
        routes.append(_route({"path": method, "grpc": {}}, {**grpc_action, "timeout": SHORT_TIMEOUT}))
    # Everything else gRPC, native or transcoded from REST: as long as the client's grpc-timeout allows.
    routes.append(
        _route(
            {"prefix": "/", "grpc": {}},
            {
                **grpc_action,
                "timeout": "0s",
                "idle_timeout": STREAM_IDLE_TIMEOUT,
                "max_stream_duration": {"grpc_timeout_header_max": "0s"},
            },
        )
    )
    return routes


def _tracing(otlp_target: str | None) -> str:
    if otlp_target is None:
        return "# tracing: off (traceparent still passes through)"
    config = {
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": "otlp_collector"}, "timeout": "1s"},
                "service_name": "protoserve-envoy",
            },
        },
        "spawn_upstream_span": False,
    }
    return "tracing: " + flow_yaml(config)


def _otlp_cluster(otlp_target: str | None) -> str:
    if otlp_target is None:
        return "# no OTLP collector"
    cluster = {
        "name": "otlp_collector",
        "type": _cluster_type([otlp_target]),
        "connect_timeout": "2s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "otlp_collector",
            "endpoints": [{"lb_endpoints": [_endpoint(otlp_target, "otlp_target")]}],
        },
    }
    return "- " + flow_yaml(cluster)


def render_config(
    grpc_target: str | Sequence[Replica],
    http_port: int,
    admin_port: int,
    descriptor_path: Path,
    *,
    listen_host: str = "127.0.0.1",
    services: Sequence[str] = DEFAULT_SERVICES,
    balancing: Balancing = Balancing(),
    otlp_target: str | None = None,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    tls: EnvoyTls | None = None,
) -> str:
    """The Envoy YAML for these ports and replicas (one gRPC target is one replica without a gateway).

    ``otlp_target``: host:port of an OTLP/gRPC collector for Envoy's own spans; None records none.
    ``allowed_hosts`` and ``allowed_origins``: see browser_routes.py. ``tls``: TLS to clients and to
    the replicas (None: plaintext both ways).
    """
    replicas = [Replica(grpc_target)] if isinstance(grpc_target, str) else list(grpc_target)
    if not replicas:
        raise ValueError("replicas must name at least one replica")
    grpc_addresses = [r.grpc for r in replicas]
    gateways = [r for r in replicas if r.http is not None]
    http_addresses = [r.http for r in gateways]
    return string.Template(TEMPLATE.read_text()).substitute(
        admin_port=admin_port,
        listen_host=listen_host,
        http_port=http_port,
        descriptor=os.fspath(descriptor_path),
        services=", ".join(services),
        routes=block_list(_routes(BrowserRules(listen_host, tuple(allowed_hosts), tuple(allowed_origins))), 24),
        tracing=_tracing(otlp_target),
        lb_policy=balancing.lb_policy,
        grpc_health_checks=flow_yaml(_health_checks(balancing, GRPC_HEALTH_CHECK)),
        http_health_checks=flow_yaml(_health_checks(balancing, HTTP_HEALTH_CHECK)),
        outlier_detection=flow_yaml(_outlier_detection(balancing)),
        circuit_breakers=flow_yaml(CIRCUIT_BREAKERS),
        grpc_cluster_type=_cluster_type(grpc_addresses),
        grpc_endpoints=block_list([_endpoint(r.grpc, "Replica.grpc", r.grpc) for r in replicas], 14),
        # With no gateway anywhere the OpenAI routes answer 503 (no healthy upstream).
        http_cluster_type=_cluster_type(http_addresses) if http_addresses else "STATIC",
        http_endpoints=block_list([_endpoint(r.http, "Replica.http", r.grpc) for r in gateways], 14),
        otlp_cluster=_otlp_cluster(otlp_target),
        downstream_tls=_downstream_tls(tls),
        grpc_upstream_tls=_upstream_tls(tls, "h2"),
        http_upstream_tls=_upstream_tls(tls, "http/1.1"),
    )


def as_configmap(config: str, name: str, command: str) -> str:
    """``config`` as a Kubernetes ConfigMap holding ``envoy.yaml``, headed by the command that made it."""
    body = "".join(f"    {line}\n" if line else "\n" for line in config.splitlines())
    return (
        f"# Generated by: {command}\n"
        "# Do not edit by hand: change gateway/envoy/ and render again (tests/deploy checks they agree).\n"
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata:\n"
        f"  name: {name}\n"
        "  labels: {app.kubernetes.io/name: envoy, app.kubernetes.io/part-of: protoserve}\n"
        "data:\n"
        "  envoy.yaml: |\n"
        f"{body}"
    )
