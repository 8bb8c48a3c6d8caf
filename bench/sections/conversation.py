"""Multi-turn conversations over a shared system prompt: protoserve beside llama-server in the same run.

N users at once (16 and 64; 2 and 4 with ``--smoke``), each holding a
conversation of several turns over the same ~500-token system prompt, each
turn sending the whole history (the previous answers as the server returned
them) through the server's OpenAI chat route, streamed, greedy, EOS ignored,
with a seeded think time after each answer (bench/peers/conversation_plan.py,
bench/peers/conversation_run.py). This is where a prefix cache pays: turn k
should compute only what turn k-1 did not leave in the cache.

Both servers get room for every conversation at its longest: llama-server as
its README serves many users, one slot per user with prompt caching (on by
default) and ``--cache-reuse 256`` (``-np <users> -c <users x slot>``);
``protoserve serve`` at its defaults (default speculation included) with
``--max-kv-blocks`` of the same tokens. Each level runs in rounds, the servers
in turn, the order reversed each round, each (server, round) with a system
prompt of its own nonce.

Figures per server and level: tokens/s (output tokens over each round's wall
time, think time included: both servers get the same think times), time to
first token p50/p99 of first turns and of later turns apart, the prefix-cache
hit rate (protoserve: GetMetrics' counters; llama-server: its usage's
``cached_tokens`` over its prompt tokens), prompt tokens computed per later
turn (median; the new tokens per turn beside it), the later turns that
recomputed their conversation's cached prefix (bench/peers/turn_accounting.py),
and protoserve's KV blocks in use per running conversation (GetMetrics); then
protoserve / llama-server ratios. Without a built peer (``make bench-peers``)
protoserve is measured and the peer's figures are skipped with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import resources
from bench.context import BenchContext
from bench.figures import Better, Figure, Target, skipped
from bench.load_generator import run_clients
from bench.load_result import LoadResult
from bench.peers import llamacpp
from bench.peers.chat_workload import model_words
from bench.peers.conversation_plan import SIZES, ConversationFactory, ConversationPlan, ConversationSizes
from bench.peers.conversation_run import TurnRecord, run_conversations
from bench.peers.llama_server import LlamaServerProcess, server_command
from bench.peers.metrics_sampler import (
    Fetch,
    MetricsSample,
    MetricsSampler,
    PrefixCacheUse,
    blocks_per_running,
    grpc_fetch,
)
from bench.peers.ratios import ratio_figure
from bench.peers.turn_accounting import TurnTokens, turn_tokens
from bench.peers.turn_transport import ChatTurnTransport, TurnTransport
from bench.resources import Server
from bench.runner import Step
from bench.sections.peer_serving import skip_reason
from bench.server_process import free_port
from bench.stats import LatencySummary, median

SECTION = "conversation"
OURS, PEER = "protoserve", "llama-server"
SERVERS = (OURS, PEER)
WORKLOAD = 48  # seed stream (issue 48)
BLOCK_SIZE = 16  # protoserve's KV block, in tokens (serve's default)
SLOT_ROUNDING = 256
CACHE_REUSE = 256  # llama-server's --cache-reuse: shortest chunk it shifts into place to reuse
# The issue's goal: later turns' first tokens in at most a tenth of llama-server's time; and no turn
# recomputing a prefix the cache still held (the pool is sized to hold every conversation).
TTFT_TARGET = Target(0.1, "lower")
RECOMPUTE_TARGET = Target(0.0, "lower")
# protoserve / llama-server: (ratio, of which figure after conversation.<server>.u<N>, better, target)
RATIOS: tuple[tuple[str, str, Better, Target | None], ...] = (
    ("ratio", "", "higher", None),
    ("ttft_ratio", ".ttft_p50", "lower", TTFT_TARGET),
    ("ttft_ratio.turn1", ".turn1.ttft_p50", "lower", None),
)


def _name(*parts: str) -> str:
    return ".".join((SECTION, *parts))


def slot_tokens(sizes: ConversationSizes) -> int:
    """Context for one conversation at its longest, a quarter spare (answers re-tokenize to a few more
    tokens), rounded up to a multiple of 256."""
    return math.ceil(sizes.conversation_tokens() * 1.25 / SLOT_ROUNDING) * SLOT_ROUNDING


def pool_blocks(sizes: ConversationSizes) -> int:
    """protoserve's pool: the widest level's conversations at their longest, as llama-server's context."""
    return max(sizes.users) * slot_tokens(sizes) // BLOCK_SIZE


def server_figure_names(server: str, users: int) -> list[tuple[str, str]]:
    base = _name(server, f"u{users}")
    out = [(base, "tok/s")]
    out += [(f"{base}{part}.{p}", "s") for part in ("", ".turn1") for p in ("ttft_p50", "ttft_p99")]
    out += [
        (f"{base}.prefix_hit_rate", "rate"),
        (f"{base}.computed_tokens", "tokens"),
        (f"{base}.recomputed_turns", "turns"),
    ]
    if server == OURS:
        out.append((f"{base}.kv_blocks_per_user", "blocks"))
    return out


def ratio_names(users: int) -> list[tuple[str, str]]:
    return [(_name(kind, f"u{users}"), "x") for kind, *_ in RATIOS]


def figure_names(sizes: ConversationSizes) -> list[tuple[str, str]]:
    """Every (figure, unit) the section reports."""
    out: list[tuple[str, str]] = []
    for users in sizes.users:
        for server in SERVERS:
            out += server_figure_names(server, users)
        out += ratio_names(users)
    return out


def round_order(round_index: int, servers: Sequence[str]) -> tuple[str, ...]:
    """The servers as given in even rounds, reversed in odd ones."""
    return tuple(servers) if round_index % 2 == 0 else tuple(reversed(servers))


@dataclass
class ServerLevel:
    """One server's turns at one level, round by round, and (protoserve) what GetMetrics said meanwhile."""

    rounds: list[list[TurnRecord]] = field(default_factory=list)
    cache_use: PrefixCacheUse | None = None
    samples: list[MetricsSample] = field(default_factory=list)

    @property
    def records(self) -> list[TurnRecord]:
        return [r for run in self.rounds for r in run]

    def tokens(self) -> list[TurnTokens]:
        """Every round's turns with their prompt tokens (a round's conversations are its own)."""
        return [t for run in self.rounds for t in turn_tokens(run)]


def _ttft_figures(base: str, records: Sequence[TurnRecord], first: bool) -> list[Figure]:
    name = f"{base}.turn1" if first else base
    ttfts = [t for r in records if (r.turn == 1) == first and r.reply.timeline.ok
             if (t := r.reply.timeline.ttft) is not None]  # fmt: skip
    summary = LatencySummary.of(ttfts)
    if summary is None:
        reason = "no first turn answered" if first else "no later turn answered"
        return [skipped(f"{name}.{p}", "s", SECTION, reason) for p in ("ttft_p50", "ttft_p99")]
    return [
        Figure(
            f"{name}.ttft_p50", summary.p50, "s", SECTION, better="lower", details={"turns": summary.count}
        ),
        Figure(f"{name}.ttft_p99", summary.p99, "s", SECTION, better="lower"),
    ]


def _median_of(values: Iterable[float]) -> float | None:
    values = [float(v) for v in values]
    return median(values) if values else None


def _token_figures(server: str, base: str, level: ServerLevel, pool: int) -> list[Figure]:
    tokens = level.tokens()
    first, later = [t for t in tokens if t.turn == 1], [t for t in tokens if t.turn > 1]
    names = [
        (f"{base}.prefix_hit_rate", "rate"),
        (f"{base}.computed_tokens", "tokens"),
        (f"{base}.recomputed_turns", "turns"),
    ]
    if not later:
        reason = "no later turn said how many prompt tokens it took from the cache"
        return [skipped(n, u, SECTION, reason) for n, u in names]
    rate, source = _hit_rate(tokens, level.cache_use)
    computed_details = {
        "new_tokens": _median_of(t.new for t in later),
        "cached_tokens": _median_of(t.cached for t in later),
        # First turns: the shared system prompt is cached for every user but the first to send it.
        "turn1_computed": _median_of(t.computed for t in first),
        "turn1_cached": _median_of(t.cached for t in first),
    }
    recomputed_details: dict[str, Any] = {"turns_checked": len(later)}
    if level.cache_use is not None:
        recomputed_details |= {"pool_blocks": pool, "preemptions": level.cache_use.preemptions}
    return [
        Figure(names[0][0], rate, "rate", SECTION, details={"from": source}),
        Figure(
            names[1][0],
            _median_of(t.computed for t in later),
            "tokens",
            SECTION,
            better="lower",
            details=computed_details,
        ),
        Figure(
            names[2][0],
            float(sum(t.recomputed for t in later)),
            "turns",
            SECTION,
            better="lower",
            target=RECOMPUTE_TARGET if server == OURS else None,
            details=recomputed_details,
        ),
    ]


def _hit_rate(tokens: Sequence[TurnTokens], cache_use: PrefixCacheUse | None) -> tuple[float, str]:
    """The server's own counters where it has them, else its replies' cached over prompt tokens."""
    if cache_use is not None and cache_use.hit_rate is not None:
        return cache_use.hit_rate, "GetMetrics prefix_cache_hits / prefix_cache_queries"
    rate = sum(t.cached for t in tokens) / max(1, sum(t.prompt for t in tokens))
    return rate, "usage cached_tokens / prompt_tokens"


def _kv_figure(base: str, level: ServerLevel, pool: int) -> Figure:
    name = f"{base}.kv_blocks_per_user"
    per_user = blocks_per_running(level.samples, pool)
    if per_user is None:
        return skipped(name, "blocks", SECTION, "no GetMetrics sample saw a request running")
    details = {
        "pool_blocks": pool,
        "peak_blocks": round(max(s.kv_usage for s in level.samples) * pool),
        # A later turn's context unshared: the system prompt's blocks counted once for each user.
        "context_blocks": _median_of(math.ceil(t.prompt / BLOCK_SIZE) for t in level.tokens() if t.turn > 1),
    }
    return Figure(name, per_user, "blocks", SECTION, better="lower", details=details)


def server_figures(server: str, users: int, level: ServerLevel, pool: int) -> list[Figure]:
    """One server's figures at one level."""
    base = _name(server, f"u{users}")
    result = LoadResult.of_rounds([[r.reply.timeline for r in run] for run in level.rounds])
    if not result.requests or result.errors == result.requests:
        reason = f"all {result.requests} turns failed: {result.first_error}"
        return [skipped(n, u, SECTION, reason) for n, u in server_figure_names(server, users)]
    records = level.records
    rates = [LoadResult.of([r.reply.timeline for r in run]).tokens_per_s for run in level.rounds]
    throughput = Figure(
        base,
        result.tokens_per_s,
        "tok/s",
        SECTION,
        details={
            "users": users,
            **result.details(),
            "rounds_tok_s": "/".join(f"{v:.0f}" for v in rates),
            "last_turn_prompt_tokens": median(
                [float(r.prompt_tokens) for r in records if r.turn == max(x.turn for x in records)]
            ),
        },
    )
    out = [
        throughput,
        *_ttft_figures(base, records, first=False),
        *_ttft_figures(base, records, first=True),
        *_token_figures(server, base, level, pool),
    ]
    if server == OURS:
        out.append(_kv_figure(base, level, pool))
    return out


def ratio_figures(users: int, ours: Sequence[Figure], theirs: Sequence[Figure]) -> list[Figure]:
    """protoserve / llama-server of each figure in RATIOS."""
    a = {f.name.removeprefix(_name(OURS, f"u{users}")): f for f in ours}
    b = {f.name.removeprefix(_name(PEER, f"u{users}")): f for f in theirs}
    return [
        ratio_figure(_name(kind, f"u{users}"), SECTION, a[of], b[of], better, target)
        for kind, of, better, target in RATIOS
    ]


def level_figures(
    users: int, levels: dict[str, ServerLevel], pool: int, peer_reason: str | None
) -> list[Figure]:
    """Both servers' figures at one level and their ratios; a server not measured is skipped, with why."""
    per_server: dict[str, list[Figure]] = {}
    for server in SERVERS:
        if server in levels:
            per_server[server] = server_figures(server, users, levels[server], pool)
        else:
            reason = peer_reason or f"{server} was not measured"
            per_server[server] = [
                skipped(n, u, SECTION, reason) for n, u in server_figure_names(server, users)
            ]
    return [*per_server[OURS], *per_server[PEER], *ratio_figures(users, per_server[OURS], per_server[PEER])]


async def _warm_up(transport: TurnTransport) -> None:
    """A short conversation, unmeasured: opens a connection and runs the chat path once."""
    await transport.send([{"role": "user", "content": "Say hello."}], 4)


async def _round(
    level: ServerLevel,
    transport: TurnTransport,
    plan: ConversationPlan,
    max_seconds: float,
    fetch: Fetch | None,
) -> None:
    """One round of one server's conversations; with ``fetch``, GetMetrics sampled meanwhile."""
    if fetch is None:
        level.rounds.append(await run_conversations(transport, plan, max_seconds))
        return
    async with MetricsSampler(fetch) as sampler:
        level.rounds.append(await run_conversations(transport, plan, max_seconds))
    use = PrefixCacheUse.between(sampler.samples[0], sampler.samples[-1])
    level.cache_use = use if level.cache_use is None else level.cache_use + use
    level.samples += sampler.samples


async def _measure(
    ctx: BenchContext, sizes: ConversationSizes, transports: dict[str, TurnTransport], ours_target: str
) -> dict[int, dict[str, ServerLevel]]:
    """Every level, round by round, the servers in turn; GetMetrics sampled while protoserve's run."""
    factory = ConversationFactory(model_words(resources.model_path()), sizes)
    servers = [s for s in SERVERS if s in transports]
    fetch, close_metrics = grpc_fetch(ours_target)
    out: dict[int, dict[str, ServerLevel]] = {}
    try:
        for transport in transports.values():
            await _warm_up(transport)
        for users in sizes.users:
            levels = {server: ServerLevel() for server in servers}
            for r in range(sizes.rounds):
                for server in round_order(r, servers):
                    # The same messages and think times for every server in a round, a fresh nonce each.
                    plan = factory.plan(
                        users, seed=ctx.seed * 1_000_003 + WORKLOAD * 10_000 + users * 100 + r
                    )
                    await _round(
                        levels[server],
                        transports[server],
                        plan,
                        sizes.max_seconds,
                        fetch if server == OURS else None,
                    )
            out[users] = levels
    finally:
        for transport in transports.values():
            await transport.close()
        await close_metrics()
    return out


def _start_peer(
    binaries: llamacpp.LlamaCppBinaries, model: Path, sizes: ConversationSizes, log_dir: Path
) -> LlamaServerProcess:
    """llama-server with a slot per user of the widest level, each with room for a whole conversation."""
    import torch

    port = free_port()
    command = server_command(
        binaries.server,
        model,
        torch.get_num_threads(),
        port,
        parallel=max(sizes.users),
        context=max(sizes.users) * slot_tokens(sizes),
        extra_args=("--cache-reuse", str(CACHE_REUSE)),
    )
    return LlamaServerProcess.start(command, port, log_dir / "llama-server-conversation.log")


def _step(ctx: BenchContext) -> Step:
    sizes = SIZES.get(ctx.profile.name, SIZES["default"])
    variant = ctx.profile.serving_variant
    pool = pool_blocks(sizes)
    expects = tuple(figure_names(sizes))
    widest = max(sizes.users)

    def run(server: Any) -> list[Figure]:
        if server.http_base_url is None:
            return [
                skipped(n, u, SECTION, "the protoserve server started no REST gateway") for n, u in expects
            ]
        lookup = llamacpp.find()
        model = resources.model_path()
        peer_reason = skip_reason(lookup, model)
        transports: dict[str, TurnTransport] = {
            OURS: ChatTurnTransport(OURS, server.http_base_url, widest, server.model_name())
        }
        peer = None
        try:
            if peer_reason is None:
                assert lookup.binaries is not None
                peer = _start_peer(lookup.binaries, model, sizes, server.log_path.parent)
                transports[PEER] = ChatTurnTransport(PEER, peer.base_url, widest, model.name)
            measured = run_clients(_measure(ctx, sizes, transports, server.grpc_target))
        finally:
            if peer is not None:
                peer.stop()
        figures = [
            f for users in sizes.users for f in level_figures(users, measured[users], pool, peer_reason)
        ]
        if peer is None or lookup.binaries is None:
            return figures
        # Which build met, with its flags: said once, on the peer's first line.
        first = _name(PEER, f"u{sizes.users[0]}")
        note = (
            f"{lookup.binaries.describe()}: -np {widest} -c {widest * slot_tokens(sizes)} "
            f"--cache-reuse {CACHE_REUSE}"
        )
        return [replace(f, note=note) if f.name == first and f.value is not None else f for f in figures]

    description = (
        f"conversations: {'/'.join(map(str, sizes.users))} users x {sizes.turns} turns over a "
        f"{sizes.system_prompt_tokens}-token system prompt, protoserve {variant.label} and llama-server"
    )
    resource = Server(variant, speculative=True, label=SECTION, args=("--max-kv-blocks", str(pool)))
    return Step(SECTION, resource, description, run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    return [_step(ctx)]
