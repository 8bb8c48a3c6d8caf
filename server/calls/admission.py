"""Admission: what every generating servicer checks before it does work."""

from __future__ import annotations

import grpc

from protoserve.server.calls.inflight import InflightRequests
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.runtime.health import Readiness
from protoserve.server.security.auth import Authenticator, Identity


class AdmittingServicer:
    """Shared state and the entry check of the InferenceService and OpenAIService servicers."""

    def __init__(
        self,
        models: ModelRegistry,
        auth: Authenticator,
        inflight: InflightRequests,
        readiness: Readiness,
    ) -> None:
        self.models = models
        self.auth = auth
        self.inflight = inflight
        self.readiness = readiness

    def _admit(self, context: grpc.aio.ServicerContext) -> Identity:
        """Authenticate and check the server takes work; every RPC but CheckHealth starts here."""
        identity = self.auth.identify(context.invocation_metadata())
        self.readiness.check()
        return identity
