"""Admission: what every generating servicer checks before it does work."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from protoserve.server.calls.inflight import InflightRequests
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.runtime.health import Readiness
from protoserve.server.security.auth import Authenticator, Identity


@dataclass(frozen=True)
class Admission:
    """What every generating servicer is built on: the served models, who may call, the in-flight
    registry (cancels, deadlines, disconnects) and whether the server takes work."""

    models: ModelRegistry
    auth: Authenticator
    inflight: InflightRequests
    readiness: Readiness


class AdmittingServicer:
    """Shared state and the entry check of every generating servicer (gRPC API surface)."""

    def __init__(self, admission: Admission) -> None:
        self.models = admission.models
        self.auth = admission.auth
        self.inflight = admission.inflight
        self.readiness = admission.readiness

    def _admit(self, context: grpc.aio.ServicerContext) -> Identity:
        """Authenticate and check the server takes work; every RPC but CheckHealth starts here."""
        identity = self.auth.identify(context.invocation_metadata())
        self.readiness.check()
        return identity
