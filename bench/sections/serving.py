"""Serving load: closed-loop clients at concurrency 1, 4, 16, 64, plus a long-prompt mix.

Each level sends ``concurrency * requests_per_worker`` requests (64-token
prompts, 64 new tokens) and stops starting new ones after
``level_max_seconds``, once per round (``serving_rounds``). The same
workload runs through the engine in this
process (AsyncEngine, the ceiling), through the gRPC server, through the
gateway's native SSE route and (at some levels) its OpenAI completions route.
The transformers baseline is one static batch of the same size as the
concurrency, same prompts and lengths.

The engine, gRPC and SSE paths of the served variant run level by level in
turn (engine c1, gRPC c1, SSE c1, engine c4, ...), the engine loaded in this
process beside the server: their ratios are the issue's targets (gRPC within 5%
of the engine, SSE within 10% of gRPC), and figures measured minutes apart on
this shared machine drift by more than that.

A second server started with ``--stream-interval 4`` runs the same paths at 16 and 64
clients beside an in-process engine at the same setting (``serving.stream4.*``): what is
left of the serving layer's share when it writes a message per 4 tokens.

Figures: aggregate output tokens/s per (path, level), with TTFT and
inter-token latency percentiles and error counts beside it, and where the
CPU went during the run (bench/cpu_usage.py: the server's loop and its other
threads, this process, the machine's idle share); gRPC TTFT p50 as figures of
its own (the issue's target is at 16 concurrent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench import cpu_usage, engine_direct
from bench.context import BenchContext
from bench.cpu_usage import CpuSnapshot
from bench.figures import Figure, skipped
from bench.load_generator import run_clients, run_load, warm_up
from bench.load_result import LoadResult
from bench.resources import Server, TransformersModel, Variant, load_engine_model
from bench.runner import Step
from bench.timeline import RequestTimeline
from bench.transports import (
    EngineTransport,
    GatewaySseTransport,
    GrpcTransport,
    OpenAiSseTransport,
    Transport,
)
from bench.workload import RequestSpec, serving_workload

SECTION = "serving"
UNIT = "tok/s"
WORKLOAD = 4
LONG_MIX = "long_mix"
STREAM_INTERVAL = 4  # the server's --stream-interval in the serving.stream4.* figures


def level_key(concurrency: int) -> str:
    return f"c{concurrency}"


def long_mix_key(ctx: BenchContext) -> str:
    return f"{LONG_MIX}.c{ctx.profile.long_mix_concurrency}"


def baseline_name(key: str) -> str:
    """The transformers figure a level is compared with: a static batch as large as the concurrency."""
    return f"serving.transformers.{key.replace('c', 'batch', 1) if key.startswith('c') else key}"


def _level_specs(ctx: BenchContext, concurrency: int, count: int | None = None) -> list[RequestSpec]:
    p = ctx.profile
    factory = ctx.factory(WORKLOAD * 1000 + concurrency)
    return serving_workload(
        factory, count or p.level_requests(concurrency), p.serving_prompt_len, p.serving_max_tokens
    )


def _long_mix_specs(ctx: BenchContext) -> list[RequestSpec]:
    p = ctx.profile
    factory = ctx.factory(WORKLOAD * 1000 + 999)
    return serving_workload(
        factory,
        p.level_requests(p.long_mix_concurrency),
        p.serving_prompt_len,
        p.serving_max_tokens,
        long_every=p.long_mix_every,
        long_prompt_len=p.long_prompt_len,
    )


def _warm_specs(ctx: BenchContext) -> list[RequestSpec]:
    factory = ctx.factory(WORKLOAD * 1000 + 998)
    return serving_workload(factory, 2, ctx.profile.serving_prompt_len, 4)


def _baseline(ctx: BenchContext, key: str) -> str | None:
    """The transformers figure for this level, when the profile measures one."""
    if key.startswith(LONG_MIX) and not ctx.profile.long_mix_transformers:
        return None
    return baseline_name(key)


def _load_figure(
    ctx: BenchContext, name: str, result: LoadResult, concurrency: int, key: str, extra: dict[str, Any]
) -> Figure:
    if result.requests and result.errors == result.requests:
        raise RuntimeError(f"all {result.requests} requests failed: {result.first_error}")
    return Figure(
        name=name,
        value=result.tokens_per_s,
        unit=UNIT,
        section=SECTION,
        baseline=_baseline(ctx, key),
        details={"concurrency": concurrency, **result.details(), **extra},
    )


def _ttft_figure(ctx: BenchContext, name: str, result: LoadResult, key: str) -> Figure | None:
    if result.ttft is None:
        return None
    base = _baseline(ctx, key)
    return Figure(
        name=f"{name}.ttft_p50",
        value=result.ttft.p50,
        unit="s",
        section=SECTION,
        better="lower",
        baseline=f"{base}.ttft_p50" if base else None,
    )


@dataclass(frozen=True)
class LoadPath:
    """One way in: a transport and the figure prefix of its levels."""

    transport: Transport
    prefix: str
    ttft_figures: bool = False


async def _levels(
    ctx: BenchContext,
    paths: Sequence[LoadPath],
    levels: tuple[int, ...],
    long_mix: bool,
    server_pid: int | None = None,
) -> list[Figure]:
    """Every level (and the long mix) through each path, the paths in turn at each level, in
    ``serving_rounds`` rounds (engine, gRPC, SSE, engine, gRPC, SSE: a stretch of a noisy machine
    lands on every path), each figure pooling its path's rounds; the transports are closed at the
    end. ``server_pid``: the server whose CPU time each figure reports."""
    p = ctx.profile
    figures: list[Figure] = []
    try:
        for path in paths:
            await warm_up(path.transport, _warm_specs(ctx))
        # Fresh specs per path: the same lengths and bodies, new nonces, so no path finds another's
        # prompts in the prefix cache (gRPC and SSE reach the same server).
        runs = [(level_key(c), c, lambda c=c: _level_specs(ctx, c)) for c in levels]
        if long_mix:
            runs.append((long_mix_key(ctx), p.long_mix_concurrency, lambda: _long_mix_specs(ctx)))
        for key, concurrency, make_specs in runs:
            rounds: dict[str, list[list[RequestTimeline]]] = {path.prefix: [] for path in paths}
            rates: dict[str, list[float]] = {path.prefix: [] for path in paths}  # each round's tok/s
            spans: dict[str, list[tuple[CpuSnapshot | None, CpuSnapshot | None]]] = {
                path.prefix: [] for path in paths
            }
            for _ in range(p.serving_rounds):
                for path in paths:
                    before = cpu_usage.snapshot(server_pid)
                    run, timelines = await run_load(path.transport, make_specs(), concurrency, p.level_max_seconds)
                    spans[path.prefix].append((before, cpu_usage.snapshot(server_pid)))
                    rounds[path.prefix].append(timelines)
                    rates[path.prefix].append(run.tokens_per_s)
            for path in paths:
                name = f"{path.prefix}.{key}"
                result = LoadResult.of_rounds(rounds[path.prefix])
                extra: dict[str, Any] = cpu_usage.usage_over(spans[path.prefix], result.output_tokens)
                if p.serving_rounds > 1:
                    extra = {"rounds_tok_s": "/".join(f"{v:.0f}" for v in rates[path.prefix]), **extra}
                try:
                    figures.append(_load_figure(ctx, name, result, concurrency, key, extra))
                except RuntimeError as exc:  # every request failed: report it, go on with the next level
                    figures.append(skipped(name, UNIT, SECTION, str(exc)))
                    continue
                ttft = _ttft_figure(ctx, name, result, key) if path.ttft_figures else None
                if ttft is not None:
                    figures.append(ttft)
    finally:
        for path in paths:
            await path.transport.close()
    return figures


def _expects(ctx: BenchContext, prefix: str, levels: tuple[int, ...], long_mix: bool, ttft: bool = False):
    keys = [level_key(c) for c in levels] + ([long_mix_key(ctx)] if long_mix else [])
    out = [(f"{prefix}.{k}", UNIT) for k in keys]
    if ttft:
        out += [(f"{prefix}.{k}.ttft_p50", "s") for k in keys]
    return tuple(out)


def _transformers_step(ctx: BenchContext) -> Step:
    p = ctx.profile
    keys = [level_key(c) for c in p.concurrencies] + ([long_mix_key(ctx)] if p.long_mix_transformers else [])

    def run(hf: Any) -> list[Figure]:
        hf.generate_batch(_warm_specs(ctx))
        figures = []
        batches = [(level_key(c), c, _level_specs(ctx, c, count=c)) for c in p.concurrencies]
        if p.long_mix_transformers:
            batches.append((long_mix_key(ctx), p.long_mix_concurrency, _long_mix_specs(ctx)))
        for key, batch, specs in batches:
            result = LoadResult.of(hf.generate_batches(specs, batch))
            name = baseline_name(key)
            figures.append(
                Figure(
                    name=name,
                    value=result.tokens_per_s,
                    unit=UNIT,
                    section=SECTION,
                    details={"batch": batch, **result.details()},
                )
            )
            if result.ttft is not None:
                figures.append(
                    Figure(
                        name=f"{name}.ttft_p50",
                        value=result.ttft.p50,
                        unit="s",
                        section=SECTION,
                        better="lower",
                    )
                )
        return figures

    expects = tuple((baseline_name(k), UNIT) for k in keys) + tuple(
        (f"{baseline_name(k)}.ttft_p50", "s") for k in keys
    )
    return Step(SECTION, TransformersModel(), "serving workload, transformers static batches", run, expects)


def _in_process_engine(variant: Variant, stream_interval: int = 1) -> Any:
    """The engine the server runs, loaded here too (its thread sleeps while the server is measured)."""
    from protoserve.engine.runtime import AsyncEngine

    loaded = load_engine_model(variant)
    return AsyncEngine(engine_direct.make_engine(loaded, variant, deterministic=True, stream_interval=stream_interval),
                       "bench")


async def _engine_grpc_sse(
    ctx: BenchContext, server: Any, engine: Any, levels: tuple[int, ...], long_mix: bool, prefix: str, widest: int
) -> list[Figure]:
    """Engine-direct, gRPC and (with a gateway) SSE in turn at each level, as ``{prefix}.{path}.{level}``."""
    engine.start()
    try:
        paths = [
            LoadPath(EngineTransport(engine), f"{prefix}.engine"),
            LoadPath(GrpcTransport(server.grpc_target), f"{prefix}.grpc", ttft_figures=True),
        ]
        if server.http_base_url is not None:
            paths.append(LoadPath(GatewaySseTransport(server.http_base_url, widest), f"{prefix}.sse"))
        return await _levels(ctx, paths, levels, long_mix=long_mix, server_pid=server.process.pid)
    finally:
        await engine.shutdown()


def _server_step(ctx: BenchContext) -> Step:
    p = ctx.profile
    levels = p.concurrencies
    widest = max(levels + p.openai_concurrencies + (p.long_mix_concurrency,))

    gateway_expects = _expects(ctx, "serving.sse", levels, True) + _expects(
        ctx, "serving.openai-sse", p.openai_concurrencies, False
    )

    variant = ctx.profile.serving_variant

    def run(server: Any) -> list[Figure]:
        engine = _in_process_engine(variant)

        async def measure() -> list[Figure]:
            figures = await _engine_grpc_sse(ctx, server, engine, levels, True, "serving", widest)
            if server.http_base_url is None:
                return figures + [
                    skipped(n, u, SECTION, "the server started no REST gateway") for n, u in gateway_expects
                ]
            openai = OpenAiSseTransport(server.http_base_url, widest, server.model_name())
            return figures + await _levels(
                ctx, [LoadPath(openai, "serving.openai-sse")], p.openai_concurrencies, False, server.process.pid
            )

        return run_clients(measure())

    expects = (
        _expects(ctx, "serving.engine", levels, True)
        + _expects(ctx, "serving.grpc", levels, True, ttft=True)
        + gateway_expects
    )
    return Step(
        SECTION, Server(variant), f"serving load: engine, gRPC and the gateway in turn, {variant.label}", run, expects
    )


def _stream_interval_step(ctx: BenchContext) -> Step:
    """The same paths at the levels from 16 streams up, server and engine streaming ``STREAM_INTERVAL`` tokens a
    message after the first (``serve --stream-interval``): what is left of the serving layer's share once it
    writes a quarter of the messages."""
    p = ctx.profile
    levels = tuple(c for c in p.concurrencies if c >= 16) or (max(p.concurrencies),)
    prefix = f"serving.stream{STREAM_INTERVAL}"
    variant = p.serving_variant

    def run(server: Any) -> list[Figure]:
        engine = _in_process_engine(variant, STREAM_INTERVAL)
        return run_clients(_engine_grpc_sse(ctx, server, engine, levels, False, prefix, max(levels)))

    expects = (
        _expects(ctx, f"{prefix}.engine", levels, False)
        + _expects(ctx, f"{prefix}.grpc", levels, False, ttft=True)
        + _expects(ctx, f"{prefix}.sse", levels, False)
    )
    server = Server(variant, label=f"stream{STREAM_INTERVAL}", args=("--stream-interval", str(STREAM_INTERVAL)))
    return Step(SECTION, server, f"serving load, {STREAM_INTERVAL} tokens a message: engine, gRPC and SSE in turn",
                run, expects)


def _server_variant_step(ctx: BenchContext, variant: Variant) -> Step:
    c = ctx.profile.server_variant_concurrency
    prefix = f"serving.grpc.{variant.label}"

    def run(server: Any) -> list[Figure]:
        path = LoadPath(GrpcTransport(server.grpc_target), prefix)
        return run_clients(_levels(ctx, [path], (c,), False, server.process.pid))

    return Step(
        SECTION,
        Server(variant),
        f"serving load through gRPC, {variant.label}",
        run,
        _expects(ctx, prefix, (c,), False),
    )


def steps(ctx: BenchContext) -> list[Step]:
    out = [_transformers_step(ctx), _server_step(ctx), _stream_interval_step(ctx)]
    out.extend(_server_variant_step(ctx, v) for v in ctx.profile.server_variants)
    return out
