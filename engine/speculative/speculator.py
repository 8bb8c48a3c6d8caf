"""Speculator: drafts tokens before a step's forward and verifies them against its logits after.

Before the forward, ``propose`` appends drafts to the running sequences about to decode
(n-gram lookup, or the draft model batched over the step). The target model scores a
drafting row's last sampled token plus its drafts in one forward, a logits row each;
after it, ``verify`` walks those rows with the ordinary sampler and hands each token it
keeps to the engine, which emits it as any decoded token. Which sequences draft, and
the back-off after misses, are decided here; the engine only counts the outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from protoserve.engine.config import EngineConfig
from protoserve.engine.sampling.sampler import Sampler, SampleResult
from protoserve.engine.scheduling.sequence import Sequence
from protoserve.engine.speculative.draft_model import DraftModelProposer
from protoserve.engine.speculative.params import SpeculativeParams
from protoserve.engine.speculative.proposer import NgramProposer, Proposer

# Most decoding steps a sequence skips drafting after verifications that accepted nothing.
MAX_SPEC_COOLDOWN = 32


class SpecTotals(Protocol):
    """Totals of verifications with drafts, drafted tokens and accepted ones (vLLM's spec_decode counters)."""

    spec_num_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int


@dataclass(frozen=True)
class Verification:
    """The outcome of verifying one sequence's drafts."""

    drafted: int
    accepted: int

    def count_into(self, totals: SpecTotals) -> None:
        totals.spec_num_drafts += 1
        totals.spec_draft_tokens += self.drafted
        totals.spec_accepted_tokens += self.accepted


class Speculator:
    """The engine's speculative decoding: who drafts, with which proposer, and what verification keeps."""

    def __init__(self, config: EngineConfig, sampler: Sampler) -> None:
        self.default = config.speculative
        self.disable_by_batch_size = config.speculative_disable_by_batch_size
        self.sampler = sampler  # the engine's own: verification samples exactly as decoding does
        self.proposer: Proposer = NgramProposer()
        self.draft_proposer: DraftModelProposer | None = None  # set by LLMEngine.enable_draft_model

    def params(self, seq: Sequence) -> SpeculativeParams | None:
        """The sequence's speculative options: its request's own, else the engine default (never for a
        constrained request, which may not opt in)."""
        sp = seq.sampling
        params = sp.speculative if sp.speculative is not None else (
            self.default if sp.constraint is None else None)
        return params if params is not None and params.enabled else None

    def propose(self, running: list[Sequence]) -> None:
        """Draft for every running sequence about to decode (one uncomputed token) with speculation on."""
        if self.disable_by_batch_size is not None and len(running) > self.disable_by_batch_size:
            return
        by_model: list[tuple[Sequence, int]] = []
        for seq in running:
            params = self._drafting(seq)
            if params is None:
                continue
            # Each accepted draft plus the final sampled token is output: never run past max_len.
            room = seq.max_len - seq.num_tokens - 1
            if room < 1:
                continue
            if params.method == "draft":  # refused at admission when there is no draft model
                if self.draft_proposer is not None:
                    by_model.append((seq, min(params.num_speculative_tokens, room)))
                continue
            drafts = self.proposer.propose(seq, params, room)
            if drafts:
                seq.add_drafts(drafts[:room])
        self._propose_by_model(by_model, running)

    def _drafting(self, seq: Sequence) -> SpeculativeParams | None:
        """The sequence's options when it drafts this step; a sequence cooling down counts one step off."""
        if seq.num_uncomputed_tokens != 1 or seq.num_pending_forks:
            return None
        params = self.params(seq)
        if params is None:
            return None
        if seq.spec_cooldown:
            seq.spec_cooldown -= 1
            return None
        return params

    def _propose_by_model(self, by_model: list[tuple[Sequence, int]], running: Iterable[Sequence]) -> None:
        """One batched run of the draft model; it also frees what it holds for sequences no longer running."""
        if self.draft_proposer is None or not (by_model or self.draft_proposer.states):
            return
        live = {s.seq_id for s in running}
        for (seq, _), drafts in zip(by_model, self.draft_proposer.propose_batch(by_model, live), strict=True):
            if drafts:
                seq.add_drafts(drafts)

    def verify(self, seq: Sequence, rows: torch.Tensor,
               emit: Callable[[Sequence, SampleResult], None]) -> Verification:
        """Emit what verification keeps of the sequence's drafts (``verify_drafts``); back off after a miss."""
        verdict = verify_drafts(self.sampler, seq, rows, emit)
        self._back_off(seq, verdict.accepted)
        return verdict

    @staticmethod
    def _back_off(seq: Sequence, accepted: int) -> None:
        """A miss doubles the steps the sequence goes without drafting; a hit ends the back-off."""
        if accepted:
            seq.spec_misses = 0
        else:
            seq.spec_misses += 1
            seq.spec_cooldown = min(2 ** seq.spec_misses, MAX_SPEC_COOLDOWN)


def verify_drafts(sampler: Sampler, seq: Sequence, rows: torch.Tensor,
                  emit: Callable[[Sequence, SampleResult], None],
                  masks: torch.Tensor | None = None) -> Verification:
    """Emit the tokens verification keeps from a drafting sequence's logits ``[1 + drafts, vocab]``.

    Row i is the target's next-token logits after the last sampled token and drafts 1..i. The
    sampler runs on the rows in order, each as a plain decode step would (penalties, min_tokens,
    logprobs and Mirostat's mu see exactly the tokens emitted so far, one draw from the
    sequence's generator per token): draft i+1 is accepted when the token drawn from row i
    equals it, and the first token that differs ends the row (after all drafts, row k gives a
    bonus token). For n-gram drafts q is a point mass, and drawing x ~ p and accepting iff
    x == draft is exactly rejection sampling's rule (accept with probability p(draft), else a
    token from p with the draft removed, renormalised), so output is the target's distribution;
    it consumes the same draws as decoding without drafts, so greedy and seeded output are
    token-for-token what they would be without speculation.

    ``masks`` holds the grammar's mask for each row, when the drafts are a constrained sequence's
    forced tokens (engine/sampling/constraints/fast_forward.py).
    """
    drafts = seq.take_drafts()
    accepted = 0
    for i in range(len(drafts) + 1):
        [sample] = sampler(rows[i : i + 1], [seq], masks[i : i + 1] if masks is not None else None)
        emit(seq, sample)
        matched = i < len(drafts) and sample.token_id == drafts[i]
        accepted += matched
        if not matched or seq.is_finished:
            break
    return Verification(len(drafts), accepted)
