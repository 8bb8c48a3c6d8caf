"""``--metrics-port``: the Prometheus endpoint on a port of its own.

The gateway serves ``GET /metrics`` on the HTTP port; a separate port keeps
scrapes off the public API port (and works with ``--no-http``). It is
prometheus-client's own threaded HTTP server, so scrapes are answered even
while the event loop is busy.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


class MetricsHttpServer:
    """Serves one registry's text exposition at ``/metrics`` (any path, in fact) on host:port."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._httpd.server_port  # the real one when 0 was asked for
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        thread: threading.Thread = self._thread
        thread.join(5)
