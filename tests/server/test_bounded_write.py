"""BoundedWriteContext: one timer per call ends a write the client leaves unread, and only that."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protoserve.server import errors
from protoserve.server.calls.stream_write_timeout import BoundedWriteContext

TIMEOUT_S = 0.05


class FakeContext:
    """A call whose writes wait on ``gate`` (a client that reads only when it is set)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.written: list[str] = []

    async def write(self, message: str) -> None:
        await self.gate.wait()
        self.written.append(message)


async def test_a_write_left_unread_ends_with_deadline_exceeded():
    context = FakeContext()
    bounded = BoundedWriteContext(context, TIMEOUT_S, "/m")  # type: ignore[arg-type]
    await bounded.write("first")
    context.gate.clear()
    with pytest.raises(errors.ServiceError) as caught:
        await bounded.write("never read")
    bounded.close()
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert bounded.stalled
    assert context.written == ["first"]
    assert asyncio.current_task().cancelling() == 0  # the timer's cancel was taken back


async def test_writes_that_are_read_never_time_out_however_long_the_stream():
    context = FakeContext()
    bounded = BoundedWriteContext(context, TIMEOUT_S, "/m")  # type: ignore[arg-type]
    # Each write waits a little under the timeout; together they last many timeouts, so the
    # timer armed by the first write fires while later ones are in progress.
    for i in range(8):
        context.gate.clear()
        asyncio.get_running_loop().call_later(TIMEOUT_S / 3, context.gate.set)
        await bounded.write(str(i))
    bounded.close()
    assert context.written == [str(i) for i in range(8)]
    assert not bounded.stalled


async def test_a_cancel_from_elsewhere_stays_a_cancel():
    context = FakeContext()
    context.gate.clear()
    bounded = BoundedWriteContext(context, 60.0, "/m")  # type: ignore[arg-type]
    task = asyncio.create_task(bounded.write("x"))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    bounded.close()
    assert not bounded.stalled


async def test_concurrent_writes_each_get_their_timeout():
    context = FakeContext()
    context.gate.clear()
    bounded = BoundedWriteContext(context, TIMEOUT_S, "/m")  # type: ignore[arg-type]
    results = await asyncio.gather(bounded.write("a"), bounded.write("b"), return_exceptions=True)
    bounded.close()
    assert all(isinstance(r, errors.ServiceError) for r in results)
    assert all(r.code is grpc.StatusCode.DEADLINE_EXCEEDED for r in results)
