"""The multi-model bench section's pure parts: its step, the overlap window and its figures.

No model: the section itself runs in ``make bench`` (``--only multi_model``).
"""

from __future__ import annotations

import pytest

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import multi_model
from bench.timeline import RequestTimeline


def timeline(first: float, tokens: int, gap: float) -> RequestTimeline:
    t = RequestTimeline(0.0)
    for k in range(tokens):
        t.add_chunk(first + k * gap, 1)
    t.finish(first + (tokens - 1) * gap)
    return t


def test_registered_serving_both_models_in_one_server():
    assert SECTIONS["multi_model"] is multi_model.steps
    [step] = multi_model.steps(BenchContext(PROFILES["default"]))
    assert step.resource.args == ("--model", "smollm2-135m-instruct", "--model", "gemma3-270m",
                                  "--no-embedding-model")
    assert ("multi_model.gemma3.itl_p99_ratio", "x") in step.expects
    assert multi_model.RATIO_TARGET.met(2.0) and not multi_model.RATIO_TARGET.met(2.01)


def test_overlap_counts_only_tokens_made_while_both_models_generate():
    # a: tokens at 0..9; b: at 5..14. Both generate from 5 to 9: a makes 5 tokens there, b 5.
    shares = multi_model.overlap_tokens({"a": [timeline(0, 10, 1)], "b": [timeline(5, 10, 1)]})
    assert shares == {"a": 5, "b": 5}
    # b twice as fast over the same window: twice a's tokens.
    shares = multi_model.overlap_tokens({"a": [timeline(0, 11, 1)], "b": [timeline(0, 21, 0.5)]})
    assert shares == {"a": 11, "b": 21}


def test_figures_give_each_models_ratio_and_share():
    sizes = multi_model.Sizes(streams=1, max_tokens=5, rounds=1)
    runs = {
        "smollm2-135m-instruct": {"alone": [[timeline(0, 5, 0.125)]], "both": [[timeline(0, 5, 0.25)]]},
        "gemma3-270m": {"alone": [[timeline(0, 5, 0.125)]], "both": [[timeline(0, 5, 0.125)]]},
    }
    figures = {f.name: f.value for f in multi_model.multi_model_figures(runs, sizes)}
    assert figures["multi_model.smollm2.itl_p99_ratio"] == pytest.approx(2.0)
    assert figures["multi_model.gemma3.itl_p99_ratio"] == pytest.approx(1.0)
    # Both generate over [0, 0.5]: smollm2 makes 3 tokens there (0, .25, .5), gemma3 all 5.
    assert figures["multi_model.smollm2.token_share.both"] == pytest.approx(3 / 8)
