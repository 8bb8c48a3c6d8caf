"""Sequence: one choice being generated, with the integer state the scheduler moves.

A request with ``n`` choices starts as one sequence; when its prompt's logits
arrive it forks into ``n`` sequences that share the prompt's KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from protoserve.engine.request import FinishReason, Tenant
from protoserve.engine.sampling.sampling_params import SamplingParams, reshapes_for_good
from protoserve.engine.scheduling.block_manager import chain_hashes

if TYPE_CHECKING:
    from llguidance import LLMatcher


class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    """Prompt plus generated tokens, how many of them have K/V in the cache, and where.

    ``num_computed_tokens`` counts tokens whose K/V are in ``block_table``'s blocks;
    a step computes ``num_tokens - num_computed_tokens`` more (all of a prompt, a
    chunk of it, or the one token sampled last step). Preemption resets it to 0.
    """

    seq_id: int
    request_id: str
    index: int  # choice index within the request
    token_ids: list[int]
    num_prompt_tokens: int
    max_len: int  # stop with "length" when len(token_ids) reaches this
    sampling: SamplingParams
    generator: torch.Generator
    priority: int = 0
    arrival_order: int = 0  # FCFS tie-break; forked choices share their parent's
    arrival_step: int = 0  # scheduler step at arrival, for priority aging
    cache_salt: bytes = b""
    tenant: Tenant = field(default_factory=Tenant)  # whose share of the engine this sequence uses
    # Leading tokens already counted as served to the tenant (engine/scheduling/fair_share.py): prompt
    # tokens as they are first computed, then each generated token; recomputing after preemption is not.
    num_charged_tokens: int = 0
    num_pending_forks: int = 0  # choices still to fork off when the prompt's logits arrive
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, grown lazily
    num_cached_blocks: int = 0  # leading table blocks already published to the prefix cache
    num_preemptions: int = 0
    # num_preemptions when its prefix last came back off disk (engine/kv_offload): once per preemption.
    num_preemptions_reloaded: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # Where the output stands in its constraint's grammar: it has taken every generated token, and
    # lives with the sequence, so preemption (which keeps the tokens and recomputes their K/V) keeps it.
    matcher: LLMatcher | None = None
    mirostat_mu: float = 0.0  # Mirostat's running target; 2 * tau before the first token
    # Drafted (speculative) tokens at the end of ``token_ids`` during one step: scheduled and
    # computed with the last sampled token, then replaced by what verification accepts. They are
    # never hashed into the prefix cache and never survive the step.
    num_draft_tokens: int = 0
    # Back-off after verifications that accepted nothing: drafting is skipped for ``spec_cooldown``
    # more steps, doubling with each miss in a row (text that does not repeat stops paying for drafts).
    spec_misses: int = 0
    spec_cooldown: int = 0
    # Read by the sampler for every row of every step; the request's parameters do not change once it runs.
    sampling_reshapes_for_good: bool = field(init=False)

    def __post_init__(self) -> None:
        self.sampling_reshapes_for_good = reshapes_for_good(self.sampling)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_final_tokens(self) -> int:
        """Tokens that are the sequence's own: all but this step's drafts."""
        return len(self.token_ids) - self.num_draft_tokens

    def full_block_hashes(self, block_size: int) -> list[bytes]:
        """Chained hashes of every full block of final tokens; those only grow, so earlier hashes stay valid.

        Drafts are left out: a block holding a draft may yet change, and a name once given is kept.
        """
        tokens = self.token_ids[: self.num_final_tokens] if self.num_draft_tokens else self.token_ids
        return chain_hashes(self.cache_salt, tokens, block_size, self.block_hashes)

    def add_drafts(self, draft_ids: list[int]) -> None:
        """Append proposed tokens for this step's verification."""
        assert self.num_draft_tokens == 0, "drafts of an earlier step were not taken"
        self.token_ids.extend(draft_ids)
        self.num_draft_tokens = len(draft_ids)

    def take_drafts(self, keep: int = 0) -> list[int]:
        """Remove the drafts past the first ``keep`` (those stay, still drafts); return the removed ones."""
        drop = self.num_draft_tokens - keep
        if drop <= 0:
            return []
        removed = self.token_ids[len(self.token_ids) - drop :]
        del self.token_ids[len(self.token_ids) - drop :]
        self.num_draft_tokens = keep
        return removed

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
