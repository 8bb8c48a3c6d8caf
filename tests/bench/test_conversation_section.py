"""The conversation section: plans, the turn loop on a scripted transport and clock, one turn against a
scripted HTTP server, the per-turn token accounting, GetMetrics sampling, the figures and ratios, the
skip without a peer, and one real conversation through the live gateway, checked against what the
server's replies and counters say it cached."""

from __future__ import annotations

import asyncio
import heapq
import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.figures import Figure
from bench.peers import llama_server
from bench.peers.chat_workload import NONCE_WORDS
from bench.peers.conversation_plan import (
    SIZES,
    ConversationFactory,
    ConversationPlan,
    ConversationSizes,
    UserScript,
)
from bench.peers.conversation_run import TurnRecord, run_conversations, run_user
from bench.peers.metrics_sampler import (
    MetricsSample,
    MetricsSampler,
    PrefixCacheUse,
    blocks_per_running,
    grpc_fetch,
)
from bench.peers.turn_accounting import SLACK_TOKENS, turn_tokens
from bench.peers.turn_transport import ChatTurnTransport, TurnReply, reported_cached_tokens
from bench.run import SECTIONS
from bench.sections import conversation
from bench.timeline import RequestTimeline

WORDS = [f"w{i:03d}x" for i in range(500)]
SMALL = ConversationSizes(
    users=(2,),
    turns=3,
    answer_tokens=4,
    rounds=1,
    max_seconds=60.0,
    system_prompt_tokens=40,
    message_tokens=6,
)


def test_registered() -> None:
    assert SECTIONS["conversation"] is conversation.steps


def test_plans_share_messages_and_think_times_by_seed_never_the_nonce() -> None:
    factory = ConversationFactory(WORDS, SMALL)
    a, b = factory.plan(3, seed=7), factory.plan(3, seed=7)
    assert a.users == b.users  # every server gets the same messages and think times ...
    assert a.system.split()[NONCE_WORDS:] == b.system.split()[NONCE_WORDS:]
    assert a.system.split()[:NONCE_WORDS] != b.system.split()[:NONCE_WORDS]  # ... behind a nonce of its own
    assert len(a.system.split()) == SMALL.system_prompt_tokens and a.answer_tokens == SMALL.answer_tokens
    for script in a.users:
        assert len(script.messages) == SMALL.turns and len(script.think_s) == SMALL.turns - 1
        assert all(SMALL.think_s[0] <= t <= SMALL.think_s[1] for t in script.think_s)
        assert 0.0 <= script.start_s <= SMALL.think_s[1]
        assert all(len(m.split()) == SMALL.message_tokens for m in script.messages)
    assert factory.plan(3, seed=8).users != a.users
    with pytest.raises(ValueError, match="think times"):
        UserScript(0.0, ("a", "b"), ())
    with pytest.raises(ValueError, match="no room"):
        ConversationFactory(WORDS, replace(SMALL, system_prompt_tokens=NONCE_WORDS))


class FakeClock:
    """Virtual time for concurrent users: ``sleep`` wakes in order of wake-up time, without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self._sleeping: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = 0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self._order += 1
        wake = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleeping, (self.now + seconds, self._order, wake))
        await wake

    def run(self, main):
        async def drive():
            task = asyncio.ensure_future(main)
            while not task.done():
                for _ in range(20):  # everyone runs until it sleeps again (the transport never waits)
                    await asyncio.sleep(0)
                if self._sleeping and not task.done():
                    self.now, _, wake = heapq.heappop(self._sleeping)
                    wake.set_result(None)
            return task.result()

        return asyncio.run(drive())


class ScriptedTransport:
    """Answers each turn with a text naming the turn, at the fake clock's time; fails the turns named."""

    name = "scripted"

    def __init__(self, clock: FakeClock, fail: frozenset[tuple[str, int]] = frozenset()) -> None:
        self.clock = clock
        self.fail = fail
        self.sent: list[list[dict[str, str]]] = []

    async def send(self, messages: list[dict[str, str]], max_tokens: int) -> TurnReply:
        self.sent.append(messages)
        user_turns = [m for m in messages if m["role"] == "user"]
        first, turn, now = user_turns[0]["content"], len(user_turns), self.clock.now
        timeline = RequestTimeline(sent=now, prompt_tokens=sum(len(m["content"].split()) for m in messages))
        timeline.add_chunk(now + 0.01, max_tokens)
        if (first, turn) in self.fail:
            timeline.fail(now + 0.02, "HTTP 500: boom")
        else:
            timeline.finish(now + 0.02)
        return TurnReply(timeline, text=f"answer {turn} to {first}", response_id=f"id-{first}-{turn}")

    async def close(self) -> None:
        pass


def _plan() -> ConversationPlan:
    users = (
        UserScript(0.3, ("u0a", "u0b", "u0c"), (1.5, 0.5)),
        UserScript(1.0, ("u1a", "u1b", "u1c"), (2.0, 0.7)),
    )
    return ConversationPlan("system words", users, answer_tokens=5)


def test_each_turn_sends_the_history_with_the_answers_the_server_returned() -> None:
    clock = FakeClock()
    transport = ScriptedTransport(clock)
    records = clock.run(run_user(transport, _plan(), 0, deadline=100.0, sleep=clock.sleep, clock=clock))
    assert [r.turn for r in records] == [1, 2, 3] and all(r.user == 0 for r in records)
    assert transport.sent[0] == [
        {"role": "system", "content": "system words"},
        {"role": "user", "content": "u0a"},
    ]
    assert transport.sent[2] == [
        {"role": "system", "content": "system words"},
        {"role": "user", "content": "u0a"}, {"role": "assistant", "content": "answer 1 to u0a"},
        {"role": "user", "content": "u0b"}, {"role": "assistant", "content": "answer 2 to u0a"},
        {"role": "user", "content": "u0c"},
    ]  # fmt: skip
    assert clock.slept == [0.3, 1.5, 0.5]  # the start offset, then the think time before each later turn
    assert [r.reply.timeline.sent for r in records] == pytest.approx([0.3, 1.8, 2.3])
    assert records[2].prompt_tokens > records[1].prompt_tokens > records[0].prompt_tokens


def test_users_talk_at_once_and_no_turn_starts_after_the_deadline() -> None:
    clock = FakeClock()
    records = clock.run(
        run_conversations(ScriptedTransport(clock), _plan(), 2.0, sleep=clock.sleep, clock=clock)
    )
    # user 0: turns at 0.3 and 1.8, the third would be at 2.3; user 1: at 1.0, the second would be at 3.0
    assert [(r.user, r.turn, round(r.reply.timeline.sent, 6)) for r in records] == [
        (0, 1, 0.3),
        (0, 2, 1.8),
        (1, 1, 1.0),
    ]


def test_a_failed_turn_ends_its_conversation() -> None:
    clock = FakeClock()
    transport = ScriptedTransport(clock, fail=frozenset({("u0a", 2)}))
    records = clock.run(run_conversations(transport, _plan(), 3.5, sleep=clock.sleep, clock=clock))
    assert [(r.user, r.turn, r.reply.timeline.ok) for r in records] == [
        (0, 1, True),
        (0, 2, False),
        (1, 1, True),
        (1, 2, True),
    ]  # user 1's third turn (3.7 s) is past 3.5
    assert len(transport.sent) == 4


def _record(
    user: int, turn: int, prompt: int, cached: int | None, rid: str = "", ok: bool = True
) -> TurnRecord:
    timeline = RequestTimeline(sent=0.0, prompt_tokens=prompt)
    timeline.add_chunk(0.1 * turn, 4)
    if ok:
        timeline.finish(0.2 * turn)
    else:
        timeline.fail(0.2, "HTTP 503")
    return TurnRecord(user, turn, TurnReply(timeline, "text", rid or f"r{user}.{turn}", cached))


def _sse_reply(events: list[dict]) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


def test_a_turn_keeps_the_answer_text_the_id_and_what_the_server_cached() -> None:
    """ChatTurnTransport against a scripted HTTP server: the request carries the history; the role-only
    chunk is no token; the text is the content chunks joined; usage sets prompt and cached tokens."""
    chunk = {"id": "chatcmpl-7", "choices": [{"delta": {"content": ""}}]}
    events = [
        {"id": "chatcmpl-7", "choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {**chunk, "choices": [{"delta": {"content": "Hello"}}]},
        {**chunk, "choices": [{"delta": {"content": " there"}}]},
        {**chunk, "choices": [{"delta": {}, "finish_reason": "length"}]},
        {"id": "chatcmpl-7", "choices": [], "usage": {"prompt_tokens": 530, "completion_tokens": 3,
                                                       "prompt_tokens_details": {"cached_tokens": 512}}},
    ]  # fmt: skip
    received: list[dict] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
        )
        received.append(json.loads(await reader.readexactly(length)))
        writer.write(_sse_reply(events))
        await writer.drain()

    async def main() -> TurnReply:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = ChatTurnTransport("scripted", f"http://127.0.0.1:{port}", 1, "m")
        try:
            history = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
            return await transport.send(history, 3)
        finally:
            await transport.close()
            server.close()

    reply = asyncio.run(main())
    assert received[0]["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert received[0]["max_tokens"] == 3 and received[0]["stream"] and received[0]["ignore_eos"]
    assert reply.timeline.ok and reply.text == "Hello there" and reply.response_id == "chatcmpl-7"
    # two content chunks, the third token counted from usage; cached as the server said
    assert reply.timeline.output_tokens == 3 and len(reply.timeline.chunks) == 2
    assert reply.timeline.prompt_tokens == 530 and reply.cached_tokens == 512


def test_cached_tokens_are_what_the_usage_says_and_none_when_it_says_nothing() -> None:
    assert reported_cached_tokens({"prompt_tokens_details": {"cached_tokens": 7}}) == 7
    assert reported_cached_tokens({"prompt_tokens_details": {}}) == 0  # a proto3 zero left out of the JSON
    assert reported_cached_tokens({"prompt_tokens": 5}) is None


def test_turn_tokens_count_new_computed_and_recomputed_prefixes() -> None:
    records = [
        _record(0, 2, 660, 640),
        _record(0, 1, 560, 0),
        _record(0, 3, 760, 600),  # turn 3 lost 60 cached tokens
        _record(1, 1, 560, 544),
        _record(1, 2, 660, 560 - SLACK_TOKENS),  # at the slack: not recomputed
        _record(2, 1, 560, 544),
        _record(2, 2, 660, None),  # unknown: not counted, still the next one's base
        _record(2, 3, 760, 0, ok=False),
    ]
    tokens = {(t.user, t.turn): t for t in turn_tokens(records)}
    assert set(tokens) == {(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (2, 1)}
    assert tokens[(0, 2)].new == 100 and tokens[(0, 2)].computed == 20 and not tokens[(0, 2)].recomputed
    assert tokens[(0, 3)].previous_prompt == 660 and tokens[(0, 3)].recomputed
    assert tokens[(0, 1)].new == 560 and not tokens[(0, 1)].recomputed  # a first turn has no prefix to keep
    assert not tokens[(1, 2)].recomputed
    with pytest.raises(ValueError, match="more than one run"):
        turn_tokens(records + [_record(0, 1, 560, 0)])  # a second round's conversations are their own


def test_metrics_sampler_and_what_it_derives() -> None:
    samples = iter(
        [
            MetricsSample(0.0, 0, 1000, 100, 2),
            MetricsSample(0.5, 4, 1500, 400, 2),
            MetricsSample(0.25, 1, 1800, 600, 3),
        ]
    )
    last = MetricsSample(0.0, 0, 2000, 1600, 3)

    async def fetch() -> MetricsSample:
        return next(samples, last)

    async def main() -> MetricsSampler:
        async with MetricsSampler(fetch, interval=0.001) as sampler:
            while len(sampler.samples) < 3:
                await asyncio.sleep(0.001)
        return sampler

    sampler = asyncio.run(main())
    assert sampler.samples[0].prefix_cache_queries == 1000 and sampler.samples[-1] == last
    use = PrefixCacheUse.between(sampler.samples[0], sampler.samples[-1])
    assert (use.queries, use.hits, use.preemptions, use.hit_rate) == (1000, 1500, 1, 1.5)
    assert (use + use).queries == 2000 and PrefixCacheUse(0, 0, 0).hit_rate is None
    # 0.5 of 400 blocks over 4 running = 50; 0.25 of 400 over 1 = 100; idle samples do not count
    assert blocks_per_running(sampler.samples, 400) == pytest.approx(75.0)
    assert blocks_per_running([last], 400) is None


def _level(
    prompt_step: int = 100, ttft: float = 0.1, cached_ok: bool = True, counters: bool = True
) -> conversation.ServerLevel:
    rounds = []
    for r in range(2):
        run = []
        for user in range(2):
            for turn in (1, 2, 3):
                prompt = 500 + prompt_step * (turn - 1)
                cached = (prompt - prompt_step if turn > 1 else 480) if cached_ok else 0
                t = RequestTimeline(sent=10.0 * r + turn, prompt_tokens=prompt)
                t.add_chunk(10.0 * r + turn + ttft * (5 if turn == 1 else 1), 1)
                t.add_chunk(10.0 * r + turn + 0.5, 7)
                t.finish(10.0 * r + turn + 0.5)
                run.append(TurnRecord(user, turn, TurnReply(t, "x", f"{r}.{user}.{turn}", cached)))
        rounds.append(run)
    if not counters:  # llama-server: only its replies say what they cached
        return conversation.ServerLevel(rounds)
    samples = [MetricsSample(0.1, 2, 0, 0, 0), MetricsSample(0.2, 4, 100, 90, 0)]
    return conversation.ServerLevel(rounds, PrefixCacheUse(6000, 5000, 0), samples)


def test_level_figures_hold_later_turns_ttft_to_a_tenth_of_the_peer() -> None:
    levels = {
        "protoserve": _level(ttft=0.05),
        "llama-server": _level(ttft=1.0, cached_ok=False, counters=False),
    }
    figures = {f.name: f for f in conversation.level_figures(16, levels, pool=640, peer_reason=None)}
    assert set(figures) == {n for n, _ in conversation.figure_names(replace(SMALL, users=(16,)))}
    ours, theirs = "conversation.protoserve.u16", "conversation.llama-server.u16"
    assert figures[f"{ours}.ttft_p50"].value == pytest.approx(0.05)
    assert figures[f"{ours}.turn1.ttft_p50"].value == pytest.approx(0.25)  # first turns apart
    ratio = figures["conversation.ttft_ratio.u16"]
    assert ratio.value == pytest.approx(0.05) and ratio.target is not None and ratio.met
    assert (
        figures["conversation.ttft_ratio.turn1.u16"].value == pytest.approx(0.05)
        and figures["conversation.ttft_ratio.turn1.u16"].target is None
    )
    assert figures["conversation.ratio.u16"].value == pytest.approx(1.0)  # the same tokens in the same time
    # 8 tokens each of 6 turns per round, each round 2.5 s from first send to last finish
    assert figures[ours].value == pytest.approx(2 * 6 * 8 / 5.0)
    assert figures[f"{ours}.prefix_hit_rate"].value == pytest.approx(5000 / 6000)  # GetMetrics' counters
    assert figures[f"{theirs}.prefix_hit_rate"].value == 0.0  # its replies' cached_tokens
    computed = figures[f"{ours}.computed_tokens"]
    assert computed.value == 100 and computed.details["new_tokens"] == 100
    assert figures[f"{ours}.recomputed_turns"].value == 0 and figures[f"{ours}.recomputed_turns"].met
    assert (
        figures[f"{theirs}.recomputed_turns"].value == 8
        and figures[f"{theirs}.recomputed_turns"].target is None
    )
    kv = figures[f"{ours}.kv_blocks_per_user"]
    assert kv.value == pytest.approx((0.1 * 640 / 2 + 0.2 * 640 / 4) / 2) and kv.details["peak_blocks"] == 128


def test_without_the_peer_protoserve_is_reported_and_the_peer_skipped_with_the_reason() -> None:
    reason = "llama.cpp peer not built for this CPU: run `make bench-peers`"
    figures = conversation.level_figures(4, {"protoserve": _level()}, pool=64, peer_reason=reason)
    measured = [f for f in figures if f.value is not None]
    assert {f.name for f in measured} == {n for n, _ in conversation.server_figure_names("protoserve", 4)}
    missing = [f for f in figures if f.value is None]
    assert all("make bench-peers" in f.note for f in missing)
    assert {f.name for f in missing} >= {n for n, _ in conversation.ratio_names(4)}


def test_a_level_whose_turns_all_failed_is_skipped_with_the_error() -> None:
    failed = [_record(0, 1, 500, None, ok=False)]
    figures = conversation.server_figures("protoserve", 2, conversation.ServerLevel([failed]), pool=64)
    assert all(f.value is None and "HTTP 503" in f.note for f in figures)


def test_both_servers_get_room_for_every_conversation() -> None:
    for sizes in SIZES.values():
        slot = conversation.slot_tokens(sizes)
        assert slot >= sizes.conversation_tokens() and slot % 256 == 0
        assert conversation.pool_blocks(sizes) * conversation.BLOCK_SIZE == max(sizes.users) * slot
    assert SIZES["default"].users == (16, 64)
    cmd = llama_server.server_command(
        Path("/b/s"),
        Path("/m.gguf"),
        2,
        8080,
        parallel=16,
        context=16 * 1280,
        extra_args=("--cache-reuse", "256"),
    )
    assert cmd[cmd.index("-np") + 1] == "16" and cmd[cmd.index("-c") + 1] == "20480"
    assert cmd[-2:] == ["--cache-reuse", "256"]
    assert [conversation.round_order(r, ("a", "b")) for r in range(3)] == [("a", "b"), ("b", "a"), ("a", "b")]


def test_the_step_serves_protoserve_with_the_pool_and_expects_every_figure() -> None:
    from bench.context import BenchContext
    from bench.profile import PROFILES

    [step] = conversation.steps(BenchContext(PROFILES["smoke"]))
    assert step.resource.speculative and step.resource.label == "conversation"
    assert step.resource.args == ("--max-kv-blocks", str(conversation.pool_blocks(SIZES["smoke"])))
    assert list(step.expects) == conversation.figure_names(SIZES["smoke"])
    assert all(isinstance(f, Figure) for f in step.skipped("x")) and len(step.skipped("x")) == len(
        step.expects
    )


# -- against the live gateway -------------------------------------------------------------------


def test_a_real_conversation_reuses_its_prefix_turn_after_turn(live_server, clean_log) -> None:
    """Two users, three turns each, over a shared system prompt through the live gateway's chat route:
    the answers the server returned go into the next prompt, each reply's usage and GetMetrics show every
    later turn took the previous turn's prompt from the cache, and the second user the system prompt."""
    from bench import resources
    from bench.peers.chat_workload import model_words

    assert live_server.http_port, "the server started no REST gateway"
    sizes = replace(SMALL, system_prompt_tokens=200, message_tokens=12, answer_tokens=6, think_s=(0.0, 0.05))
    plan = ConversationFactory(model_words(resources.model_path()), sizes).plan(2, seed=1)
    # The second user starts a second after the first, once the shared system prompt's blocks are
    # computed: two first turns admitted into one step both compute it (and the plan had them 50 ms apart).
    first, second = plan.users
    plan = replace(plan, users=(first, replace(second, start_s=first.start_s + 1.0)))

    async def main() -> tuple[list[TurnRecord], list[MetricsSample]]:
        fetch, close = grpc_fetch(live_server.grpc_target)
        base_url = f"http://127.0.0.1:{live_server.http_port}"
        transport = ChatTurnTransport("protoserve", base_url, 2, "SmolLM2-135M-Instruct")
        try:
            async with MetricsSampler(fetch, interval=0.05) as sampler:
                records = await run_conversations(transport, plan, max_seconds=120.0)
        finally:
            await transport.close()
            await close()
        return records, sampler.samples

    records, samples = asyncio.run(main())
    errors = [r.reply.timeline.error for r in records if not r.reply.timeline.ok]
    assert len(records) == 6 and not errors, errors
    assert all(r.reply.text and r.reply.response_id.startswith("chatcmpl") for r in records)
    tokens = turn_tokens(records)
    assert len(tokens) == 6  # every reply said what it took from the cache
    later = [t for t in tokens if t.turn > 1]
    # The answer and the next message went in ...
    assert all(t.new > sizes.message_tokens + sizes.answer_tokens for t in later)
    # ... and only about them was computed: the previous prompt came from the cache.
    assert not [t for t in later if t.recomputed], [
        (t.turn, t.prompt, t.cached, t.previous_prompt) for t in later
    ]
    assert all(t.computed < t.new + SLACK_TOKENS for t in later)
    # The second user to start found the shared system prompt's blocks cached.
    assert max(t.cached for t in tokens if t.turn == 1) >= sizes.system_prompt_tokens - SLACK_TOKENS
    use = PrefixCacheUse.between(samples[0], samples[-1])
    assert use.hits >= sum(t.cached for t in tokens) and use.hit_rate is not None and use.hit_rate > 0.5
