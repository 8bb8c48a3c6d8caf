"""The ``serve`` process: signals (drain on the first, abort on the second, SIGHUP re-reads TLS files),
the listen and ready lines, and the exit code of each way it ends."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from protoserve.server import exit_codes
from protoserve.server.agent.tool_registry import ToolRegistryError
from protoserve.server.runtime.event_loop import loop_name
from protoserve.server.runtime.heap import freeze_startup_heap
from protoserve.server.runtime.ports import PortUnavailable

if TYPE_CHECKING:


    pass

from protoserve.server.app import HttpGatewayStarter, ServerApp, ServerConfig

log = logging.getLogger("protoserve.server.app")


def _file_error(exc: OSError | ValueError) -> str:
    """One line for a file that cannot be read: its name and the OS's reason."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"cannot read {exc.filename}: {exc.strerror.lower()}"
    return str(exc)


async def serve(config: ServerConfig, http_gateway: HttpGatewayStarter | None = None) -> int:
    """Run a server until SIGTERM/SIGINT, then drain; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            stop.set()
        else:
            # A second signal means "now": skip the rest of the grace period.
            log.warning("received %s again: aborting in-flight calls", signal.Signals(signum).name)
            app.inflight.abort_all()

    try:
        app = ServerApp(config, http_gateway=http_gateway)
    except ToolRegistryError as exc:
        # An installed tool package that is broken: its owner's to fix, named in the message.
        print(f"protoserve: {exc}", file=sys.stderr, flush=True)
        return exit_codes.USAGE
    except (OSError, ValueError) as exc:
        # A file a flag names (API keys, secrets) that cannot be read or used: the user's to fix.
        print(f"protoserve: {_file_error(exc)}", file=sys.stderr, flush=True)
        return exit_codes.USAGE
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    if app.tls is not None:
        # Files that changed are picked up at the next handshake anyway; SIGHUP re-reads them regardless.
        loop.add_signal_handler(signal.SIGHUP, app.tls.reload)
    try:
        await app.start()
    except PortUnavailable as exc:
        print(f"protoserve: {exc}", file=sys.stderr, flush=True)
        await app.stop()
        return exit_codes.PORT_UNAVAILABLE
    http = f", http on {config.host}:{app.http_port}" if app.http_port is not None else ""
    if app.metrics_port is not None:
        http += f", metrics on {config.host}:{app.metrics_port}"
    print(f"protoserve listening on {app.grpc_target} (grpc){http}", flush=True)
    if app.tls is not None:
        mutual = f", client certificates from {config.tls.client_ca_file}" if app.tls.current.mutual else ""
        log.info("TLS on the gRPC and HTTP ports (certificate sha256 %s%s)", app.tls.current.fingerprint, mutual)
    log.info("event loop: %s", loop_name(loop))

    load = asyncio.create_task(app.load_model())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        from protoserve.engine.api import ModelLoadError

        exc = load.exception()
        # A bad path or checkpoint, or an option it cannot take (ValueError, e.g. --max-model-len
        # beyond its context): one line. Anything else is a bug, so keep the traceback.
        user_error = isinstance(exc, ModelLoadError | OSError | ValueError)
        log.log(logging.DEBUG if user_error else logging.ERROR, "model loading failed", exc_info=exc)
        print(f"protoserve: could not load the model: {exc}", file=sys.stderr, flush=True)
        stopping.cancel()
        await app.stop()
        return exit_codes.MODEL_LOAD
    if not load.done():
        # Shutdown asked for while loading: stop serving now; the loading thread
        # cannot be interrupted, so the process exits when it returns.
        await app.readiness.set_draining()
        await app.stop()
        load.cancel()
        return 0
    # Health is SERVING now: "listening" came first (probes get answers while the model
    # loads), so this is the line that says requests will be answered.
    served = ", ".join(m.name for m in app.models.listing())
    frozen = freeze_startup_heap()
    log.debug("froze %d start-up objects out of the garbage collector's walks", frozen)
    print(f"protoserve ready: serving {served} on {app.grpc_target} (grpc){http}", flush=True)
    await stopping
    await app.drain()
    log.info("stopped")
    return 0
