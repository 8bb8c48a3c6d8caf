"""Activation precision: the int4 model with exact activation codes (int8 codes plus codes of their
rounding error, the default) and fast ones (the codes alone, llama.cpp's Q8 activations), in one run.

Engine-direct, on one loaded model switched between the modes (``Decoder.set_activation_precision``,
what ``--activation-precision`` applies at start): c=16 decode aggregate tokens/s and 512-token
prefill tokens/s, measured in ABBA order (exact, fast, fast, exact per round) so drift on the shared
machine falls on both modes alike, reported per mode and as fast / exact. Then the price: along the
float32 model's 32-token greedy continuation of a chat prompt (teacher-forced), each mode's mean
|logit error| against float32 and how often its top token is float32's.
"""

from __future__ import annotations

from typing import Any

from bench import engine_direct
from bench.context import BenchContext
from bench.figures import Figure
from bench.profile import FP32, INT4_KV_BF16
from bench.resources import EngineModel, load_engine_model
from bench.runner import Step
from bench.stats import median, significant
from bench.timeline import RequestTimeline
from bench.workload import RequestSpec

SECTION = "activation"
MODES = ("exact", "fast")
WORKLOAD = 9
CONCURRENCY = 16
DECODE_TOKENS = 64
PREFILL = 512
QUALITY_TOKENS = 32
QUALITY_UNITS = {"logit_error": "mean |logit| vs fp32", "greedy_agreement": "top-1 vs fp32"}
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


def _abba(rounds: int) -> list[str]:
    return [m for _ in range(rounds) for m in ("exact", "fast", "fast", "exact")]


def _aggregate(timelines: list[RequestTimeline]) -> float:
    """Output tokens of the whole batch over the batch's wall time (nano-vllm's offline figure)."""
    start = min(t.sent for t in timelines)
    end = max(t.finished for t in timelines)
    return sum(t.output_tokens for t in timelines) / (end - start)


def _rate_figures(kind: str, unit: str, rates: dict[str, list[float]]) -> list[Figure]:
    figures = [
        Figure(
            name=f"activation.{kind}.{mode}",
            value=median(rates[mode]),
            unit=unit,
            section=SECTION,
            details={"runs": len(rates[mode]), "min": significant(min(rates[mode])),
                     "max": significant(max(rates[mode]))},
            note="default" if mode == "exact" else "",
        )
        for mode in MODES
    ]
    ratio = median(rates["fast"]) / median(rates["exact"])
    figures.append(Figure(name=f"activation.{kind}.fast_over_exact", value=ratio, unit="x", section=SECTION,
                          note="medians, ABBA order"))
    return figures


def _quality_figures(model: Any) -> list[Figure]:
    from protoserve.engine.runtime import all_position_logits

    reference = load_engine_model(FP32)
    tok = reference.tokenizer
    prompt = tok.encode(tok.apply_chat_template(CHAT))
    seq = list(prompt)
    for _ in range(QUALITY_TOKENS):  # the float32 model's greedy continuation
        seq.append(int(all_position_logits(reference.model, seq)[-1].argmax()))
    positions = slice(len(prompt) - 1, len(seq) - 1)
    ref = all_position_logits(reference.model, seq)[positions]
    del reference
    figures = []
    for mode in MODES:
        model.set_activation_precision(mode)
        out = all_position_logits(model, seq)[positions]
        agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        figures.append(Figure(name=f"activation.logit_error.{mode}", value=(out - ref).abs().mean().item(),
                              unit=QUALITY_UNITS["logit_error"], section=SECTION, better="lower",
                              details={"positions": QUALITY_TOKENS}))
        figures.append(Figure(name=f"activation.greedy_agreement.{mode}", value=agree, unit=QUALITY_UNITS["greedy_agreement"],
                              section=SECTION, details={"positions": QUALITY_TOKENS}))
    return figures


def _step(ctx: BenchContext) -> Step:
    variant = INT4_KV_BF16
    kinds = (("decode_c16", "tok/s"), (f"prefill_{PREFILL}", "tok/s"))
    expects = tuple(
        [(f"activation.{kind}.{m}", unit) for kind, unit in kinds for m in (*MODES, "fast_over_exact")]
        + [(f"activation.{q}.{m}", unit) for q, unit in QUALITY_UNITS.items() for m in MODES]
    )

    def run(loaded: Any) -> list[Figure]:
        engine = engine_direct.make_engine(loaded, variant, deterministic=True)
        model = loaded.model  # the engine's: it runs the loaded model
        p = ctx.profile
        factory = ctx.factory(WORKLOAD)
        rounds = max(1, p.repeats - 1)
        decode: dict[str, list[float]] = {m: [] for m in MODES}
        prefill: dict[str, list[float]] = {m: [] for m in MODES}
        try:
            for mode in MODES:  # warm both modes' code paths
                model.set_activation_precision(mode)
                engine_direct.warm_up(engine, [RequestSpec(factory.prompt(p.serving_prompt_len), 8)] * 2)
            for mode in _abba(rounds):
                model.set_activation_precision(mode)
                specs = [RequestSpec(factory.prompt(p.serving_prompt_len), DECODE_TOKENS) for _ in range(CONCURRENCY)]
                decode[mode].append(_aggregate(engine_direct.run_requests(engine, specs)))
                ttft = engine_direct.run_requests(engine, [RequestSpec(factory.prompt(PREFILL), 1)])[0].ttft
                prefill[mode].append(PREFILL / ttft)
            figures = _rate_figures("decode_c16", "tok/s", decode) + _rate_figures(f"prefill_{PREFILL}", "tok/s", prefill)
            return figures + _quality_figures(model)
        finally:
            model.set_activation_precision(engine.config.activation_precision)

    return Step(SECTION, EngineModel(variant), f"activation precision exact vs fast, engine {variant.label}", run,
                expects)


def steps(ctx: BenchContext) -> list[Step]:
    return [_step(ctx)]
