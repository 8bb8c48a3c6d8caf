"""Printing results: a human table grouped by section, and one JSON line per figure."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from bench.figures import Figure

HEADERS = ("figure", "value", "unit", "x transformers", "target", "status", "details")
NOTE_WIDTH = 160  # the JSON line keeps the whole reason


def format_value(value: float | None) -> str:
    """Three significant digits for small numbers, whole numbers from 100 up; '-' for none."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def format_details(details: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in details.items())


def status(figure: Figure) -> str:
    if figure.value is None:
        return "skipped"
    if figure.met is None:
        return ""
    return "met" if figure.met else "NOT MET"


def table_rows(figures: Sequence[Figure]) -> list[tuple[str, ...]]:
    rows = []
    for f in figures:
        ratio = "" if f.ratio_to_transformers is None else f"{f.ratio_to_transformers:.2f}x"
        target = f.target.describe() if f.target is not None else ""
        note = f.note.removeprefix("skipped: ")
        if len(note) > NOTE_WIDTH:
            note = note[: NOTE_WIDTH - 3] + "..."
        details = " ".join(part for part in (format_details(f.details), note) if part)
        rows.append((f.name, format_value(f.value), f.unit, ratio, target, status(f), details))
    return rows


def format_table(figures: Iterable[Figure]) -> str:
    """A fixed-width table, one block per section in first-seen order; the last column is not padded."""
    figures = list(figures)
    sections: dict[str, list[Figure]] = {}
    for f in figures:
        sections.setdefault(f.section, []).append(f)
    all_rows = table_rows(figures)
    widths = [
        max(len(h), *(len(r[i]) for r in all_rows)) if all_rows else len(h) for i, h in enumerate(HEADERS)
    ]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if i in (1, 3) else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells[:-1], widths, strict=False))
        ]
        return "  ".join([*padded, cells[-1]]).rstrip()

    out = [line(HEADERS), line(["-" * w for w in widths])]
    for name, members in sections.items():
        out.append(f"[{name}]")
        out.extend(line(row) for row in table_rows(members))
    return "\n".join(out)


def json_lines(figures: Iterable[Figure]) -> list[str]:
    """One compact JSON object per figure (the machine-readable output)."""
    return [json.dumps(f.to_json(), separators=(",", ":"), sort_keys=False) for f in figures]
