"""A prompt sent as a user sends it: text to the OpenAI completions route, one new token, streamed.

Prefill as a user sees it: the server tokenizes the text, computes the prompt
and streams the first token. The prompt's length is what the server's usage
chunk reports, so the rate (prompt tokens / time to first token) does not
depend on guessing how the text tokenizes.
"""

from __future__ import annotations

import time
from typing import Any

from bench.peers.chat_workload import NONCE_WORDS, ChatPromptFactory
from bench.sse_client import SseClient
from bench.timeline import RequestTimeline
from bench.transports import stream_sse

COMPLETIONS_ROUTE = "/v1/completions"


def text_prompt(factory: ChatPromptFactory, tokens: int) -> str:
    """About ``tokens`` tokens of text: a nonce, then seeded words (one token each after the first)."""
    if tokens <= NONCE_WORDS:
        raise ValueError(f"a text prompt of {tokens} tokens leaves no room after the {NONCE_WORDS}-word nonce")
    body = " ".join(factory.rng.choice(factory.words) for _ in range(tokens - NONCE_WORDS - 1))
    return f"{factory.nonce()} {body}"


def prefill_rate(timeline: RequestTimeline) -> float | None:
    """Prompt tokens (as the server counted them) / time to first token; None for a failed request."""
    if not timeline.ok or not timeline.ttft or not timeline.prompt_tokens:
        return None
    return timeline.prompt_tokens / timeline.ttft


class TextPrefill:
    """``POST /v1/completions`` with a text prompt and ``max_tokens: 1`` to one server."""

    def __init__(self, base_url: str, model: str) -> None:
        self.client = SseClient(base_url, 1)
        self.model = model

    async def stream(self, prompt: str) -> RequestTimeline:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        timeline = RequestTimeline(sent=time.perf_counter())

        def on_event(event: dict[str, Any]) -> None:
            if event.get("choices") and not timeline.chunks:
                timeline.add_chunk(time.perf_counter(), 1)
            if event.get("usage"):
                timeline.prompt_tokens = int(event["usage"].get("prompt_tokens", 0))

        return await stream_sse(self.client, COMPLETIONS_ROUTE, body, timeline, on_event)

    async def close(self) -> None:
        await self.client.aclose()
