"""Multi-model: each chat model's inter-token latency with both models busy, against it busy alone (issue 46).

One server serves the two installed chat models (``--model smollm2-135m-instruct --model gemma3-270m``),
an engine each, both on the one compute gate (engine/execution/compute_gate.py), which hands the cores
to the engines' forwards in the order they asked: two busy engines alternate. Each round runs
``streams`` gRPC streams per model three ways: on SmolLM2 alone, on Gemma 3 alone (the other engine
loaded and idle), and on both at once, the same per-model load; the order reverses every other round
(ABBA), so drift in the machine's load falls on each alike. Greedy, EOS ignored, a fixed
``max_tokens``, fresh prompts (unique nonces) each run. The figures are each model's ITL p99 in each,
pooled over the rounds, its ratio both/alone (target <= 2: sharing the cores at most doubles what a
model's streams wait) and its share of the tokens generated while both were generating (from the
later first token to the earlier last one): with the same streams per model a step makes as many
tokens in either, so that is its share of the engine steps, 1/2 by the gate's rule.

Only on the default model: the section sets its own ``--model`` flags (with ``bench --model`` it is
left out).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.context import BenchContext
from bench.figures import Figure, Target
from bench.load_generator import run_clients
from bench.load_result import LoadResult
from bench.resources import Server, model_args
from bench.runner import Step
from bench.stats import significant
from bench.timeline import RequestTimeline
from bench.transports import GrpcTransport
from bench.workload import RequestSpec

SECTION = "multi_model"
MODELS = ("smollm2-135m-instruct", "gemma3-270m")
SHORT = {"smollm2-135m-instruct": "smollm2", "gemma3-270m": "gemma3"}
WORKLOAD = 17
PROMPT_LEN = 32
RATIO_TARGET = Target(2.0, "lower")  # the issue's: within 2x of the model busy alone


@dataclass(frozen=True)
class Sizes:
    streams: int  # per model
    max_tokens: int
    rounds: int


SIZES = {"smoke": Sizes(2, 8, 1), "default": Sizes(4, 48, 3), "full": Sizes(4, 96, 5)}

Runs = dict[str, list[list[RequestTimeline]]]  # "alone"/"both" rounds of one model


async def _run(transports: dict[str, GrpcTransport], specs: dict[str, list[RequestSpec]]) -> dict[str, list[RequestTimeline]]:
    """The models' streams at once; each model's timelines."""
    names = list(specs)
    results = await asyncio.gather(
        *(asyncio.gather(*(transports[m].stream(s) for s in specs[m])) for m in names)
    )
    return {m: list(r) for m, r in zip(names, results, strict=True)}


def _itl(rounds: Sequence[Sequence[RequestTimeline]], what: str) -> LoadResult:
    result = LoadResult.of_rounds(rounds)
    if result.itl is None:
        raise RuntimeError(f"no inter-token latencies for {what} ({result.first_error or 'no tokens'})")
    return result


def overlap_tokens(together: dict[str, Sequence[RequestTimeline]]) -> dict[str, int]:
    """Each model's tokens that arrived while every model was generating: from the last model's first
    token to the first model's last token."""
    chunks = {m: [c for t in timelines for c in t.chunks] for m, timelines in together.items()}
    if not all(chunks.values()):
        return {m: 0 for m in together}
    start = max(min(at for at, _ in c) for c in chunks.values())
    end = min(max(at for at, _ in c) for c in chunks.values())
    return {m: sum(n for at, n in c if start <= at <= end) for m, c in chunks.items()}


def multi_model_figures(runs: dict[str, Runs], sizes: Sizes) -> list[Figure]:
    """Per model: ITL p99 alone and beside the other, their ratio, and its share of the tokens when both ran."""
    load = {"streams_per_model": sizes.streams, "max_tokens": sizes.max_tokens, "rounds": sizes.rounds}
    figures: list[Figure] = []
    both_tokens = dict.fromkeys(runs, 0)
    for i in range(sizes.rounds):
        for model, tokens in overlap_tokens({m: runs[m]["both"][i] for m in runs}).items():
            both_tokens[model] += tokens
    total = sum(both_tokens.values())
    for model, by_mode in runs.items():
        short = SHORT[model]
        alone, both = _itl(by_mode["alone"], f"{model} alone"), _itl(by_mode["both"], f"{model} with both")
        figures += [
            Figure(f"{SECTION}.{short}.itl_p99.alone", alone.itl.p99, "s", SECTION, better="lower",
                   details={**alone.details(), **load}, note="the other model loaded and idle"),
            Figure(f"{SECTION}.{short}.itl_p99.both", both.itl.p99, "s", SECTION, better="lower",
                   details={**both.details(), **load}, note="both models busy at the same per-model load"),
            Figure(f"{SECTION}.{short}.itl_p99_ratio", both.itl.p99 / alone.itl.p99, "x", SECTION,
                   better="lower", target=RATIO_TARGET,
                   details={"alone_s": significant(alone.itl.p99), "both_s": significant(both.itl.p99)}),
            Figure(f"{SECTION}.{short}.token_share.both", both_tokens[model] / total if total else 0.0,
                   "ratio", SECTION, details={"tokens": both_tokens[model], "all_tokens": total},
                   note="of the tokens made while both models were generating"),
        ]  # fmt: skip
    return figures


def _step(ctx: BenchContext, sizes: Sizes) -> Step:
    variant = ctx.profile.serving_variant

    def run(server: Any) -> list[Figure]:
        factory = ctx.factory(WORKLOAD)

        def specs(models: Sequence[str]) -> dict[str, list[RequestSpec]]:
            return {m: [RequestSpec(factory.prompt(PROMPT_LEN), sizes.max_tokens) for _ in range(sizes.streams)]
                    for m in models}

        async def main() -> dict[str, Runs]:
            transports = {m: GrpcTransport(server.grpc_target, m) for m in MODELS}
            runs: dict[str, Runs] = {m: {"alone": [], "both": []} for m in MODELS}
            modes = [(MODELS[0],), (MODELS[1],), MODELS]
            try:
                await _run(transports, specs(MODELS))  # warm-up: both engines' first shapes
                for round_ in range(sizes.rounds):
                    for models in modes if round_ % 2 == 0 else modes[::-1]:
                        mode = "both" if len(models) > 1 else "alone"
                        for model, timelines in (await _run(transports, specs(models))).items():
                            runs[model][mode].append(timelines)
            finally:
                for transport in transports.values():
                    await transport.close()
            return runs

        return multi_model_figures(run_clients(main()), sizes)

    expects = tuple(
        (f"{SECTION}.{SHORT[m]}.{name}", unit)
        for m in MODELS
        for name, unit in (("itl_p99.alone", "s"), ("itl_p99.both", "s"), ("itl_p99_ratio", "x"),
                           ("token_share.both", "ratio"))
    )
    args = tuple(a for m in MODELS for a in ("--model", m)) + ("--no-embedding-model",)
    return Step(
        SECTION,
        Server(variant, label="multi-model", args=args),
        f"{' + '.join(MODELS)} in one server: {sizes.streams} streams per model, alone and both",
        run,
        expects,
    )


def steps(ctx: BenchContext) -> list[Step]:
    if model_args():  # bench --model: the section's own models would be served beside it
        return []
    return [_step(ctx, SIZES.get(ctx.profile.name, SIZES["default"]))]
