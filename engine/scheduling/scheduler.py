"""Scheduler: which sequences run this step, and how many new tokens each.

One step has a token budget (``max_num_batched_tokens``). Every running sequence
asks for its uncomputed tokens: one after a decode, the rest of its prompt during
prefill. Prompts longer than what is left of the budget are cut into chunks, so a
long prefill shares the forward with other sequences' decode tokens instead of
stalling them.

Order is fair across tenants first (fair_share.py: the least-served group, then the
least-served identity within it), then priority (higher first, raised by age so nothing
starves), then arrival (FCFS): priorities order one identity's requests, never another's.
Running sequences are served first, in that order; when the pool has no block for one
of them, the last running sequence in that order (the most-served tenant's lowest
priority, newest) is preempted: its blocks are freed and it returns to the waiting
queue to recompute its tokens later. Waiting sequences are admitted in that order too,
and strictly so: a large request at the head is not overtaken forever by smaller ones
behind it. When the head cannot fit (no slot, no blocks, no step budget), running work
of a tenant served more than the fairness margin beyond the head's makes room: it is
preempted, or it waits a step, so one tenant holding every slot and block cannot keep
another waiting. A head whose caller has nothing running gets its first step without the
rows of tenants ahead of it, so its first token waits for a short step rather than a full
batch. In steps where running sequences were preempted for blocks, only such fair
admissions happen.

Optional hard caps bound what one identity holds at any time, alone or not:
``max_running_per_identity`` sequences and ``max_kv_share_per_identity`` of the pool.
An identity at a cap waits (others are admitted past it), and a sequence of an identity
at its block cap grows by preempting that identity's own last sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protoserve.engine.config import EngineConfig, identity_block_cap
from protoserve.engine.request import Tenant
from protoserve.engine.scheduling.block_manager import BlockManager
from protoserve.engine.scheduling.fair_share import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST, FairShare
from protoserve.engine.scheduling.queue_shedding import shed_victim
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
    fair_preemptions: int = 0  # of those, made to admit a less-served tenant's request
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    queue_sheds: int = 0  # waiting requests refused to make room for a shorter-queued tenant's


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
        self.fair = FairShare(config.fairness_margin_tokens)
        self.max_blocks_per_identity = identity_block_cap(config, block_manager.num_blocks)
        self._caps = bool(config.max_running_per_identity) or self.max_blocks_per_identity < block_manager.num_blocks

    # -- queues --------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival_step = self.num_steps
        self.fair.join(seq.tenant)
        self.waiting.append(seq)

    def set_aside(self, seq: Sequence) -> None:
        """Take a waiting sequence out of the queue while its prefix comes off disk (engine/kv_offload); it
        stays its tenant's, and ``put_back`` returns it to the queue with its arrival and age kept."""
        self.waiting.remove(seq)

    def put_back(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def shed_for(self, tenant: Tenant) -> Sequence | None:
        """At a full waiting queue: take out the waiting sequence to refuse so one of ``tenant``'s can wait
        (queue_shedding.py), or None when the newcomer is the one to refuse."""
        victim = shed_victim(self.waiting, tenant)
        if victim is not None:
            self.finish(victim)
            self.counters.queue_sheds += 1
        return victim

    def order_key(self, seq: Sequence) -> tuple[int, int, int, int]:
        """Sort key: the least-served tenant first, then effective priority descending, then arrival."""
        aging = self.config.priority_aging_steps
        bonus = (self.num_steps - seq.arrival_step) // aging if aging > 0 else 0
        return (*self.fair.rank(seq.tenant), -(seq.priority + bonus), seq.arrival_order)

    # -- one step ------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.token_budget()
        for seq in self.running:
            self._charge_output(seq)
        self.running.sort(key=self.order_key)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # Its drafts wait for what the waiting requests leave of the budget (_add_drafts).
            n = min(seq.num_uncomputed_tokens - seq.num_draft_tokens, budget)
            preempted_self = False
            while not self._grow(seq, seq.num_computed_tokens + n):
                # Everything after position i is later in order and not yet scheduled this step.
                victim = self._room_victim(seq, i, seq.num_computed_tokens + n)
                self.running.remove(victim)
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

        budget = self._admit_waiting(batch, budget, fair_only=bool(batch.preempted))
        self._add_drafts(batch, budget)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            self._charge_prompt(seq, n)  # after admission, which may have taken budget back
        return batch

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """The scheduled rows' drafts, in order, with the budget the running rows and the waiting requests
        left: a new request's prefill is work it needs and its time to first token, while a draft only
        may save a step, so beside many drafting rows arrivals no longer wait steps for budget. Drafts
        that do not fit are dropped, not chunked, and never cost another sequence its blocks."""
        for j, seq in enumerate(batch.seqs):
            if not seq.num_draft_tokens:
                continue
            k = min(seq.num_draft_tokens, budget)
            if k and not self._grow(seq, seq.num_computed_tokens + batch.num_new_tokens[j] + k):
                k = 0
            seq.take_drafts(keep=k)
            batch.num_new_tokens[j] += k
            budget -= k

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` of a running sequence, within its identity's block cap."""
        if self._over_block_cap(seq, num_tokens):
            return False
        return self.block_manager.allocate(seq.block_table, num_tokens)

    def _over_block_cap(self, seq: Sequence, num_tokens: int) -> bool:
        if not self._caps:
            return False
        new = self.block_manager.blocks_for(num_tokens) - len(seq.block_table)
        return new > 0 and self._held(seq.tenant)[1] + new > self.max_blocks_per_identity

    def _room_victim(self, seq: Sequence, i: int, num_tokens: int) -> Sequence:
        """Whom to preempt when running sequence ``seq`` (at ``i``) cannot grow to ``num_tokens``: the last
        in order of the not yet scheduled, or, when its identity is at its block cap, that identity's own last."""
        if self._over_block_cap(seq, num_tokens):
            return next(s for s in reversed(self.running[i:]) if _same_identity(s.tenant, seq.tenant))
        return self.running[-1]

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, *, fair_only: bool) -> int:
        """Admit waiting sequences in order. A head owed room by a more-served tenant takes that tenant's
        slots, blocks and step budget if it must; ``fair_only``: only such heads are admitted. Returns the
        budget left."""
        if not self.waiting:
            return budget
        bm = self.block_manager
        # A request with n choices will occupy n slots once it forks; reserve them from the start.
        slots = sum(1 + s.num_pending_forks for s in self.running)
        queues = self._waiting_queues()
        admitted: set[int] = set()  # seq ids admitted this step: never preempted for another this step
        given = False  # the step went to a caller with nothing running: only heads owed room join it
        while queues:
            head = min((q[0] for q in queues.values()), key=self.order_key)
            if self._caps and self._at_cap(head):
                del queues[_identity(head.tenant)]  # it waits; others go past it
                continue
            owed = self._fair_victim(head, admitted) is not None
            if not owed and (fair_only or budget <= 0 or given):
                return budget
            if owed:
                # A caller with nothing running gets this step to itself (the tenants ahead of it wait one
                # step): its first token then waits for one short step, not a full batch's.
                newcomer = not any(_same_identity(s.tenant, head.tenant) for s in self.running)
                want = min(head.num_tokens, self.config.token_budget())
                budget += self._reclaim_budget(batch, head, batch.num_tokens if newcomer else want - budget,
                                               admitted)
                given = given or newcomer
            made_room = False
            while True:
                hits = self._prefix_hits(head)
                num_cached = len(hits) * self.block_size
                n = min(head.num_tokens - num_cached, budget)
                if ((made_room or not fair_only)
                        and n > 0
                        and slots + 1 + head.num_pending_forks <= self.config.max_num_seqs
                        and bm.allocate(head.block_table, num_cached + n, hits)):
                    break
                victim = self._fair_victim(head, admitted)
                if victim is None:
                    return budget
                budget += self._unschedule(batch, victim)
                self.running.remove(victim)
                self._preempt(victim)
                self.counters.fair_preemptions += 1
                batch.preempted.append(victim)
                slots -= 1 + victim.num_pending_forks
                made_room = True
            queue = queues[_identity(head.tenant)]
            queue.pop(0)
            if not queue:
                del queues[_identity(head.tenant)]
            self.waiting.remove(head)
            head.status = SequenceStatus.RUNNING
            head.num_computed_tokens = num_cached
            head.num_cached_blocks = len(hits)
            self._charge_prompt(head, n)  # now: the heads after it are ordered with it counted
            self.counters.prefix_cache_queries += head.num_tokens
            self.counters.prefix_cache_hits += num_cached
            batch.prefix_hit_tokens[head.seq_id] = num_cached
            self.running.append(head)
            admitted.add(head.seq_id)
            slots += 1 + head.num_pending_forks
            batch.seqs.append(head)
            batch.num_new_tokens.append(n)
            budget -= n
        return budget

    def _reclaim_budget(self, batch: ScheduledBatch, head: Sequence, tokens: int, admitted: set[int]) -> int:
        """Up to ``tokens`` of this step's budget back from scheduled sequences of tenants served more than
        the margin beyond ``head``'s, the most served first: a prefill chunk shrinks, a decode row (or a
        row with drafts) waits; they keep their blocks, nothing is recomputed."""
        reclaimed = 0
        for j in reversed(range(len(batch.seqs))):
            seq = batch.seqs[j]
            if reclaimed >= tokens:
                break
            if seq.seq_id in admitted or not self.fair.ahead(seq.tenant, head.tenant):
                continue
            n = batch.num_new_tokens[j]
            if seq.num_draft_tokens or n <= tokens - reclaimed:
                seq.take_drafts()
                reclaimed += self._unschedule(batch, seq)
            else:
                batch.num_new_tokens[j] = n - (tokens - reclaimed)
                reclaimed = tokens
        return reclaimed

    def _waiting_queues(self) -> dict[tuple[str, str], list[Sequence]]:
        """Each identity's waiting sequences in its own order (priority, then arrival)."""
        queues: dict[tuple[str, str], list[Sequence]] = {}
        for seq in sorted(self.waiting, key=self.order_key):
            queues.setdefault(_identity(seq.tenant), []).append(seq)
        return queues

    def _fair_victim(self, head: Sequence, admitted: set[int]) -> Sequence | None:
        """The running sequence to preempt so ``head`` fits: the most-served tenant's last, among tenants
        served more than the fairness margin beyond ``head``'s; None when no tenant is that far ahead."""
        owing = [s for s in self.running if s.seq_id not in admitted and self.fair.ahead(s.tenant, head.tenant)]
        return max(owing, key=self.order_key, default=None)

    @staticmethod
    def _unschedule(batch: ScheduledBatch, seq: Sequence) -> int:
        """Take ``seq`` out of this step's batch (nothing ran yet); the tokens it had are budget again."""
        for j, scheduled in enumerate(batch.seqs):
            if scheduled is seq:
                del batch.seqs[j]
                batch.prefix_hit_tokens.pop(seq.seq_id, None)
                return batch.num_new_tokens.pop(j)
        return 0

    def _held(self, tenant: Tenant) -> tuple[int, int]:
        """Slots and KV blocks the identity's running sequences hold (a block shared by two counts twice)."""
        slots = blocks = 0
        for seq in self.running:
            if _same_identity(seq.tenant, tenant):
                slots += 1 + seq.num_pending_forks
                blocks += len(seq.block_table)
        return slots, blocks

    def _at_cap(self, head: Sequence) -> bool:
        """Whether admitting ``head`` would take its identity past a hard cap."""
        slots, blocks = self._held(head.tenant)
        cap = self.config.max_running_per_identity
        if cap and slots + 1 + head.num_pending_forks > cap:
            return True
        # Its first step's blocks at least (prefix hits included: they are held once referenced).
        first = self.block_manager.blocks_for(min(head.num_tokens, self.config.token_budget()))
        return blocks + first > self.max_blocks_per_identity

    def _charge_prompt(self, seq: Sequence, n: int) -> None:
        """Charge the prompt tokens among the ``n`` this step computes that were never computed before
        (a prefix-cache hit is free, and so is recomputing after a preemption)."""
        start = max(seq.num_charged_tokens, seq.num_computed_tokens)
        end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens)
        if end > start:
            self.fair.charge(seq.tenant, PROMPT_TOKEN_COST * (end - start))
            seq.num_charged_tokens = end

    def _charge_output(self, seq: Sequence) -> None:
        new = seq.num_final_tokens - seq.num_charged_tokens
        if new > 0 and seq.num_charged_tokens >= seq.num_prompt_tokens:
            self.fair.charge(seq.tenant, OUTPUT_TOKEN_COST * new)
            seq.num_charged_tokens = seq.num_final_tokens

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
            self.block_manager.cache_block(seq.block_table[b], hashes[b], seq.cache_salt)
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
        child.num_charged_tokens = child.num_tokens  # the prompt was the parent's to pay for
        child.status = SequenceStatus.RUNNING
        self.fair.join(child.tenant)
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of either queue and free its blocks (finished or aborted)."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._charge_output(seq)
        elif seq in self.waiting:  # else set aside (set_aside)
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        self.fair.leave(seq.tenant)
        seq.status = SequenceStatus.FINISHED


def _identity(tenant: Tenant) -> tuple[str, str]:
    return tenant.group, tenant.identity


def _same_identity(a: Tenant, b: Tenant) -> bool:
    return a.group == b.group and a.identity == b.identity
