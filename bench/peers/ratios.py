"""Figures that set protoserve beside a peer: the ratio of two measured figures, or a skip with the reason."""

from __future__ import annotations

from bench.figures import Better, Figure, Target, skipped

RATIO_UNIT = "x"


def ratio_figure(
    name: str,
    section: str,
    ours: Figure,
    theirs: Figure,
    better: Better = "higher",
    target: Target | None = None,
) -> Figure:
    """``ours / theirs`` (for a latency too: read it with ``better``, below 1 wins there).

    Skipped, naming the missing side, when either figure has no value; the two values go in the
    details so the ratio can be checked from the line alone.
    """
    for side in (ours, theirs):
        if side.value is None:
            return skipped(name, RATIO_UNIT, section, f"{side.name} has no value ({side.note or 'skipped'})")
    if theirs.value == 0:
        return skipped(name, RATIO_UNIT, section, f"{theirs.name} is 0")
    return Figure(
        name=name,
        value=ours.value / theirs.value,
        unit=RATIO_UNIT,
        section=section,
        better=better,
        target=target,
        details={"ours": _short(ours.value), "theirs": _short(theirs.value), "of": f"{ours.name} / {theirs.name}"},
    )


def _short(value: float) -> float:
    return round(value, 4) if abs(value) < 10 else round(value, 1)
