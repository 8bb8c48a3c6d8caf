"""Anthropic's content blocks as chat turns, and a reply's output as Anthropic's blocks and events.

Pure functions: the live behaviour through the official client is tests/gateway/test_anthropic_messages_live.py.
"""

from __future__ import annotations

import json

from google.protobuf import json_format

from protoserve.anthropic.v1 import messages_pb2 as am
from protoserve.engine.request import CompletionDelta, FinishReason
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.services.anthropic.conversion import chat_turns, tools_asked
from protoserve.server.services.anthropic.replies import BlockEvents, StopReason, content_blocks, tool_input
from protoserve.server.tool_calls.call import ToolCall, ToolChoice, ToolChoiceMode
from protoserve.server.tool_calls.parsers import HERMES
from protoserve.server.tool_calls.request import ToolPlan


def _request(body: dict) -> am.CreateMessageRequest:
    return json_format.ParseDict(body, am.CreateMessageRequest())


def _turns(body: dict) -> tuple[list[ChatTurn], list[tuple[str, str]]]:
    req = _request(body)
    violations: list[tuple[str, str]] = []
    turns = chat_turns(req.system if req.HasField("system") else None, req.messages, violations)
    return turns, violations


def test_a_tool_round_trip_becomes_calls_and_tool_turns_in_order():
    turns, violations = _turns(
        {
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                         "content": [{"type": "text", "text": "no station"}]},
                        {"type": "text", "text": "And tomorrow?", "citations": None},
                    ],
                },
            ],
        }
    )
    assert violations == []
    assert turns == [
        ChatTurn("system", "Be brief.\nUse tools."),
        ChatTurn("user", "Weather in Paris and Rome?"),
        ChatTurn(
            "assistant",
            "Checking.",
            tool_calls=(
                ToolCall("toolu_1", "get_weather", '{"city":"Paris"}'),
                ToolCall("toolu_2", "get_weather", '{"city":"Rome"}'),
            ),
        ),
        ChatTurn("tool", "Sunny", tool_call_id="toolu_1"),
        ChatTurn("tool", "Error: no station", tool_call_id="toolu_2"),
        ChatTurn("user", "And tomorrow?"),
    ]


def test_blocks_that_cannot_be_honoured_are_named():
    _, violations = _turns(
        {
            "system": 5,
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "forever"}}]},
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "text", "text": 3, "colour": "red"}]},
                {"role": "system", "content": "x"},
                {"role": "assistant", "content": "prefill"},
            ],
        }
    )
    assert [path for path, _ in violations] == [
        "system",
        "messages[0].content[0].type",
        "messages[1].content[0].type",
        "messages[2].content[0].cache_control",
        "messages[3].content[0].type",
        "messages[4].content[0].colour",
        "messages[4].content[0].text",
        "messages[5].role",
        "messages[6].role",
    ]
    assert "read text only" in violations[1][1] and "prefill" in violations[-1][1]


def test_tools_and_choices_map_onto_chats():
    def asked(body: dict):
        req = _request({"messages": [], **body})
        violations: list[tuple[str, str]] = []
        result = tools_asked(req.tools, req.tool_choice if req.HasField("tool_choice") else None, violations)
        return result, violations

    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    result, violations = asked({"tools": [tool]})
    assert violations == [] and result.choice.mode == ToolChoiceMode.AUTO and result.parallel
    assert result.specs[0].parameters["properties"] == {"city": {"type": "string"}}
    assert asked({"tools": [tool], "tool_choice": {"type": "any"}})[0].choice.mode == ToolChoiceMode.REQUIRED
    named, _ = asked({"tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather",
                                                       "disable_parallel_tool_use": True}})
    assert (named.choice.mode, named.choice.name, named.parallel) == (ToolChoiceMode.NAMED, "get_weather", False)
    assert asked({"tools": [tool], "tool_choice": {"type": "none"}})[0].choice.mode == ToolChoiceMode.NONE
    assert asked({})[0].choice.mode == ToolChoiceMode.NONE

    _, violations = asked(
        {
            "tools": [
                {"name": "bad name", "input_schema": {"type": "object"}},
                {"name": "arr", "input_schema": {"type": "array"}},
                {"name": "search", "type": "web_search_20250305"},
            ],
            "tool_choice": {"type": "tool", "name": "missing"},
        }
    )
    assert [path for path, _ in violations] == [
        "tools[2].type",
        "tools[0].name",
        "tools[1].input_schema",
        "tool_choice.name",
    ]


PLAN = ToolPlan(HERMES, ToolChoice(ToolChoiceMode.AUTO), None)
OUTPUT = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_the_streamed_events_add_up_to_the_unary_blocks():
    whole = BlockEvents(PLAN)
    unary = content_blocks(whole.feed(OUTPUT, finished=True))
    pieces = BlockEvents(PLAN)
    events = []
    for i in range(0, len(OUTPUT), 3):
        events += pieces.feed(OUTPUT[i : i + 3], finished=False)
    events += pieces.feed("", finished=True)
    streamed = content_blocks(events)
    assert streamed[1].id.startswith("toolu_") and whole.called and pieces.called
    streamed[1].id = unary[1].id  # each parse draws a fresh call id
    assert streamed == unary
    assert [(b.type, b.text) for b in unary[:1]] == [("text", "Let me check. ")]
    call = unary[1]
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert json_format.MessageToDict(call.input) == {"city": "Paris"}
    # The input goes out whole once the call is complete: one delta, a complete object.
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 1]
    assert deltas == ['{"city":"Paris"}']
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]


def test_a_call_that_is_no_object_stays_text_and_stop_reasons():
    assert tool_input("") == {} and tool_input('"{\\"a\\": 1}"') == {"a": 1} and tool_input("[1]") is None
    events = BlockEvents(PLAN)
    blocks = content_blocks(events.feed('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', True))
    assert [b.type for b in blocks] == ["text"] and not events.called
    assert json.loads(blocks[0].text) == {"name": "f", "arguments": [1, 2]}

    def delta(finish: FinishReason, stop: str | int | None = None) -> CompletionDelta:
        return CompletionDelta(0, "", [], finish_reason=finish, stop_reason=stop)

    assert StopReason.of(delta(FinishReason.LENGTH), True, []) == StopReason("max_tokens")
    assert StopReason.of(delta(FinishReason.STOP), True, []) == StopReason("tool_use")
    assert StopReason.of(delta(FinishReason.STOP, "END"), False, ["END"]) == StopReason("stop_sequence", "END")
    assert StopReason.of(delta(FinishReason.STOP, 2), False, ["END"]) == StopReason("end_turn")
