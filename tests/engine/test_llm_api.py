"""LLM.generate, the synchronous API: ``max_tokens`` as everywhere else, sampling given one way."""

from __future__ import annotations

import pytest

from protoserve.engine.llm import LLM
from protoserve.engine.request import FinishReason
from protoserve.engine.sampling.sampling_params import SamplingParams

PROMPT = list(range(10, 30))


def test_max_tokens_is_a_sampling_field(make_engine):
    [done] = LLM(engine=make_engine()).generate(prompt_token_ids=PROMPT, max_tokens=3, ignore_eos=True)
    [choice] = done.choices
    assert len(choice.token_ids) == 3 and choice.finish_reason == FinishReason.LENGTH


def test_a_sampling_object_keeps_its_own_max_tokens(make_engine):
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    [done] = LLM(engine=make_engine()).generate(prompt_token_ids=PROMPT, sampling=sampling)
    assert len(done.choices[0].token_ids) == 5


def test_sampling_and_fields_together_are_refused(make_engine):
    with pytest.raises(ValueError, match="not both.*max_tokens"):
        LLM(engine=make_engine()).generate(prompt_token_ids=PROMPT, sampling=SamplingParams(), max_tokens=4)
    with pytest.raises(TypeError):
        LLM(engine=make_engine()).generate(prompt_token_ids=PROMPT, max_new_tokens=4)
