"""The speculative-decoding bench section's pure parts: its figures, its prompts, and how it measures.

No model: ``measure`` runs against a scripted engine on a fake clock; the section itself runs in
``make bench`` (``--only speculative``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import speculative
from protoserve.engine.request import CompletionDelta, RequestOutput, RequestStats

DRAFTS, ACCEPTED = 4, 2  # per verification of the scripted engine


class ScriptedEngine:
    """One step = one second of the fake clock. A request's first step emits one token; after that a
    speculative request emits ``1 + ACCEPTED`` tokens a step (drafting ``DRAFTS``), others one. Token i
    of a request is ``prompt[0] + i`` (plus ``skew`` with speculation: a broken verifier)."""

    def __init__(self, skew: int = 0) -> None:
        self.now = 0.0
        self.skew = skew
        self.live: dict[str, list] = {}  # id -> [request, tokens emitted, stats]
        self.added: list[bool] = []  # speculative or not, per request, in order

    def clock(self) -> float:
        return self.now

    def add_request(self, request) -> None:
        self.added.append(request.sampling.speculative is not None)
        self.live[request.request_id] = [request, 0, RequestStats()]

    def step(self) -> list[RequestOutput]:
        self.now += 1.0
        outputs = []
        for rid, state in list(self.live.items()):
            request, emitted, stats = state
            spec = request.sampling.speculative is not None
            count = 1 + ACCEPTED if spec and emitted else 1
            if spec and emitted:
                stats.spec_num_drafts += 1
                stats.spec_draft_tokens += DRAFTS
                stats.spec_accepted_tokens += ACCEPTED
            count = min(count, request.sampling.max_tokens - emitted)
            base = request.prompt_token_ids[0] + (self.skew if spec else 0)
            tokens = [base + emitted + k for k in range(count)]
            state[1] = emitted + count
            finished = state[1] == request.sampling.max_tokens
            outputs.append(RequestOutput(rid, [CompletionDelta(0, "", tokens)], finished=finished,
                                         stats=stats if finished else None))
            if finished:
                del self.live[rid]
        return outputs


@pytest.fixture
def engine(monkeypatch):
    scripted = ScriptedEngine()
    monkeypatch.setattr(speculative, "time", SimpleNamespace(perf_counter=scripted.clock))
    return scripted


def test_registered_with_its_figures_and_the_issue_targets():
    assert SECTIONS["speculative"] is speculative.steps
    steps = speculative.steps(BenchContext(PROFILES["default"]))
    names = [name for step in steps for name, _ in step.expects]
    levels = ["ngram.copy.c1", "ngram.free.c16", "draft.free.c1"]
    offs = ["off.copy.c1", "off.free.c16", "off.free.c1"]
    assert names == [name for level, off in zip(levels, offs, strict=True)
                     for name in (f"speculative.engine.{level}", f"speculative.engine.{off}",
                                  f"speculative.ratio.{level}", f"speculative.acceptance.{level}")]
    assert len(set(names)) == len(names)
    assert speculative.COPY_TARGET.met(1.5) and not speculative.COPY_TARGET.met(1.49)
    assert speculative.LOAD_TARGET.met(0.9) and not speculative.LOAD_TARGET.met(0.89)


def test_c1_ratio_pools_decode_after_first_token_and_acceptance_skips_the_warm_up(engine):
    level = speculative.Level("ngram", "copy", 1, speculative.COPY_TARGET)
    prompts = [[100], [200]]
    spec, off, ratio, acceptance = speculative.measure(engine, level, prompts, max_tokens=13, rounds=2)
    # 12 tokens after the first: 12 steps without speculation, 4 with 3 tokens a step.
    assert off.value == pytest.approx(1.0) and spec.value == pytest.approx(3.0)
    assert ratio.value == pytest.approx(3.0) and ratio.met
    # Both warm-up runs, then the paths in ABBA order, one request at a time.
    assert engine.added == [False] * 2 + [True] * 2 + [True] * 2 + [False] * 2 + [False] * 2 + [True] * 2
    assert acceptance.value == pytest.approx(ACCEPTED / DRAFTS)
    assert acceptance.details["verifications"] == 2 * 2 * 4  # rounds x requests x steps after the first


def test_c16_ratio_is_output_tokens_over_wall_time(engine):
    level = speculative.Level("ngram", "free", 16, speculative.LOAD_TARGET)
    spec, off, ratio, _ = speculative.measure(engine, level, [[1], [2], [3]], max_tokens=7, rounds=1)
    assert off.value == pytest.approx(3 * 7 / 7) and spec.value == pytest.approx(3 * 7 / 3)


def test_tokens_that_differ_with_speculation_fail_the_level(monkeypatch):
    broken = ScriptedEngine(skew=1)
    monkeypatch.setattr(speculative, "time", SimpleNamespace(perf_counter=broken.clock))
    level = speculative.Level("ngram", "copy", 1, speculative.COPY_TARGET)
    with pytest.raises(RuntimeError, match="differ"):
        speculative.measure(broken, level, [[5]], max_tokens=6, rounds=1)


def test_copy_prompts_quote_passages_longer_than_the_tokens_asked_for():
    from protoserve.engine.loader.default_model import default_model_path
    from protoserve.engine.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path())
    prompts = speculative.copy_prompts(tokenizer, len(speculative.PASSAGES))
    for passage, prompt in zip(speculative.PASSAGES, prompts, strict=True):
        assert passage in tokenizer.decode(prompt)
        assert len(tokenizer.encode(passage)) > max(s.copy_tokens for s in speculative.SIZES.values())
    with pytest.raises(ValueError, match="copy_requests"):
        speculative.copy_prompts(tokenizer, len(speculative.PASSAGES) + 1)
    assert len(set(map(tuple, speculative.free_prompts(tokenizer, 16)))) == 16
