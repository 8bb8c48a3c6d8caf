"""OpenAI's chunked surfaces (completions and chat completions): answered once, or streamed as chunks.

A stream is a chunk per opening choice once the engine has taken the request (chat's roles,
completions' echoed prompts), then a chunk per choice of each delta, then (with
``stream_options.include_usage``) a last chunk with no choices and the usage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from protoserve.engine.request import CompletionDelta, RequestOutput
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.security.auth import Identity
from protoserve.server.services.openai.outputs import usage
from protoserve.server.services.openai.preparation import PreparedRequest
from protoserve.server.services.openai.streaming import EngineRunner, Generation


@dataclass(frozen=True)
class ChunkShape:
    """What tells the completions and the chat completions responses apart around their choices."""

    id_prefix: str  # of the response id
    response_object: str  # the ``object`` of the unary response
    response_type: type[oa.CreateCompletionResponse] | type[oa.CreateChatCompletionResponse]
    chunk_object: str  # the ``object`` of a streamed chunk
    chunk_type: type[oa.CreateCompletionStreamResponse] | type[oa.CreateChatCompletionStreamResponse]


class ChoiceStream(Protocol):
    """A surface's choices in one stream, with whatever state they need from delta to delta."""

    def opening(self) -> Iterable[Any]:
        """The choices that go out once the engine has taken the request."""
        ...

    def choices(self, prompt_index: int, delta: CompletionDelta) -> Iterable[Any]:
        """The choices one delta of a prompt makes."""
        ...


class ChunkedSurface(ABC):
    """A surface's unary run and its stream; subclasses read their request and make their choices."""

    shape: ChunkShape

    def __init__(self, models: ModelRegistry, runner: EngineRunner) -> None:
        self.models = models
        self.runner = runner

    @abstractmethod
    async def prepare(self, req: Any, *, streaming: bool) -> PreparedRequest:
        """The validated request (``streaming`` False refuses stream-only fields)."""

    @abstractmethod
    def choices(self, generation: Generation) -> list[Any]:
        """The unary response's choices of a finished generation."""

    @abstractmethod
    def choice_stream(self, prepared: PreparedRequest) -> ChoiceStream:
        """The choices one stream of ``prepared`` writes."""

    async def create(self, request: Any, context: grpc.aio.ServicerContext, identity: Identity) -> Any:
        """Validate a unary request, run it to its end and answer with every choice."""
        prepared = await self.prepare(request, streaming=False)
        generation = await self.runner.complete(context, identity, prepared, self.shape.id_prefix)
        return self.shape.response_type(
            object=self.shape.response_object,
            choices=self.choices(generation),
            usage=usage(generation.results),
            **generation.envelope(),
        )

    async def create_stream(
        self, request: Any, context: grpc.aio.ServicerContext, identity: Identity
    ) -> None:
        """Validate a stream request's ``request`` and write its chunks."""
        inner = request.request
        prepared = await self.prepare(inner, streaming=True)
        generation = Generation.start(prepared, self.shape.id_prefix)
        stream = self.choice_stream(prepared)
        envelope = generation.envelope()

        def chunk(choices: list[Any], totals: oa.Usage | None = None) -> Any:
            return self.shape.chunk_type(
                object=self.shape.chunk_object, choices=choices, usage=totals, **envelope
            )

        started = False

        async def write(index: int, output: RequestOutput) -> None:
            nonlocal started
            if not started:
                started = True
                for choice in stream.opening():
                    await context.write(chunk([choice]))
            for delta in output.deltas:
                for choice in stream.choices(index, delta):
                    await context.write(chunk([choice]))

        await self.runner.run(context, identity, generation, write)
        if inner.stream_options.include_usage:
            await context.write(chunk([], usage(generation.results)))
