"""Long contexts: prefill and single-stream decode at 512 / 2k / 4k / 8k tokens beside ``llama-bench``.

protoserve's served variant in this process (no server, one-token steps without speculation, as
``llama-bench`` runs): for each context N, one prompt of N random token ids and 64 new tokens, whose
time to first token gives the prefill rate (N / TTFT, in chunks of ``max_num_batched_tokens``) and
whose later tokens the decode rate at context N..N+64. Beside it ``llama-bench -fa 1`` on the same
GGUF and threads: ``-p N -n 0`` (prefill over an empty context) and ``-p 0 -n 64 -d N`` (64 tokens
generated after N tokens already in the context). A 32-token prompt's decode is the short-context
baseline both sides' long decodes are compared with. The two take turns (the order flipped each
round) and every figure carries the load average taken beside it, since the host is shared. The
largest context is 8,128 so that it and its 64 new tokens fit SmolLM2's 8,192-token window.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from bench import engine_direct, resources
from bench.context import BenchContext
from bench.figures import Figure, Target, skipped
from bench.peers import llama_bench
from bench.peers.llama_bench import LlamaBenchResult
from bench.peers.ratios import ratio_figure
from bench.resources import EngineModel
from bench.runner import Step
from bench.stats import median, significant
from bench.timeline import RequestTimeline
from bench.workload import RequestSpec

SECTION = "long_context"
UNIT = "tok/s"
CONTEXTS = (512, 2048, 4096, 8128)
GENERATE = 64
SHORT_PROMPT = 32
FLASH_ATTN = 1  # llama.cpp's faster setting at long contexts on these CPUs
WORKLOAD = 31
TARGETS = {
    "ratio.prefill.4096": Target(4.0, "higher"),
    "ratio.decode.4096": Target(2.5, "higher"),
    "self.decode.4096": Target(0.6, "higher"),
}


def _name(*parts: str | int) -> str:
    return ".".join((SECTION, *(str(p) for p in parts)))


def figure_names() -> list[tuple[str, str]]:
    out = []
    for side in ("protoserve", "llama-bench"):
        out += [(_name(side, "prefill", n), UNIT) for n in CONTEXTS]
        out += [(_name(side, "decode", n), UNIT) for n in ("short", *CONTEXTS)]
    out += [(_name("ratio", kind, n), "x") for kind in ("prefill", "decode") for n in CONTEXTS]
    out += [(_name("self", "decode", n), "x") for n in CONTEXTS]
    return out


class Rates:
    """Measured rates per figure name, each with the load average when it was taken."""

    def __init__(self) -> None:
        self.rates: dict[str, list[float]] = {}
        self.loads: dict[str, list[float]] = {}
        self.errors: dict[str, str] = {}

    def add(self, name: str, rate: float | None, error: str | None = None) -> None:
        if rate is None:
            self.errors.setdefault(name, error or "nothing measured")
            return
        self.rates.setdefault(name, []).append(rate)
        self.loads.setdefault(name, []).append(os.getloadavg()[0])

    def figure(self, name: str) -> Figure:
        rates = self.rates.get(name)
        if not rates:
            return skipped(name, UNIT, SECTION, self.errors.get(name, "nothing measured"))
        loads = self.loads[name]
        return Figure(name=name, value=median(rates), unit=UNIT, section=SECTION,
                      details={"runs": len(rates), "min": significant(min(rates)), "max": significant(max(rates)),
                               "load_avg_1m": f"{min(loads):.1f}-{max(loads):.1f}"})


def _measure_ours(engine: Any, ctx: BenchContext, rates: Rates) -> None:
    """One request per context (and the short one): prefill from its first token, decode after it."""
    factory = ctx.factory(WORKLOAD)
    for n in (SHORT_PROMPT, *CONTEXTS):
        t: RequestTimeline = engine_direct.run_requests(engine, [RequestSpec(factory.prompt(n), GENERATE)])[0]
        label = "short" if n == SHORT_PROMPT else n
        error = t.error or "no token arrived"
        if n != SHORT_PROMPT:
            rates.add(_name("protoserve", "prefill", n), n / t.ttft if t.ok and t.ttft else None, error)
        rates.add(_name("protoserve", "decode", label), t.decode_tokens_per_s() if t.ok else None, error)


def add_peer_results(results: Sequence[LlamaBenchResult], rates: Rates) -> None:
    """llama-bench's pp N (empty context) and tg64 at depth N (0: the short baseline) as their figures."""
    for r in results:
        if r.test.startswith("pp") and r.depth == 0:
            rates.add(_name("llama-bench", "prefill", int(r.test[2:])), r.tokens_per_s)
        elif r.test == f"tg{GENERATE}":
            rates.add(_name("llama-bench", "decode", r.depth or "short"), r.tokens_per_s)


def ratio_figures(fig: dict[str, Figure]) -> list[Figure]:
    out = []
    for kind in ("prefill", "decode"):
        for n in CONTEXTS:
            key = f"ratio.{kind}.{n}"
            out.append(ratio_figure(_name(key), SECTION, fig[_name("protoserve", kind, n)],
                                    fig[_name("llama-bench", kind, n)], target=TARGETS.get(key)))
    for n in CONTEXTS:  # a long decode against our own short one: what the context costs
        key = f"self.decode.{n}"
        out.append(ratio_figure(_name(key), SECTION, fig[_name("protoserve", "decode", n)],
                                fig[_name("protoserve", "decode", "short")], target=TARGETS.get(key)))
    return out


def _step(ctx: BenchContext) -> Step:
    variant = ctx.profile.serving_variant
    expects = tuple(figure_names())
    repeats = ctx.profile.repeats
    rounds = 2 if repeats > 1 else 1

    def run(loaded: Any) -> list[Figure]:
        import torch

        model = resources.model_path()
        binaries, reason = llama_bench.find_for(model)
        if binaries is None:
            return [skipped(n, u, SECTION, reason) for n, u in expects]
        threads = torch.get_num_threads()
        reps = max(1, repeats // rounds)
        commands = [
            llama_bench.depth_command(binaries.bench, model, threads, CONTEXTS, 0, (0,), FLASH_ATTN, reps),
            llama_bench.depth_command(binaries.bench, model, threads, (0,), GENERATE, (0, *CONTEXTS), FLASH_ATTN, reps),
        ]
        engine = engine_direct.make_engine(loaded, variant, deterministic=True)
        engine_direct.warm_up(engine, [RequestSpec(ctx.factory(WORKLOAD + 1).prompt(600), 4)])
        rates = Rates()
        for r in range(rounds):
            for side in ("peer", "ours") if r % 2 == 0 else ("ours", "peer"):
                if side == "peer":
                    add_peer_results([res for command in commands for res in llama_bench.run(command)], rates)
                else:
                    for _ in range(reps):
                        _measure_ours(engine, ctx, rates)
        figures = {name: rates.figure(name) for name, unit in expects if unit == UNIT}
        return [*figures.values(), *ratio_figures(figures)]

    return Step(SECTION, EngineModel(variant), f"long contexts: protoserve {variant.label} and llama-bench in turn",
                run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    return [_step(ctx)]
