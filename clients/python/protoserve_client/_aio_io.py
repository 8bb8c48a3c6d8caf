"""What the asyncio client does its own way: open a channel, read a stream, sleep.

``aio.py`` imports these names from here, and the ``client.py`` generated from
it the same names from ``_sync_io``; the rest of both clients is written once.
"""

from __future__ import annotations

from asyncio import CancelledError, sleep
from collections.abc import Callable
from typing import Any, TypeAlias

import grpc.aio
from grpc.aio import Channel, insecure_channel, secure_channel

from protoserve_client.errors import ProtoserveError

__all__ = ["Channel", "StreamCall", "insecure_channel", "next_message", "secure_channel", "sleep"]

StreamCall: TypeAlias = "grpc.aio.UnaryStreamCall[Any, Any]"


async def next_message(call: StreamCall, hung_up: Callable[[], bool]) -> Any | None:
    """The call's next message; None at its end, or once ``hung_up()`` says this side cancelled it."""
    if hung_up():
        return None
    try:
        msg = await call.read()
    except grpc.aio.AioRpcError as e:
        raise ProtoserveError.from_rpc_error(e) from e
    except CancelledError:
        # grpc.aio reports a call we cancelled ourselves as CancelledError
        # from read(); only that case is a normal end. A cancelled task
        # must still see its CancelledError.
        if hung_up():
            return None
        raise
    return None if msg is grpc.aio.EOF else msg
