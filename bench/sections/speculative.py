"""Speculative decoding: tokens/s with drafts as a ratio to the same requests without, and acceptance.

Engine-direct, SmolLM2 in float32 (the draft figures' target: its int4 weights
draft for it, as tests/speculative does). Every request is greedy with EOS
ignored and a fixed ``max_tokens``, so both paths of a ratio generate the same
tokens; each level runs both paths once unmeasured (warming the verification
shapes and the prompts' cached blocks, and giving the reference tokens), then
in rounds, the two paths in alternating order (ABBA), so drift in the
machine's load falls on both alike. A round whose tokens differ from the
reference raises: speculation must not change greedy output, and a figure
over other tokens would compare other work.

Levels, each a ratio to speculation off (the request's ``speculative`` unset)
on the same engine:

- ``ngram.copy.c1``: prompt lookup on chat prompts asking the model to repeat a
  passage word for word, one request at a time; decode tokens/s after each
  first token, pooled (the issue's target: at least 1.5x).
- ``draft.free.c1``: the int4 draft model on free-text chat prompts, one at a time.
- ``ngram.free.c16``: prompt lookup on free-text prompts, all sent at once;
  output tokens over wall time. The engine's default settings, so whatever
  turns speculation off under load (per-sequence cooldown after misses,
  ``speculative_disable_by_batch_size`` when set) is what is measured.

Acceptance is accepted / drafted tokens, summed over the measured speculative
runs from each request's final stats.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.context import BenchContext
from bench.figures import Figure, Target
from bench.resources import DEFAULT_VARIANT, EngineModel
from bench.runner import Step
from bench.sections.constrained import Pooled
from bench.stats import significant
from bench.timeline import RequestTimeline

SECTION = "speculative"
COPY_TARGET = Target(1.5, "higher")  # the issue's: prompt lookup pays on text that quotes its prompt
# --speculative-model turns drafting off above one running sequence on the premise that a draft
# model pays single-stream; this checks that premise.
DRAFT_TARGET = Target(1.0, "higher")
LOAD_TARGET = Target(0.9, "higher")  # the issue's: speculation under load costs at most a tenth
_ids = itertools.count()

# Passages SmolLM2-135M-Instruct repeats verbatim when asked (others it paraphrases, which is a
# different workload): each is longer than the copy levels' max_tokens, so every generated token
# is inside the copy.
PASSAGES = (
    "Bread dough needs time. Mix the flour, water, salt and yeast, then knead it for ten minutes until "
    "it is smooth and springs back when pressed. Leave it covered in a warm place for an hour, shape it "
    "into a loaf, let it rise again, and bake it in a hot oven until the crust is brown and the loaf "
    "sounds hollow when tapped underneath.",
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
    "trimmed the wick, and polished the great lens until it shone. Ships passing the rocky point relied "
    "on its beam to find the safe channel into the harbour, and on stormy nights he stayed awake until "
    "dawn to keep the light turning.",
    "Rivers carry water from the mountains to the sea. Rain and melting snow gather in small streams, "
    "the streams join into larger rivers, and the rivers wind across the plains, carrying sand and mud "
    "with them. Where a river meets the sea it slows down and drops what it carries, building deltas of "
    "rich soil where farmers grow rice and wheat.",
)
COPY_INSTRUCTION = "Repeat the following text exactly, word for word.\n\n"
QUESTIONS = (
    "Write a short story about a dragon who learns to paint.",
    "Explain how rain forms.",
    "List ten fruits and describe each one.",
    "What is the capital of France? Explain its history.",
    "How does a bicycle stay upright?",
    "Describe a busy market in the morning.",
    "Why do leaves change colour in autumn?",
    "Give advice to someone starting to learn the piano.",
    "Explain what a computer's memory does.",
    "Write a letter to a friend about a trip to the mountains.",
    "How do bees make honey?",
    "Compare cats and dogs as pets.",
    "What makes a good breakfast?",
    "Describe how a train journey across a country might feel.",
    "Explain why the sky is blue.",
    "Write a poem about the sea at night.",
)


@dataclass(frozen=True)
class Sizes:
    copy_requests: int  # passages, at most len(PASSAGES)
    copy_tokens: int  # below every passage's length in tokens
    draft_requests: int
    free_tokens: int
    load_requests: int
    rounds: int
    concurrency: int = 16


SIZES = {
    "smoke": Sizes(1, 12, 1, 12, 4, 1, 4),
    "default": Sizes(3, 56, 3, 64, 16, 4),
    "full": Sizes(3, 56, 4, 128, 32, 6),
}


@dataclass(frozen=True)
class Level:
    """One ratio: which speculation, on which prompts, at which concurrency."""

    method: str  # SpeculativeParams.method of the speculative path
    prompts: str  # "copy" or "free"
    concurrency: int
    target: Target

    @property
    def key(self) -> str:
        return f"{self.method}.{self.prompts}.c{self.concurrency}"

    @property
    def names(self) -> tuple[str, str, str, str]:
        """(speculative tok/s, off tok/s, ratio, acceptance) figure names."""
        return (f"{SECTION}.engine.{self.key}", f"{SECTION}.engine.off.{self.prompts}.c{self.concurrency}",
                f"{SECTION}.ratio.{self.key}", f"{SECTION}.acceptance.{self.key}")


UNITS = ("tok/s", "tok/s", "ratio", "rate")


def ngram_levels(sizes: Sizes) -> tuple[Level, Level]:
    return Level("ngram", "copy", 1, COPY_TARGET), Level("ngram", "free", sizes.concurrency, LOAD_TARGET)


DRAFT_LEVEL = Level("draft", "free", 1, DRAFT_TARGET)


@dataclass
class Acceptance:
    """Speculative verifications, drafted and accepted tokens, summed over requests."""

    verifications: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, stats: Any) -> None:
        self.verifications += stats.spec_num_drafts
        self.drafted += stats.spec_draft_tokens
        self.accepted += stats.spec_accepted_tokens

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def details(self) -> dict[str, Any]:
        per = (self.accepted + self.verifications) / self.verifications if self.verifications else None
        return {"verifications": self.verifications, "draft_tokens": self.drafted,
                "accepted_tokens": self.accepted,
                "tokens_per_verification": significant(per) if per is not None else None}


@dataclass
class Finished:
    """One request's timeline, tokens and final stats."""

    timeline: RequestTimeline
    token_ids: list[int] = field(default_factory=list)
    stats: Any = None


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """``text`` as the user's turn, through the model's own chat template (as the chat routes send it)."""
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def copy_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    if not 1 <= count <= len(PASSAGES):
        raise ValueError(f"copy_requests must be in [1, {len(PASSAGES)}]")
    return [chat_prompt(tokenizer, COPY_INSTRUCTION + p) for p in PASSAGES[:count]]


def free_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """``count`` free-text prompts, the questions in turn."""
    return [chat_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)]) for i in range(count)]


def _requests(prompts: Sequence[Sequence[int]], max_tokens: int, method: str | None) -> list[Any]:
    from protoserve.engine.api import SamplingParams, SpeculativeParams, TokenizedRequest

    spec = SpeculativeParams(method=method) if method is not None else None
    return [TokenizedRequest(f"{SECTION}-{next(_ids)}", list(prompt),
                             SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                            speculative=spec))
            for prompt in prompts]


def _run(engine: Any, requests: list[Any], concurrency: int) -> list[Finished]:
    """Keep ``concurrency`` requests in the engine until all have run; one result per request, in order."""
    done: dict[str, Finished] = {}
    queue = list(requests)
    pending: set[str] = set()
    while queue or pending:
        while queue and len(pending) < concurrency:
            r = queue.pop(0)
            done[r.request_id] = Finished(RequestTimeline(time.perf_counter(), len(r.prompt_token_ids)))
            engine.add_request(r)
            pending.add(r.request_id)
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            result = done[out.request_id]
            tokens = [t for d in out.deltas for t in d.token_ids]
            result.token_ids += tokens
            result.timeline.add_chunk(now, len(tokens))
            if out.finished:
                result.timeline.finish(now)
                result.stats = out.stats
                pending.discard(out.request_id)
    return [done[r.request_id] for r in requests]


def measure(engine: Any, level: Level, prompts: list[list[int]], max_tokens: int, rounds: int) -> list[Figure]:
    """The level's four figures: both paths warmed once, then ``rounds`` ABBA rounds."""
    reference = [f.token_ids for f in _run(engine, _requests(prompts, max_tokens, None), level.concurrency)]
    _run(engine, _requests(prompts, max_tokens, level.method), level.concurrency)
    pools = {True: Pooled(), False: Pooled()}
    acceptance = Acceptance()
    for round_ in range(rounds):
        for speculative in (True, False) if round_ % 2 == 0 else (False, True):
            method = level.method if speculative else None
            finished = _run(engine, _requests(prompts, max_tokens, method), level.concurrency)
            if [f.token_ids for f in finished] != reference:
                raise RuntimeError(f"{level.key}: greedy tokens {'with' if speculative else 'without'} "
                                   "speculation differ from the first run's")
            pools[speculative].add([f.timeline for f in finished], level.concurrency)
            if speculative:
                for f in finished:
                    acceptance.add(f.stats)
    spec_name, off_name, ratio_name, acceptance_name = level.names
    spec, off = pools[True], pools[False]
    details = {"requests": len(prompts), "rounds": rounds, "max_tokens": max_tokens}
    how = "one at a time, decode after each first token" if level.concurrency == 1 else "all at once, wall time"
    return [
        Figure(spec_name, spec.rate, "tok/s", SECTION, details=details,
               note=f"{level.method} speculation, greedy, {DEFAULT_VARIANT.label}, {how}"),
        Figure(off_name, off.rate, "tok/s", SECTION, details=details, note="same requests, speculation off"),
        Figure(ratio_name, spec.rate / off.rate if off.rate > 0 else None, "ratio", SECTION, target=level.target,
               details={"spec_tok_s": significant(spec.rate), "off_tok_s": significant(off.rate),
                        "acceptance": significant(acceptance.rate) if acceptance.rate is not None else None}),
        Figure(acceptance_name, acceptance.rate, "rate", SECTION, details=acceptance.details(),
               note="accepted / drafted tokens" if acceptance.drafted else "nothing was drafted"),
    ]


def _expects(levels: Sequence[Level]) -> tuple[tuple[str, str], ...]:
    return tuple((name, unit) for level in levels for name, unit in zip(level.names, UNITS, strict=True))


def _ngram_step(sizes: Sizes) -> Step:
    levels = ngram_levels(sizes)

    def run(loaded: Any) -> list[Figure]:
        from bench import engine_direct

        engine = engine_direct.make_engine(loaded, DEFAULT_VARIANT, deterministic=True)
        copy, load = levels
        return (measure(engine, copy, copy_prompts(loaded.tokenizer, sizes.copy_requests), sizes.copy_tokens,
                        sizes.rounds)
                + measure(engine, load, free_prompts(loaded.tokenizer, sizes.load_requests), sizes.free_tokens,
                          sizes.rounds))

    return Step(SECTION, EngineModel(DEFAULT_VARIANT), "n-gram speculation vs off, engine-direct", run,
                _expects(levels))


def _draft_step(sizes: Sizes) -> Step:
    def run(loaded: Any) -> list[Figure]:
        from bench import engine_direct
        from protoserve.engine.runtime import load_model

        draft = load_model(None, quantization="int4", progress=False, load_tokenizer=False)
        engine = engine_direct.make_engine(loaded, DEFAULT_VARIANT, deterministic=True)
        engine.enable_draft_model(draft)
        return measure(engine, DRAFT_LEVEL, free_prompts(loaded.tokenizer, sizes.draft_requests),
                       sizes.free_tokens, sizes.rounds)

    return Step(SECTION, EngineModel(DEFAULT_VARIANT), "int4 draft-model speculation vs off, engine-direct", run,
                _expects([DRAFT_LEVEL]))


def steps(ctx: BenchContext) -> list[Step]:
    sizes = SIZES.get(ctx.profile.name, SIZES["default"])
    return [_ngram_step(sizes), _draft_step(sizes)]
