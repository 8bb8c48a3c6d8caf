"""Offline throughput (nano-vllm's benchmark): N requests of random prompt and output lengths, all at once.

The figure is generated tokens per second of wall time until the last request
finishes. The engine gets every request at once and batches continuously;
transformers runs static batches of ``offline_hf_batch`` in order, each until
its longest request is done.
"""

from __future__ import annotations

import time
from typing import Any

from bench import engine_direct
from bench.context import BenchContext, engine_label, mode_label
from bench.figures import Figure
from bench.resources import EngineModel, TransformersModel, Variant
from bench.runner import Step
from bench.workload import RequestSpec, offline_workload, output_tokens

SECTION = "offline"
UNIT = "tok/s"
WORKLOAD = 3
WARM_UP = 4  # short requests before the measured run


def baseline_name(ctx: BenchContext) -> str:
    return f"offline.transformers.batch{ctx.profile.offline_hf_batch}"


def _specs(ctx: BenchContext) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """Warm-up requests and the measured workload (same shape every call, fresh nonces)."""
    p = ctx.profile
    factory = ctx.factory(WORKLOAD)
    warm = [RequestSpec(factory.prompt(32), 4) for _ in range(WARM_UP)]
    return warm, offline_workload(factory, p.offline_requests, p.offline_prompt_len, p.offline_output_len)


def _figure(ctx: BenchContext, name: str, specs: list[RequestSpec], seconds: float, note: str = "") -> Figure:
    generated = output_tokens(specs)
    prompt = sum(s.prompt_len for s in specs)
    base = baseline_name(ctx)
    return Figure(
        name=name,
        value=generated / seconds,
        unit=UNIT,
        section=SECTION,
        baseline=None if name == base else base,
        details={
            "requests": len(specs),
            "prompt_tokens": prompt,
            "output_tokens": generated,
            "seconds": round(seconds, 2),
            "total_tok_s": round((prompt + generated) / seconds, 1),
        },
        note=note,
    )


def _engine_step(ctx: BenchContext, variant: Variant, deterministic: bool) -> Step:
    name = f"offline.engine.{engine_label(variant, deterministic)}"

    def run(loaded: Any) -> list[Figure]:
        engine = engine_direct.make_engine(loaded, variant, deterministic)
        warm, specs = _specs(ctx)
        engine_direct.warm_up(engine, warm)
        start = time.perf_counter()
        timelines = engine_direct.run_requests(engine, specs)
        seconds = time.perf_counter() - start
        produced = sum(t.output_tokens for t in timelines)
        if produced != output_tokens(specs):
            raise RuntimeError(
                f"engine generated {produced} tokens, the workload asked for {output_tokens(specs)}"
            )
        note = "as served" if variant == ctx.profile.serving_variant and deterministic else ""
        return [_figure(ctx, name, specs, seconds, note)]

    return Step(
        SECTION,
        EngineModel(variant),
        f"offline engine {variant.label} {mode_label(deterministic)}",
        run,
        ((name, UNIT),),
    )


def _transformers_step(ctx: BenchContext) -> Step:
    name = baseline_name(ctx)

    def run(hf: Any) -> list[Figure]:
        warm, specs = _specs(ctx)
        hf.generate_batch(warm)
        start = time.perf_counter()
        hf.generate_batches(specs, ctx.profile.offline_hf_batch)
        return [_figure(ctx, name, specs, time.perf_counter() - start, "static batches, in order")]

    return Step(SECTION, TransformersModel(), "offline transformers", run, ((name, UNIT),))


def steps(ctx: BenchContext) -> list[Step]:
    out = [_engine_step(ctx, variant, det) for variant, det in ctx.profile.offline_variants]
    out.append(_transformers_step(ctx))
    return out
