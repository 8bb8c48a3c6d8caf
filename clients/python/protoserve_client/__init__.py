"""Typed Python client for protoserve: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Example: ``Client("localhost:50051").generate("The capital of France is", max_tokens=8).text``.
"""

from protoserve_client._common import Metadata
from protoserve_client.aio import AsyncClient, AsyncGenerateStream
from protoserve_client.builders import GenerateKwargs, Message, generate_request, sampling_params
from protoserve_client.client import Client, GenerateStream
from protoserve_client.errors import FieldViolation, ProtoserveError
from protoserve_client.types import (
    ChatMessage,
    Choice,
    ChoiceFinish,
    ContextPolicy,
    FinishReason,
    GenerateResult,
    Health,
    ModelInfo,
    PositionLogprobs,
    RequestStats,
    SamplingKwargs,
    StreamDelta,
    StreamEvent,
    StreamFinal,
    TokenizeResult,
    TokenLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncGenerateStream",
    "ChatMessage",
    "Choice",
    "ChoiceFinish",
    "Client",
    "ContextPolicy",
    "FieldViolation",
    "FinishReason",
    "GenerateKwargs",
    "GenerateResult",
    "GenerateStream",
    "Health",
    "Message",
    "Metadata",
    "ModelInfo",
    "PositionLogprobs",
    "ProtoserveError",
    "RequestStats",
    "SamplingKwargs",
    "StreamDelta",
    "StreamEvent",
    "StreamFinal",
    "TokenLogprob",
    "TokenizeResult",
    "Usage",
    "generate_request",
    "sampling_params",
]
