"""Reading rich gRPC errors in tests: code, message and the google.rpc details by type."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

DETAIL_TYPES = (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo)


@dataclass
class RpcFailure:
    """A failed call as the client sees it."""

    code: grpc.StatusCode
    message: str
    details: dict[str, object] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        return self.details["ErrorInfo"].reason

    @property
    def fields(self) -> set[str]:
        bad_request = self.details.get("BadRequest")
        return {v.field for v in bad_request.field_violations} if bad_request else set()


def unpack_details(status) -> dict[str, object]:
    details: dict[str, object] = {}
    for any_detail in status.details if status is not None else []:
        for cls in DETAIL_TYPES:
            if any_detail.Is(cls.DESCRIPTOR):
                message = cls()
                any_detail.Unpack(message)
                details[cls.__name__] = message
    return details


async def failure_of(call) -> RpcFailure:
    """Await a call that must fail (unary, or a stream read to its end); its status with details."""
    try:
        if hasattr(call, "read"):
            while await call.read() is not grpc.aio.EOF:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        status = await rpc_status.aio.from_call(call)
        return RpcFailure(exc.code(), exc.details() or "", unpack_details(status))
    raise AssertionError("the call succeeded")


async def read_all(stream) -> list:
    """Every remaining message of a server stream (read()-style)."""
    out = []
    while (message := await stream.read()) is not grpc.aio.EOF:
        out.append(message)
    return out
