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
from google.protobuf.message import Message

from protoserve.engine.api import CompletionDelta, RequestOutput
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.models.served_model import ServedModel
from protoserve.server.security.auth import Identity
from protoserve.server.services.openai.outputs import usage
from protoserve.server.services.openai.preparation import PreparedRequest
from protoserve.server.services.openai.streaming import EngineRunner, Generation
from protoserve.server.services.openai.translation import Violations, stream_field_violations


@dataclass(frozen=True)
class Reply:
    """One of a surface's reply messages: its proto type and the ``object`` string it carries."""

    type: type[Message]
    object: str


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

    id_prefix: str  # of the response id: ``{id_prefix}-…``
    response: Reply  # the unary response
    chunk: Reply  # a streamed chunk

    def __init__(self, models: ModelRegistry, runner: EngineRunner) -> None:
        self.models = models
        self.runner = runner

    async def prepare(self, req: Any, *, streaming: bool) -> PreparedRequest:
        """The validated request (``streaming`` False refuses stream-only fields)."""
        served, adapter = self.models.resolve(req.model)
        return await self.validate(req, served, adapter, stream_field_violations(req, streaming))

    @abstractmethod
    async def validate(
        self, req: Any, served: ServedModel, adapter: str | None, violations: Violations
    ) -> PreparedRequest:
        """``req`` checked for ``served`` (``adapter``: the LoRA adapter its ``model`` named), after
        ``violations`` already found; INVALID_ARGUMENT naming them all when there are any."""

    @abstractmethod
    def choices(self, generation: Generation) -> list[Any]:
        """The unary response's choices of a finished generation."""

    @abstractmethod
    def choice_stream(self, prepared: PreparedRequest) -> ChoiceStream:
        """The choices one stream of ``prepared`` writes."""

    async def create(self, request: Any, context: grpc.aio.ServicerContext, identity: Identity) -> Any:
        """Validate a unary request, run it to its end and answer with every choice."""
        prepared = await self.prepare(request, streaming=False)
        generation = await self.runner.complete(context, identity, prepared, self.id_prefix)
        return self.response.type(
            object=self.response.object,
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
        generation = Generation.start(prepared, self.id_prefix)
        stream = self.choice_stream(prepared)
        envelope = generation.envelope()

        def chunk_of(choices: list[Any], totals: oa.Usage | None = None) -> Any:
            return self.chunk.type(object=self.chunk.object, choices=choices, usage=totals, **envelope)

        started = False

        async def write(index: int, output: RequestOutput) -> None:
            nonlocal started
            if not started:
                started = True
                for choice in stream.opening():
                    await context.write(chunk_of([choice]))
            for delta in output.deltas:
                for choice in stream.choices(index, delta):
                    await context.write(chunk_of([choice]))

        await self.runner.run(context, identity, generation, write)
        if inner.stream_options.include_usage:
            await context.write(chunk_of([], usage(generation.results)))
