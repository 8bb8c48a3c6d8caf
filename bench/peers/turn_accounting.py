"""Prompt tokens per turn: how many a server computed, how many were new, whether a prefix was recomputed.

Turn k's prompt is turn k-1's prompt, then the answer, the next user message
and the template around them: with a prefix cache the server should compute
only those new tokens. A turn **recomputed** its conversation's cached prefix
when the server took fewer tokens from its cache than the previous turn's
prompt less one KV block (``SLACK_TOKENS``: protoserve caches whole 16-token
blocks and must compute a prompt's last token; llama-server matches token by
token, so the slack only makes the check fair to both).

Both servers say what each turn took from the cache in its reply's
``usage.prompt_tokens_details.cached_tokens``; a turn whose reply does not say
is left out of these counts rather than counted as computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.peers.conversation_run import TurnRecord

SLACK_TOKENS = 16


@dataclass(frozen=True)
class TurnTokens:
    """One successful turn's prompt tokens: in all, from the cache, and new since the user's previous turn."""

    user: int
    turn: int
    prompt: int
    cached: int
    previous_prompt: int  # 0 for a first turn

    @property
    def new(self) -> int:
        return self.prompt - self.previous_prompt

    @property
    def computed(self) -> int:
        return self.prompt - self.cached

    @property
    def recomputed(self) -> bool:
        """A later turn that recomputed (more than a block of) what the previous turn left cached."""
        return self.turn > 1 and self.cached < self.previous_prompt - SLACK_TOKENS


def turn_tokens(records: Sequence[TurnRecord]) -> list[TurnTokens]:
    """Every successful turn of one run whose cached count is known, with its user's previous prompt."""
    turns = [(r.user, r.turn) for r in records]
    if len(set(turns)) != len(turns):
        raise ValueError("records of more than one run: a user's turn appears twice")
    previous: dict[int, int] = {}
    out = []
    for r in sorted(records, key=lambda r: (r.user, r.turn)):
        if not r.reply.timeline.ok:
            continue
        if r.reply.cached_tokens is not None:
            out.append(
                TurnTokens(r.user, r.turn, r.prompt_tokens, r.reply.cached_tokens, previous.get(r.user, 0))
            )
        previous[r.user] = r.prompt_tokens
    return out
