"""The constrained-decoding bench section's pure parts: its figures, and how it pools rounds.

No model: the section itself runs in ``make bench`` (``--only constrained``).
"""

from __future__ import annotations

import json

import pytest

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import constrained
from bench.timeline import RequestTimeline
from protoserve.engine.sampling.constraints.constraint import Constraint


def timeline(sent: float, first: float, tokens: int, gap: float) -> RequestTimeline:
    t = RequestTimeline(sent)
    for k in range(tokens):
        t.add_chunk(first + k * gap, 1)
    t.finish(first + (tokens - 1) * gap)
    return t


def test_registered_with_its_figures_and_the_issue_target():
    assert SECTIONS["constrained"] is constrained.steps
    steps = constrained.steps(BenchContext(PROFILES["default"]))
    names = [name for step in steps for name, _ in step.expects]
    assert names == ["constrained.compile.first", "constrained.compile.cached",
                     "constrained.engine.json.c1", "constrained.engine.plain.c1", "constrained.ratio.c1",
                     "constrained.engine.json.c16", "constrained.engine.plain.c16", "constrained.ratio.c16",
                     "constrained.ff.json.c1", "constrained.ff.stepwise.c1", "constrained.ff.plain.c1",
                     "constrained.ff.ratio.c1"]
    assert constrained.RATIO_TARGET.met(0.9) and not constrained.RATIO_TARGET.met(0.89)
    assert constrained.FF_TARGET.met(1.2) and not constrained.FF_TARGET.met(1.19)


def test_c1_pools_decode_time_after_each_first_token_and_c16_wall_time():
    runs = [timeline(0.0, 1.0, 11, 0.1), timeline(5.0, 5.5, 6, 0.2)]
    c1 = constrained.Pooled()
    c1.add(runs, 1)
    assert (c1.tokens, c1.seconds) == (15, pytest.approx(2.0))  # prefill and the waits between are nobody's
    c16 = constrained.Pooled()
    c16.add(runs, 16)
    assert (c16.tokens, c16.seconds) == (17, pytest.approx(6.5))


@pytest.mark.parametrize("schema", constrained.BENCH_SCHEMAS + constrained.HEAVY_SCHEMAS)
def test_bench_schemas_are_well_formed_constraints(schema):
    assert Constraint.json_schema(json.dumps(schema)).validate() == []
