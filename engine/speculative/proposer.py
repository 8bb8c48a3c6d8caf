"""Proposers: the drafts of one decoding sequence for this step.

A proposer only suggests tokens; verification decides which the output keeps, so a
proposer changes speed, never output. The engine calls ``propose`` for each running
sequence that is about to decode its last sampled token and has speculation on.
"""

from __future__ import annotations

from typing import Protocol

from protoserve.engine.scheduling.sequence import Sequence
from protoserve.engine.speculative.ngram import propose_ngram
from protoserve.engine.speculative.params import SpeculativeParams


class Proposer(Protocol):
    def propose(self, seq: Sequence, params: SpeculativeParams, max_drafts: int) -> list[int]:
        """At most ``max_drafts`` tokens to follow ``seq.token_ids``."""
        ...


class NgramProposer:
    """Prompt lookup over the sequence's own prompt and output (no model)."""

    def propose(self, seq: Sequence, params: SpeculativeParams, max_drafts: int) -> list[int]:
        k = min(params.num_speculative_tokens, max_drafts)
        return propose_ngram(seq.token_ids, k, params.prompt_lookup_min, params.prompt_lookup_max)
