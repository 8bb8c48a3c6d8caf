"""Percentiles and latency summaries: the small amount of statistics the harness needs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's default).

    Interpolating, rather than picking the nearest rank, keeps p99 of a short
    run (a few dozen samples) from jumping straight to the maximum.
    Raises ValueError for an empty sequence or ``q`` outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    """The 50th percentile; the harness's summary of repeated measurements (robust to one slow run)."""
    return percentile(values, 50.0)


@dataclass(frozen=True)
class LatencySummary:
    """p50 / p99 / mean / max of a set of latency samples, in the samples' unit."""

    count: int
    p50: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> LatencySummary | None:
        """The summary, or None when there are no samples (e.g. every request failed)."""
        if not samples:
            return None
        return cls(
            count=len(samples),
            p50=percentile(samples, 50.0),
            p99=percentile(samples, 99.0),
            mean=sum(samples) / len(samples),
            max=max(samples),
        )


def significant(value: float, digits: int = 3) -> float:
    """``value`` rounded to ``digits`` significant digits (for secondary numbers in the report)."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))
