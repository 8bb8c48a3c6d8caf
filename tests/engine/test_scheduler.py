"""Scheduler without a model: a fake forward whose next token is a function of the tokens so far."""

from __future__ import annotations

import hashlib

import pytest
import torch

from protoserve.engine.config import EngineConfig
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.block_manager import BlockManager
from protoserve.engine.scheduling.scheduler import ScheduledBatch, Scheduler
from protoserve.engine.scheduling.sequence import Sequence

BS = 4


def next_token(tokens: list[int]) -> int:
    return hashlib.sha256(str(tokens).encode()).digest()[0] % 50


def make_seq(seq_id: int, prompt: list[int], max_len: int, priority: int = 0, forks: int = 0) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        index=0,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        max_len=max_len,
        sampling=SamplingParams(),
        generator=torch.Generator(),
        priority=priority,
        arrival_order=seq_id,
        num_pending_forks=forks,
    )


def make_scheduler(num_blocks: int = 64, **kw) -> Scheduler:
    config = EngineConfig(block_size=BS, **kw)
    return Scheduler(config, BlockManager(num_blocks, BS))


def fake_step(sched: Scheduler) -> ScheduledBatch:
    batch = sched.schedule()
    sampled = [batch.samples(i) for i in range(len(batch.seqs))]
    sched.finish_step(batch)
    for seq, s in zip(batch.seqs, sampled, strict=True):
        if s:
            seq.append_token(next_token(seq.token_ids))
            if seq.num_tokens >= seq.max_len:
                sched.finish(seq)
    return batch


def run_all(sched: Scheduler, max_steps: int = 10_000) -> list[ScheduledBatch]:
    batches = []
    while sched.has_unfinished():
        batches.append(fake_step(sched))
        assert len(batches) < max_steps, "no progress"
    return batches


def test_chunked_prefill_mixes_with_decode_within_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    short = make_seq(0, [1, 2], max_len=12)
    sched.add(short)
    fake_step(sched)  # short's prefill
    long = make_seq(1, list(range(20)), max_len=22)
    sched.add(long)
    batches = [fake_step(sched) for _ in range(3)]
    for b in batches:
        assert b.num_tokens <= 8
        assert b.seqs[0] is short and b.num_new_tokens[0] == 1  # decode keeps going
    assert [b.num_new_tokens[1] for b in batches] == [7, 7, 6]  # 20 prompt tokens in chunks
    assert long.num_generated == 1  # sampled only after the last chunk


def test_small_pool_preempts_and_everything_finishes_with_same_tokens():
    prompts = [[i, i + 1, i + 2, 7, 8] for i in range(6)]

    def run(num_blocks: int) -> tuple[list[list[int]], Scheduler]:
        sched = make_scheduler(num_blocks=num_blocks, enable_prefix_caching=False)
        seqs = [make_seq(i, p, max_len=16) for i, p in enumerate(prompts)]
        for s in seqs:
            sched.add(s)
        run_all(sched)
        return [s.token_ids for s in seqs], sched

    big, big_sched = run(64)
    small, small_sched = run(6)  # 24 token slots for 6 sequences of up to 16 tokens
    assert small == big
    assert big_sched.counters.preemptions == 0
    assert small_sched.counters.preemptions > 0
    assert small_sched.block_manager.num_free_blocks == 6


def test_preemption_victim_is_lowest_priority_then_newest():
    sched = make_scheduler(num_blocks=3, enable_prefix_caching=False, priority_aging_steps=0)
    a = make_seq(0, [1, 2, 3, 4], max_len=12, priority=1)
    b = make_seq(1, [1, 2, 3], max_len=12, priority=0)
    c = make_seq(2, [1, 2, 3], max_len=12, priority=0)
    for s in (a, b, c):
        sched.add(s)
    fake_step(sched)  # all three admitted, one block each
    assert len(sched.running) == 3
    batch = fake_step(sched)  # a needs a second block: the newest low-priority one goes
    assert batch.preempted == [c]
    assert c.num_computed_tokens == 0 and c.block_table == [] and c.num_preemptions == 1
    assert sched.waiting == [c]


def test_priority_first_then_fcfs():
    sched = make_scheduler(max_num_seqs=1, priority_aging_steps=0)
    order = []
    seqs = [make_seq(0, [1], 3, priority=0), make_seq(1, [1], 3, priority=5), make_seq(2, [1], 3, priority=0),
            make_seq(3, [1], 3, priority=5)]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished():
        b = fake_step(sched)
        for s in b.seqs:
            if s.seq_id not in order:
                order.append(s.seq_id)
    assert order == [1, 3, 0, 2]


def test_aging_prevents_starvation():
    def first_step_of_low(aging: int, steps: int = 60) -> int | None:
        sched = make_scheduler(max_num_seqs=1, priority_aging_steps=aging)
        low = make_seq(0, [1], max_len=2, priority=0)
        sched.add(low)
        sched.add(make_seq(1, [1], max_len=3, priority=3))
        for step in range(steps):
            sched.add(make_seq(100 + step, [1], max_len=3, priority=3))  # a steady stream of urgent work
            b = fake_step(sched)
            if low in b.seqs:
                return step
        return None

    assert first_step_of_low(aging=0) is None
    assert first_step_of_low(aging=4) is not None


def test_max_num_seqs_counts_pending_forks():
    sched = make_scheduler(max_num_seqs=4)
    sched.add(make_seq(0, [1, 2], max_len=6, forks=2))  # will become 3 choices
    sched.add(make_seq(1, [1, 2], max_len=6, forks=1))  # would need 2 more slots
    b = sched.schedule()
    assert [s.seq_id for s in b.seqs] == [0]


def test_fork_shares_full_prompt_blocks_and_recomputes_tail():
    sched = make_scheduler()
    parent = make_seq(0, list(range(10)), max_len=20, forks=1)
    sched.add(parent)
    batch = sched.schedule()
    sched.finish_step(batch)
    child = make_seq(1, parent.token_ids + [42], max_len=20)
    sched.fork(parent, child)
    parent.append_token(41)
    assert child.block_table == parent.block_table[:2]
    assert child.num_computed_tokens == 8
    b = sched.schedule()
    assert dict(zip([s.seq_id for s in b.seqs], b.num_new_tokens, strict=True)) == {0: 1, 1: 3}
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] != parent.block_table[2]


def test_prefix_cache_hits_across_requests_but_not_salts():
    sched = make_scheduler()
    prompt = list(range(13))
    first = make_seq(0, prompt, max_len=14)
    sched.add(first)
    run_all(sched)
    second = make_seq(1, prompt + [99], max_len=15)
    sched.add(second)
    b = sched.schedule()
    assert b.prefix_hit_tokens[1] == 12 and b.num_new_tokens == [2]
    sched.finish_step(b)
    other = make_seq(2, prompt, max_len=14)
    other.cache_salt = b"tenant-b"
    sched.add(other)
    b = sched.schedule()
    assert b.prefix_hit_tokens[2] == 0
    assert sched.counters.prefix_cache_hits == 12


def test_drafts_take_only_the_budget_a_waiting_prefill_leaves():
    """Beside rows with drafts, a new request's prompt is scheduled first: drafts may save a step, the
    prefill is the arrival's time to first token. Drafts fill what is left, in order, and the rest drop."""
    sched = make_scheduler(max_num_batched_tokens=12)
    rows = [make_seq(i, [1, 2, 3], max_len=40) for i in range(2)]
    for seq in rows:
        sched.add(seq)
    fake_step(sched)  # both prefilled; each has sampled its first token
    for seq in rows:  # four drafts each, as the speculator appends them
        seq.token_ids.extend([7, 7, 7, 7])
        seq.num_draft_tokens = 4
    arrival = make_seq(2, [4, 5, 6, 7, 8, 9], max_len=40)
    sched.add(arrival)
    batch = sched.schedule()
    scheduled = dict(zip((s.seq_id for s in batch.seqs), batch.num_new_tokens, strict=True))
    assert scheduled == {0: 1 + 4, 1: 1, 2: 6}  # 12: the arrival whole, then row 0's drafts
    assert (rows[0].num_draft_tokens, rows[1].num_draft_tokens) == (4, 0)
    assert rows[1].token_ids[-1] != 7 and len(rows[1].token_ids) == 4


def test_the_chunked_prefill_budget_defaults_to_the_device() -> None:
    # One 1,000-token prompt: the CPU's default cuts it into 256-token chunks; on cuda, where a prefill
    # step's cost is the host launching its kernels, it goes in one step; a given budget wins on both.
    chunks = {}
    for device, given in (("cpu", None), ("cuda", None), ("cuda", 300)):
        sched = make_scheduler(num_blocks=400, device=device, max_num_batched_tokens=given)
        sched.add(make_seq(0, list(range(1000)), 1001))
        chunks[device, given] = [b.num_new_tokens[0] for b in run_all(sched)]
    assert chunks["cpu", None] == [256, 256, 256, 232]
    assert chunks["cuda", None] == [1000]
    assert chunks["cuda", 300] == [300, 300, 300, 100]
    assert EngineConfig(device="cuda").token_budget() == 8192
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least 1"):
        EngineConfig(max_num_batched_tokens=0).validate()
