"""Constraints the grammar engine cannot follow: refused when compiled, or the request fails honestly.

The inputs are issue 43's: constraints no text satisfies and constraints whose forced start is past
llguidance's limits compile to a refusal on ``constraint.<kind>`` (kept in the cache); a limit hit on
the path the output took ends the request with ConstraintFailedError, never ``stop``, and its choices'
text equals their token ids. A template a limit broke is never handed to the next request.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_constrained_decoding import chat, engine_of

from protoserve.engine.async_engine import AsyncEngine
from protoserve.engine.errors import ConstraintFailedError, InvalidRequestError
from protoserve.engine.llm import LLM
from protoserve.engine.loader.default_model import default_model_path
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.constraints.compiler import ConstraintCompileError, GrammarCompiler
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.tokenizer.tokenizer import Tokenizer

NO_OUTPUT = "no output can satisfy it"
OVER_LIMITS = "beyond the grammar engine's limits"
UNSATISFIABLE = {
    "regex matching no character": Constraint.regex(r"[^\x00-\x{10FFFF}]"),
    "rule made of itself": Constraint.grammar("root ::= x\nx ::= x"),
    "left recursion without a base": Constraint.grammar('root ::= root "a"'),
    "mutual $ref": Constraint.json_schema({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
                                           "$ref": "#/$defs/A"}),
}
OVER_THE_LIMITS = {
    "endless forced grammar": Constraint.grammar('root ::= "a" root'),
    "required $ref to the root": Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}},
                                                         "required": ["a"]}),
    "regex of a million a": Constraint.regex("(a{1000}){1000}"),
    "required mutual $ref": Constraint.json_schema({
        "$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
                  "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}},
        "$ref": "#/$defs/A"}),
}
# Fine until the model has chosen "b" or "c": the endless forced "aaa..." after it is past the limits.
FAILS_AFTER_ONE_TOKEN = {
    "grammar": Constraint.grammar('root ::= ("b" | "c") rest\nrest ::= "a" rest'),
    "regex": Constraint.regex("[bc](a{1000}){1000}"),
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = Tokenizer.from_path(default_model_path())
    return GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)


@pytest.fixture(scope="module")
def smollm2():
    from protoserve.engine.loader.load import load_model

    return load_model(None, progress=False)


@pytest.mark.parametrize(("name", "problem"), [(n, NO_OUTPUT) for n in UNSATISFIABLE]
                         + [(n, OVER_LIMITS) for n in OVER_THE_LIMITS])
def test_constraints_no_output_can_follow_are_refused_when_compiled(compiler, name, problem):
    constraint = {**UNSATISFIABLE, **OVER_THE_LIMITS}[name]
    for _ in range(2):  # the second answer is the cached refusal
        with pytest.raises(ConstraintCompileError) as refused:
            compiler.compile(constraint)
        assert refused.value.field == constraint.field
        assert problem in refused.value.message
        assert "<" not in refused.value.message  # no parser state dump (it would quote the grammar)
    assert compiler.cached(constraint)


@pytest.mark.parametrize("constraint", FAILS_AFTER_ONE_TOKEN.values(), ids=FAILS_AFTER_ONE_TOKEN.keys())
def test_a_limit_on_a_path_the_model_chooses_is_not_refused_up_front(compiler, constraint):
    compiler.compile(constraint)


def ask(loaded, rid: str, constraint: Constraint | None, **sampling) -> TokenizedRequest:
    sampling.setdefault("max_tokens", 24)
    return TokenizedRequest(rid, chat(loaded, "Answer:"), SamplingParams(constraint=constraint, **sampling))


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAILS_AFTER_ONE_TOKEN)
def test_a_limit_hit_mid_output_fails_the_request_and_spares_its_neighbours(smollm2, kind):
    engine = engine_of(smollm2)
    constraint = FAILS_AFTER_ONE_TOKEN[kind]
    bad = ask(smollm2, "bad", constraint, n=3, temperature=1.0, seed=1)
    bad.constraint_field = f"response_format.{kind}"
    plain = ask(smollm2, "plain", None, temperature=0.0)
    failed, neighbour = LLM(engine=engine).run([bad, plain])
    assert isinstance(failed.error, ConstraintFailedError)
    [(field, message)] = failed.error.violations
    assert field == f"response_format.{kind}"
    assert "after 1 output token (" in message
    for choice in failed.choices:
        assert choice.finish_reason is None
        assert len(choice.token_ids) == 1 and choice.text == smollm2.tokenizer.decode(choice.token_ids)
        assert choice.text in ("b", "c", "ba", "ca")
    [alone] = LLM(engine=engine_of(smollm2)).run([ask(smollm2, "alone", None, temperature=0.0)])
    assert neighbour.error is None and neighbour.choices == alone.choices
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.grammars.cached(constraint)  # its template's lexer is spent: the next request recompiles


@pytest.mark.slow
def test_a_template_a_limit_broke_ends_in_an_error_not_in_stop(smollm2):
    """The issue's cached rerun: copies of one template share its lexer, and a limit hit leaves it broken,
    so a later copy's mask allows EOS alone. That EOS is the grammar engine's failure, not an answer."""
    engine = engine_of(smollm2)
    constraint = FAILS_AFTER_ONE_TOKEN["regex"]
    prepared = engine.prepare(ask(smollm2, "late", constraint, temperature=0.0))
    spent = prepared.grammar.new_matcher()
    assert spent.consume_token(smollm2.tokenizer.encode("b", add_special_tokens=False)[0])
    [forced] = np.flatnonzero(np.unpackbits(np.frombuffer(spent.compute_bitmask(), np.uint8), bitorder="little"))
    assert not spent.consume_token(int(forced)) and spent.is_error()
    engine.add_request(prepared)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and isinstance(final.error, ConstraintFailedError)
    assert "after 0 output tokens (" in final.error.violations[0][1]
    assert all(not d.token_ids and not d.text and d.finish_reason is None for o in outputs for d in o.deltas)
    # The next request compiles afresh and gets as far as the grammar allows (one token), not a replay.
    [again] = LLM(engine=engine).run([ask(smollm2, "again", constraint, temperature=0.0)])
    assert "after 1 output token (" in again.error.violations[0][1]


@pytest.mark.slow
def test_the_async_engine_streams_the_tokens_then_raises(smollm2):
    async def run() -> tuple[list, BaseException | None]:
        engine = AsyncEngine(engine_of(smollm2), "smollm2")
        outputs = []
        try:
            async for out in engine.generate(ask(smollm2, "s", FAILS_AFTER_ONE_TOKEN["grammar"], temperature=0.0)):
                outputs.append(out)
        except InvalidRequestError as exc:
            return outputs, exc
        finally:
            await engine.shutdown()
        return outputs, None

    outputs, error = asyncio.run(run())
    assert isinstance(error, ConstraintFailedError), outputs
    assert error.violations[0][0] == "constraint.grammar"
    assert not any(o.finished for o in outputs)
    [delta] = [d for o in outputs for d in o.deltas]
    assert len(delta.token_ids) == 1 and delta.text == smollm2.tokenizer.decode(delta.token_ids)
    assert delta.finish_reason is None
