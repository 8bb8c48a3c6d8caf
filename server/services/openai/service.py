"""OpenAIService: the gRPC servicer of OpenAI's API, composed of one object per surface.

Built on the same served model (validation, tokenization, chat template) and in-flight registry
(cancel, deadline, abort on disconnect) as InferenceService, so only the shapes differ: ids
``cmpl-…``/``chatcmpl-…``, ``created`` unix seconds, ``object`` strings, ``system_fingerprint``,
OpenAI's logprob layouts and its defaults. Every RPC authenticates and checks readiness first.
"""

from __future__ import annotations

import grpc

from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.openai.v1 import openai_pb2_grpc
from protoserve.server import errors
from protoserve.server.calls.admission import Admission, AdmittingServicer
from protoserve.server.services.openai.chat import ChatCompletions
from protoserve.server.services.openai.completions import Completions
from protoserve.server.services.openai.embeddings import Embeddings
from protoserve.server.services.openai.models import Models
from protoserve.server.services.openai.streaming import EngineRunner


class OpenAIService(AdmittingServicer, openai_pb2_grpc.OpenAIServiceServicer):
    """OpenAI-compatible completions, chat completions, embeddings and models over gRPC."""

    def __init__(self, admission: Admission) -> None:
        super().__init__(admission)
        models, runner = admission.models, EngineRunner(admission.inflight)
        self.completions = Completions(models, runner)
        self.chat = ChatCompletions(models, runner)
        self.embeddings = Embeddings(admission.inflight, models)
        self.model_list = Models(models)

    @errors.reports_errors
    async def CreateCompletion(
        self, request: oa.CreateCompletionRequest, context: grpc.aio.ServicerContext
    ) -> oa.CreateCompletionResponse:
        """Complete one or more prompts; choice i*n+j is choice j of prompt i."""
        return await self.completions.create(request, context, self._admit(context))

    @errors.reports_errors
    async def CreateCompletionStream(
        self, request: oa.CreateCompletionStreamRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream completion chunks; the last chunk of each choice carries its finish_reason."""
        await self.completions.create_stream(request, context, self._admit(context))

    @errors.reports_errors
    async def CreateChatCompletion(
        self, request: oa.CreateChatCompletionRequest, context: grpc.aio.ServicerContext
    ) -> oa.CreateChatCompletionResponse:
        """Answer a conversation with n choices."""
        return await self.chat.create(request, context, self._admit(context))

    @errors.reports_errors
    async def CreateChatCompletionStream(
        self, request: oa.CreateChatCompletionStreamRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream chat chunks: role first, then content, then an empty delta with finish_reason."""
        await self.chat.create_stream(request, context, self._admit(context))

    @errors.reports_errors
    async def CreateEmbedding(
        self, request: oa.CreateEmbeddingRequest, context: grpc.aio.ServicerContext
    ) -> oa.CreateEmbeddingResponse:
        """OpenAI's embeddings: a vector per input, as floats or base64 float32s."""
        return await self.embeddings.create(request, self._admit(context))

    @errors.reports_errors
    async def ListModels(
        self, request: oa.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> oa.ListModelsResponse:
        """OpenAI's model list: every model, then its LoRA adapters."""
        self._admit(context)
        return self.model_list.list()

    @errors.reports_errors
    async def RetrieveModel(
        self, request: oa.RetrieveModelRequest, context: grpc.aio.ServicerContext
    ) -> oa.RetrieveModelResponse:
        """One model by id; NOT_FOUND when it is not loaded."""
        self._admit(context)
        return self.model_list.retrieve(request)
