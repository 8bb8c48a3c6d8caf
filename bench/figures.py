"""Figure: one measured (or skipped) number of the benchmark, with its baseline and target.

A figure names its transformers baseline (another figure of the same run)
instead of holding a ratio: ratios are resolved once every figure exists
(``resolve``), so a section may be measured in any order and a missing
baseline leaves the ratio empty instead of failing the run.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Better = Literal["higher", "lower"]


@dataclass(frozen=True)
class Target:
    """A goal for one figure: ``value >= threshold`` (higher is better) or ``value <= threshold``."""

    threshold: float
    better: Better

    def met(self, value: float) -> bool:
        compare = operator.ge if self.better == "higher" else operator.le
        return compare(value, self.threshold)

    def describe(self) -> str:
        return f"{'>=' if self.better == 'higher' else '<='} {self.threshold:g}"


@dataclass(frozen=True)
class Figure:
    """One line of the report.

    ``value`` is None when the measurement was skipped or failed; ``note`` says
    why. ``baseline`` is the name of the figure this one is compared with
    (a transformers figure), ``better`` says which direction wins, and
    ``details`` holds secondary metrics (percentiles, counts) printed beside it.
    """

    name: str
    value: float | None
    unit: str
    section: str
    better: Better = "higher"
    baseline: str | None = None
    ratio_to_transformers: float | None = None
    target: Target | None = None
    details: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def met(self) -> bool | None:
        """Whether the target is met; None without a target or a value."""
        if self.target is None or self.value is None:
            return None
        return self.target.met(self.value)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this figure: the fixed keys first, then its details."""
        out: dict[str, Any] = {
            "figure": self.name,
            "value": None if self.value is None else round(self.value, 4),
            "unit": self.unit,
            "ratio_to_transformers": None
            if self.ratio_to_transformers is None
            else round(self.ratio_to_transformers, 3),
            "section": self.section,
            "better": self.better,
            "baseline": self.baseline,
            "target": self.target.describe() if self.target is not None else None,
            "met": self.met,
        }
        if self.note:
            out["note"] = self.note
        for key, value in self.details.items():
            out.setdefault(key, value)
        return out


def skipped(name: str, unit: str, section: str, reason: str) -> Figure:
    """A figure that could not be measured: kept in the report so its absence is visible."""
    return Figure(name=name, value=None, unit=unit, section=section, note=f"skipped: {reason}")


def speedup(value: float, baseline: float, better: Better) -> float | None:
    """How many times better ``value`` is than ``baseline``: > 1 means protoserve wins.

    Throughputs divide ours by theirs; latencies divide theirs by ours, so the
    ratio always reads the same way.
    """
    if value <= 0 or baseline <= 0:
        return None
    return value / baseline if better == "higher" else baseline / value


def resolve(figures: Iterable[Figure], targets: dict[str, Target]) -> list[Figure]:
    """Attach targets by name and compute every ratio to its transformers baseline."""
    figures = list(figures)
    by_name = {f.name: f for f in figures}
    out = []
    for f in figures:
        base = by_name.get(f.baseline) if f.baseline else None
        ratio = None
        if f.value is not None and base is not None and base.value is not None:
            ratio = speedup(f.value, base.value, f.better)
        out.append(replace(f, ratio_to_transformers=ratio, target=targets.get(f.name, f.target)))
    return out
