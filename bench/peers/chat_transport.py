"""ChatSseTransport: one streamed OpenAI chat completion, the same client for protoserve and llama-server.

Chat chunks carry text, not token ids. The first chunk of either server may be
a role-only delta sent before any token is computed, so only a chunk with
content counts as a token's arrival (TTFT is the first of those). A token that
renders as no text (a special token past the ignored EOS) sends no content, so
the final usage chunk's ``completion_tokens`` corrects the count, and its
``prompt_tokens`` records how long each server found the prompt.
"""

from __future__ import annotations

import time
from typing import Any

from bench.peers.chat_workload import ChatSpec
from bench.sse_client import SseClient
from bench.timeline import RequestTimeline
from bench.transports import stream_sse

CHAT_ROUTE = "/v1/chat/completions"


def content_of(event: dict[str, Any]) -> str:
    """The text a chat chunk carries ('' for a role-only, usage-only or finish chunk)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta") or {}
    return delta.get("content") or ""


def cached_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens the server took from its prefix cache, where it says (0 where it does not)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def apply_usage(timeline: RequestTimeline, usage: dict[str, Any]) -> None:
    """Set the prompt length and add tokens that arrived without text to the last chunk."""
    timeline.prompt_tokens = int(usage.get("prompt_tokens", timeline.prompt_tokens))
    timeline.count_unseen(int(usage.get("completion_tokens", 0)))


class ChatSseTransport:
    """``POST /v1/chat/completions`` with ``stream: true`` to one server."""

    def __init__(self, name: str, base_url: str, concurrency: int, model: str) -> None:
        self.name = name
        self.model = model
        self.client = SseClient(base_url, concurrency)
        # Prompt tokens served from a prefix cache over every request: the nonce should keep it at 0.
        self.cached_prompt_tokens = 0

    async def stream(self, spec: ChatSpec) -> RequestTimeline:
        timeline = RequestTimeline(sent=time.perf_counter())

        def on_event(event: dict[str, Any]) -> None:
            if content_of(event):
                timeline.add_chunk(time.perf_counter(), 1)
            if event.get("usage"):
                apply_usage(timeline, event["usage"])
                self.cached_prompt_tokens += cached_tokens(event["usage"])

        return await stream_sse(self.client, CHAT_ROUTE, spec.body(self.model), timeline, on_event)

    async def close(self) -> None:
        await self.client.aclose()
