"""Tool-call parsers: what each format's parser finds in a model's output, whole and streamed.

The tables pin what the unary response holds (content, and each call's name with the raw JSON
text the model wrote for its arguments). The property tests pin the guarantee streaming rests on:
feeding an output in any pieces yields exactly the content and calls :func:`parse_output` finds in
the whole text, with well-formed events (a call starts once, before its arguments, indices in order).
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protoserve.server.tool_calls.call import ToolCall
from protoserve.server.tool_calls.parsers import (
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    SMOLLM2,
    CallArguments,
    CallStart,
    Content,
    ToolCallFormat,
    ToolCallParser,
    parse_output,
)
from protoserve.server.tool_calls.rendering import written_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
CALC = '{"name": "calculate", "arguments": {"expression": "17 * 23"}}'
CALC_ARGS = '{"expression": "17 * 23"}'
# Braces, brackets, quotes, escapes, separators and the close tag, all inside strings.
TRICKY_ARGS = (
    '{"q": "a \\"quoted\\" } { [ ] ; </tool_call> <tool_call>", '
    '"n": {"m": [1, {"k": "]}\\\\"}], "u": "\\u007d"}}'
)


def summary(text: str, fmt: ToolCallFormat, max_calls: int | None = None):
    found = parse_output(text, fmt, max_calls)
    return found.content, [(c.name, c.arguments) for c in found.tool_calls]


HERMES_CASES = [
    ("single", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER_ARGS)]),
    (
        "parallel",
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{CALC}\n</tool_call>",
        None,
        [("get_weather", WEATHER_ARGS), ("calculate", CALC_ARGS)],
    ),
    (
        "content before",
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
        "Let me check.\n",
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "content between and after",
        f"<tool_call>{WEATHER}</tool_call> and <tool_call>{CALC}</tool_call> done",
        " and  done",
        [("get_weather", WEATHER_ARGS), ("calculate", CALC_ARGS)],
    ),
    ("no calls", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("a tag holding no call", "<tool_call>hi</tool_call>", "<tool_call>hi</tool_call>", []),
    ("an object that is no call", '<tool_call>{"x": 1}</tool_call>', '<tool_call>{"x": 1}</tool_call>', []),
    ("an empty list", "<tool_call>[]</tool_call>", "", []),
    ("a close tag alone", "a </tool_call> b", "a </tool_call> b", []),
    ("a tag-like start", "a <tool b <tool_c", "a <tool b <tool_c", []),
    (
        "arguments before the name",
        '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        "strings holding braces, quotes and the close tag",
        f'<tool_call>\n{{"name": "search", "arguments": {TRICKY_ARGS}}}\n</tool_call>',
        None,
        [("search", TRICKY_ARGS)],
    ),
    (
        "arguments written as the model spaced them",
        '<tool_call>{"name":"f","arguments":{ "a" :1 ,"b":[ 1,2 ] }}</tool_call>',
        None,
        [("f", '{ "a" :1 ,"b":[ 1,2 ] }')],
    ),
    (
        '"parameters" for arguments',
        '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>',
        None,
        [("f", '{"a": 1}')],
    ),
    ("no arguments", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    (
        "a string for arguments",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        [("f", '"{\\"a\\": 1}"')],
    ),
    (
        "an escaped name",
        '<tool_call>{"name": "get\\u005fweather", "arguments": {}}</tool_call>',
        None,
        [("get_weather", "{}")],
    ),
    (
        "cut by max_tokens inside the arguments",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        None,
        [("get_weather", '{"city": "Par')],
    ),
    ("cut inside the close tag", f"<tool_call>\n{WEATHER}\n</tool_", None, [("get_weather", WEATHER_ARGS)]),
    ("cut inside the open tag", "Sure. <tool_ca", "Sure. <tool_ca", []),
    ("cut before the name", '<tool_call>\n{"name": "get_w', '<tool_call>\n{"name": "get_w', []),
]

SMOLLM2_CASES = [
    ("single", f"<tool_call>[{WEATHER}]</tool_call>", None, [("get_weather", WEATHER_ARGS)]),
    (
        "parallel",
        f"<tool_call>[{WEATHER}, {CALC}]</tool_call>",
        None,
        [("get_weather", WEATHER_ARGS), ("calculate", CALC_ARGS)],
    ),
    (
        "parallel, one a line",
        f"<tool_call>[\n{WEATHER},\n{CALC}\n]</tool_call>",
        None,
        [("get_weather", WEATHER_ARGS), ("calculate", CALC_ARGS)],
    ),
    (
        "content before",
        f"Checking. <tool_call>[{WEATHER}]</tool_call>",
        "Checking. ",
        [("get_weather", WEATHER_ARGS)],
    ),
    ("no calls", "17 times 23 is 391.", "17 times 23 is 391.", []),
    ("a tag holding no call", "<tool_call>hi</tool_call>", "<tool_call>hi</tool_call>", []),
    ("an empty list", "<tool_call>[]</tool_call>", "", []),
    ("an empty list after text", "No tool fits. <tool_call>[]</tool_call>", "No tool fits. ", []),
    ("a bare object in the tag", f"<tool_call>{WEATHER}</tool_call>", None, [("get_weather", WEATHER_ARGS)]),
    (
        "arguments before the name",
        '<tool_call>[{"arguments": {"expression": "1+1"}, "name": "calculate"}]</tool_call>',
        None,
        [("calculate", '{"expression": "1+1"}')],
    ),
    (
        "strings holding brackets, quotes and the close tag",
        f'<tool_call>[{{"name": "search", "arguments": {TRICKY_ARGS}}}, {CALC}]</tool_call>',
        None,
        [("search", TRICKY_ARGS), ("calculate", CALC_ARGS)],
    ),
    (
        "cut by max_tokens inside the second call",
        f'<tool_call>[{WEATHER}, {{"name": "calculate", "arguments": {{"expression": "17 *',
        None,
        [("get_weather", WEATHER_ARGS), ("calculate", '{"expression": "17 *')],
    ),
]

LLAMA3_CASES = [
    (
        "single",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        "after the python tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        "parallel",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "calculate", "parameters": {}}',
        None,
        [("get_weather", '{"city": "Paris"}'), ("calculate", "{}")],
    ),
    ("leading whitespace", '\n {"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
    (
        "text before JSON is content, not a call",
        'Sure: {"name": "f", "parameters": {}}',
        'Sure: {"name": "f", "parameters": {}}',
        [],
    ),
    ("no calls", "It is sunny.", "It is sunny.", []),
    ("an object that is no call", '{"answer": 42}', '{"answer": 42}', []),
    ("an empty list", "[]", "[]", []),
    (
        "text after the calls is content",
        '{"name": "f", "parameters": {"a": 1}} I called f.',
        "I called f.",
        [("f", '{"a": 1}')],
    ),
    (
        "arguments before the name",
        '{"parameters": {"a": "x;}"}, "name": "f"}',
        None,
        [("f", '{"a": "x;}"}')],
    ),
    (
        "strings holding separators and braces",
        f'{{"name": "search", "parameters": {TRICKY_ARGS}}}; {{"name": "f", "arguments": {{}}}}',
        None,
        [("search", TRICKY_ARGS), ("f", "{}")],
    ),
    (
        "cut by max_tokens inside the arguments",
        '{"name": "get_weather", "parameters": {"city": "Pa',
        None,
        [("get_weather", '{"city": "Pa')],
    ),
    ("cut inside the python tag", "<|python", "<|python", []),
]


def _cases(fmt: ToolCallFormat, cases):
    return [
        pytest.param(fmt, text, content, calls, id=f"{fmt.name}: {name}")
        for name, text, content, calls in cases
    ]


@pytest.mark.parametrize(
    "fmt, text, content, calls",
    _cases(HERMES, HERMES_CASES) + _cases(SMOLLM2, SMOLLM2_CASES) + _cases(LLAMA3_JSON, LLAMA3_CASES),
)
def test_each_format_finds_the_content_and_calls_of_an_output(fmt, text, content, calls):
    assert summary(text, fmt) == (content, calls)


@pytest.mark.parametrize(
    "fmt, text",
    [
        (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{CALC}\n</tool_call>"),
        (SMOLLM2, f"<tool_call>[{WEATHER}, {CALC}]</tool_call>"),
        (LLAMA3_JSON, WEATHER.replace("arguments", "parameters") + "; " + CALC),
    ],
    ids=["hermes", "smollm2", "llama3_json"],
)
def test_max_calls_keeps_only_the_first_calls(fmt, text):
    content, calls = summary(text, fmt, max_calls=1)
    assert content is None
    assert calls == [("get_weather", WEATHER_ARGS)]
    assert len(summary(text, fmt)[1]) == 2


def test_calls_get_fresh_openai_ids():
    found = parse_output(f"<tool_call>{WEATHER}</tool_call><tool_call>{CALC}</tool_call>", HERMES)
    ids = [c.id for c in found.tool_calls]
    assert all(i.startswith("call_") and len(i) == len("call_") + 24 for i in ids)
    assert len(set(ids)) == 2


def test_a_streamed_call_reports_its_name_once_then_its_arguments_as_they_come():
    parser = ToolCallParser(HERMES)
    assert parser.feed("Sure.\n<tool_") == [Content("Sure.\n")]  # the tag may be starting: held
    assert parser.feed('call>\n{"name": "get_wea') == []  # the name is not whole yet
    started = parser.feed('ther", "arguments": {"city": "Pa')
    assert [type(e) for e in started] == [CallStart, CallArguments]
    assert (started[0].index, started[0].name) == (0, "get_weather")
    assert started[1] == CallArguments(0, '{"city": "Pa')
    assert parser.feed('ris"}}\n</tool_call>') == [CallArguments(0, 'ris"}')]
    assert parser.finish() == []
    assert parser.calls_started == 1


@pytest.mark.parametrize(
    "fmt, text",
    [
        (HERMES, f"<tool_call>{WEATHER}</tool_call>\n It is 18 C. \n<tool_call>{CALC}</tool_call> \n"),
        (SMOLLM2, f"<tool_call>[{WEATHER}]</tool_call>\n It is 18 C. \n"),
        (LLAMA3_JSON, WEATHER + "\n It is 18 C. \n"),
    ],
    ids=["hermes", "smollm2", "llama3_json"],
)
def test_whitespace_after_a_call_is_content_only_before_more_content(fmt, text):
    # Held however the text arrives: a character at a time, the trailing spaces come alone.
    expected = ("It is 18 C." if fmt is LLAMA3_JSON else "\n It is 18 C."), summary(text, fmt)[1]
    assert summary(text, fmt) == expected
    assert streamed(text, list(range(len(text))), fmt, None) == expected


def test_arguments_written_before_the_name_are_held_until_it_comes():
    parser = ToolCallParser(SMOLLM2)
    assert parser.feed('<tool_call>[{"arguments": {"a": 1}, ') == []
    events = parser.feed('"name": "f"}]</tool_call>')
    assert [type(e) for e in events] == [CallStart, CallArguments]
    assert events[1] == CallArguments(0, '{"a": 1}')


# -- streaming equals unary, whatever the pieces -------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3)
NAMES = st.sampled_from(["get_weather", "calculate", "search_flights", "f"])
SEPARATORS = st.sampled_from([(", ", ": "), (",", ":")])


@st.composite
def call_objects(draw, fmt: ToolCallFormat) -> str:
    """One call object as a model may write it: either key first, compact or spaced, any arguments."""
    name = json.dumps(draw(NAMES))
    arguments = json.dumps(draw(ARGUMENTS), ensure_ascii=draw(st.booleans()), separators=draw(SEPARATORS))
    key = json.dumps(draw(st.sampled_from(["arguments", "parameters", fmt.arguments_key])))
    fields = [f'"name": {name}', f"{key}: {arguments}"]
    if draw(st.booleans()):
        fields.reverse()
    return "{" + ", ".join(fields) + "}"


def fragments(fmt: ToolCallFormat):
    """Pieces that make outputs: prose, call objects, the format's markers and JSON punctuation."""
    markers = ["<tool_call>", "</tool_call>", "<|python_tag|>", "<tool", "</tool_", "<|py"]
    punctuation = ["{", "}", "[", "]", '"', "\\", ",", ":", ";", " ", "\n", '"name"', '"arguments"']
    return st.one_of(
        st.text(max_size=6),
        st.sampled_from(markers + punctuation + ["[]", "hi", "It is sunny. "]),
        call_objects(fmt),
    )


@st.composite
def well_formed_outputs(draw, fmt: ToolCallFormat) -> str:
    """Content, then calls in the format's own spelling, then maybe more text."""
    calls = draw(st.lists(call_objects(fmt), min_size=1, max_size=3))
    if fmt.list_in_tag:
        body = f"{fmt.open_tag}[{', '.join(calls)}]{fmt.close_tag}"
    elif fmt.open_tag:
        between = draw(st.sampled_from(["\n", "", "\n\n", " and ", "Next: \n"]))
        body = between.join(f"{fmt.open_tag}\n{c}\n{fmt.close_tag}" for c in calls)
    else:
        body = draw(st.sampled_from(["", fmt.bare_prefix])) + draw(st.sampled_from(["; ", ";", "\n"])).join(
            calls
        )
    before = "" if not fmt.open_tag else draw(st.sampled_from(["", "Let me check. ", "\n"]))
    after = draw(st.sampled_from(["", "\n", " Done.", "Done. \n", " \n It is 18 C. ", " <tool_call>"]))
    return before + body + after


def outputs(fmt: ToolCallFormat):
    soup = st.lists(fragments(fmt), max_size=10).map("".join)
    return st.one_of(soup, well_formed_outputs(fmt))


def streamed(text: str, cuts: list[int], fmt: ToolCallFormat, max_calls: int | None):
    """The content and calls a stream reassembles, after checking its events are well formed."""
    parser = ToolCallParser(fmt, max_calls)
    events = []
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in itertools.pairwise(bounds):
        events += parser.feed(text[start:end])
    events += parser.finish()
    content: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, Content):
            assert event.text
            content.append(event.text)
        elif isinstance(event, CallStart):
            assert event.index == len(names), "calls start once each, in order"
            assert event.id.startswith("call_")
            names[event.index] = event.name
            arguments[event.index] = []
        else:
            assert event.index in names, "arguments come after their call's start"
            arguments[event.index].append(event.text)
    if max_calls is not None:
        assert len(names) <= max_calls
    assert parser.calls_started == len(names)
    text_content = "".join(content)
    calls = [(names[i], "".join(arguments[i])) for i in sorted(names)]
    return (None if calls and not text_content.strip() else text_content), calls


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_split_of_an_output_streams_to_the_unary_result(fmt, data):
    text = data.draw(outputs(fmt), label="text")
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts")
    max_calls = data.draw(st.sampled_from([None, 1]), label="max_calls")
    assert streamed(text, cuts, fmt, max_calls) == summary(text, fmt, max_calls)
    # One character at a time, the finest split there is.
    assert streamed(text, list(range(len(text))), fmt, max_calls) == summary(text, fmt, max_calls)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_calls_written_in_a_format_parse_back_to_the_same_calls(fmt, data):
    calls = data.draw(
        st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3).map(
            lambda pairs: [ToolCall(f"call_{i}", n, json.dumps(a)) for i, (n, a) in enumerate(pairs)]
        )
    )
    text = written_calls(calls, fmt)
    found = parse_output(text, fmt)
    assert found.content is None
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]
