"""MessagesService: the gRPC servicer of Anthropic's Messages API. Every RPC authenticates and
checks readiness first, as every other servicer's does."""

from __future__ import annotations

import grpc

from protoserve.anthropic.v1 import messages_pb2 as am
from protoserve.anthropic.v1 import messages_pb2_grpc
from protoserve.server import errors
from protoserve.server.calls.admission import Admission, AdmittingServicer
from protoserve.server.services.anthropic.messages import Messages
from protoserve.server.services.openai.streaming import EngineRunner


class MessagesService(AdmittingServicer, messages_pb2_grpc.MessagesServiceServicer):
    """Anthropic-compatible messages and token counts over gRPC."""

    def __init__(self, admission: Admission) -> None:
        super().__init__(admission)
        self.messages = Messages(admission.models, EngineRunner(admission.inflight))

    @errors.reports_errors
    async def CreateMessage(
        self, request: am.CreateMessageRequest, context: grpc.aio.ServicerContext
    ) -> am.CreateMessageResponse:
        """Answer a conversation with one reply."""
        return await self.messages.create(request, context, self._admit(context))

    @errors.reports_errors
    async def CreateMessageStream(
        self, request: am.CreateMessageStreamRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream the reply as Anthropic's events."""
        await self.messages.create_stream(request, context, self._admit(context))

    @errors.reports_errors
    async def CountMessageTokens(
        self, request: am.CountMessageTokensRequest, context: grpc.aio.ServicerContext
    ) -> am.CountMessageTokensResponse:
        """The input tokens a CreateMessage with this input would use."""
        self._admit(context)
        return await self.messages.count_tokens(request)
