"""bench/sections/host_loop.py and bench/stand_in_forward.py: the stand-in logits drive a real engine over
the default model's tokenizer, a tiny run reports every phase, and the 64-row figure carries the issue's
target, reported (not hidden) when missed."""

from __future__ import annotations

import pytest

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.resources import Variant
from bench.run import SECTIONS
from bench.sections import host_loop
from bench.stand_in_forward import PHASES, PhaseTimes

TINY = host_loop.HostLoopSizes((1, 3), 4)


@pytest.fixture(scope="module")
def loaded():
    from protoserve.engine.runtime import load_model

    return load_model(None, dtype="float32", quantization="none", progress=False)


def test_registered() -> None:
    assert SECTIONS["host_loop"] is host_loop.steps
    [step] = host_loop.steps(BenchContext(PROFILES["smoke"]))
    assert step.expects == tuple(host_loop.figure_names((1, 4)))


def test_the_engine_emits_the_stand_in_logits_peaks_as_text(loaded) -> None:
    from protoserve.engine.api import SamplingParams, TokenizedRequest

    engine, model = host_loop.make_engine(loaded, Variant(), TINY)
    engine.add_request(TokenizedRequest(request_id="r", prompt_token_ids=[1000 + i for i in range(8)],
                                        sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    tokens, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            tokens += [t for d in out.deltas for t in d.token_ids]
            text += "".join(d.text for d in out.deltas)
    # Call k's logits (the prefill's first) peak row 0 on its own token: greedy takes exactly those.
    assert tokens == [model.expected_token(k, 0) for k in range(6)]
    assert len(set(tokens)) > 1
    assert text == loaded.tokenizer.decode(tokens, skip_special_tokens=True) and text


def test_a_tiny_run_times_every_phase_and_leaves_the_engine_empty(loaded) -> None:
    engine, model = host_loop.make_engine(loaded, Variant(), TINY)
    times = host_loop.measure(engine, model, 3, TINY.steps)
    assert len(times.steps) == TINY.steps
    for step in times.steps:
        assert step["total"] > 0 and step["block_tables"] > 0 and step["sampling"] > 0
        assert sum(step[p] for p in PHASES) == pytest.approx(step["total"])
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    figures = host_loop.figures_of(3, times)
    assert [(f.name, f.unit) for f in figures] == host_loop.figure_names((3,))
    assert all(f.value is not None and f.value > 0 for f in figures if not f.name.endswith(".other.3"))
    assert figures[0].details["steps"] == TINY.steps


def test_the_64_row_step_carries_the_target_met_or_not() -> None:
    def times(seconds: float) -> PhaseTimes:
        return PhaseTimes([{**{p: seconds / len(PHASES) for p in PHASES}, "total": seconds}] * 3)

    slow, fast = host_loop.figures_of(64, times(0.002))[0], host_loop.figures_of(64, times(0.0005))[0]
    assert slow.name == "host_loop.step.64" and slow.value == pytest.approx(2.0)
    assert slow.target is not None and slow.target.describe() == "<= 1"
    assert slow.met is False and fast.met is True
    assert host_loop.figures_of(16, times(0.002))[0].target is None
