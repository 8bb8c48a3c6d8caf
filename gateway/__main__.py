"""``python -m protoserve.gateway --grpc-target HOST:PORT``: run the REST/JSON gateway on its own.

Tracing follows the standard ``OTEL_*`` variables (see server.observability.tracing_setup);
``GET /metrics`` serves the gateway's own HTTP metrics, since the engine's
live in the server process (``protoserve serve --metrics-port``).
"""

from __future__ import annotations

import argparse
import logging

from protoserve.gateway.app import run_gateway
from protoserve.gateway.browser_safety import check_allowed_hosts
from protoserve.gateway.cors import check_origins
from protoserve.gateway.runtime.handler import GatewaySettings


def main() -> None:
    """Parse arguments and serve until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m protoserve.gateway", description=__doc__)
    parser.add_argument("--grpc-target", default="127.0.0.1:50051", help="gRPC server [127.0.0.1:50051]")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address [127.0.0.1]")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port [8000]")
    # An instance's value: on the slotted dataclass the class attribute is the slot descriptor.
    default_body_limit = GatewaySettings().max_body_bytes
    parser.add_argument(
        "--max-body-bytes", type=int, default=default_body_limit, help=f"larger bodies get 413 [{default_body_limit}]"
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (scheme://host[:port], or * for any) call the API; repeatable [off]",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host is NAME (.NAME: it and its subdomains; *: any Host); IP "
        "literals, localhost and --host always work; repeatable [none]",
    )
    default_idle = GatewaySettings().stream_idle_timeout_s
    parser.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=default_idle,
        metavar="SECONDS",
        help=f"drop an SSE or WebSocket client that reads nothing for this long, cancelling its requests "
        f"[{default_idle:g}]",
    )
    args = parser.parse_args()
    try:
        cors_origins = check_origins(args.cors_origin)
        allowed_hosts = check_allowed_hosts(args.allowed_host)
        settings = GatewaySettings(
            max_body_bytes=args.max_body_bytes, stream_idle_timeout_s=args.stream_idle_timeout
        )
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The SDK setup is shared with the server CLI; imported here only, so the
    # gateway library itself depends on the OpenTelemetry API alone.
    from protoserve.server.observability.tracing_setup import configure_tracing

    try:
        configure_tracing("protoserve-gateway")
    except ValueError as exc:
        parser.error(str(exc))
    run_gateway(
        args.host,
        args.port,
        args.grpc_target,
        settings=settings,
        cors_origins=cors_origins,
        allowed_hosts=allowed_hosts,
    )


if __name__ == "__main__":
    main()
