"""Can the server listen where it was told to? Checked before anything starts.

gRPC answers a taken port with "Failed to bind" (the OS's reason only in its
C-core log) and uvicorn with a log record and ``sys.exit``; binding a plain
socket first, with the same SO_REUSEADDR both of them set, gives one error
with the OS's reason while nothing is running yet.
"""

from __future__ import annotations

import errno
import socket


class PortUnavailable(OSError):
    """A port the server cannot listen on: taken, not permitted, or an address this host lacks."""


def check_can_listen(host: str, port: int, what: str) -> None:
    """Raise PortUnavailable unless ``host:port`` can be bound now; ``what`` names the listener.

    Port 0 (any free port) always can. Like the servers, it is enough that one of
    the host's addresses binds, but a port taken on any of them is taken.
    """
    if port == 0:
        return
    where = f"cannot listen on {host}:{port} ({what})"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortUnavailable(f"{where}: {exc.strerror}") from exc
    failure: OSError | None = None
    bound = False
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                failure = exc
                if exc.errno == errno.EADDRINUSE:
                    break
            else:
                bound = True
    if failure is not None and (not bound or failure.errno == errno.EADDRINUSE):
        raise PortUnavailable(f"{where}: {failure.strerror.lower()}") from failure
