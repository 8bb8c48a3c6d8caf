"""A replica behind Envoy keeps its ports open on SIGTERM until Envoy's health check has seen it drain.

Envoy sends calls to a replica until a health check fails. Over HTTP/1.1 a request Envoy writes onto a
keep-alive connection that the replica closes gets no answer, and Envoy cannot tell whether the replica
started it, so it answers 503 itself rather than retry (the mesh's drain test once saw one). A replica
with nothing in flight used to close its ports the moment SIGTERM came, up to a whole check interval
before Envoy knew. Here Envoy must take it out of rotation while the process still runs.
"""

from __future__ import annotations

import signal
import time

import pytest

from protoserve.gateway.envoy import launcher
from protoserve.gateway.envoy.config import Balancing, Replica

pytestmark = pytest.mark.live
CHECK_INTERVAL_S = 2.0


def test_sigterm_waits_for_envoy_to_see_the_drain(spawn_server):
    pytest.importorskip("envoy")
    server = spawn_server("--no-embedding-model")
    grpc_port = server.grpc_target.rpartition(":")[2]
    replica = Replica(f"127.0.0.1:{grpc_port}", f"127.0.0.1:{server.http_port}")
    with launcher.running_envoy([replica], balancing=Balancing(health_check_interval_s=CHECK_INTERVAL_S)) as envoy:
        envoy.wait_healthy(1)
        time.sleep(CHECK_INTERVAL_S / 2)  # between two checks: the next one is not imminent
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 4 * CHECK_INTERVAL_S
        while envoy.healthy_hosts("protoserve_http") == 1:
            assert time.monotonic() < deadline, envoy.log()
            time.sleep(0.01)
        # Out of rotation, and Envoy learnt it from the replica's own answer, not a refused connection.
        assert server.process.poll() is None, server.log()
        assert server.process.wait(30) == 0, server.log()
