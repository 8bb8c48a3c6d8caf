"""Readiness.wait_seen_draining: a drained server closes its ports once its health checker has seen it."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from protoserve.server.runtime.health import CHECK_HEALTH, GRPC_HEALTH, Readiness


async def test_a_server_nobody_checks_does_not_wait():
    readiness = Readiness([])
    await readiness.set_draining()
    assert await asyncio.wait_for(readiness.wait_seen_draining(60.0), 5.0) is True


async def test_a_one_off_readiness_poll_is_not_a_checker():
    readiness = Readiness([])
    readiness.note_check()  # NOT_SERVING while loading
    await readiness.set_serving()
    readiness.note_check()  # the poll that saw SERVING, and stopped
    await readiness.set_draining()
    assert await asyncio.wait_for(readiness.wait_seen_draining(60.0), 5.0) is True


async def test_a_checker_that_stopped_checking_is_not_waited_for():
    now = [100.0]
    readiness = Readiness([], clock=lambda: now[0])
    await readiness.set_serving()
    for _ in range(3):  # every 2 s, then nothing for 10 s
        readiness.note_check()
        now[0] += 2.0
    now[0] += 8.0
    await readiness.set_draining()
    assert await asyncio.wait_for(readiness.wait_seen_draining(60.0), 5.0) is True


async def _checked_steadily(readiness: Readiness) -> None:
    await readiness.set_serving()
    for _ in range(3):  # a load balancer's checks while serving
        readiness.note_check()
        await asyncio.sleep(0.1)


async def test_a_checked_server_waits_for_a_check_after_the_drain_began():
    readiness = Readiness([])
    await _checked_steadily(readiness)
    await readiness.set_draining()
    waiting = asyncio.create_task(readiness.wait_seen_draining(60.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    readiness.note_check()  # answered NOT_SERVING
    assert await asyncio.wait_for(waiting, 5.0) is True


async def test_the_wait_ends_with_the_grace_period():
    readiness = Readiness([])
    await _checked_steadily(readiness)
    await readiness.set_draining()
    assert await readiness.wait_seen_draining(0.05) is False


async def test_grpc_health_checks_count():
    readiness = Readiness([])
    await readiness.start()

    class Context:
        def set_code(self, code): ...
        def set_details(self, details): ...

    await readiness.set_serving()
    for _ in range(2):
        await readiness.health.Check(health_pb2.HealthCheckRequest(service=""), Context())
        await asyncio.sleep(0.1)
    await readiness.set_draining()
    waiting = asyncio.create_task(readiness.wait_seen_draining(60.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await readiness.health.Check(health_pb2.HealthCheckRequest(service=""), Context())
    assert await asyncio.wait_for(waiting, 5.0) is True


async def test_a_checker_that_goes_away_during_the_drain_is_not_waited_for_longer():
    """The balancer stopped before the replica (a whole deployment deleted): no check will come."""
    now = [100.0]
    readiness = Readiness([], clock=lambda: now[0])
    await readiness.set_serving()
    for _ in range(3):  # every 2 s: gone 6 s after the last
        readiness.note_check()
        now[0] += 2.0
    now[0] += 3.9  # 0.1 s before it counts as gone
    await readiness.set_draining()
    assert await asyncio.wait_for(readiness.wait_seen_draining(60.0), 5.0) is True


async def test_every_kind_of_checker_must_see_the_drain():
    """Envoy checks a replica's gRPC port and its gateway's /health apart: one seeing it is not enough."""
    readiness = Readiness([])
    await readiness.set_serving()
    for _ in range(2):
        readiness.note_check(GRPC_HEALTH)
        readiness.note_check(CHECK_HEALTH)
        await asyncio.sleep(0.1)
    await readiness.set_draining()
    waiting = asyncio.create_task(readiness.wait_seen_draining(60.0))
    readiness.note_check(GRPC_HEALTH)
    await asyncio.sleep(0.05)
    assert not waiting.done()
    readiness.note_check(CHECK_HEALTH)
    assert await asyncio.wait_for(waiting, 5.0) is True
