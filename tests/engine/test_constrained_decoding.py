"""Constrained decoding with the real SmolLM2-135M: every output parses; plain neighbours are unchanged.

32 JSON Schemas x 3 seeds at temperature 0.8 in one engine run must all
validate with ``jsonschema`` (format checks included) and end with ``stop``;
regex outputs fullmatch, GBNF outputs parse, choices are one of the choices,
with ``n > 1``, preemption and batch neighbours.
"""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest
from constrained_schemas import SCHEMAS
from test_engine_batching import clone, logprobs, tokens

from protoserve.engine.config import EngineConfig
from protoserve.engine.errors import InvalidRequestError
from protoserve.engine.llm import LLM
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import FinishReason, TokenizedRequest
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.sampling.sampling_params import SamplingParams

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
ARITHMETIC = r"""
root   ::= expr
expr   ::= term (ws ("+" | "-") ws term){0,3}
term   ::= factor (ws ("*" | "/") ws factor){0,2}
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
ws     ::= " "?
"""


@pytest.fixture(scope="module")
def smollm2():
    from protoserve.engine.loader.load import load_model

    return load_model(None, progress=False)


def engine_of(loaded, **config) -> LLMEngine:
    config.setdefault("max_num_batched_tokens", 512)
    return LLMEngine(loaded, EngineConfig(**config))


def chat(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def schema_request(loaded, i: int, seed: int, **sampling) -> TokenizedRequest:
    schema = SCHEMAS[i]
    prompt = chat(loaded, f"Give a JSON value for this JSON Schema: {json.dumps(schema)}")
    sp = SamplingParams(max_tokens=128, temperature=0.8, seed=seed, constraint=Constraint.json_schema(schema),
                        **sampling)
    return TokenizedRequest(f"schema{i}-seed{seed}", prompt, sp)


def assert_valid(r: TokenizedRequest, text: str, finish: FinishReason | None) -> None:
    schema = json.loads(r.sampling.constraint.text)
    assert finish == FinishReason.STOP, f"{r.request_id}: {finish} after {text!r}"
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


@pytest.mark.slow
def test_every_schema_output_validates(smollm2):
    assert len(SCHEMAS) >= 30
    reqs = [schema_request(smollm2, i, seed) for i in range(len(SCHEMAS)) for seed in range(3)]
    done = LLM(engine=engine_of(smollm2)).run(reqs)
    for r, c in zip(reqs, done, strict=True):
        assert_valid(r, c.choices[0].text, c.choices[0].finish_reason)
    assert len({c.choices[0].text for c in done}) > 2 * len(SCHEMAS)  # sampled, not one answer per schema


@pytest.mark.slow
def test_regex_grammar_and_choice_outputs_match(smollm2):
    regexes = {
        "date": (r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", "When did Apollo 11 land?"),
        "email": (r"[a-z]{2,12}\.[a-z]{2,12}@[a-z]{3,10}\.(com|org|net)", "Write Jane Doe's email address."),
        "phone": (r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", "Write a US phone number."),
    }
    reqs, checks = [], []
    for name, (rx, question) in regexes.items():
        for seed in range(2):
            reqs.append(TokenizedRequest(f"{name}{seed}", chat(smollm2, question), SamplingParams(
                max_tokens=40, temperature=0.8, seed=seed, constraint=Constraint.regex(rx))))
            checks.append(lambda t, rx=rx: re.fullmatch(rx, t) is not None)
    for seed in range(3):
        reqs.append(TokenizedRequest(f"math{seed}", chat(smollm2, "Write an arithmetic expression."),
                                      SamplingParams(max_tokens=60, temperature=0.8, seed=seed,
                                                     constraint=Constraint.grammar(ARITHMETIC))))
        checks.append(parses_as_arithmetic)
    answers = ["yes", "no", "not sure"]
    reqs.append(TokenizedRequest("choice", chat(smollm2, "Is Paris the capital of France?"), SamplingParams(
        max_tokens=10, temperature=0.8, seed=0, n=4, constraint=Constraint.choice(answers))))
    done = LLM(engine=engine_of(smollm2)).run(reqs)
    for r, c, check in zip(reqs, done, checks, strict=False):
        [choice] = c.choices
        assert choice.finish_reason == FinishReason.STOP and check(choice.text), (r.request_id, choice.text)
    assert all(ch.text in answers and ch.finish_reason == FinishReason.STOP for ch in done[-1].choices)


def parses_as_arithmetic(text: str) -> bool:
    tree = ast.parse(text, mode="eval")  # raises on anything that is not an expression
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


@pytest.mark.slow
def test_unconstrained_neighbours_n_and_preemption(smollm2):
    """One mixed batch: plain requests equal to themselves alone; n=3 schema choices valid; a tiny KV pool
    that preempts gives the constrained outputs of a big one, token for token."""
    plain = [
        TokenizedRequest("plain-greedy", chat(smollm2, "Name three colors."),
                          SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2)),
        TokenizedRequest("plain-sampled", chat(smollm2, "Tell me about cats."),
                          SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, logprobs=True,
                                         frequency_penalty=0.3)),
    ]
    constrained = [schema_request(smollm2, i, seed=i, n=3 if i % 2 else 1, presence_penalty=0.2 * (i % 3))
                   for i in (0, 3, 7, 10, 19, 23)]
    mixed = [clone(r) for r in plain + constrained]
    big = engine_of(smollm2, max_kv_blocks=512)
    batched = {c.request_id: c for c in LLM(engine=big).run(mixed)}
    alone = LLM(engine=engine_of(smollm2))
    for r in plain:
        [a] = alone.run([clone(r, "-alone")])
        assert tokens(a) == tokens(batched[r.request_id]), r.request_id
        assert logprobs(a) == logprobs(batched[r.request_id]), r.request_id
    for r in constrained:
        for choice in batched[r.request_id].choices:
            assert_valid(r, choice.text, choice.finish_reason)
    assert len({ch.text for ch in batched[constrained[1].request_id].choices}) > 1  # each fork its own draw

    small = engine_of(smollm2, max_kv_blocks=40, max_num_seqs=16)  # 640 slots for 16 sequences of ~200
    preempted = {c.request_id: c for c in LLM(engine=small).run([clone(r) for r in constrained])}
    assert small.stats().preemptions_total > 0
    for r in constrained:
        assert tokens(preempted[r.request_id]) == tokens(batched[r.request_id]), r.request_id


def test_a_bad_schema_is_refused_with_the_grammar_engines_message(smollm2):
    engine = engine_of(smollm2)
    bad = Constraint.json_schema(
        {"type": "object", "properties": {"a": {"type": "string", "format": "bogus"}}})
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(TokenizedRequest("bad", [1, 2, 3], SamplingParams(constraint=bad)))
    assert e.value.violations == [("constraint.json_schema", "Unknown format: bogus")]
