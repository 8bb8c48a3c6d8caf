"""RequestTimeline: when one streamed request was sent and when each of its tokens arrived.

Every path the harness measures (engine-direct, gRPC, gateway SSE,
transformers' streamer) fills one of these per request, so TTFT and
inter-token latency are computed by the same code everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTimeline:
    """Send time, then (arrival time, tokens in that chunk) per streamed chunk; seconds on one clock."""

    sent: float
    prompt_tokens: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)
    finished: float | None = None
    error: str | None = None

    def add_chunk(self, at: float, tokens: int) -> None:
        """Record a chunk; chunks without tokens (e.g. a text-only keep-alive) are ignored."""
        if tokens > 0:
            self.chunks.append((at, tokens))

    def count_unseen(self, total_tokens: int) -> None:
        """The server counted ``total_tokens`` but fewer arrived as chunks (tokens that render as no
        text): the rest join the last chunk."""
        missing = total_tokens - self.output_tokens
        if missing > 0 and self.chunks:
            at, tokens = self.chunks[-1]
            self.chunks[-1] = (at, tokens + missing)

    def finish(self, at: float) -> None:
        self.finished = at

    def fail(self, at: float, error: str) -> None:
        self.finished = at
        self.error = error

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None

    @property
    def output_tokens(self) -> int:
        return sum(tokens for _, tokens in self.chunks)

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first token, or None when no token arrived."""
        return self.chunks[0][0] - self.sent if self.chunks else None

    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive tokens after the first.

        A chunk of k tokens that arrived ``gap`` seconds after the previous one
        counts as k gaps of ``gap / k``: a transport that coalesces tokens is
        neither rewarded with zero-latency tokens nor punished with one long gap.
        """
        gaps: list[float] = []
        for (prev_at, _), (at, tokens) in zip(self.chunks, self.chunks[1:], strict=False):
            gaps.extend([(at - prev_at) / tokens] * tokens)
        return gaps

    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first divided by the time after the first (single-stream decode speed)."""
        if len(self.chunks) < 2:
            return None
        span = self.chunks[-1][0] - self.chunks[0][0]
        after_first = self.output_tokens - self.chunks[0][1]
        return after_first / span if span > 0 else None
