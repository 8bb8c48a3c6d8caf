"""Constrained decoding in the engine, on the tiny byte-level model: masks, validation, cache, scheduling.

The tiny model's tokens are single bytes, so a grammar steers it one character at
a time; the real-model checks (JSON Schemas with SmolLM2) are in
test_constrained_decoding.py.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading

import pytest
from test_engine_batching import clone, fresh_rng, logprobs, tokens
from tiny_checkpoint_ids import TINY_EOS, TINY_VOCAB

from protoserve.engine.async_engine import AsyncEngine
from protoserve.engine.errors import ConstraintFailedError, InvalidRequestError
from protoserve.engine.llm import LLM
from protoserve.engine.request import FinishReason, TokenizedRequest
from protoserve.engine.sampling.constraints.constraint import Constraint, ConstraintKind
from protoserve.engine.sampling.constraints.masks import MaskFiller, allowed_tokens
from protoserve.engine.sampling.sampling_params import SamplingParams

REGEXES = [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"\d{4}-\d{2}-\d{2}", r"(yes|no|maybe)!?",
           r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){1,2}"]


def request(rid: str, constraint: Constraint | None, prompt_seed: int = 0, **sampling) -> TokenizedRequest:
    sampling.setdefault("max_tokens", 48)
    sampling.setdefault("temperature", 1.0)
    rng = random.Random(prompt_seed)
    prompt = [rng.randrange(256) for _ in range(rng.randint(3, 30))]
    return TokenizedRequest(rid, prompt, SamplingParams(constraint=constraint, **sampling))


def text(c) -> list[str]:
    return [ch.text for ch in c.choices]


def test_regex_outputs_fullmatch_and_stop(make_engine):
    reqs = [request(f"r{i}-{s}", Constraint.regex(rx), i * 10 + s, seed=s,
                    repetition_penalty=1.3 if s else 1.0) for i, rx in enumerate(REGEXES) for s in range(3)]
    done = LLM(engine=make_engine()).run(reqs)
    for r, c in zip(reqs, done, strict=True):
        [choice] = c.choices
        pattern = r.sampling.constraint.text
        assert re.fullmatch(pattern, choice.text), (pattern, choice.text)
        assert choice.finish_reason == FinishReason.STOP


def test_choice_with_n_gives_each_fork_its_own_matcher(make_engine):
    choices = ["alpha", "beta", "gamma", "delta"]
    llm = LLM(engine=make_engine())
    [c] = llm.run([request("c", Constraint.choice(choices), n=8, seed=3, temperature=5.0)])
    assert all(t in choices for t in text(c)), text(c)
    assert len(set(text(c))) > 1  # the forks drew on their own, each advancing its own matcher
    assert all(ch.finish_reason == FinishReason.STOP and ch.stop_reason is None for ch in c.choices)
    [c] = llm.run([request("r", Constraint.regex(r"[a-z]{6}"), n=4, seed=1, temperature=5.0)])
    assert all(re.fullmatch(r"[a-z]{6}", t) for t in text(c)) and len(set(text(c))) == 4


def test_forced_token_has_logprob_zero_of_the_masked_distribution(make_engine):
    """Logprobs are of the distribution sampled from: after the mask, a forced token is certain."""
    [c] = LLM(engine=make_engine()).run([request("l", Constraint.choice(["xyz"]), temperature=0.0,
                                                 logprobs=True, top_logprobs=3)])
    [choice] = c.choices
    assert choice.text == "xyz"
    for position in choice.logprobs:
        assert position.chosen.logprob == 0.0
        assert [t.logprob for t in position.top[1:]] == [-9999.0, -9999.0]


def test_greedy_under_a_mask_takes_the_same_token_on_the_batched_and_per_row_paths(make_engine):
    """Plain greedy rows are masked and reduced together; logprobs send a row down the per-row path."""
    reqs = [request(f"g{i}-{lp}", Constraint.regex(REGEXES[i % 4]), i, temperature=0.0, logprobs=lp)
            for i in range(8) for lp in (False, True)]
    done = LLM(engine=make_engine()).run(reqs)
    for fast, per_row in zip(done[::2], done[1::2], strict=True):
        assert tokens(fast) == tokens(per_row) and per_row.choices[0].logprobs


def test_a_token_the_grammar_refuses_fails_only_its_request(make_engine, caplog):
    """Should the grammar engine fail mid-output, the request ends with ConstraintFailedError (no finish
    reason), without the refused token; the step and the other requests go on."""
    from protoserve.engine.sampling.sampler import SampleResult

    caplog.set_level(logging.INFO, logger="protoserve.engine.llm_engine")
    engine = make_engine()
    sample = engine.sampler.__call__

    def sampler(logits, seqs, bitmask=None):
        results = sample(logits, seqs, bitmask)
        return [SampleResult(ord("!")) if s.request_id == "broken" and s.num_generated == 2 else r
                for s, r in zip(seqs, results, strict=True)]

    engine.sampler = sampler
    six = Constraint.regex(r"[a-z]{6}")
    done = LLM(engine=engine).run([request("broken", six, 1), request("fine", six, 2)])
    [broken] = done[0].choices
    assert isinstance(done[0].error, ConstraintFailedError) and broken.finish_reason is None
    assert done[0].error.violations[0][0] == "constraint.regex"
    assert len(broken.token_ids) == 2 and broken.text == bytes(broken.token_ids).decode()
    assert re.fullmatch(r"[a-z]{6}", done[1].choices[0].text) and done[1].error is None
    assert "its grammar failed after 2 output tokens" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_min_tokens_holds_eos_until_reached_but_never_past_a_complete_grammar(make_engine):
    llm = LLM(engine=make_engine())
    [c] = llm.run([request("digits", Constraint.regex(r"[0-9]{1,12}"), min_tokens=7, seed=0)])
    assert re.fullmatch(r"[0-9]{7,12}", c.choices[0].text)
    [c] = llm.run([request("short", Constraint.choice(["ab"]), min_tokens=10, seed=0)])
    assert c.choices[0].text == "ab" and c.choices[0].finish_reason == FinishReason.STOP


def test_stop_string_and_max_tokens_cut_a_constrained_output(make_engine):
    llm = LLM(engine=make_engine())
    [c] = llm.run([request("s", Constraint.regex(r"(ab)+c"), stop=["ba"], temperature=0.0, max_tokens=40)])
    assert c.choices[0].text == "a" and c.choices[0].stop_reason == "ba"
    [c] = llm.run([request("m", Constraint.regex(r"[a-z]{20}"), max_tokens=5, seed=0)])
    assert len(c.choices[0].text) == 5 and c.choices[0].finish_reason == FinishReason.LENGTH


def test_eos_is_allowed_exactly_when_the_grammar_accepts(make_engine):
    engine = make_engine()
    compiled = engine.grammars.compile(Constraint.regex(r"(ab){1,3}"))
    matcher = compiled.new_matcher()
    filler = MaskFiller(engine.grammars.vocab_size)
    seen = []
    for byte in b"ababab":
        allowed = allowed_tokens(filler.start([matcher]).result()[0], TINY_VOCAB)
        seen.append((bool(allowed[TINY_EOS]), matcher.is_accepting()))
        assert not allowed[257:].any()  # padded ids past the tokenizer never are
        assert matcher.consume_token(byte)
    assert all(eos == accepting for eos, accepting in seen)
    assert [eos for eos, _ in seen] == [False, False, True, False, True, False]
    assert matcher.is_stopped()
    filler.close()


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(make_engine):
    rng = fresh_rng()
    plain = []
    for i in range(12):
        sp = SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0 if i % 3 == 0 else 0.9,
                            logprobs=True, top_logprobs=2, seed=rng.randrange(2**31),
                            presence_penalty=0.5 if i % 4 == 1 else 0.0)
        plain.append(TokenizedRequest(f"u{i}", [rng.randrange(256) for _ in range(rng.randint(1, 50))], sp))
    constrained = [request(f"c{i}", Constraint.regex(REGEXES[i % 4]), 100 + i, seed=i, n=2 if i % 3 else 1)
                   for i in range(10)]
    mixed = [clone(r) for pair in zip(plain, constrained, strict=False) for r in pair]
    mixed += [clone(r) for r in plain[10:]]
    batched = {c.request_id: c for c in LLM(engine=make_engine(max_num_seqs=32)).run(mixed)}
    alone = LLM(engine=make_engine())
    for r in plain:
        [a] = alone.run([clone(r)])
        b = batched[r.request_id]
        assert tokens(a) == tokens(b) and logprobs(a) == logprobs(b), r.request_id


def test_preemption_keeps_constrained_outputs_valid_and_identical(make_engine):
    reqs = [request(f"p{i}", Constraint.regex(r"[a-z]{10,30}\.[0-9]{5,10}"), 200 + i, seed=i, max_tokens=60)
            for i in range(8)]
    expected = LLM(engine=make_engine(max_kv_blocks=256)).run([clone(r) for r in reqs])
    small = make_engine(max_kv_blocks=12, max_model_len=150)
    got = LLM(engine=small).run([clone(r) for r in reqs])
    assert small.stats().preemptions_total > 0
    assert [tokens(c) for c in got] == [tokens(c) for c in expected]  # the matcher stayed with its tokens
    assert all(re.fullmatch(r"[a-z]{10,30}\.[0-9]{5,10}", c.choices[0].text) for c in got)


def test_prefix_cache_hits_do_not_disturb_the_matcher(make_engine):
    engine = make_engine()
    first = TokenizedRequest("a", list(range(40, 90)), SamplingParams(
        constraint=Constraint.regex(r"[a-z]{8}"), seed=5, max_tokens=20))
    [a] = LLM(engine=engine).run([first])
    [b] = LLM(engine=engine).run([clone(first, "-again")])
    assert b.stats.cached_prompt_tokens == 48
    assert tokens(a) == tokens(b) and re.fullmatch(r"[a-z]{8}", a.choices[0].text)


def test_compile_cache_returns_the_same_grammar_without_recompiling(make_engine):
    engine = make_engine()
    grammars = engine.grammars
    c = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    first = grammars.compile(c)
    assert grammars.compile(Constraint.json_schema(c.text)) is first
    assert (grammars.stats.misses, grammars.stats.hits) == (1, 1)
    LLM(engine=engine).run([request("x", c, max_tokens=30, temperature=0.0)])
    assert (grammars.stats.misses, grammars.stats.hits) == (1, 2)
    assert first.compile_s > 0
    bad = Constraint.regex("a(b")
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            engine.prepare(request("bad", bad))
    assert (grammars.stats.misses, grammars.stats.failures) == (2, 1)  # a refusal is cached too


def test_the_cache_is_bounded(tiny_loaded):
    from protoserve.engine.sampling.constraints.compiler import GrammarCompiler

    compiler = GrammarCompiler(tiny_loaded.tokenizer, TINY_VOCAB, [TINY_EOS], cache_size=2)
    a, b, c = (Constraint.regex(p) for p in ("a+", "b+", "c+"))
    first_a = compiler.compile(a)
    compiler.compile(b)
    compiler.compile(c)  # evicts a, the least recently used
    assert compiler.compile(a) is not first_a and compiler.stats.misses == 4


@pytest.mark.parametrize(
    "constraint, field, message",
    [
        (Constraint.regex("a(b"), "constraint.regex", "unclosed group"),
        (Constraint.json_schema('{"type": "foo"}'), "constraint.json_schema", "Invalid type: foo"),
        (Constraint.json_schema('{"type": "array", "uniqueItems": true}'), "constraint.json_schema",
         "Unimplemented keys"),
        (Constraint.json_schema("{not json"), "constraint.json_schema", "not valid JSON"),
        (Constraint.json_schema("[1]"), "constraint.json_schema", "must be a JSON object"),
        (Constraint.grammar('root ::= "yes" | no'), "constraint.grammar", "Rule 'no' not found"),
        (Constraint.grammar("root ::= ("), "constraint.grammar", ""),
        (Constraint.grammar(""), "constraint.grammar", "must not be empty"),
        (Constraint.choice([]), "constraint.choice", "at least one"),
        (Constraint.choice(["a", ""]), "constraint.choice", "non-empty"),
        (Constraint(ConstraintKind.JSON_OBJECT, "x"), "constraint.json_object", "takes no text"),
        (Constraint("xml", "<a/>"), "constraint", "unknown kind"),  # type: ignore[arg-type]
        (Constraint("regex", "(("), "constraint.regex", "unclosed group"),  # type: ignore[arg-type]
    ],
)
def test_bad_constraints_are_refused_naming_the_field(make_engine, constraint, field, message):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(request("bad", constraint))
    [(got_field, problem)] = e.value.violations
    assert got_field == field and message in problem
    assert not engine.has_unfinished()


def test_ignore_eos_is_refused_with_a_constraint(make_engine):
    with pytest.raises(InvalidRequestError) as e:
        make_engine().add_request(request("i", Constraint.json_object(), ignore_eos=True))
    assert [f for f, _ in e.value.violations] == ["ignore_eos"]


def test_json_object_and_gbnf_on_bytes(make_engine):
    import json

    gbnf = 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
    reqs = [request(f"j{s}", Constraint.json_object(), s, seed=s, max_tokens=200) for s in range(3)]
    reqs += [request(f"g{s}", Constraint.grammar(gbnf), s, seed=s) for s in range(3)]
    done = LLM(engine=make_engine()).run(reqs)
    for c in done[:3]:
        if c.choices[0].finish_reason == FinishReason.STOP:  # a random byte model may not close in time
            assert isinstance(json.loads(c.choices[0].text), dict)
        else:
            assert c.choices[0].text.startswith("{")
    for c in done[3:]:
        assert re.fullmatch(r"\([1-9][0-9]{0,2}(,[1-9][0-9]{0,2}){0,3}\)", c.choices[0].text)


def test_async_engine_compiles_off_the_loop_and_refuses_at_first_anext(make_engine):
    llm_engine = make_engine()
    prepared_on = []
    prepare = llm_engine.prepare

    def recording_prepare(req):
        prepared_on.append((req.sampling.constraint is not None, threading.get_ident()))
        return prepare(req)

    llm_engine.prepare = recording_prepare

    async def main():
        engine = AsyncEngine(llm_engine, model_name="tiny")
        try:
            outs = [o async for o in engine.generate(request("a", Constraint.regex(r"[0-9]{4}"), seed=1))]
            assert re.fullmatch(r"[0-9]{4}", "".join(d.text for o in outs for d in o.deltas))
            [_ async for _ in engine.generate(request("plain", None, max_tokens=2))]
            loop_thread = threading.get_ident()
            assert [(c, t == loop_thread) for c, t in prepared_on] == [(True, False), (False, True)]
            with pytest.raises(InvalidRequestError) as e:
                async for _ in engine.generate(request("b", Constraint.regex("(("))):
                    pass
            assert e.value.violations[0][0] == "constraint.regex"
        finally:
            await engine.shutdown()

    asyncio.run(main())
