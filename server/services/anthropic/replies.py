"""A reply as Anthropic's content blocks: the stream's block events, and the unary content from them.

:class:`BlockEvents` reads the model's output as it comes (through the tool-call parser when the
request offers tools) and writes content_block_start / _delta / _stop events: text as it arrives,
each tool call as one ``tool_use`` block whose input goes out whole once the call is complete, as
Anthropic's API buffers tool input (so its one ``input_json_delta`` is always a valid object). The
unary reply is the same reading of the whole output, folded into blocks (:func:`content_blocks`),
so a streamed reply always adds up to the unary one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import struct_pb2

from protoserve.anthropic.v1 import messages_pb2 as am
from protoserve.engine.api import Choice, CompletionDelta, FinishReason
from protoserve.server.models.sampling_mapping import json_text
from protoserve.server.tool_calls.parsers import CallArguments, CallStart, Content, StreamedOutput
from protoserve.server.tool_calls.request import ToolPlan

Event = am.CreateMessageStreamResponse


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` form of a parsed call's ``call_`` id."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's argument text as the object Anthropic's ``input`` is; None if it is no object.

    No text is no arguments; a JSON string holding an object (some models quote their arguments)
    is that object.
    """
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
        if isinstance(value, str):
            value = json.loads(value)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass
class _PendingCall:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class BlockEvents:
    """One reply's content-block events, from its output text in pieces."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self._output = StreamedOutput(plan.format, plan.max_calls) if plan is not None else None
        self._next_index = 0
        self._text_open = False
        self._call: _PendingCall | None = None
        self.called = False  # a tool_use block has gone out

    def feed(self, text: str, finished: bool) -> list[Event]:
        """The events of the next piece of output (``finished``: it is the last)."""
        if self._output is None:
            parsed = [Content(text)] if text else []
        else:
            parsed = self._output.feed(text, finished)
        events: list[Event] = []
        for item in parsed:
            if isinstance(item, Content) and item.text:
                events += self._end_call()
                events += self._text(item.text)
            elif isinstance(item, CallStart):
                events += self._end_call() + self._end_text()
                self._call = _PendingCall(tool_use_id(item.id), item.name)
            elif isinstance(item, CallArguments) and self._call is not None:
                self._call.arguments.append(item.text)
        if finished:
            events += self._end_call() + self._end_text()
        return events

    def _text(self, text: str) -> list[Event]:
        events = []
        if not self._text_open:
            self._text_open = True
            block = am.ContentBlock(type="text", text="")
            events.append(Event(type="content_block_start", index=self._next_index, content_block=block))
        delta = am.Delta(type="text_delta", text=text)
        events.append(Event(type="content_block_delta", index=self._next_index, delta=delta))
        return events

    def _end_text(self) -> list[Event]:
        if not self._text_open:
            return []
        self._text_open = False
        return [self._stop()]

    def _end_call(self) -> list[Event]:
        call, self._call = self._call, None
        if call is None:
            return []
        raw = "".join(call.arguments)
        value = tool_input(raw)
        if value is None:
            # Not a call Anthropic's clients could run: what the model wrote goes back as text.
            return self._text(f'{{"name": {json.dumps(call.name)}, "arguments": {raw}}}') + self._end_text()
        self.called = True
        block = am.ContentBlock(type="tool_use", id=call.id, name=call.name, input=struct_pb2.Struct())
        delta = am.Delta(type="input_json_delta", partial_json=json_text(value))
        return [
            Event(type="content_block_start", index=self._next_index, content_block=block),
            Event(type="content_block_delta", index=self._next_index, delta=delta),
            self._stop(),
        ]

    def _stop(self) -> Event:
        event = Event(type="content_block_stop", index=self._next_index)
        self._next_index += 1
        return event


def content_blocks(events: list[Event]) -> list[am.ContentBlock]:
    """The reply's blocks, folded from its block events."""
    blocks: list[am.ContentBlock] = []
    inputs: dict[int, list[str]] = {}
    for event in events:
        if event.type == "content_block_start":
            blocks.append(am.ContentBlock())
            blocks[-1].CopyFrom(event.content_block)
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            blocks[event.index].text += event.delta.text
        elif event.type == "content_block_delta":
            inputs.setdefault(event.index, []).append(event.delta.partial_json)
    for index, pieces in inputs.items():
        blocks[index].input.update(json.loads("".join(pieces)))
    return blocks


@dataclass(frozen=True)
class StopReason:
    """Why a reply ended, in Anthropic's words, and the stop sequence it matched."""

    reason: str
    sequence: str | None = None

    @classmethod
    def of(cls, choice: Choice | CompletionDelta, called: bool, stop_sequences: list[str]) -> StopReason:
        """From the engine's finish: max_tokens for a length finish, else tool_use after a call,
        stop_sequence for one of the request's sequences, end_turn for the rest (EOS)."""
        if choice.finish_reason == FinishReason.LENGTH:
            return cls("max_tokens")
        if called:
            return cls("tool_use")
        if isinstance(choice.stop_reason, str) and choice.stop_reason in stop_sequences:
            return cls("stop_sequence", choice.stop_reason)
        return cls("end_turn")

    def delta(self) -> am.Delta:
        """message_delta's delta: the reason, and the sequence or null."""
        sequence = struct_pb2.Value(null_value=struct_pb2.NULL_VALUE)
        if self.sequence is not None:
            sequence = struct_pb2.Value(string_value=self.sequence)
        return am.Delta(stop_reason=self.reason, stop_sequence=sequence)
