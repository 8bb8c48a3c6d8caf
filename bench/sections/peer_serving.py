"""protoserve beside llama.cpp's llama-server: both up at once, the same chat load through each one's
OpenAI chat route, level by level in turn.

``protoserve serve`` as a user starts it (the served variant: for the default
Q4_1 GGUF, what ``protoserve serve`` picks by itself, int4 layers and bf16
K/V, and its default n-gram speculation while one sequence runs), the same
with ``--activation-precision fast`` (one int8 code per activation, llama.cpp's
own Q8 activations: the comparison at the peer's precision, reported beside
the default's, without targets) and ``llama-server -np 64 -c 32768 -t <threads>`` on the same GGUF file.
Each request is a ~100-token chat prompt whose system message opens with a
nonce (bench/peers/chat_workload.py), streamed, greedy, EOS ignored, 64 new
tokens. At each level (1, 4, 16, 64 concurrent clients) every round runs
the servers one after the other, the order reversed each round, so a slow
stretch of the shared machine falls on all; each figure pools its rounds as
the serving section's do. While one server is loaded the others idle.

Figures: aggregate tokens/s and TTFT p50 of each server per level, the ratios
protoserve / llama-server (tokens/s: above 1 protoserve is faster; TTFT: below
1 its first tokens come sooner; ``ratio_fast`` / ``ttft_ratio_fast`` for the
fast mode), and the default server's and llama-server's resident memory (the
process tree) idle after warm-up and at the peak of its c=64 run. Without a
built peer (``make bench-peers``) every figure is skipped with the reason.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import resources
from bench.context import BenchContext
from bench.figures import Figure, Target, skipped
from bench.load_generator import run_clients, run_load, warm_up
from bench.load_result import LoadResult
from bench.peers import llamacpp
from bench.peers.chat_transport import ChatSseTransport
from bench.peers.chat_workload import ChatPromptFactory, model_words
from bench.peers.llama_server import LlamaServerProcess, server_command
from bench.peers.ratios import ratio_figure
from bench.peers.rss import PeakRss, tree_rss_bytes
from bench.resources import Server
from bench.runner import Step
from bench.server_process import ServerProcess, free_port
from bench.stats import median
from bench.timeline import RequestTimeline

SECTION = "peer_serving"
OURS, FAST, PEER = "protoserve", "protoserve-fast", "llama-server"
SERVERS = (OURS, FAST, PEER)
RSS_SERVERS = (OURS, PEER)  # the fast mode's process holds the same model
RATIO_SUFFIX = {OURS: "", FAST: "_fast"}
UNIT = "tok/s"
MIB = 1024 * 1024
WORKLOAD = 28  # prompt-body seed stream
# The goals for the ratios (issue 28): aggregate at c16 and c64, TTFT p50 at c16.
TARGETS = {
    "ratio.c16": Target(5.0, "higher"),
    "ratio.c64": Target(6.0, "higher"),
    "ttft_ratio.c16": Target(0.1, "lower"),
}


def _name(*parts: str) -> str:
    return ".".join((SECTION, *parts))


def figure_names(levels: Sequence[int]) -> list[tuple[str, str]]:
    """Every (figure, unit) the section reports for these load levels."""
    out: list[tuple[str, str]] = []
    for c in levels:
        for server in SERVERS:
            out += [(_name(server, f"c{c}"), UNIT), (_name(server, f"c{c}", "ttft_p50"), "s")]
        for suffix in RATIO_SUFFIX.values():
            out += [(_name(f"ratio{suffix}.c{c}"), "x"), (_name(f"ttft_ratio{suffix}.c{c}"), "x")]
    for server in RSS_SERVERS:
        out += [(_name("rss", server, "idle"), "MiB"), (_name("rss", server, f"c{max(levels)}"), "MiB")]
    return out


def round_order(round_index: int) -> tuple[str, ...]:
    """llama-server first in even rounds, last in odd ones (the rest reversed with it)."""
    order = (PEER, OURS, FAST)
    return order if round_index % 2 == 0 else order[::-1]


def level_figures(
    concurrency: int,
    rounds: dict[str, list[list[RequestTimeline]]],
    rates: dict[str, list[float]],
    cached: dict[str, int] | None = None,
) -> list[Figure]:
    """Each server's pooled tokens/s and TTFT p50 at one level, then the two ratios. ``cached``: prompt
    tokens each server said it took from its prefix cache at this level (the nonces should keep it 0)."""
    key = f"c{concurrency}"
    figures: dict[str, tuple[Figure, Figure]] = {}
    for server in SERVERS:
        result = LoadResult.of_rounds(rounds[server])
        name = _name(server, key)
        if not result.requests or result.errors == result.requests:
            reason = f"all {result.requests} requests failed: {result.first_error}"
            figures[server] = (skipped(name, UNIT, SECTION, reason), skipped(f"{name}.ttft_p50", "s", SECTION, reason))
            continue
        ok = [t for run in rounds[server] for t in run if t.ok]
        details: dict[str, Any] = {
            "concurrency": concurrency,
            **result.details(),
            "rounds_tok_s": "/".join(f"{v:.0f}" for v in rates[server]),
            "prompt_tokens": round(median([float(t.prompt_tokens) for t in ok]), 1),
            "output_tokens": round(median([float(t.output_tokens) for t in ok]), 1),
        }
        if cached is not None:
            details["cached_prompt_tokens"] = cached.get(server, 0)
        throughput = Figure(name=name, value=result.tokens_per_s, unit=UNIT, section=SECTION, details=details)
        ttft = (
            Figure(name=f"{name}.ttft_p50", value=result.ttft.p50, unit="s", section=SECTION, better="lower")
            if result.ttft is not None
            else skipped(f"{name}.ttft_p50", "s", SECTION, "no token arrived")
        )
        figures[server] = (throughput, ttft)
    theirs = figures[PEER]
    out = [*theirs]
    for server, suffix in RATIO_SUFFIX.items():
        ours = figures[server]
        out += [
            *ours,
            ratio_figure(_name(f"ratio{suffix}.{key}"), SECTION, ours[0], theirs[0],
                         target=TARGETS.get(f"ratio{suffix}.{key}")),
            ratio_figure(_name(f"ttft_ratio{suffix}.{key}"), SECTION, ours[1], theirs[1], "lower",
                         TARGETS.get(f"ttft_ratio{suffix}.{key}")),
        ]
    return out


def rss_figures(idle: dict[str, int], peak: dict[str, int], level: int) -> list[Figure]:
    """Resident memory of each server's process tree, idle and at the peak of the widest level."""
    out = []
    for server in RSS_SERVERS:
        for when, values in (("idle", idle), (f"c{level}", peak)):
            name = _name("rss", server, when)
            if server in values:
                out.append(Figure(name=name, value=values[server] / MIB, unit="MiB", section=SECTION, better="lower"))
            else:
                out.append(skipped(name, "MiB", SECTION, f"{server} was not measured {when}"))
    return out


async def _measure(
    ctx: BenchContext, transports: dict[str, ChatSseTransport], pids: dict[str, int], levels: Sequence[int]
) -> list[Figure]:
    p = ctx.profile
    words = model_words(resources.model_path())
    widest = max(levels)
    figures: list[Figure] = []
    idle: dict[str, int] = {}
    peak: dict[str, int] = {}
    try:
        for server in SERVERS:
            await warm_up(transports[server], ChatPromptFactory(words, seed=-1).specs(2, 8))
            idle[server] = tree_rss_bytes(pids[server])
        for c in levels:
            rounds: dict[str, list[list[RequestTimeline]]] = {s: [] for s in SERVERS}
            rates: dict[str, list[float]] = {s: [] for s in SERVERS}
            cached_before = {s: transports[s].cached_prompt_tokens for s in SERVERS}
            for r in range(p.serving_rounds):
                for server in round_order(r):
                    # The same bodies for every server in a round (same seed), fresh nonces for each.
                    seed = ctx.seed * 1_000_003 + WORKLOAD * 10_000 + c * 100 + r
                    specs = ChatPromptFactory(words, seed=seed).specs(p.level_requests(c), p.serving_max_tokens)
                    async with PeakRss(pids[server]) as rss:
                        result, timelines = await run_load(transports[server], specs, c, p.level_max_seconds)
                    if c == widest:
                        peak[server] = max(peak.get(server, 0), rss.peak)
                    rounds[server].append(timelines)
                    rates[server].append(result.tokens_per_s)
            cached = {s: transports[s].cached_prompt_tokens - cached_before[s] for s in SERVERS}
            figures += level_figures(c, rounds, rates, cached)
    finally:
        for transport in transports.values():
            await transport.close()
    return figures + rss_figures(idle, peak, widest)


def skip_reason(lookup: llamacpp.Lookup, model: Any) -> str | None:
    """Why the peer cannot run here, or None when it can."""
    if lookup.binaries is None:
        return lookup.reason
    if not str(model).endswith(".gguf"):
        return f"llama-server needs a GGUF file; this run's model is {model}"
    return None


def _step(ctx: BenchContext) -> Step:
    levels = ctx.profile.concurrencies
    variant = ctx.profile.serving_variant
    expects = tuple(figure_names(levels))

    def run(server: Any) -> list[Figure]:
        import torch

        lookup = llamacpp.find()
        model = resources.model_path()
        reason = skip_reason(lookup, model)
        if reason is None and server.http_base_url is None:
            reason = "the protoserve server started no REST gateway"
        if reason is not None:
            return [skipped(n, u, SECTION, reason) for n, u in expects]
        assert lookup.binaries is not None
        port = free_port()
        command = server_command(lookup.binaries.server, model, torch.get_num_threads(), port)
        peer = LlamaServerProcess.start(command, port, server.log_path.parent / "llama-server.log")
        fast = None
        data_dir = tempfile.TemporaryDirectory(prefix="bench-peer-fast-")
        try:
            fast_server = Server(replace(variant, activation_precision="fast"), speculative=True)
            fast = ServerProcess.start(server.log_path.parent / fast_server.log_name, fast_server.variant,
                                       torch.get_num_threads(), speculative=True, data_dir=Path(data_dir.name))
            widest = max(levels)
            transports = {
                OURS: ChatSseTransport(OURS, server.http_base_url, widest, server.model_name()),
                FAST: ChatSseTransport(FAST, fast.http_base_url, widest, fast.model_name()),
                PEER: ChatSseTransport(PEER, peer.base_url, widest, model.name),
            }
            pids = {OURS: server.process.pid, FAST: fast.process.pid, PEER: peer.pid}
            figures = run_clients(_measure(ctx, transports, pids, levels))
        finally:
            peer.stop()
            if fast is not None:
                fast.stop()
            data_dir.cleanup()
        # Which builds met: said once, on the section's first line.
        first = _name(PEER, f"c{levels[0]}")
        note = f"{lookup.binaries.describe()}; protoserve {variant.label} with serve's default speculation"
        return [replace(f, note=note) if f.name == first and f.value is not None else f for f in figures]

    return Step(SECTION, Server(variant, speculative=True),
                f"protoserve {variant.label} (exact and fast) and llama-server in turn, chat load", run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    return [_step(ctx)]
