"""fit_to_context: each context policy on a prompt that fits and one that does not, without an engine."""

from __future__ import annotations

import pytest

from protoserve.engine.errors import ContextLengthError
from protoserve.engine.sampling.sampling_params import ContextPolicy
from protoserve.engine.scheduling.admission import fit_to_context, prompt_problems

PROMPT = list(range(10))


@pytest.mark.parametrize(("policy", "limit", "max_tokens", "kept", "max_len"), [
    (ContextPolicy.ALLOW_CONTEXT_STOP, 16, 20, PROMPT, 16),  # generation stops at the window
    (ContextPolicy.REJECT, 16, 6, PROMPT, 16),
    (ContextPolicy.TRUNCATE_LEFT, 8, None, PROMPT[3:], 8),  # one token of room kept
    (ContextPolicy.TRUNCATE_RIGHT, 8, 4, PROMPT[:7], 8),
    (ContextPolicy.RESERVE_GENERATION, 8, 3, PROMPT[5:], 8),  # room for all of max_tokens
])
def test_each_policy_fits_the_prompt(policy, limit, max_tokens, kept, max_len):
    fitted = fit_to_context(PROMPT, policy, limit, max_tokens)
    assert (fitted.prompt_token_ids, fitted.truncated, fitted.max_len) == (kept, len(PROMPT) - len(kept), max_len)


@pytest.mark.parametrize(("policy", "limit", "max_tokens"), [
    (ContextPolicy.ALLOW_CONTEXT_STOP, 10, None),  # no room to generate
    (ContextPolicy.REJECT, 15, 6),  # prompt + max_tokens over the window
    (ContextPolicy.RESERVE_GENERATION, 8, 8),  # max_tokens leaves no room for a prompt
])
def test_refusals_are_context_length_errors(policy, limit, max_tokens):
    with pytest.raises(ContextLengthError):
        fit_to_context(PROMPT, policy, limit, max_tokens)


def test_prompt_problems_name_the_field():
    assert prompt_problems([], 100) == [("prompt_token_ids", "must not be empty")]
    assert prompt_problems([5, 100], 100) == [("prompt_token_ids", "token ids must be in [0, 100)")]
    assert prompt_problems([5, 99], 100) == []
