"""Admission: a TokenizedRequest checked against the engine and fitted to its context window.

Pure functions over plain values, so any thread may run them (the server prepares requests off
the step's thread) and tests can call them without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from protoserve.engine.errors import ContextLengthError
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import ContextPolicy

if TYPE_CHECKING:
    from protoserve.engine.sampling.constraints.compiler import CompiledGrammar


@dataclass(frozen=True)
class FittedPrompt:
    """A prompt as its context policy leaves it within the window."""

    prompt_token_ids: list[int]
    truncated: int  # tokens cut from the prompt
    max_len: int  # total tokens (prompt + generated) at which each choice stops with "length"


@dataclass
class AdmittedRequest:
    """A TokenizedRequest admitted to the queue: validated, its prompt as its context policy leaves it,
    its constraint compiled."""

    request: TokenizedRequest
    fitted: FittedPrompt
    grammar: CompiledGrammar | None = None  # the compiled constraint, when the request has one


def prompt_problems(prompt: list[int], vocab_size: int) -> list[tuple[str, str]]:
    if not prompt:
        return [("prompt_token_ids", "must not be empty")]
    if any(not 0 <= t < vocab_size for t in prompt):
        return [("prompt_token_ids", f"token ids must be in [0, {vocab_size})")]
    return []


def fit_to_context(prompt: list[int], policy: ContextPolicy, limit: int, max_tokens: int | None) -> FittedPrompt:
    """Apply ``policy`` to a prompt for a context window of ``limit`` tokens; ContextLengthError when it
    refuses (REJECT, or a prompt that leaves no room to generate)."""
    length = len(prompt)
    keep = length
    if policy in (ContextPolicy.ALLOW_CONTEXT_STOP, ContextPolicy.REJECT) and length >= limit:
        raise ContextLengthError(length, limit, f"the prompt has {length} tokens but the context window "
                                 f"(max_model_len) is {limit} tokens, which leaves no room to generate")
    if policy == ContextPolicy.REJECT and max_tokens is not None and length + max_tokens > limit:
        raise ContextLengthError(length + max_tokens, limit, f"the prompt ({length} tokens) plus max_tokens "
                                 f"({max_tokens}) is {length + max_tokens} tokens, more than the context "
                                 f"window (max_model_len) of {limit} tokens")
    if policy in (ContextPolicy.TRUNCATE_LEFT, ContextPolicy.TRUNCATE_RIGHT):
        keep = min(length, limit - 1)  # leave room for at least one generated token
    if policy == ContextPolicy.RESERVE_GENERATION:
        reserve = max_tokens if max_tokens is not None else 1
        if reserve >= limit:
            raise ContextLengthError(reserve, limit, f"max_tokens ({reserve}) leaves no room for a prompt in "
                                     f"the context window (max_model_len) of {limit} tokens")
        keep = min(length, limit - reserve)
    kept = prompt[:keep] if policy == ContextPolicy.TRUNCATE_RIGHT else prompt[length - keep :]
    max_len = limit if max_tokens is None else min(limit, keep + max_tokens)
    return FittedPrompt(kept, length - keep, max_len)
