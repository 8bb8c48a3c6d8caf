"""What the blocking client does its own way: open a channel, read a stream, sleep (see ``_aio_io``)."""

from __future__ import annotations

from collections.abc import Callable
from time import sleep
from typing import Any, TypeAlias

import grpc
from grpc import Channel, insecure_channel, secure_channel

from protoserve_client.errors import ProtoserveError

__all__ = ["Channel", "StreamCall", "insecure_channel", "next_message", "secure_channel", "sleep"]

# A server-streaming call is a grpc.Call, a grpc.Future and an iterator of
# messages in one object, for which grpc names no type.
StreamCall: TypeAlias = Any


def next_message(call: StreamCall, hung_up: Callable[[], bool]) -> Any | None:
    """The call's next message; None at its end, or once ``hung_up()`` says this side cancelled it."""
    try:
        return next(call)
    except StopIteration:
        return None
    except grpc.RpcError as e:
        if hung_up() and e.code() == grpc.StatusCode.CANCELLED:
            # We hung up ourselves; that is the end, not an error.
            return None
        raise ProtoserveError.from_rpc_error(e) from e
