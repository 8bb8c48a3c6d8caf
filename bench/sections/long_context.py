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

Then both with 8-bit K/V at 4,096 (the ``-kv8`` figures): protoserve at ``--kv-cache-dtype int8``
beside ``llama-bench -ctk q8_0 -ctv q8_0``, each side's long decode also against its own short one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
# The 8-bit K/V pass: our int8 rows beside llama.cpp's q8_0 cache (which needs its flash attention).
KV8_CONTEXTS = (4096,)
KV8_PEER_CACHE = "q8_0"
TARGETS = {
    "ratio.prefill.4096": Target(4.0, "higher"),
    "ratio.decode.4096": Target(2.5, "higher"),
    "self.decode.4096": Target(0.6, "higher"),
    "ratio-kv8.decode.4096": Target(2.5, "higher"),
    "self-kv8.decode.4096": Target(0.6, "higher"),
}


@dataclass(frozen=True)
class Pass:
    """One comparison: our side and the peer's figure prefixes, its contexts, and the ratios' prefixes."""

    ours: str
    peer: str
    contexts: tuple[int, ...]
    ratio: str
    own: str  # a long decode against the same side's short one


DEFAULT = Pass("protoserve", "llama-bench", CONTEXTS, "ratio", "self")
KV8 = Pass("protoserve-kv8", "llama-bench-kv8", KV8_CONTEXTS, "ratio-kv8", "self-kv8")


def _name(*parts: str | int) -> str:
    return ".".join((SECTION, *(str(p) for p in parts)))


def figure_names() -> list[tuple[str, str]]:
    out = []
    for p in (DEFAULT, KV8):
        for side in (p.ours, p.peer):
            out += [(_name(side, "prefill", n), UNIT) for n in p.contexts]
            out += [(_name(side, "decode", n), UNIT) for n in ("short", *p.contexts)]
        out += [(_name(p.ratio, kind, n), "x") for kind in ("prefill", "decode") for n in p.contexts]
        out += [(_name(p.own, "decode", n), "x") for n in p.contexts]
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


def _measure_ours(engine: Any, ctx: BenchContext, rates: Rates, p: Pass) -> None:
    """One request per context (and the short one): prefill from its first token, decode after it."""
    factory = ctx.factory(WORKLOAD)
    for n in (SHORT_PROMPT, *p.contexts):
        t: RequestTimeline = engine_direct.run_requests(engine, [RequestSpec(factory.prompt(n), GENERATE)])[0]
        label = "short" if n == SHORT_PROMPT else n
        error = t.error or "no token arrived"
        if n != SHORT_PROMPT:
            rates.add(_name(p.ours, "prefill", n), n / t.ttft if t.ok and t.ttft else None, error)
        rates.add(_name(p.ours, "decode", label), t.decode_tokens_per_s() if t.ok else None, error)


def add_peer_results(results: Sequence[LlamaBenchResult], rates: Rates, p: Pass = DEFAULT) -> None:
    """llama-bench's pp N (empty context) and tg64 at depth N (0: the short baseline) as their figures."""
    for r in results:
        if r.test.startswith("pp") and r.depth == 0:
            rates.add(_name(p.peer, "prefill", int(r.test[2:])), r.tokens_per_s)
        elif r.test == f"tg{GENERATE}":
            rates.add(_name(p.peer, "decode", r.depth or "short"), r.tokens_per_s)


def ratio_figures(fig: dict[str, Figure], p: Pass = DEFAULT) -> list[Figure]:
    out = []
    for kind in ("prefill", "decode"):
        for n in p.contexts:
            key = f"{p.ratio}.{kind}.{n}"
            out.append(ratio_figure(_name(key), SECTION, fig[_name(p.ours, kind, n)], fig[_name(p.peer, kind, n)],
                                    target=TARGETS.get(key)))
    for n in p.contexts:  # a long decode against the same side's short one: what the context costs
        key = f"{p.own}.decode.{n}"
        out.append(ratio_figure(_name(key), SECTION, fig[_name(p.ours, "decode", n)],
                                fig[_name(p.ours, "decode", "short")], target=TARGETS.get(key)))
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

        def commands(p: Pass, cache_type: str | None) -> list[list[str]]:
            return [
                llama_bench.depth_command(binaries.bench, model, threads, p.contexts, 0, (0,), FLASH_ATTN, reps,
                                          cache_type),
                llama_bench.depth_command(binaries.bench, model, threads, (0,), GENERATE, (0, *p.contexts),
                                          FLASH_ATTN, reps, cache_type),
            ]

        passes = [
            (DEFAULT, variant, commands(DEFAULT, None)),
            (KV8, replace(variant, kv_cache_dtype="int8"), commands(KV8, KV8_PEER_CACHE)),
        ]
        rates = Rates()
        for p, ours, peer in passes:
            engine = engine_direct.make_engine(loaded, ours, deterministic=True)
            engine_direct.warm_up(engine, [RequestSpec(ctx.factory(WORKLOAD + 1).prompt(600), 4)])
            for r in range(rounds):
                for side in ("peer", "ours") if r % 2 == 0 else ("ours", "peer"):
                    if side == "peer":
                        add_peer_results([res for command in peer for res in llama_bench.run(command)], rates, p)
                    else:
                        for _ in range(reps):
                            _measure_ours(engine, ctx, rates, p)
            del engine
        figures = {name: rates.figure(name) for name, unit in expects if unit == UNIT}
        return [*figures.values(), *(f for p, _, _ in passes for f in ratio_figures(figures, p))]

    return Step(SECTION, EngineModel(variant), f"long contexts: protoserve {variant.label} and llama-bench in turn",
                run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    return [_step(ctx)]
