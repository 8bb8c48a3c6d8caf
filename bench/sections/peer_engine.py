"""protoserve's engine-level figures beside llama.cpp's ``llama-bench`` on the same GGUF and threads.

``llama-bench -p 512 -n 128 -fa 0,1``: pp512 is one 512-token prompt over an
empty context (random token ids), tg128 128 tokens generated one at a time.
Beside it, the served variant measured the way the bench's prefill and decode
sections measure it, both in this process (engine) and through the gRPC
server: a 512-token prompt of random ids behind a nonce with one new token
(prompt tokens / time to first token), and one stream of 128 new tokens after
a short prompt (tokens after the first / time after the first); and prefill
as a user sends it, ~512 tokens of text to the gateway's OpenAI completions
route (bench/peers/text_prefill.py). llama-bench
and protoserve take turns, the order flipped each round, so both see the same
machine. Ratios are protoserve / llama-bench's better flash-attention setting
(the issue's targets: gRPC prefill >= 6x, gRPC decode >= 1.3x). Without a
built peer every figure is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bench import engine_direct, resources
from bench.context import BenchContext
from bench.figures import Figure, Target, skipped
from bench.load_generator import run_clients
from bench.peers import llama_bench
from bench.peers.chat_workload import ChatPromptFactory, model_words
from bench.peers.llama_bench import LlamaBenchResult
from bench.peers.ratios import ratio_figure
from bench.peers.text_prefill import TextPrefill, text_prompt
from bench.peers.text_prefill import prefill_rate as text_prefill_rate
from bench.resources import Server, load_engine_model
from bench.runner import Step
from bench.stats import median, significant
from bench.timeline import RequestTimeline
from bench.transports import GrpcTransport
from bench.workload import RequestSpec

SECTION = "peer_engine"
UNIT = "tok/s"
PROMPT = llama_bench.PROMPT
GENERATE = llama_bench.GENERATE
PEER_TESTS = tuple(f"{test}.fa{fa}" for test in (f"pp{PROMPT}", f"tg{GENERATE}") for fa in llama_bench.FLASH_ATTN)
PREFILL = f"prefill{PROMPT}"
# Each figure's paths: in this process, over gRPC with token ids (the bench's other sections' way), and for
# prefill also as a user sends it (text to the gateway's OpenAI completions route).
PATHS = {PREFILL: ("engine", "grpc", "openai"), "decode": ("engine", "grpc")}
WORKLOAD = 29
DECODE_PROMPT = 32
TARGETS = {f"ratio.{PREFILL}.grpc": Target(6.0, "higher"), "ratio.decode.grpc": Target(1.3, "higher")}


def _name(*parts: str) -> str:
    return ".".join((SECTION, *parts))


def figure_names() -> list[tuple[str, str]]:
    out = [(_name("llama-bench", key), UNIT) for key in PEER_TESTS]
    out += [(_name("protoserve", kind, path), UNIT) for kind, paths in PATHS.items() for path in paths]
    out += [(_name("ratio", kind, path), "x") for kind, paths in PATHS.items() for path in paths]
    return out


def peer_figures(results: Sequence[LlamaBenchResult]) -> list[Figure]:
    """One figure per llama-bench test: the median over rounds of llama-bench's own averages."""
    figures = []
    for key in PEER_TESTS:
        runs = [r for r in results if r.key == key]
        name = _name("llama-bench", key)
        if not runs:
            figures.append(skipped(name, UNIT, SECTION, f"llama-bench reported no {key}"))
            continue
        rates = [r.tokens_per_s for r in runs]
        figures.append(
            Figure(
                name=name,
                value=median(rates),
                unit=UNIT,
                section=SECTION,
                details={"rounds": len(runs), "min": significant(min(rates)), "max": significant(max(rates)),
                         "stddev": significant(max(r.stddev for r in runs)), "threads": runs[0].threads},
            )
        )
    return figures


def best_peer(figures: Sequence[Figure], test: str) -> Figure:
    """llama-bench's faster flash-attention setting for ``test`` (pp512 or tg128): the ratio is held to it."""
    measured = [f for f in figures if f.name.startswith(_name("llama-bench", test + ".")) and f.value is not None]
    if not measured:
        return skipped(_name("llama-bench", test), UNIT, SECTION, f"no llama-bench {test} figure")
    return max(measured, key=lambda f: f.value or 0.0)


def our_figure(name: str, rates: Sequence[float], errors: Sequence[str]) -> Figure:
    if not rates:
        return skipped(name, UNIT, SECTION, errors[0] if errors else "nothing measured")
    return Figure(name=name, value=median(rates), unit=UNIT, section=SECTION,
                  details={"runs": len(rates), "min": significant(min(rates)), "max": significant(max(rates))})


def ratio_figures(peer: Sequence[Figure], ours: dict[str, Figure]) -> list[Figure]:
    theirs = {PREFILL: best_peer(peer, f"pp{PROMPT}"), "decode": best_peer(peer, f"tg{GENERATE}")}
    out = []
    for kind, paths in PATHS.items():
        for path in paths:
            key = f"ratio.{kind}.{path}"
            out.append(ratio_figure(_name(key), SECTION, ours[f"{kind}.{path}"], theirs[kind], target=TARGETS.get(key)))
    return out


def _prefill_rate(t: RequestTimeline) -> float | None:
    return PROMPT / t.ttft if t.ok and t.ttft else None


def _decode_rate(t: RequestTimeline) -> float | None:
    return t.decode_tokens_per_s() if t.ok else None


class _Ours:
    """Rates of each (kind, path), and the first error of each."""

    def __init__(self) -> None:
        self.rates: dict[str, list[float]] = {f"{k}.{p}": [] for k, paths in PATHS.items() for p in paths}
        self.errors: dict[str, list[str]] = {key: [] for key in self.rates}

    def add(self, key: str, timeline: RequestTimeline, rate: float | None) -> None:
        if rate is None:
            self.errors[key].append(timeline.error or "no token arrived")
        else:
            self.rates[key].append(rate)

    def figures(self) -> dict[str, Figure]:
        return {key: our_figure(_name("protoserve", *key.split(".")), self.rates[key], self.errors[key])
                for key in self.rates}


def _step(ctx: BenchContext) -> Step:
    variant = ctx.profile.serving_variant
    expects = tuple(figure_names())
    repeats = ctx.profile.repeats
    rounds = 2 if repeats > 1 else 1

    def run(server: Any) -> list[Figure]:
        import torch

        model = resources.model_path()
        binaries, reason = llama_bench.find_for(model)
        if binaries is None:
            return [skipped(n, u, SECTION, reason) for n, u in expects]
        threads = torch.get_num_threads()
        command = llama_bench.bench_command(binaries.bench, model, threads, repetitions=max(1, repeats))
        engine = engine_direct.make_engine(load_engine_model(variant), variant, deterministic=True)
        factory = ctx.factory(WORKLOAD)
        texts = ChatPromptFactory(model_words(model), seed=ctx.seed * 1_000_003 + WORKLOAD)
        ours = _Ours()
        peer: list[LlamaBenchResult] = []

        def prefill() -> RequestSpec:
            return RequestSpec(factory.prompt(PROMPT), 1)

        def decode() -> RequestSpec:
            return RequestSpec(factory.prompt(DECODE_PROMPT), GENERATE)

        async def measure_ours() -> None:
            grpc = GrpcTransport(server.grpc_target)
            text = TextPrefill(server.http_base_url, server.model_name()) if server.http_base_url else None
            try:
                await grpc.stream(prefill())
                engine_direct.warm_up(engine, [prefill()])
                if text is not None:
                    await text.stream(text_prompt(texts, PROMPT))
                for _ in range(repeats):
                    for kind, make, rate in ((PREFILL, prefill, _prefill_rate), ("decode", decode, _decode_rate)):
                        t = engine_direct.run_requests(engine, [make()])[0]
                        ours.add(f"{kind}.engine", t, rate(t))
                        t = await grpc.stream(make())
                        ours.add(f"{kind}.grpc", t, rate(t))
                    if text is not None:
                        t = await text.stream(text_prompt(texts, PROMPT))
                        ours.add(f"{PREFILL}.openai", t, text_prefill_rate(t))
                    else:
                        ours.errors[f"{PREFILL}.openai"].append("the server started no REST gateway")
            finally:
                await grpc.close()
                if text is not None:
                    await text.close()

        for r in range(rounds):
            # ABBA: llama-bench first in even rounds.
            for side in ("peer", "ours") if r % 2 == 0 else ("ours", "peer"):
                if side == "peer":
                    peer.extend(llama_bench.run(command))
                else:
                    run_clients(measure_ours())
        peer_figs = peer_figures(peer)
        peer_figs[0] = replace(peer_figs[0], note=binaries.describe()) if peer_figs[0].value is not None else peer_figs[0]
        mine = ours.figures()
        return [*peer_figs, *mine.values(), *ratio_figures(peer_figs, mine)]

    return Step(SECTION, Server(variant), f"llama-bench and protoserve {variant.label} in turn", run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    return [_step(ctx)]
