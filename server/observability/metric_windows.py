"""Recent-history windows behind the MetricsService snapshot: latency percentiles and token rates.

Prometheus histograms are for scrapers, which compute quantiles themselves; the
snapshot API answers p50/p90/p99 directly, so each latency also keeps its
latest observations here, and token counts are bucketed per second for
"tokens per second over the last minute".
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_WINDOW_SIZE = 4096


@dataclass(frozen=True)
class LatencyStats:
    """Count and mean over every observation; percentiles over the latest ones."""

    count: int = 0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    mean: float = 0.0


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile (0-100) of sorted values, by the nearest-rank method."""
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class LatencyWindow:
    """The latest ``size`` observations of one latency, plus all-time count and sum."""

    def __init__(self, size: int = DEFAULT_WINDOW_SIZE) -> None:
        self._recent: deque[float] = deque(maxlen=size)
        self._count = 0
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._recent.append(seconds)
            self._count += 1
            self._sum += seconds

    def stats(self) -> LatencyStats:
        with self._lock:
            ordered = sorted(self._recent)
            count, total = self._count, self._sum
        if not count:
            return LatencyStats()
        return LatencyStats(
            count=count,
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            mean=total / count,
        )


class RateWindow:
    """Amounts per second over the last ``window_s`` seconds, in one-second buckets.

    While the window is younger than ``window_s`` (the server just started) the
    rate is over the time it has existed, so early rates are not diluted.
    """

    def __init__(self, window_s: int = 60, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._created = clock()
        self._buckets: deque[list[float]] = deque()  # [second, amount], oldest first
        self._lock = threading.Lock()

    def add(self, amount: float) -> None:
        second = math.floor(self._clock())
        with self._lock:
            if self._buckets and self._buckets[-1][0] == second:
                self._buckets[-1][1] += amount
            else:
                self._buckets.append([second, amount])
            self._expire(second)

    def rate(self) -> float:
        now = self._clock()
        with self._lock:
            self._expire(math.floor(now))
            total = sum(amount for _, amount in self._buckets)
        span = min(float(self.window_s), max(now - self._created, 1.0))
        return total / span

    def _expire(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - self.window_s:
            self._buckets.popleft()
