"""LoadResult: the aggregate of one load run (many RequestTimelines at one concurrency)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.stats import LatencySummary
from bench.timeline import RequestTimeline


@dataclass(frozen=True)
class LoadResult:
    """Throughput, latency percentiles and errors of one load run.

    ``tokens_per_s`` is output tokens of the requests that succeeded divided by
    the wall time from the first send to the last completion: the aggregate
    rate a server sustains, not a per-request average.
    """

    requests: int
    errors: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft: LatencySummary | None  # seconds
    itl: LatencySummary | None  # seconds
    first_error: str | None = None

    @classmethod
    def of(cls, timelines: Sequence[RequestTimeline]) -> LoadResult:
        return cls.of_rounds([timelines])

    @classmethod
    def of_rounds(cls, rounds: Sequence[Sequence[RequestTimeline]]) -> LoadResult:
        """Several runs of the same load pooled: their tokens over the sum of their wall times,
        latency percentiles over every request (other paths' runs between them are not counted)."""
        timelines = [t for run in rounds for t in run]
        if not timelines:
            return cls(0, 0, 0, 0.0, 0.0, None, None)
        ok = [t for t in timelines if t.ok]
        failed = [t for t in timelines if not t.ok]
        wall = sum(_wall(run) for run in rounds if run)
        tokens = sum(t.output_tokens for t in ok)
        ttfts = [t.ttft for t in ok if t.ttft is not None]
        itls = [gap for t in ok for gap in t.inter_token_latencies()]
        return cls(
            requests=len(timelines),
            errors=len(failed),
            output_tokens=tokens,
            wall_s=wall,
            tokens_per_s=tokens / wall if wall > 0 else 0.0,
            ttft=LatencySummary.of(ttfts),
            itl=LatencySummary.of(itls),
            first_error=failed[0].error if failed else None,
        )

    def details(self) -> dict[str, float | int | str]:
        """Secondary metrics for the report: latencies in ms, counts, the first error if any."""
        out: dict[str, float | int | str] = {"requests": self.requests, "errors": self.errors}
        if self.ttft is not None:
            out["ttft_p50_ms"] = round(self.ttft.p50 * 1000, 1)
            out["ttft_p99_ms"] = round(self.ttft.p99 * 1000, 1)
        if self.itl is not None:
            out["itl_p50_ms"] = round(self.itl.p50 * 1000, 2)
            out["itl_p99_ms"] = round(self.itl.p99 * 1000, 2)
        if self.first_error:
            out["first_error"] = self.first_error[:200]
        return out


def _wall(timelines: Sequence[RequestTimeline]) -> float:
    """From the first send to the last completion of one run."""
    start = min(t.sent for t in timelines)
    return max((t.finished for t in timelines if t.finished is not None), default=start) - start
