"""Constrained decoding: JSON-Schema decoding speed as a share of plain decoding, and grammar compile time.

Engine-direct, the served variant. At each level a set of JSON-Schema requests
(greedy, a few schemas in turn, random token prompts behind a nonce) runs once
unmeasured: that fixes how many tokens each produces (greedy decoding repeats
itself exactly) and caches the prompts' blocks. Then each round runs them
constrained, and the same prompts unconstrained with EOS ignored and
``max_tokens`` set to exactly those counts, the two in alternating order
(ABBA), so both paths produce as many tokens from the same prompts (same prefix
hits) and drift in the machine's load falls on both alike: the ratio is the
constraint's price (mask fill, the sampler's masked path, the matcher's advance)
less what grammar fast-forward, on as served, saves (forced tokens take no
forward of their own). At c=1 the requests run one at a time and the
figure is decode tokens/s after the first token, pooled over the requests; at
c=16 they are all sent at once and the figure is output tokens over wall time.

Fast-forward figures (``ff``): at c=1, JSON Schemas of many fixed keys and short values (the
output is mostly keys and punctuation the grammar forces), run with grammar fast-forward (the
engine's default: forced tokens drafted and verified in the forward of the token before them),
step by step (fast-forward off) and unconstrained with the same token counts, in rotating order
over rounds; ``ff.ratio.c1`` is fast-forward / unconstrained, and the details give the steps each
path took per output token.

Compile figures: ``first`` is ``GrammarCompiler.compile`` of a schema the cache
has not seen (median over the schemas, llguidance's tokenizer view already
built: its one-off build is a detail, as is the first mask fill, where
llguidance builds its lexer lazily); ``cached`` is the same call answered from
the cache.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

from bench.context import BenchContext
from bench.engine_direct import run_tokenized
from bench.figures import Figure, Target
from bench.resources import EngineModel
from bench.runner import Step
from bench.stats import median, significant
from bench.timeline import RequestTimeline

SECTION = "constrained"
WORKLOAD = 7
PROMPT_LEN = 32
RATIO_TARGET = Target(0.9, "higher")  # the issue's: constraints cost at most a tenth of the speed
FF_TARGET = Target(1.2, "higher")  # issue 48: forced tokens skip their forwards, so schema-heavy output is faster
FF_PATHS = ("ff", "stepwise", "plain")
_ids = itertools.count()

NAME = {"type": "string", "maxLength": 24}


def _obj(properties: dict[str, Any]) -> dict[str, Any]:
    """OpenAI strict mode's shape: every property required, no others (a model cannot pad the object)."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


BENCH_SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
          "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
          "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}}),
    _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                    "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 9}})},
          "total": {"type": "number", "minimum": 0, "maximum": 1000}}),
    {"$defs": {"pt": _obj({"x": {"type": "integer", "minimum": -999, "maximum": 999},
                           "y": {"type": "integer", "minimum": -999, "maximum": 999}})},
     **_obj({"path": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 2, "maxItems": 4},
             "closed": {"type": "boolean"}})},
    _obj({"event": NAME, "when": {"type": "string", "format": "date"},
          "where": {"anyOf": [NAME, {"type": "null"}]}}),
]
FLAG = {"type": "boolean"}
COUNT = {"type": "integer", "minimum": 0, "maximum": 999}
# Schema-heavy output: long fixed keys, short values, enums with long shared prefixes.
HEAVY_SCHEMAS: list[dict[str, Any]] = [
    _obj({"customer_account_number": COUNT, "customer_display_name": {"type": "string", "maxLength": 12},
          "preferred_contact_method": {"enum": ["email_address", "telephone_number", "postal_mail"]},
          "marketing_emails_opt_in": FLAG, "loyalty_program_member": FLAG, "loyalty_points_balance": COUNT,
          "account_status": {"enum": ["active_in_good_standing", "suspended_pending_review"]}}),
    _obj({"server_hostname": {"type": "string", "maxLength": 12}, "listen_port_number": COUNT,
          "enable_transport_layer_security": FLAG, "maximum_concurrent_connections": COUNT,
          "request_timeout_seconds": COUNT, "enable_response_compression": FLAG,
          "log_verbosity_level": {"enum": ["debug_messages", "informational_messages", "warnings_only"]}}),
]


@dataclass(frozen=True)
class Sizes:
    max_tokens: int
    c1_requests: int
    c16_requests: int
    rounds: int
    concurrency: int = 16
    ff_max_tokens: int = 192  # room for a schema-heavy object: each run ends with its grammar


SIZES = {"smoke": Sizes(16, 2, 4, 1, 4, 32), "default": Sizes(96, 4, 16, 4), "full": Sizes(128, 8, 32, 6)}


def _requests(prompts: list[tuple[int, ...]], max_tokens: list[int] | int, constrained: bool,
              schemas: list[dict[str, Any]] = BENCH_SCHEMAS) -> list[Any]:
    from protoserve.engine.api import Constraint, SamplingParams, TokenizedRequest

    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    out = []
    for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        sp = SamplingParams(max_tokens=limit, temperature=0.0)
        if constrained:
            sp.constraint = Constraint.json_schema(schemas[i % len(schemas)])
        else:
            sp.ignore_eos = True
        out.append(TokenizedRequest(f"constrained-{next(_ids)}", list(prompt), sp))
    return out


@dataclass
class Pooled:
    """Tokens and seconds summed over rounds, for one path at one concurrency."""

    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, timelines: list[RequestTimeline], concurrency: int) -> None:
        if concurrency == 1:  # decode speed: what follows each request's first token
            for t in timelines:
                self.tokens += t.output_tokens - t.chunks[0][1]
                self.seconds += t.chunks[-1][0] - t.chunks[0][0]
        else:
            self.tokens += sum(t.output_tokens for t in timelines)
            self.seconds += max(t.finished for t in timelines) - min(t.sent for t in timelines)


def _speed_step(ctx: BenchContext, sizes: Sizes) -> Step:
    variant = ctx.profile.serving_variant
    levels = ((1, sizes.c1_requests), (sizes.concurrency, sizes.c16_requests))
    names = {c: (f"{SECTION}.engine.json.c{c}", f"{SECTION}.engine.plain.c{c}", f"{SECTION}.ratio.c{c}")
             for c, _ in levels}

    def run(loaded: Any) -> list[Figure]:
        from bench import engine_direct

        engine = engine_direct.make_engine(loaded, variant, deterministic=True)
        factory = ctx.factory(WORKLOAD)
        warm = [factory.prompt(PROMPT_LEN) for _ in range(2)]
        run_tokenized(engine, _requests(warm, 8, constrained=True), 2)
        figures: list[Figure] = []
        for concurrency, count in levels:
            prompts = [factory.prompt(PROMPT_LEN) for _ in range(count)]
            first = run_tokenized(engine, _requests(prompts, sizes.max_tokens, True), concurrency)
            counts = [t.output_tokens for t in first]
            pools = {True: Pooled(), False: Pooled()}
            for round_ in range(sizes.rounds):
                for constrained in (True, False) if round_ % 2 == 0 else (False, True):
                    limits = sizes.max_tokens if constrained else counts
                    timelines = run_tokenized(engine, _requests(prompts, limits, constrained), concurrency)
                    if [t.output_tokens for t in timelines] != counts:
                        raise RuntimeError("a greedy rerun generated other token counts than the first run")
                    pools[constrained].add(timelines, concurrency)
            json_pool, plain_pool, produced = pools[True], pools[False], counts * sizes.rounds
            json_name, plain_name, ratio_name = names[concurrency]
            details = {"requests": len(produced), "rounds": sizes.rounds, "tokens": sum(produced),
                       "mean_tokens": significant(sum(produced) / len(produced))}
            figures += [
                Figure(json_name, json_pool.rate, "tok/s", SECTION, details=details,
                       note=f"JSON Schema, greedy, {variant.label}"),
                Figure(plain_name, plain_pool.rate, "tok/s", SECTION, details=details,
                       note="same prompts and token counts, unconstrained"),
                Figure(ratio_name, json_pool.rate / plain_pool.rate, "ratio", SECTION, target=RATIO_TARGET,
                       details={"json_tok_s": significant(json_pool.rate),
                                "plain_tok_s": significant(plain_pool.rate)}),
            ]
        return figures

    units = ("tok/s", "tok/s", "ratio")
    expects = tuple((n, u) for c, _ in levels for n, u in zip(names[c], units, strict=True))
    return Step(SECTION, EngineModel(variant), "constrained decoding vs plain, engine-direct", run, expects)


def _fast_forward_step(ctx: BenchContext, sizes: Sizes) -> Step:
    variant = ctx.profile.serving_variant
    names = {path: f"{SECTION}.ff.{'json' if path == 'ff' else path}.c1" for path in FF_PATHS}
    ratio_name = f"{SECTION}.ff.ratio.c1"

    def run(loaded: Any) -> list[Figure]:
        from bench import engine_direct

        engine = engine_direct.make_engine(loaded, variant, deterministic=True)
        factory = ctx.factory(WORKLOAD)
        prompts = [factory.prompt(PROMPT_LEN) for _ in range(sizes.c1_requests)]
        first = run_tokenized(engine, _requests(prompts, sizes.ff_max_tokens, True, HEAVY_SCHEMAS), 1)
        counts = [t.output_tokens for t in first]
        pools = {path: Pooled() for path in FF_PATHS}
        steps = dict.fromkeys(FF_PATHS, 0)
        for round_ in range(sizes.rounds):
            for path in FF_PATHS[round_ % 3:] + FF_PATHS[: round_ % 3]:
                # One engine for all three paths (same prefix cache, same pool); the switch is read each step.
                engine.fast_forward.enabled = path != "stepwise"
                before = engine.stats().num_steps
                limits = sizes.ff_max_tokens if path != "plain" else counts
                timelines = run_tokenized(engine, _requests(prompts, limits, path != "plain", HEAVY_SCHEMAS), 1)
                if [t.output_tokens for t in timelines] != counts:
                    raise RuntimeError("a greedy rerun generated other token counts than the first run")
                pools[path].add(timelines, 1)
                steps[path] += engine.stats().num_steps - before
        engine.fast_forward.enabled = True
        tokens = sum(counts) * sizes.rounds
        details = {"requests": len(counts), "rounds": sizes.rounds, "tokens": tokens,
                   "mean_tokens": significant(sum(counts) / len(counts))}
        figures = [Figure(names[path], pools[path].rate, "tok/s", SECTION, note=note,
                          details={**details, "steps_per_token": significant(steps[path] / tokens)})
                   for path, note in (("ff", f"schema-heavy JSON, grammar fast-forward, {variant.label}"),
                                      ("stepwise", "the same, fast-forward off"),
                                      ("plain", "same prompts and token counts, unconstrained"))]
        figures.append(Figure(ratio_name, pools["ff"].rate / pools["plain"].rate, "ratio", SECTION, target=FF_TARGET,
                              details={"ff_tok_s": significant(pools["ff"].rate),
                                       "stepwise_tok_s": significant(pools["stepwise"].rate),
                                       "plain_tok_s": significant(pools["plain"].rate)}))
        return figures

    expects = (*((names[path], "tok/s") for path in FF_PATHS), (ratio_name, "ratio"))
    return Step(SECTION, EngineModel(variant), "schema-heavy JSON with grammar fast-forward vs plain, c=1", run,
                expects)


def _compile_step(ctx: BenchContext) -> Step:
    variant = ctx.profile.serving_variant
    first_name, cached_name = f"{SECTION}.compile.first", f"{SECTION}.compile.cached"

    def run(loaded: Any) -> list[Figure]:
        from protoserve.engine.api import Constraint
        from protoserve.engine.runtime import GrammarCompiler, MaskFiller

        engine_eos = set(loaded.tokenizer.eos_token_ids) | set(loaded.config.eos_token_ids)
        compiler = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, engine_eos)
        started = time.perf_counter()
        _ = compiler.ll_tokenizer
        tokenizer_ms = (time.perf_counter() - started) * 1e3
        filler = MaskFiller(compiler.vocab_size)
        firsts, masks, cached = [], [], []
        for schema in BENCH_SCHEMAS:
            constraint = Constraint.json_schema(json.dumps(schema))
            started = time.perf_counter()
            compiled = compiler.compile(constraint)
            firsts.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            filler.start([compiled.new_matcher()]).result()
            masks.append((time.perf_counter() - started) * 1e3)
            for _ in range(5):
                started = time.perf_counter()
                assert compiler.compile(constraint) is compiled
                cached.append((time.perf_counter() - started) * 1e3)
        filler.close()
        return [
            Figure(first_name, median(firsts), "ms", SECTION, better="lower",
                   details={"schemas": len(firsts), "max_ms": significant(max(firsts)),
                            "first_mask_ms": significant(median(masks)),
                            "tokenizer_build_ms": significant(tokenizer_ms)}),
            Figure(cached_name, median(cached), "ms", SECTION, better="lower",
                   details={"calls": len(cached), "max_ms": significant(max(cached))}),
        ]

    expects = ((first_name, "ms"), (cached_name, "ms"))
    return Step(SECTION, EngineModel(variant), "grammar compile time", run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    sizes = SIZES.get(ctx.profile.name, SIZES["default"])
    return [_compile_step(ctx), _speed_step(ctx, sizes), _fast_forward_step(ctx, sizes)]
