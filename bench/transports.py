"""Transports: one streamed request through each path the harness compares.

Every transport fills a RequestTimeline the same way: ``sent`` just before the
request leaves, one chunk per streamed message that carries tokens, ``finish``
after the last message. All requests are greedy with EOS ignored, so every
path generates exactly ``max_tokens`` tokens.

- ``engine``: AsyncEngine in this process (no RPC at all): the ceiling.
- ``grpc``: InferenceService.GenerateStream over one shared loopback channel.
- ``sse``: the REST gateway's ``/v1/generate:stream`` (the same RPC behind HTTP/SSE).
- ``openai-sse``: the gateway's OpenAI ``/v1/completions`` with ``stream: true``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from bench.sse_client import SseClient, SseResponse
from bench.timeline import RequestTimeline
from bench.workload import RequestSpec

if TYPE_CHECKING:
    import grpc

    from protoserve.engine.runtime import AsyncEngine

REQUEST_TIMEOUT_S = 300.0  # per request: generous, a loaded 2-core box can queue for a long time
_ids = itertools.count()


class Transport(Protocol):
    """Streams one request and records its timeline; never raises for a failed request."""

    name: str

    async def stream(self, spec: RequestSpec) -> RequestTimeline: ...

    async def close(self) -> None: ...


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


class EngineTransport:
    """AsyncEngine.generate in this process."""

    name = "engine"

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def stream(self, spec: RequestSpec) -> RequestTimeline:
        from protoserve.engine.api import SamplingParams, TokenizedRequest

        request = TokenizedRequest(
            request_id=f"bench-{next(_ids)}",
            prompt_token_ids=list(spec.prompt_token_ids),
            sampling=SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True),
        )
        timeline = RequestTimeline(sent=time.perf_counter(), prompt_tokens=spec.prompt_len)
        try:
            async for output in self.engine.generate(request):
                timeline.add_chunk(time.perf_counter(), sum(len(d.token_ids) for d in output.deltas))
            timeline.finish(time.perf_counter())
        except Exception as exc:  # noqa: BLE001 - a failed request is a counted error, not a crash
            timeline.fail(time.perf_counter(), _error(exc))
        return timeline

    async def close(self) -> None:
        """The engine belongs to the caller."""


class GrpcTransport:
    """InferenceService.GenerateStream; one channel for all concurrent calls, as a client library would.

    ``model``: the served model the requests name ("": the server's default)."""

    name = "grpc"

    def __init__(self, target: str, model: str = "") -> None:
        self.target = target
        self.model = model
        self.channel: grpc.aio.Channel | None = None
        self.stub: Any = None

    def _connect(self) -> None:
        """Open the channel on first use: a grpc.aio channel belongs to the loop it was made in."""
        import grpc

        from protoserve.v1 import inference_pb2_grpc

        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)

    async def stream(self, spec: RequestSpec) -> RequestTimeline:
        from protoserve.v1 import inference_pb2 as pb

        if self.channel is None:
            self._connect()

        request = pb.GenerateStreamRequest(
            request=pb.GenerateRequest(
                model=self.model,
                token_ids=pb.TokenIds(ids=spec.prompt_token_ids),
                sampling=pb.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True),
            )
        )
        timeline = RequestTimeline(sent=time.perf_counter(), prompt_tokens=spec.prompt_len)
        try:
            call = self.stub.GenerateStream(request, timeout=REQUEST_TIMEOUT_S)
            async for message in call:
                if message.HasField("delta"):
                    timeline.add_chunk(time.perf_counter(), len(message.delta.token_ids))
            timeline.finish(time.perf_counter())
        except Exception as exc:  # noqa: BLE001
            timeline.fail(time.perf_counter(), _error(exc))
        return timeline

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


async def _failed_status(response: SseResponse) -> RuntimeError:
    text = (await response.body()).decode(errors="replace")
    return RuntimeError(f"HTTP {response.status}: {text[:200]}")


async def stream_sse(client: SseClient, path: str, body: Any, timeline: RequestTimeline,
                     on_event: Callable[[dict[str, Any]], None]) -> RequestTimeline:
    """POST ``body`` to ``path`` and hand each streamed event to ``on_event``; ``timeline`` finishes
    after the last event, or fails with the first error (an HTTP status, an error event, a dropped
    connection): a failed request is a counted error, never raised."""
    try:
        async with client.post(path, body) as response:
            if response.status != 200:
                raise await _failed_status(response)
            async for event in response.events():
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                on_event(event)
        timeline.finish(time.perf_counter())
    except Exception as exc:  # noqa: BLE001
        timeline.fail(time.perf_counter(), _error(exc))
    return timeline


class GatewaySseTransport:
    """The gateway's native ``POST /v1/generate:stream``: GenerateStream as Server-Sent Events."""

    name = "sse"

    def __init__(self, base_url: str, concurrency: int) -> None:
        self.client = SseClient(base_url, concurrency)

    async def stream(self, spec: RequestSpec) -> RequestTimeline:
        body = {
            "token_ids": {"ids": list(spec.prompt_token_ids)},
            "sampling": {"max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        timeline = RequestTimeline(sent=time.perf_counter(), prompt_tokens=spec.prompt_len)

        def on_event(event: dict[str, Any]) -> None:
            if "delta" in event:
                timeline.add_chunk(time.perf_counter(), len(event["delta"].get("token_ids", [])))

        return await stream_sse(self.client, "/v1/generate:stream", body, timeline, on_event)

    async def close(self) -> None:
        await self.client.aclose()


class OpenAiSseTransport:
    """The gateway's OpenAI ``POST /v1/completions`` with ``stream: true`` and a token-id prompt.

    Completion chunks carry text, not token ids, so each chunk with a choice
    counts as one token (the server sends one chunk per engine step) and the
    final usage chunk corrects the total if a step's chunk was held back.
    """

    name = "openai-sse"

    def __init__(self, base_url: str, concurrency: int, model: str) -> None:
        self.client = SseClient(base_url, concurrency)
        self.model = model

    async def stream(self, spec: RequestSpec) -> RequestTimeline:
        body = {
            "model": self.model,
            "prompt": list(spec.prompt_token_ids),
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        timeline = RequestTimeline(sent=time.perf_counter(), prompt_tokens=spec.prompt_len)

        def on_event(event: dict[str, Any]) -> None:
            if event.get("choices"):
                timeline.add_chunk(time.perf_counter(), 1)
            usage = event.get("usage")
            if usage:
                timeline.count_unseen(usage["completion_tokens"])

        return await stream_sse(self.client, "/v1/completions", body, timeline, on_event)

    async def close(self) -> None:
        await self.client.aclose()
