"""The grammars that force tool calls, compiled and run by llguidance over SmolLM2's real vocabulary.

Every grammar goes through the engine's own compile path (``GrammarCompiler`` over a ``Constraint``).
A matcher fed the token ids of a text says whether the model could have written it: a call in the
format that follows its tool's schema must be accepted whole (and may end there), anything else must
be rejected. Every text a grammar accepts parses back to the same calls: grammar and parser agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import pytest

from protoserve.engine.loader.default_model import default_model_path
from protoserve.engine.sampling.constraints.compiler import GrammarCompiler
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.tokenizer.tokenizer import Tokenizer
from protoserve.server.tool_calls.call import ToolSpec
from protoserve.server.tool_calls.forcing import auto_strict_grammar, forced_grammar
from protoserve.server.tool_calls.parsers import (
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    SMOLLM2,
    ToolCallFormat,
    parse_output,
)

WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    strict=True,
)
CALC = ToolSpec(
    "calculate",
    "Evaluate an arithmetic expression",
    {
        "type": "object",
        "properties": {"expression": {"type": "string", "maxLength": 60}, "precision": {"type": "integer"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
)
TOOLS = [WEATHER, CALC]
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
SUM = ("calculate", {"expression": "17 * 23", "precision": 2})
FORMAT_LIST = list(FORMATS.values())


@dataclass(frozen=True)
class Matching:
    """The engine's grammar compiler over SmolLM2's vocabulary, and that vocabulary's tokenizer."""

    tokenizer: Tokenizer
    compiler: GrammarCompiler

    def problems(self, grammar: str) -> str:
        """llguidance's verdict on the grammar: empty when it compiles."""
        lark = llguidance.grammar_from("lark", grammar)
        return llguidance.LLMatcher.validate_grammar(lark, self.compiler.ll_tokenizer)

    def accepts(self, grammar: str, text: str) -> bool:
        """Whether the grammar lets the model write exactly ``text`` and stop there."""
        matcher = self.compiler.compile(Constraint.lark(grammar)).new_matcher()
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


@pytest.fixture(scope="module")
def matching() -> Matching:
    tokenizer = Tokenizer.from_path(str(default_model_path()))
    return Matching(tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids))


def call_json(name: str, arguments, fmt: ToolCallFormat) -> str:
    # The spacing the grammar holds the model to (engine JSON options: ", " and ": ", no padding).
    return json.dumps({"name": name, fmt.arguments_key: arguments}, ensure_ascii=False)


def written(fmt: ToolCallFormat, *calls: tuple[str, object]) -> str:
    """Calls spelled as the forced grammar has the model write them."""
    objects = [call_json(name, arguments, fmt) for name, arguments in calls]
    if fmt.list_in_tag:
        return f"{fmt.open_tag}[\n" + ",\n".join(objects) + f"\n]{fmt.close_tag}"
    if fmt.open_tag:
        return "\n".join(f"{fmt.open_tag}\n{o}\n{fmt.close_tag}" for o in objects)
    return "; ".join(objects)


def assert_accepted_and_parsed(
    matching: Matching, grammar: str, text: str, fmt: ToolCallFormat, calls
) -> None:
    assert matching.accepts(grammar, text), text
    found = parse_output(text, fmt)
    assert found.content is None, text
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == list(calls)


def grammars(fmt: ToolCallFormat, tools=TOOLS) -> dict[str, str]:
    return {
        "forced single": forced_grammar(tools, fmt, single=True),
        "forced parallel": forced_grammar(tools, fmt, single=False),
        "auto single": auto_strict_grammar(tools, fmt, single=True),
        "auto parallel": auto_strict_grammar(tools, fmt, single=False),
    }


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=lambda f: f.name)
def test_every_grammar_compiles(matching, fmt):
    for kind, grammar in grammars(fmt).items():
        verdict = matching.problems(grammar)
        assert verdict == "", f"{kind}: {verdict}"


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=lambda f: f.name)
def test_a_forced_call_that_follows_its_schema_is_accepted(matching, fmt):
    single = forced_grammar(TOOLS, fmt, single=True)
    parallel = forced_grammar(TOOLS, fmt, single=False)
    for grammar in (single, parallel):
        assert_accepted_and_parsed(matching, grammar, written(fmt, PARIS), fmt, [PARIS])
        assert_accepted_and_parsed(matching, grammar, written(fmt, SUM), fmt, [SUM])
        optional_left_out = ("calculate", {"expression": "1 + 1"})
        assert_accepted_and_parsed(
            matching, grammar, written(fmt, optional_left_out), fmt, [optional_left_out]
        )
    assert_accepted_and_parsed(matching, parallel, written(fmt, PARIS, SUM), fmt, [PARIS, SUM])
    assert_accepted_and_parsed(matching, parallel, written(fmt, SUM, PARIS, SUM), fmt, [SUM, PARIS, SUM])


BAD_CALLS = {
    "an unknown function": ("get_time", {"city": "Paris", "unit": "celsius"}),
    "a wrong type": ("get_weather", {"city": 75001, "unit": "celsius"}),
    "a missing required argument": ("get_weather", {"city": "Paris"}),
    "a value outside the enum": ("get_weather", {"city": "Paris", "unit": "kelvin"}),
    "an argument the schema does not have": ("calculate", {"expression": "1", "verbose": True}),
    "a string over maxLength": ("get_weather", {"city": "x" * 41, "unit": "celsius"}),
    "arguments that are not an object": ("calculate", "1 + 1"),
}


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=lambda f: f.name)
@pytest.mark.parametrize("bad", BAD_CALLS)
def test_a_forced_call_that_breaks_its_schema_is_rejected(matching, fmt, bad):
    for single in (True, False):
        grammar = forced_grammar(TOOLS, fmt, single=single)
        assert not matching.accepts(grammar, written(fmt, BAD_CALLS[bad]))
        assert not matching.accepts(grammar, written(fmt, PARIS, BAD_CALLS[bad]))


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=lambda f: f.name)
def test_forced_output_is_calls_only(matching, fmt):
    single = forced_grammar(TOOLS, fmt, single=True)
    assert not matching.accepts(single, written(fmt, PARIS, SUM))  # a second call when one is allowed
    for grammar in (single, forced_grammar(TOOLS, fmt, single=False)):
        assert not matching.accepts(grammar, "It is sunny in Paris.")
        assert not matching.accepts(grammar, "")
        assert not matching.accepts(grammar, "Sure. " + written(fmt, PARIS))
        assert not matching.accepts(grammar, written(fmt, PARIS) + " Done.")
        assert not matching.accepts(grammar, written(fmt, PARIS)[:-3])  # a call not finished may not stop


def test_a_named_function_grammar_allows_only_that_function(matching):
    grammar = forced_grammar([CALC], HERMES, single=True)
    assert_accepted_and_parsed(matching, grammar, written(HERMES, SUM), HERMES, [SUM])
    assert not matching.accepts(grammar, written(HERMES, PARIS))


# -- auto with a strict tool ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=lambda f: f.name)
def test_auto_strict_lets_the_model_answer_in_text(matching, fmt):
    for single in (True, False):
        grammar = auto_strict_grammar(TOOLS, fmt, single=single)
        for text in ("It is sunny in Paris.", "", "Use {braces} and <tags> freely.\nTwo lines."):
            assert matching.accepts(grammar, text), text
            assert parse_output(text, fmt).tool_calls == []


@pytest.mark.parametrize("fmt", [HERMES, SMOLLM2], ids=lambda f: f.name)
def test_auto_strict_text_may_not_open_a_call_later(matching, fmt):
    grammar = auto_strict_grammar(TOOLS, fmt, single=False)
    assert not matching.accepts(grammar, "Let me check. " + written(fmt, PARIS))
    assert not matching.accepts(grammar, "Let me check. <tool_call>")


def test_auto_strict_llama3_text_may_not_start_like_a_call(matching):
    grammar = auto_strict_grammar(TOOLS, LLAMA3_JSON, single=False)
    assert not matching.accepts(grammar, '{"answer": 42}')
    assert not matching.accepts(grammar, '  {"name": "get_weather"}')
    assert matching.accepts(grammar, 'The JSON is {"answer": 42}.')


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=lambda f: f.name)
def test_auto_strict_holds_strict_tools_to_their_schema_only(matching, fmt):
    for single in (True, False):
        grammar = auto_strict_grammar(TOOLS, fmt, single=single)
        assert_accepted_and_parsed(matching, grammar, written(fmt, PARIS), fmt, [PARIS])
        assert not matching.accepts(grammar, written(fmt, BAD_CALLS["a value outside the enum"]))
        assert not matching.accepts(grammar, written(fmt, BAD_CALLS["a missing required argument"]))
        assert not matching.accepts(grammar, written(fmt, BAD_CALLS["an unknown function"]))
        # calculate is not strict: any object is its arguments.
        anything = ("calculate", {"verbose": [1, {"deep": None}], "expression": 5})
        assert_accepted_and_parsed(matching, grammar, written(fmt, anything), fmt, [anything])
        assert not matching.accepts(grammar, written(fmt, ("calculate", "1 + 1")))
    parallel = auto_strict_grammar(TOOLS, fmt, single=False)
    assert_accepted_and_parsed(matching, parallel, written(fmt, PARIS, SUM), fmt, [PARIS, SUM])
    assert not matching.accepts(auto_strict_grammar(TOOLS, fmt, single=True), written(fmt, PARIS, SUM))


# -- definitions and references inside tool parameters -------------------------------------------

ORDER = ToolSpec(
    "place_order",
    "",
    {
        "type": "object",
        "$defs": {
            "Item": {
                "type": "object",
                "properties": {"sku": {"$ref": "#/$defs/Sku"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "Sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
        },
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1}},
        "required": ["items"],
        "additionalProperties": False,
    },
    strict=True,
)
# Draft-7 "definitions", and the same definition names as ORDER's with different content.
REFUND = ToolSpec(
    "refund",
    "",
    {
        "type": "object",
        "definitions": {
            "Item": {
                "type": "object",
                "properties": {"sku": {"$ref": "#/definitions/Sku"}},
                "required": ["sku"],
            },
            "Sku": {"type": "integer"},
        },
        "properties": {"item": {"$ref": "#/definitions/Item"}},
        "required": ["item"],
        "additionalProperties": False,
    },
    strict=True,
)


# One definition text in two tools ("Id" is {"$ref": "#/$defs/Raw"}), each pointing at its own "Raw".
def _id_tool(name: str, raw: dict) -> ToolSpec:
    return ToolSpec(
        name,
        "",
        {
            "type": "object",
            "$defs": {"Id": {"$ref": "#/$defs/Raw"}, "Raw": raw},
            "properties": {"id": {"$ref": "#/$defs/Id"}},
            "required": ["id"],
            "additionalProperties": False,
        },
        strict=True,
    )


TREE = ToolSpec(
    "make_tree",
    "",
    {
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["a", "b"]},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["label"],
        "additionalProperties": False,
    },
    strict=True,
)
SAME_AS = ToolSpec(
    "pair",
    "",
    {
        "type": "object",
        "properties": {"first": {"type": "integer", "maximum": 9}, "second": {"$ref": "#/properties/first"}},
        "required": ["first", "second"],
        "additionalProperties": False,
    },
    strict=True,
)
# name: (tools, calls that follow their schemas, calls that break them)
REFERENCE_CASES = {
    "$defs and definitions, one name with two contents": (
        [ORDER, REFUND],
        [("place_order", {"items": [{"sku": "ABC12", "qty": 2}]}), ("refund", {"item": {"sku": 7}})],
        [
            ("place_order", {"items": [{"sku": "abc12", "qty": 2}]}),  # the referenced pattern
            ("place_order", {"items": [{"sku": "ABC12", "qty": 0}]}),  # the referenced minimum
            ("place_order", {"items": [{"sku": 7, "qty": 1}]}),  # refund's Sku, not place_order's
            ("refund", {"item": {"sku": "ABC12"}}),  # place_order's Sku, not refund's
        ],
    ),
    "one definition text pointing at different definitions": (
        [_id_tool("by_number", {"type": "integer"}), _id_tool("by_code", {"type": "string"})],
        [("by_number", {"id": 7}), ("by_code", {"id": "x7"})],
        [("by_number", {"id": "x7"}), ("by_code", {"id": 7})],
    ),
    "recursion through the root": (
        [TREE, CALC],
        [("make_tree", {"label": "a", "children": [{"label": "b", "children": [{"label": "a"}]}]}), SUM],
        [
            ("make_tree", {"label": "a", "children": [{"label": "c"}]}),
            ("make_tree", {"label": "a", "children": [{"name": "make_tree", "arguments": {"label": "a"}}]}),
        ],
    ),
    "a pointer into the schema's own properties": (
        [SAME_AS],
        [("pair", {"first": 1, "second": 2})],
        [("pair", {"first": 1, "second": 10}), ("pair", {"first": 1, "second": "2"})],
    ),
}


@pytest.mark.parametrize("fmt", FORMAT_LIST, ids=lambda f: f.name)
@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_referenced_definitions_are_enforced_for_every_tool(matching, fmt, case):
    tools, good_calls, bad_calls = REFERENCE_CASES[case]
    for kind, grammar in grammars(fmt, tools).items():
        verdict = matching.problems(grammar)
        assert verdict == "", f"{kind}: {verdict}"
    for grammar in (forced_grammar(tools, fmt, single=False), auto_strict_grammar(tools, fmt, single=False)):
        for good in good_calls:
            assert_accepted_and_parsed(matching, grammar, written(fmt, good), fmt, [good])
        assert_accepted_and_parsed(matching, grammar, written(fmt, *good_calls), fmt, good_calls)
        for bad in bad_calls:
            assert not matching.accepts(grammar, written(fmt, bad)), bad


def test_a_named_tool_with_references_is_enforced_alone(matching):
    grammar = forced_grammar([REFUND], HERMES, single=True)
    good = ("refund", {"item": {"sku": 7}})
    assert_accepted_and_parsed(matching, grammar, written(HERMES, good), HERMES, [good])
    assert not matching.accepts(grammar, written(HERMES, ("refund", {"item": {"sku": "ABC12"}})))


def test_a_schema_with_its_own_id_keeps_its_references(matching):
    tool = ToolSpec(
        "tag",
        "",
        {
            "$id": "https://example.com/tag.json",
            "type": "object",
            "$defs": {"Colour": {"enum": ["red", "green"]}},
            "properties": {"colour": {"$ref": "#/$defs/Colour"}},
            "required": ["colour"],
        },
    )
    grammar = forced_grammar([tool], HERMES, single=True)
    assert_accepted_and_parsed(
        matching, grammar, written(HERMES, ("tag", {"colour": "red"})), HERMES, [("tag", {"colour": "red"})]
    )
    assert not matching.accepts(grammar, written(HERMES, ("tag", {"colour": "blue"})))


def test_references_in_data_are_left_alone():
    tool = ToolSpec(
        "note",
        "",
        {"type": "object", "properties": {"ref": {"const": {"$ref": "#/x"}}}, "required": ["ref"]},
    )
    grammar = forced_grammar([tool], HERMES, single=True)
    assert '{"const": {"$ref": "#/x"}}' in grammar
    assert "$defs" not in grammar  # nothing needed hoisting
