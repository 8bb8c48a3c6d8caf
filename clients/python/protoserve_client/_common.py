"""Pieces shared by the sync and async clients: metadata, deadlines and result conversion."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from protoserve_client._stubs import inference_pb2 as pb
from protoserve_client.errors import ProtoserveError
from protoserve_client.types import (
    GenerateResult,
)

Metadata = Sequence[tuple[str, str]]
"""gRPC metadata as (key, value) pairs; keys must be lower case."""

DEFAULT_TARGET = "localhost:50051"

# Codes that mean "not ready yet" to wait_until_ready: UNAVAILABLE while the
# process starts, loads its model or drains; DEADLINE_EXCEEDED when one probe
# outlives its short deadline on a busy machine.
NOT_READY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Deadline of one readiness probe, so a hung connect cannot eat the whole wait.
PROBE_TIMEOUT_S = 5.0


def probe_timeout(remaining: float) -> float:
    """Deadline of the next readiness probe given the seconds left to wait."""
    return max(0.05, min(PROBE_TIMEOUT_S, remaining))


def not_ready(timeout: float, last: ProtoserveError | None) -> ProtoserveError:
    """The error wait_until_ready raises: the last probe's failure, or a plain deadline."""
    if last is not None:
        return last
    return ProtoserveError(grpc.StatusCode.DEADLINE_EXCEEDED, f"server not serving after {timeout}s")


class CallOptions:
    """Per-client defaults for auth metadata and deadlines, merged into every call."""

    def __init__(
        self,
        api_key: str | None,
        user_id: str | None,
        timeout: float | None,
        metadata: Metadata | None,
    ) -> None:
        base: list[tuple[str, str]] = []
        if api_key:
            base.append(("authorization", f"Bearer {api_key}"))
        if user_id:
            base.append(("x-user-id", user_id))
        base.extend(metadata or ())
        self.metadata: tuple[tuple[str, str], ...] = tuple(base)
        self.timeout = timeout

    def call_metadata(self, extra: Metadata | None) -> tuple[tuple[str, str], ...]:
        """The client's metadata followed by this call's own."""
        return self.metadata + tuple(extra or ())

    def call_timeout(self, timeout: float | None) -> float | None:
        """This call's deadline in seconds from now: its own if given, else the client default (None: none)."""
        return self.timeout if timeout is None else timeout


def batch_results(resp: pb.BatchResponse) -> list[GenerateResult | ProtoserveError]:
    """One result per request, in request order: the response, or the error it failed with."""
    out: list[GenerateResult | ProtoserveError] = []
    for r in resp.results:
        if r.WhichOneof("result") == "error":
            out.append(ProtoserveError.from_status(r.error))
        else:
            out.append(GenerateResult.from_proto(r.response))
    return out
