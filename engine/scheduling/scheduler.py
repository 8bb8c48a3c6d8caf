"""Scheduler: which sequences run this step, and how many new tokens each.

One step has a token budget (``max_num_batched_tokens``). Every running sequence
asks for its uncomputed tokens: one after a decode, the rest of its prompt during
prefill. Prompts longer than what is left of the budget are cut into chunks, so a
long prefill shares the forward with other sequences' decode tokens instead of
stalling them.

Order is priority (higher first, raised by age so nothing starves), then arrival
(FCFS). Running sequences are served first, in that order; when the pool has no
block for one of them, the last running sequence in that order (lowest priority,
newest) is preempted: its blocks are freed and it returns to the waiting queue to
recompute its tokens later. Waiting sequences are admitted only in steps without
preemption, and strictly in order, so a large request at the head is not overtaken
forever by smaller ones behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protoserve.engine.config import EngineConfig
from protoserve.engine.scheduling.block_manager import BlockManager
from protoserve.engine.scheduling.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The sequences of one step and the number of new tokens each computes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Per scheduled sequence: prompt tokens served from the prefix cache when it was admitted this step.
    prefix_hit_tokens: dict[int, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def samples(self, i: int) -> bool:
        """Whether sequence i's new tokens reach its last token, so its next token is sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


@dataclass
class SchedulerCounters:
    """Monotonic totals the engine reports."""

    preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found


class Scheduler:
    """Waiting and running queues over one BlockManager."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self.num_steps = 0

    # -- queues --------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival_step = self.num_steps
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def order_key(self, seq: Sequence) -> tuple[int, int]:
        """Sort key: effective priority descending, then arrival."""
        aging = self.config.priority_aging_steps
        bonus = (self.num_steps - seq.arrival_step) // aging if aging > 0 else 0
        return (-(seq.priority + bonus), seq.arrival_order)

    # -- one step ------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=self.order_key)
        self.waiting.sort(key=self.order_key)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n < seq.num_uncomputed_tokens:  # drafts that do not fit the budget are dropped, not chunked
                seq.take_drafts(keep=max(0, seq.num_draft_tokens - (seq.num_uncomputed_tokens - n)))
            preempted_self = False
            while not self.block_manager.allocate(seq.block_table, seq.num_computed_tokens + n):
                if seq.num_draft_tokens:  # drafts never cost another sequence its blocks
                    seq.take_drafts()
                    n = min(seq.num_uncomputed_tokens, budget)
                    continue
                # Everything after position i is lower in order and not yet scheduled this step.
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                break
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        for seq in self.running[i:]:  # left out of this step: their drafts go stale
            seq.take_drafts()

        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        # A request with n choices will occupy n slots once it forks; reserve them from the start.
        slots = sum(1 + s.num_pending_forks for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if slots + 1 + seq.num_pending_forks > self.config.max_num_seqs:
                break
            hits = self._prefix_hits(seq)
            num_cached = len(hits) * self.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not bm.allocate(seq.block_table, num_cached + n, hits):
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            seq.num_cached_blocks = len(hits)
            self.counters.prefix_cache_queries += seq.num_tokens
            self.counters.prefix_cache_hits += num_cached
            batch.prefix_hit_tokens[seq.seq_id] = num_cached
            self.running.append(seq)
            slots += 1 + seq.num_pending_forks
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        if not self.block_manager.enable_prefix_caching:
            return []
        hashes = seq.full_block_hashes(self.block_size)
        # At least one token must be computed to produce the logits of the next one.
        usable = (seq.num_tokens - 1) // self.block_size
        return self.block_manager.match_prefix(hashes[:usable])

    def _preempt(self, seq: Sequence) -> None:
        seq.take_drafts()
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.counters.preemptions += 1

    def finish_step(self, batch: ScheduledBatch) -> None:
        """After the forward: the new tokens' K/V are in the cache; publish blocks that became full."""
        self.num_steps += 1
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self._cache_full_blocks(seq)

    def rollback_drafts(self, seq: Sequence) -> None:
        """After verification replaced a row's drafts by the accepted tokens and one sampled token:
        only the tokens before that last one have valid K/V. Blocks past them (written for rejected
        drafts, never hashed) go back to the pool; full blocks of accepted tokens are published."""
        assert seq.num_draft_tokens == 0, "take the drafts before rolling back"
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        self.block_manager.truncate(seq.block_table, self.block_manager.blocks_for(seq.num_computed_tokens))
        self._cache_full_blocks(seq)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        if not self.block_manager.enable_prefix_caching:
            return
        # A block holding a draft is not final: verification may replace its tokens.
        num_full = min(seq.num_computed_tokens, seq.num_final_tokens) // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = seq.full_block_hashes(self.block_size)
        for b in range(seq.num_cached_blocks, num_full):
            self.block_manager.cache_block(seq.block_table[b], hashes[b])
        seq.num_cached_blocks = num_full

    # -- sequence lifecycle --------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` (holding the parent's tokens) running on the parent's full computed blocks.

        Only full blocks are shared: the parent keeps writing its partial last
        block, so the child recomputes those few tokens into a block of its own
        rather than copying K/V.
        """
        num_shared = parent.num_computed_tokens // self.block_size
        child.block_table = self.block_manager.fork(parent.block_table, num_shared)
        child.num_computed_tokens = num_shared * self.block_size
        child.num_cached_blocks = min(parent.num_cached_blocks, num_shared)
        child.block_hashes = parent.block_hashes[:num_shared]
        child.arrival_step = parent.arrival_step
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of either queue and free its blocks (finished or aborted)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED
