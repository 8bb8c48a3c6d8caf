"""Prefill speed: one prompt of 512 or 2,048 tokens, one new token; prompt tokens / time to first token.

The engine computes a long prompt in chunks of ``max_num_batched_tokens``
(256 by default), so both figures include chunking; transformers
runs the whole prompt in one forward. The gRPC 512-token figure carries the
issue's target (>= 2,200 tokens/s); the served variant also runs in this
process in turn with it (``prefill.engine.paired.<length>``), the figure the
gRPC one is held to.
"""

from __future__ import annotations

from typing import Any

from bench import engine_direct
from bench.context import BenchContext, engine_label, mode_label
from bench.figures import Figure
from bench.load_generator import run_clients
from bench.paired import alternate
from bench.resources import EngineModel, Server, TransformersModel, Variant, load_engine_model
from bench.runner import Step
from bench.stats import median
from bench.timeline import RequestTimeline
from bench.transports import GrpcTransport
from bench.workload import RequestSpec

SECTION = "prefill"
UNIT = "tok/s"
WORKLOAD = 2


def baseline_name(length: int) -> str:
    return f"prefill.transformers.{length}"


def _specs(ctx: BenchContext, length: int) -> tuple[RequestSpec, list[RequestSpec]]:
    factory = ctx.factory(WORKLOAD + length)
    warm = RequestSpec(factory.prompt(length), 1)
    return warm, [RequestSpec(factory.prompt(length), 1) for _ in range(ctx.profile.repeats)]


def _figure(name: str, length: int, timelines: list[RequestTimeline], note: str = "") -> Figure:
    ttfts = [t.ttft for t in timelines if t.ok and t.ttft]
    if not ttfts:
        raise RuntimeError(next((t.error for t in timelines if t.error), "no token arrived"))
    rates = [length / ttft for ttft in ttfts]
    base = baseline_name(length)
    return Figure(
        name=name,
        value=median(rates),
        unit=UNIT,
        section=SECTION,
        baseline=None if name == base else base,
        details={"runs": len(rates), "ttft_ms": round(median(ttfts) * 1000, 1)},
        note=note,
    )


def _engine_step(ctx: BenchContext, variant: Variant, deterministic: bool) -> Step:
    label = engine_label(variant, deterministic)
    names = {length: f"prefill.engine.{label}.{length}" for length in ctx.profile.prefill_lengths}

    def run(loaded: Any) -> list[Figure]:
        engine = engine_direct.make_engine(loaded, variant, deterministic)
        figures = []
        for length, name in names.items():
            warm, runs = _specs(ctx, length)
            engine_direct.warm_up(engine, [warm])
            timelines = [engine_direct.run_requests(engine, [spec])[0] for spec in runs]
            note = "as served" if variant == ctx.profile.serving_variant and deterministic else ""
            figures.append(_figure(name, length, timelines, note))
        return figures

    return Step(
        SECTION,
        EngineModel(variant),
        f"prefill engine {variant.label} {mode_label(deterministic)}",
        run,
        tuple((n, UNIT) for n in names.values()),
    )


def _transformers_step(ctx: BenchContext) -> Step:
    lengths = ctx.profile.prefill_lengths

    def run(hf: Any) -> list[Figure]:
        figures = []
        for length in lengths:
            warm, runs = _specs(ctx, length)
            hf.generate_batch([warm])
            figures.append(_figure(baseline_name(length), length, [hf.generate_batch([s])[0] for s in runs]))
        return figures

    return Step(
        SECTION,
        TransformersModel(),
        "prefill transformers",
        run,
        tuple((baseline_name(n), UNIT) for n in lengths),
    )


def paired_name(length: int) -> str:
    """The served variant in-process, measured in turn with ``prefill.grpc.<length>``."""
    return f"prefill.engine.paired.{length}"


def _server_step(ctx: BenchContext) -> Step:
    variant = ctx.profile.serving_variant
    lengths = ctx.profile.prefill_lengths

    def run(server: Any) -> list[Figure]:
        # The engine the server runs, loaded here too, and measured in turn with the server.
        engine = engine_direct.make_engine(load_engine_model(variant), variant, deterministic=True)
        figures = []
        for length in lengths:
            warm, runs = _specs(ctx, length)
            _, engine_runs = _specs(ctx, length)
            served, direct = run_clients(
                alternate(GrpcTransport(server.grpc_target), engine, warm, runs, engine_runs)
            )
            figures.append(_figure(f"prefill.grpc.{length}", length, served))
            figures.append(
                _figure(paired_name(length), length, direct, note=f"in turn with prefill.grpc.{length}")
            )
        return figures

    expects = tuple((n, UNIT) for length in lengths for n in (f"prefill.grpc.{length}", paired_name(length)))
    return Step(SECTION, Server(variant), f"prefill through gRPC and in-process in turn, {variant.label}", run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    out = [_engine_step(ctx, variant, det) for variant, det in ctx.profile.prefill_variants]
    out.append(_transformers_step(ctx))
    out.append(_server_step(ctx))
    return out
