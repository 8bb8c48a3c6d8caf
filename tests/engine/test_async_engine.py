"""AsyncEngine: a responsive event loop while generating, refusals at the first __anext__, abort on aclose."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from protoserve.engine.async_engine import AsyncEngine
from protoserve.engine.errors import (
    ContextLengthError,
    EngineStoppedError,
    InvalidRequestError,
    QueueFullError,
)
from protoserve.engine.request import FinishReason, TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams


def long_request(rid: str, max_tokens: int = 200) -> TokenizedRequest:
    return TokenizedRequest(rid, list(range(10, 90)), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      ignore_eos=True))


@pytest.fixture
async def engine(make_engine):
    eng = AsyncEngine(make_engine(max_model_len=1024, max_queue=4), model_name="tiny")
    eng.start()
    yield eng
    await eng.shutdown()


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def collect(engine: AsyncEngine, request: TokenizedRequest):
    outs = [out async for out in engine.generate(request)]
    return outs


async def test_loop_stays_responsive_while_generating(engine):
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker():
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    started = time.monotonic()
    results = await asyncio.gather(*(collect(engine, long_request(f"g{i}", 120)) for i in range(4)))
    elapsed = time.monotonic() - started
    stop.set()
    await tick
    for outs in results:
        assert outs[-1].finished and outs[-1].stats is not None
        assert sum(len(o.deltas[0].token_ids) for o in outs if o.deltas) == 120
    # A free loop ticks every ~10 ms; at least half of those ticks must have happened.
    assert len(gaps) >= max(3, 0.5 * elapsed / 0.01), f"the ticker ran {len(gaps)} times in {elapsed:.2f}s"
    assert max(gaps) < 0.5, f"event loop blocked for {max(gaps):.3f}s"
    assert engine.stats().generation_tokens_total == 480


async def test_aclose_aborts_and_frees_blocks(engine):
    total = engine.engine.block_manager.num_blocks
    gen = engine.generate(long_request("closing", 500))
    first = await gen.__anext__()
    assert first.deltas[0].token_ids
    await wait_for(lambda: engine.stats().kv_blocks_free < total)
    await gen.aclose()
    await wait_for(lambda: engine.stats().kv_blocks_free == total and engine.stats().running == 0)
    assert not engine.abort("closing")
    assert engine.stats().requests_cancelled_total == 1


async def test_cancelled_task_aborts(engine):
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(long_request("task", 500)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: engine.stats().running == 0 and engine.stats().kv_usage == 0.0)


@pytest.mark.parametrize("leave", ["aclose", "cancel"])
async def test_a_caller_that_leaves_gets_the_aborts_final_stats(engine, leave):
    """The final output of a request aborted after 3 outputs reaches on_abandoned with its real timings."""
    finals = []
    received = 0

    async def consume():
        nonlocal received
        async with contextlib.aclosing(engine.generate(long_request(leave, 500), on_abandoned=finals.append)) as gen:
            async for out in gen:
                received += sum(len(d.token_ids) for d in out.deltas)
                if received >= 3:
                    if leave == "aclose":
                        return
                    await asyncio.Event().wait()  # until cancelled

    task = asyncio.create_task(consume())
    if leave == "cancel":
        await wait_for(lambda: received >= 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        await task
    [final] = finals
    assert final.finished and final.deltas[0].finish_reason == FinishReason.CANCELLED
    stats = final.stats
    assert stats.generated_tokens >= received >= 3
    assert stats.time_to_first_token_s > 0 and stats.decode_time_s > 0 and stats.prefill_time_s > 0
    assert stats.e2e_time_s >= stats.time_to_first_token_s + stats.decode_time_s


async def test_abort_by_id_ends_the_stream_cancelled(engine):
    gen = engine.generate(long_request("byid", 500))
    await gen.__anext__()
    assert engine.abort("byid")
    outs = [o async for o in gen]
    assert outs[-1].finished and outs[-1].deltas[0].finish_reason == FinishReason.CANCELLED
    assert not engine.abort("byid") and not engine.abort("never-seen")


async def test_refusals_raise_at_first_anext(engine):
    bad = engine.generate(TokenizedRequest("bad", [1], SamplingParams(temperature=-1)))
    with pytest.raises(InvalidRequestError):
        await bad.__anext__()
    too_long = engine.generate(TokenizedRequest("long", [1] * 1024, SamplingParams()))
    with pytest.raises(ContextLengthError):
        await too_long.__anext__()


async def test_full_queue_raises_queue_full(make_engine):
    eng = AsyncEngine(make_engine(max_num_seqs=1, max_queue=2), model_name="tiny")
    running = eng.generate(long_request("run", 300))
    await running.__anext__()  # admitted: the only slot is taken
    waiting = [eng.generate(long_request(f"w{i}", 3)) for i in range(2)]
    pending = [asyncio.ensure_future(g.__anext__()) for g in waiting]
    await wait_for(lambda: eng.stats().waiting == 2)
    with pytest.raises(QueueFullError):
        await eng.generate(long_request("shed", 3)).__anext__()
    await running.aclose()
    for p in pending:
        assert (await p).request_id.startswith("w")
    for g in waiting:
        await g.aclose()
    await eng.shutdown()


async def test_shutdown_cancels_pending_and_refuses_new(make_engine):
    eng = AsyncEngine(make_engine(), model_name="tiny")
    eng.start()
    eng.start()  # idempotent
    gen = eng.generate(long_request("pending", 900))
    await gen.__anext__()
    await eng.shutdown()
    outs = [o async for o in gen]
    assert outs[-1].finished and outs[-1].deltas[0].finish_reason == FinishReason.CANCELLED
    with pytest.raises(EngineStoppedError):
        await eng.generate(long_request("late")).__anext__()
    assert eng.engine.block_manager.num_free_blocks == eng.engine.block_manager.num_blocks


async def test_failing_step_fails_its_requests_and_the_engine_goes_on(make_engine):
    eng = AsyncEngine(make_engine(), model_name="tiny")
    real = eng.engine.runner.execute

    def explode(seqs, num_new_tokens):
        raise RuntimeError("kernel exploded")

    eng.engine.runner.execute = explode
    with pytest.raises(RuntimeError, match="exploded"):
        async for _ in eng.generate(long_request("boom", 5)):
            pass
    eng.engine.runner.execute = real
    outs = [o async for o in eng.generate(long_request("after", 3))]
    assert outs[-1].finished and outs[-1].deltas[0].finish_reason == FinishReason.LENGTH
    assert eng.stats().kv_blocks_free == eng.stats().kv_blocks_total
    await eng.shutdown()


def _logprob_request(rid: str, max_tokens: int) -> TokenizedRequest:
    return TokenizedRequest(rid, list(range(10, 90)), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2))


async def test_a_caller_that_falls_behind_gets_the_queued_steps_in_one_output(engine):
    steady = await collect(engine, _logprob_request("steady", 48))

    stream = engine.generate(_logprob_request("behind", 48))
    first = await anext(stream)
    # Take nothing more until the engine has finished the request: every later step waits queued.
    await wait_for(lambda: "behind" not in engine.engine.requests)
    rest = [out async for out in stream]

    assert len(rest) == 1 and rest[0].finished and rest[0].stats is not None
    behind = [first, *rest]
    tokens = [t for out in behind for d in out.deltas for t in d.token_ids]
    assert tokens == [t for out in steady for d in out.deltas for t in d.token_ids]
    assert "".join(d.text for out in behind for d in out.deltas) == "".join(
        d.text for out in steady for d in out.deltas)
    merged = rest[0].deltas[0]
    assert len(merged.logprobs) == len(merged.token_ids) == 48 - len(first.deltas[0].token_ids)
    assert [p.chosen.token_id for p in merged.logprobs] == merged.token_ids
    assert merged.finish_reason == FinishReason.LENGTH


def _tokens(outs) -> list[int]:
    return [t for out in outs for d in out.deltas for t in d.token_ids]


async def test_stream_interval_hands_over_the_first_token_then_n_at_a_time(make_engine):
    eng = AsyncEngine(make_engine(stream_interval=4), model_name="tiny")
    every = AsyncEngine(make_engine(), model_name="tiny")
    real = eng.engine.runner.execute

    def slow_step(seqs, num_new_tokens):
        time.sleep(0.03)  # a caller that keeps up takes each hand-over alone
        return real(seqs, num_new_tokens)

    eng.engine.runner.execute = slow_step
    try:
        outs = await collect(eng, _logprob_request("chunked", 11))
        steady = await collect(every, _logprob_request("steady", 11))
    finally:
        await eng.shutdown()
        await every.shutdown()

    # The first token at once, then 4 at a time, the rest with the end.
    assert [len(out.deltas[0].token_ids) for out in outs] == [1, 4, 4, 2]
    assert outs[-1].finished and outs[-1].stats is not None
    assert _tokens(outs) == _tokens(steady) and len(_tokens(outs)) == 11
    assert "".join(d.text for o in outs for d in o.deltas) == "".join(d.text for o in steady for d in o.deltas)
    assert [p.chosen.token_id for o in outs for p in o.deltas[0].logprobs] == _tokens(outs)


async def test_stream_interval_hands_over_held_tokens_before_a_failure(make_engine):
    eng = AsyncEngine(make_engine(stream_interval=1000), model_name="tiny")
    real = eng.engine.runner.execute
    calls = 0

    def explode_on_the_seventh(seqs, num_new_tokens):
        nonlocal calls
        calls += 1
        if calls == 7:
            raise RuntimeError("kernel exploded")
        return real(seqs, num_new_tokens)

    eng.engine.runner.execute = explode_on_the_seventh
    outs = []
    with pytest.raises(RuntimeError, match="exploded"):
        async for out in eng.generate(long_request("held", 50)):
            outs.append(out)
    await eng.shutdown()
    # Six forwards made six tokens: the first went at once, the five held went before the error (a
    # caller that fell behind gets them in one output).
    assert sum(len(o.deltas[0].token_ids) for o in outs) == 6
    assert outs and not outs[-1].finished
