"""Fairness of embedding work across tenants: FairQueue's order, and the worker's, on fakes.

No timing anywhere: the queue is driven step by step, and the worker runs a fake model whose units
record their order and block on events, so every assertion is about which unit ran when.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from protoserve.engine.embedding.fair_queue import FairQueue
from protoserve.engine.embedding.worker import EmbeddingWorker
from protoserve.engine.errors import EngineStoppedError


def drain(queue: FairQueue[str], units: dict[str, list[int]]) -> list[str]:
    """Serve the queue to the end: each job's units have the given costs; the jobs served, unit by unit."""
    order = []
    while (picked := queue.next()) is not None:
        tenant, job = picked
        cost = units[job].pop(0)
        queue.charge(tenant, cost)
        order.append(job)
        if not units[job]:
            queue.remove(tenant, job)
    return order


def test_the_least_served_tenant_goes_next():
    queue: FairQueue[str] = FairQueue()
    units = {"index": [100] * 10, "search": [1, 1, 1]}
    queue.push("a", "index")
    for _ in range(4):  # a is alone: it runs
        tenant, job = queue.next()
        if units[job] == [100] * 7:
            # b arrives while a's fourth unit runs (the worker charges a unit when it ends): b is
            # lifted to a's counter, not left at 0 (no credit for having been idle)...
            queue.push("b", "search")
            assert queue.served("b") == 300
        queue.charge(tenant, units[job].pop(0))
    # ...yet a's running unit and b's small ones keep b below a: its whole search runs next.
    assert drain(queue, units) == ["search"] * 3 + ["index"] * 6
    # Had b arrived between two units instead, it would have waited for one of a's units.
    queue.push("a", "index")
    queue.charge("a", 100)
    queue.push("b", "search")
    assert drain(queue, {"index": [100] * 2, "search": [60, 60]}) == ["search", "index", "search", "index"]


def test_equal_tenants_alternate_whatever_their_request_sizes():
    queue: FairQueue[str] = FairQueue()
    units = {"a1": [10] * 4, "a2": [10] * 4, "b1": [5] * 8}
    queue.push("a", "a1")
    queue.push("a", "a2")
    queue.push("b", "b1")
    order = drain(queue, units)
    # Served counters stay within one unit of each other while both wait: a's 80 against b's 40
    # never buys a more than its share, and a's own jobs run in the order it sent them.
    assert order[:6] == ["a1", "b1", "b1", "a1", "b1", "b1"]
    assert [j for j in order if j.startswith("a")] == ["a1"] * 4 + ["a2"] * 4


def test_a_newcomer_goes_before_the_tenant_just_served_at_equal_counters():
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "big")
    tenant, job = queue.next()
    queue.charge(tenant, 7)
    queue.push("b", "small")
    assert queue.next() == ("b", "small")


def test_one_tenants_jobs_run_in_order_and_removal_anywhere_is_clean():
    queue: FairQueue[str] = FairQueue()
    for job in ("first", "second", "third"):
        queue.push("a", job)
    queue.remove("a", "second")  # cancelled while queued
    assert len(queue) == 2
    assert drain(queue, {"first": [1], "third": [1]}) == ["first", "third"]
    assert not queue and queue.next() is None
    queue.remove("a", "never-queued")  # no-op


def test_a_debt_outlives_a_pause_but_not_an_empty_queue():
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "a1")
    queue.push("b", "b1")
    queue.charge("a", 1000)
    queue.remove("a", "a1")  # a pauses, 1000 ahead of b
    assert queue.served("a") == 1000
    queue.push("a", "a2")  # and comes back: it still owes its 1000
    assert queue.next() == ("b", "b1")
    queue.remove("a", "a2")
    queue.remove("b", "b1")
    # The queue emptied: every counter is forgotten, nobody owes anything.
    assert queue.served("a") is None and queue.served("b") is None


class FakeModel:
    """Units that record themselves and wait for the test's go-ahead; vectors are the job's number."""

    dimensions = 2
    special_tokens = 2
    max_tokens = 16

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.entered = threading.Semaphore(0)

    def gate(self, name: str) -> threading.Event:
        return self.gates.setdefault(name, threading.Event())

    def embed_steps(self, ids, batch_size, unit_tokens, check=True):
        name = f"job{ids[0][0]}"
        for unit in range(ids[0][1]):
            label = f"{name}.{unit}"
            self.entered.release()
            self.gate(label).wait(10)
            self.ran.append(label)
            yield 100
        return np.full((len(ids), 2), ids[0][0], dtype=np.float32)


async def _entered(model: FakeModel) -> None:
    assert await asyncio.to_thread(model.entered.acquire, True, 10)


async def test_worker_serves_another_tenant_after_the_running_unit():
    model = FakeModel()
    worker = EmbeddingWorker(model)
    try:
        big = asyncio.create_task(worker.embed_token_ids([[1, 3]], tenant="indexer"))  # job1: 3 units
        await _entered(model)  # job1.0 is running
        small = asyncio.create_task(worker.embed_token_ids([[2, 1]], tenant="searcher"))  # job2: 1 unit
        same = asyncio.create_task(worker.embed_token_ids([[3, 1]], tenant="indexer"))  # after job1
        await asyncio.sleep(0.05)  # both queued behind the running unit
        for label in ("job1.0", "job2.0", "job1.1", "job1.2", "job3.0"):
            model.gate(label).set()
        assert (await small)[0, 0] == 2 and (await big)[0, 0] == 1 and (await same)[0, 0] == 3
        # The searcher's unit ran right after the unit that was running; the indexer's second
        # request waited for its first.
        assert model.ran == ["job1.0", "job2.0", "job1.1", "job1.2", "job3.0"]
    finally:
        for gate in model.gates.values():
            gate.set()
        worker.close()


async def test_a_cancelled_caller_stops_after_the_running_unit():
    model = FakeModel()
    worker = EmbeddingWorker(model)
    try:
        job = asyncio.create_task(worker.embed_token_ids([[1, 5]], tenant="a"))
        await _entered(model)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        model.gate("job1.0").set()
        after = asyncio.create_task(worker.embed_token_ids([[2, 1]], tenant="a"))
        await _entered(model)
        model.gate("job2.0").set()
        await after
        assert model.ran == ["job1.0", "job2.0"]  # nothing of job1 after its running unit
        assert worker.queued() == 0
    finally:
        for gate in model.gates.values():
            gate.set()
        worker.close()


async def test_close_ends_queued_jobs_and_refuses_new_ones():
    model = FakeModel()
    worker = EmbeddingWorker(model)
    running = asyncio.create_task(worker.embed_token_ids([[1, 2]], tenant="a"))
    await _entered(model)
    queued = asyncio.create_task(worker.embed_token_ids([[2, 1]], tenant="b"))
    await asyncio.sleep(0.05)
    closing = asyncio.create_task(worker.aclose())
    await asyncio.sleep(0.05)
    assert not closing.done()  # it waits for the running unit
    model.gate("job1.0").set()
    await closing
    for task in (running, queued):
        with pytest.raises(EngineStoppedError):
            await task
    with pytest.raises(EngineStoppedError):
        await worker.embed_token_ids([[3, 1]], tenant="c")
    assert model.ran == ["job1.0"]
