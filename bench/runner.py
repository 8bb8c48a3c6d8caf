"""Step and run_steps: group measurements by the resource they need, and never let one failure end the run.

Sections describe their measurements as Steps; the runner orders them so each
resource is loaded once (every engine variant, then transformers, then each
server), and turns a resource that will not load, or a step that raises, into
skipped figures with the reason, so a variant the build does not support
(say int4 on a CPU without the kernel) is a clear note rather than a crash.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.figures import Figure, skipped
from bench.report import format_value
from bench.resources import ResourceKey, acquire, collect, release

log = logging.getLogger("bench")


@dataclass(frozen=True)
class Step:
    """One measurement: what it needs, what it reports, and how to run it.

    ``expects`` lists the (figure name, unit) pairs the step reports, so the
    report can still show them (as skipped) when the step cannot run.
    """

    section: str
    resource: ResourceKey
    description: str
    run: Callable[[Any], list[Figure]]
    expects: tuple[tuple[str, str], ...] = ()

    def skipped(self, reason: str) -> list[Figure]:
        return [skipped(name, unit, self.section, reason) for name, unit in self.expects]


def order_steps(steps: Sequence[Step]) -> list[tuple[ResourceKey, list[Step]]]:
    """Steps grouped by resource; groups ordered by resource kind, then by first appearance."""
    groups: dict[ResourceKey, list[Step]] = {}
    for step in steps:
        groups.setdefault(step.resource, []).append(step)
    keys = sorted(groups, key=lambda k: (k.order, list(groups).index(k)))
    return [(key, groups[key]) for key in keys]


def short_reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def run_steps(steps: Sequence[Step], results_dir: Path, threads: int) -> list[Figure]:
    """Run every step, resource by resource; returns the figures in section order."""
    figures: list[Figure] = []
    for key, group in order_steps(steps):
        log.info("loading %s", key.describe())
        started = time.perf_counter()
        try:
            resource = acquire(key, results_dir, threads)
        except Exception as exc:  # noqa: BLE001 - reported as skipped figures
            log.warning("could not load %s: %s", key.describe(), short_reason(exc))
            log.debug("%s", traceback.format_exc())
            for step in group:
                figures.extend(step.skipped(f"{key.describe()} failed to load ({short_reason(exc)})"))
            continue
        log.info("loaded %s in %.1fs", key.describe(), time.perf_counter() - started)
        try:
            for step in group:
                log.info("measuring %s", step.description)
                started = time.perf_counter()
                try:
                    produced = step.run(resource)
                except Exception as exc:  # noqa: BLE001
                    log.warning("%s failed: %s", step.description, short_reason(exc))
                    log.debug("%s", traceback.format_exc())
                    produced = step.skipped(f"failed ({short_reason(exc)})")
                figures.extend(produced)
                log.info("  done in %.1fs", time.perf_counter() - started)
                # Each figure as soon as it exists: an interrupted long run still leaves its numbers in the log.
                for f in produced:
                    log.info(
                        "  %s = %s %s",
                        f.name,
                        format_value(f.value),
                        f.unit if f.value is not None else f.note,
                    )
        finally:
            release(key, resource)
            resource = None
            collect()
    section_order = list(dict.fromkeys(s.section for s in steps))
    return sorted(
        figures,
        key=lambda f: section_order.index(f.section) if f.section in section_order else len(section_order),
    )
