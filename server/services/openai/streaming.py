"""The engine run every generating surface shares, streamed or not.

:class:`EngineRunner` runs a prepared request's prompts under one in-flight call (cancel, deadline,
abort on disconnect) and hands each output to the surface as it comes, so any API's stream (OpenAI's
chunks in ``chunked``, or another API's events) is that surface's callback around the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from protoserve.engine.api import RequestOutput
from protoserve.server.calls.inflight import InflightRequests
from protoserve.server.models.served_model import CollectedOutput, new_request_id
from protoserve.server.security.auth import Identity
from protoserve.server.services.inference_service import call_deadline
from protoserve.server.services.openai.outputs import system_fingerprint
from protoserve.server.services.openai.preparation import PreparedRequest

T = TypeVar("T")
OnOutput = Callable[[int, RequestOutput], Awaitable[None]]  # an output and its prompt's index


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index.

    The first stream to fail fails the merge; leaving early cancels the rest.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None))
            queue.put_nowait((index, done, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Generation:
    """One response's run: its public id, ``created`` (unix seconds) and each prompt's collected output."""

    prepared: PreparedRequest
    public_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    results: list[CollectedOutput] = field(init=False)

    def __post_init__(self) -> None:
        self.results = [CollectedOutput(n=self.prepared.sampling.n) for _ in self.prepared.prompts]

    def envelope(self) -> dict[str, Any]:
        """The fields OpenAI's responses and chunks carry around their choices."""
        return {
            "id": self.public_id,
            "created": self.created,
            "model": self.prepared.model,
            "system_fingerprint": system_fingerprint(self.prepared.served),
        }

    @classmethod
    def start(cls, prepared: PreparedRequest, id_prefix: str) -> Generation:
        """A new response whose id is ``{id_prefix}-…`` (``cmpl``, ``chatcmpl``, …)."""
        return cls(prepared, new_request_id(id_prefix))


class EngineRunner:
    """Runs every prompt of a generation on the engine, concurrently, under one in-flight call."""

    def __init__(self, inflight: InflightRequests) -> None:
        self.inflight = inflight

    async def run(
        self,
        context: grpc.aio.ServicerContext,
        identity: Identity,
        generation: Generation,
        on_output: OnOutput | None = None,
    ) -> None:
        """Fold each output into ``generation.results`` and hand it to ``on_output``.

        ``on_output`` runs inside the call, so a write that fails (the client left) aborts the
        engine requests; its first call means the engine took the request (its refusals come
        before any output, as a plain error status).
        """
        prepared = generation.prepared
        requests = prepared.engine_requests(generation.public_id, identity)
        async with self.inflight.call(identity, generation.public_id, call_deadline(context)) as call:
            streams = [self.inflight.generate(call, prepared.served.engine, r) for r in requests]
            # Closed before leaving the call, so the tasks reading several prompts are gone
            # before the call closes their streams.
            async with contextlib.aclosing(merge(streams)) as outputs:
                async for index, output in outputs:
                    generation.results[index].add(output)
                    if on_output is not None:
                        await on_output(index, output)

    async def complete(
        self, context: grpc.aio.ServicerContext, identity: Identity, prepared: PreparedRequest, id_prefix: str
    ) -> Generation:
        """Run a request to its end; the finished generation."""
        generation = Generation.start(prepared, id_prefix)
        await self.run(context, identity, generation)
        return generation
