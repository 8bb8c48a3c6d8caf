"""Single-stream decode: one request, a short prompt, many new tokens; tokens/s after the first.

Measured engine-direct for every variant in both engine modes, through
transformers at batch 1, and through the server (gRPC and gateway SSE). The
gRPC figure is the one with the issue's target (>= 170 tokens/s).
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
from bench.stats import median, significant
from bench.timeline import RequestTimeline
from bench.transports import GatewaySseTransport, GrpcTransport, Transport
from bench.workload import RequestSpec

SECTION = "decode"
BASELINE = "decode.transformers.batch1"
UNIT = "tok/s"
WORKLOAD = 1  # factory stream: the same prompt bodies for every path
PAIRED_ENGINE = "decode.engine.paired"  # the served variant in-process, measured in turn with decode.grpc


def _specs(ctx: BenchContext) -> tuple[RequestSpec, list[RequestSpec]]:
    """A short warm-up request and ``repeats`` measured ones (fresh nonce each)."""
    p = ctx.profile
    factory = ctx.factory(WORKLOAD)
    warm = RequestSpec(factory.prompt(p.decode_prompt_len), min(8, p.decode_tokens))
    runs = [RequestSpec(factory.prompt(p.decode_prompt_len), p.decode_tokens) for _ in range(p.repeats)]
    return warm, runs


def _figure(name: str, timelines: list[RequestTimeline], note: str = "") -> Figure:
    rates = [r for r in (t.decode_tokens_per_s() for t in timelines) if r is not None]
    errors = [t.error for t in timelines if t.error]
    if errors and not rates:
        raise RuntimeError(errors[0])
    return Figure(
        name=name,
        value=median(rates),
        unit=UNIT,
        section=SECTION,
        baseline=None if name == BASELINE else BASELINE,
        details={"runs": len(rates), "min": significant(min(rates)), "max": significant(max(rates))},
        note=note,
    )


def _engine_step(ctx: BenchContext, variant: Variant, deterministic: bool) -> Step:
    name = f"decode.engine.{engine_label(variant, deterministic)}"

    def run(loaded: Any) -> list[Figure]:
        engine = engine_direct.make_engine(loaded, variant, deterministic)
        warm, runs = _specs(ctx)
        engine_direct.warm_up(engine, [warm])
        timelines = [engine_direct.run_requests(engine, [spec])[0] for spec in runs]
        note = "as served" if variant == ctx.profile.serving_variant and deterministic else ""
        return [_figure(name, timelines, note)]

    return Step(
        SECTION,
        EngineModel(variant),
        f"decode engine {variant.label} {mode_label(deterministic)}",
        run,
        ((name, UNIT),),
    )


def _transformers_step(ctx: BenchContext) -> Step:
    def run(hf: Any) -> list[Figure]:
        warm, runs = _specs(ctx)
        hf.generate_batch([warm])
        timelines = [hf.generate_batch([spec])[0] for spec in runs]
        return [_figure(BASELINE, timelines)]

    return Step(SECTION, TransformersModel(), "decode transformers batch 1", run, ((BASELINE, UNIT),))


async def _sequential(
    transport: Transport, warm: RequestSpec, runs: list[RequestSpec]
) -> list[RequestTimeline]:
    try:
        await transport.stream(warm)
        return [await transport.stream(spec) for spec in runs]
    finally:
        await transport.close()


def _server_step(ctx: BenchContext, variant: Variant) -> Step:
    headline = variant == ctx.profile.serving_variant
    suffix = "" if headline else f".{variant.label}"
    grpc_name, sse_name = f"decode.grpc{suffix}", f"decode.sse{suffix}"

    def run(server: Any) -> list[Figure]:
        warm, runs = _specs(ctx)
        if headline:
            # The engine the server runs, loaded here too, and measured in turn with the server.
            loaded = load_engine_model(variant)
            engine = engine_direct.make_engine(loaded, variant, deterministic=True)
            _, engine_runs = _specs(ctx)
            served, direct = run_clients(
                alternate(GrpcTransport(server.grpc_target), engine, warm, runs, engine_runs)
            )
            del engine, loaded
            figures = [_figure(grpc_name, served), _figure(PAIRED_ENGINE, direct, "in turn with decode.grpc")]
        else:
            figures = [
                _figure(grpc_name, run_clients(_sequential(GrpcTransport(server.grpc_target), warm, runs)))
            ]
        if server.http_base_url is not None and headline:
            warm, runs = _specs(ctx)
            sse = run_clients(_sequential(GatewaySseTransport(server.http_base_url, 1), warm, runs))
            figures.append(_figure(sse_name, sse))
        return figures

    expects = (
        ((grpc_name, UNIT), (PAIRED_ENGINE, UNIT), (sse_name, UNIT)) if headline else ((grpc_name, UNIT),)
    )
    return Step(SECTION, Server(variant), f"decode through server {variant.label}", run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    p = ctx.profile
    out = [_engine_step(ctx, variant, det) for variant, det in p.decode_variants]
    out.append(_transformers_step(ctx))
    out.append(_server_step(ctx, p.serving_variant))
    out.extend(_server_step(ctx, v) for v in p.server_variants)
    return out
