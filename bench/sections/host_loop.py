"""The host loop: ``LLMEngine.step()`` with a stand-in forward, its host time per step split by phase.

No model compute (bench/stand_in_forward.py: the decoder replaced by precomputed float32 logits of
SmolLM2's vocabulary, its real tokenizer detokenizing), so what is left is what a device would wait
on between forwards: schedule, block tables (``build_forward_batch``), sampling, detokenize and
postprocess, output collection. Steady-state greedy decode of 1 / 16 / 64 / 256 running sequences
(32-token prompts, never finishing while measured), the mean over the timed steps. The issue's goal:
at most 1 ms a step at 64 running.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.context import BenchContext
from bench.figures import Figure, Target
from bench.resources import EngineModel, Variant
from bench.runner import Step
from bench.stand_in_forward import PHASES, PhaseTimes, StandInModel, timed_host_phases
from bench.stats import percentile, significant

SECTION = "host_loop"
UNIT = "ms"
PROMPT_TOKENS = 32
WARM_STEPS = 5  # after every sequence decodes: first calls of each shape, caches filled
TARGETS = {64: Target(1.0, "lower")}


@dataclass(frozen=True)
class HostLoopSizes:
    rows: tuple[int, ...]  # running sequences, one measurement each
    steps: int  # timed steps at each


SIZES = {
    "smoke": HostLoopSizes((1, 4), 5),
    "default": HostLoopSizes((1, 16, 64, 256), 100),
    "full": HostLoopSizes((1, 16, 64, 256), 200),
}


def figure_names(rows: tuple[int, ...]) -> list[tuple[str, str]]:
    return [(f"{SECTION}.{part}.{n}", UNIT) for n in rows for part in ("step", *PHASES)]


def make_engine(loaded: Any, variant: Variant, sizes: HostLoopSizes) -> tuple[Any, StandInModel]:
    """An engine sized for ``sizes`` (every sequence running at once, each with blocks for its whole run)
    with the stand-in in the decoder's place."""
    from protoserve.engine.api import EngineConfig
    from protoserve.engine.runtime import LLMEngine

    most = max(sizes.rows)
    # Every prompt in one step: the first sequences do not run out of tokens while the last prefill.
    config = EngineConfig(kv_cache_dtype=variant.kv_cache_dtype, max_num_seqs=most,
                          max_num_batched_tokens=most * PROMPT_TOKENS)
    config.max_kv_blocks = most * -(-(PROMPT_TOKENS + WARM_STEPS + sizes.steps + 8) // config.block_size) + 1
    engine = LLMEngine(loaded, config)
    model = StandInModel(engine.vocab_size, most)
    engine.runner.model = model
    return engine, model


def measure(engine: Any, model: StandInModel, rows: int, steps: int, seed: int = 0) -> PhaseTimes:
    """``steps`` timed decode steps of ``rows`` sequences; every request is aborted and gone afterwards."""
    import torch

    from protoserve.engine.api import SamplingParams, TokenizedRequest

    gen = torch.Generator().manual_seed(seed + rows)
    ids = [f"host-loop-{rows}-{i}" for i in range(rows)]
    sampling = SamplingParams(max_tokens=WARM_STEPS + steps + 8, temperature=0.0, ignore_eos=True)
    for request_id in ids:
        prompt = torch.randint(1000, engine.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist()
        engine.add_request(TokenizedRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling))
    for _ in range(PROMPT_TOKENS):
        if _all_decoding(engine, rows):
            break
        engine.step()
    else:
        raise RuntimeError(f"the {rows} sequences were not all decoding after {PROMPT_TOKENS} steps")
    for _ in range(WARM_STEPS):
        engine.step()
    with timed_host_phases(engine, model) as times:
        for _ in range(steps):
            engine.step()
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return times


def _all_decoding(engine: Any, rows: int) -> bool:
    stats = engine.stats()
    return stats.last_step_seqs == rows and stats.last_step_tokens == rows


def figures_of(rows: int, times: PhaseTimes) -> list[Figure]:
    totals = [1e3 * s["total"] for s in times.steps]
    step = Figure(name=f"{SECTION}.step.{rows}", value=times.mean_ms("total"), unit=UNIT, section=SECTION,
                  better="lower", target=TARGETS.get(rows),
                  details={"p50": significant(percentile(totals, 50)), "p90": significant(percentile(totals, 90)),
                           "steps": len(totals), "us_per_token": significant(1e3 * times.mean_ms("total") / rows)})
    phases = [Figure(name=f"{SECTION}.{phase}.{rows}", value=times.mean_ms(phase), unit=UNIT, section=SECTION,
                     better="lower") for phase in PHASES]
    return [step, *phases]


def _step(ctx: BenchContext) -> Step:
    variant = ctx.profile.serving_variant
    sizes = SIZES.get(ctx.profile.name, SIZES["default"])

    def run(loaded: Any) -> list[Figure]:
        engine, model = make_engine(loaded, variant, sizes)
        try:
            return [f for rows in sizes.rows
                    for f in figures_of(rows, measure(engine, model, rows, sizes.steps, ctx.seed))]
        finally:
            engine.close()

    return Step(SECTION, EngineModel(variant),
                f"host loop: engine steps with a stand-in forward at {'/'.join(map(str, sizes.rows))} running",
                run, tuple(figure_names(sizes.rows)))


def steps(ctx: BenchContext) -> list[Step]:
    return [_step(ctx)]
