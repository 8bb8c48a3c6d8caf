"""Grammar fast-forward: the tokens a constraint forces, computed in the forward that runs anyway.

Where the grammar leaves no choice (a JSON object's fixed keys and punctuation, the rest of
an enum value once its first token is out), llguidance names the forced tokens
(``LLMatcher.compute_ff_tokens``). In each decoding step a constrained sequence appends them
after its last sampled token as drafts (``Sequence.add_drafts``), so the step's forward
computes their K/V with that token's: one forward yields the forced run and the token after
it, where step-by-step decoding spends a forward on each.

The drafts are verified as speculative decoding's are (``verify_drafts``), each logits row
under the grammar's mask at its position: the sampler runs on every row exactly as a
decoding step would (one draw from the sequence's generator per token, Mirostat's mu,
penalties, logprobs), each kept token is emitted as a sampled one (stop strings, stop tokens,
``max_tokens``, streaming), and the first token that differs from its draft ends the run.
That rule, not the drafts, decides the output, so it is token for token the step-by-step
output, greedy or seeded. llguidance's mask at a forced position allows the forced token
alone (it keeps the tokenization canonical), so in practice every draft is kept.

Constrained sequences draft nothing else: a constrained request may not opt in to
speculative decoding (speculative/speculator.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protoserve.engine.sampling.sampler import Sampler, SampleResult
from protoserve.engine.scheduling.sequence import Sequence
from protoserve.engine.speculative.speculator import Verification, verify_drafts


@dataclass
class FastForwardCounts:
    """Forced tokens drafted, and of those kept by verification."""

    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class FastForward:
    """Drafts each constrained sequence's forced tokens before the forward, verifies them after it."""

    enabled: bool  # read each step: EngineConfig.grammar_fast_forward at the start
    sampler: Sampler  # the engine's own: verification samples exactly as decoding does
    token_budget: int  # EngineConfig.max_num_batched_tokens
    counts: FastForwardCounts = field(default_factory=FastForwardCounts)

    def propose(self, running: list[Sequence]) -> None:
        """Append its forced tokens to every running constrained sequence about to decode, within what the
        step's token budget leaves once every running sequence has its own tokens: the scheduler serves
        running sequences in turn until the budget is spent, so a draft must not crowd another one out."""
        if not self.enabled:
            return
        spare = self.token_budget - sum(seq.num_uncomputed_tokens for seq in running)
        for seq in running:
            if spare <= 0:
                return
            forced = forced_tokens(seq)[:spare]
            if forced:
                seq.add_drafts(forced)
                spare -= len(forced)

    def verify(self, seq: Sequence, rows: torch.Tensor, masks: torch.Tensor,
               emit: Callable[[Sequence, SampleResult], None]) -> Verification:
        """Emit the tokens verification keeps from the logits ``[1 + drafts, vocab]`` of a sequence
        whose drafts are forced tokens, under ``masks`` (the grammar's, one row each)."""
        verdict = verify_drafts(self.sampler, seq, rows, emit, masks)
        self.counts.draft_tokens += verdict.drafted
        self.counts.accepted_tokens += verdict.accepted
        return verdict


def forced_tokens(seq: Sequence) -> list[int]:
    """The tokens the sequence's grammar forces next, as many as may be output; empty when none are
    forced or the sequence is not decoding (a prompt or a recomputation runs, choices are to fork)."""
    matcher = seq.matcher
    if matcher is None or seq.num_uncomputed_tokens != 1 or seq.num_pending_forks or seq.num_draft_tokens:
        return []
    # Every kept draft and the token sampled after them are output: never run past max_len.
    room = seq.max_len - seq.num_tokens - 1
    if room < 1 or matcher.is_stopped() or matcher.is_error():
        return []
    return matcher.compute_ff_tokens()[:room]
