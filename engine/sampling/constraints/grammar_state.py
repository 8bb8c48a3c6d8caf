"""Where a constrained choice stands after each token it takes: its matcher fed, or found failed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from llguidance import LLMatcher

GrammarState = Literal["open", "complete", "failed"]  # "complete": only EOS may follow


def advance_grammar(matcher: LLMatcher, token: int, consume: bool) -> GrammarState:
    """Feed the matcher the token, unless ``consume`` is false (a stop token, which ends the choice
    and is no part of the grammar's output)."""
    # A matcher that failed while computing this step's mask left only EOS allowed: that EOS is
    # the grammar engine's failure, not the end of an output that satisfies the constraint.
    if matcher.is_error() or (consume and not matcher.consume_token(token)):
        return "failed"
    return "complete" if consume and matcher.is_stopped() else "open"
