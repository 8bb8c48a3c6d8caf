"""The families bench section: registered, and at its smoke size each tiny random family served by the
engine passes the correctness check against transformers, with its speed figures labelled smoke
(the section itself runs in ``make bench``, ``--only families``)."""

from __future__ import annotations

import pytest

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import families


def test_registered_with_its_figures():
    assert SECTIONS["families"] is families.steps
    steps = families.steps(BenchContext(PROFILES["default"]))
    assert [s.expects for s in steps] == [
        ((f"families.{f}.prefill", "tok/s"), (f"families.{f}.decode", "tok/s"), (f"families.{f}.correct", "pass"))
        for f in ("gemma2", "phi3", "deepseek_v3")
    ]
    assert families.CORRECT_TARGET.met(1.0) and not families.CORRECT_TARGET.met(0.0)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_smoke_run_passes_the_correctness_check(family):
    [step] = [s for s in families.steps(BenchContext(PROFILES["smoke"])) if s.expects[0][0] == f"families.{family}.prefill"]
    prefill, decode, correct = step.run(None)  # the resource goes unused
    assert prefill.value > 0 and decode.value > 0
    assert "smoke" in prefill.note and prefill.target is None and decode.target is None
    assert correct.details["greedy_tokens_equal"] is True
    assert correct.details["max_logit_error"] < families.MAX_LOGIT_ERROR
    assert correct.value == 1.0 and correct.met
    assert prefill.details["prompt_len"] > 48  # Phi-3 past its original context


def test_a_wrong_model_fails_the_check(tmp_path, monkeypatch):
    """The check can fail: with Gemma 2's attention soft-cap switched off in the served model, the
    logits leave transformers' and the section reports 0."""
    from protoserve.engine.runtime import load_model as real_load

    def uncapped(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        loaded.model.config.attn_logit_softcapping = None
        return loaded

    monkeypatch.setattr("protoserve.engine.runtime.load_model", uncapped)
    sizes = families.SIZES["smoke"]
    result = families.measure("gemma2", sizes, tmp_path)
    assert result.max_logit_error > 1e-2 and not result.correct
    [_, _, correct] = families.figures("gemma2", result, sizes)
    assert correct.value == 0.0 and correct.met is False
