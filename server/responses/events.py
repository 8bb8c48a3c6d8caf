"""A response's output items, built from the model's text as it comes, and the typed events of its stream.

``OutputItems`` reads output pieces (through the tool-call parser when the request has tools) into
output items: a message with one ``output_text`` part, then function calls, in the order the model
wrote them. Each piece gives the events that report it (an item opened, text or argument deltas, an
item closed), without sequence numbers, which ``EventNumbers`` adds as events go out. The unary
response is the same reading in one piece, so a stream adds up to the unary response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf import struct_pb2

from protoserve.openai.v1 import responses_pb2 as rs
from protoserve.server.responses.items import new_id, text_parts
from protoserve.server.tool_calls.parsers import CallArguments, CallStart, Content, Event, StreamedOutput
from protoserve.server.tool_calls.request import ToolPlan

Events = list[rs.CreateResponseStreamResponse]


def _event(kind: str, **fields: object) -> rs.CreateResponseStreamResponse:
    return rs.CreateResponseStreamResponse(type=kind, **fields)


def _empty_list() -> struct_pb2.ListValue:
    return struct_pb2.ListValue()


def output_text_part(text: str) -> rs.ResponseContentPart:
    """An ``output_text`` part as the stream's part events carry it."""
    return rs.ResponseContentPart(type="output_text", text=text, annotations=_empty_list())


@dataclass
class _OpenItem:
    """The output item being written: its position and what it holds so far."""

    index: int
    item: rs.ResponseItem
    text: list[str] = field(default_factory=list)  # a message's text or a call's arguments


class OutputItems:
    """One response's output items, and the events of each new piece of output."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self._parser = StreamedOutput(plan.format, plan.max_calls) if plan is not None else None
        self.items: list[rs.ResponseItem] = []
        self._open: _OpenItem | None = None

    @property
    def called(self) -> bool:
        """Whether the model called a function."""
        return any(item.type == "function_call" for item in self.items) or (
            self._open is not None and self._open.item.type == "function_call"
        )

    def feed(self, text: str, finished: bool) -> Events:
        """The events of the next piece of output (``finished``: it is the last)."""
        if self._parser is not None:
            parsed: list[Event] = self._parser.feed(text, finished)
        else:
            parsed = [Content(text)] if text else []
        events: Events = []
        for piece in parsed:
            if isinstance(piece, Content):
                events += self._text(piece.text)
            elif isinstance(piece, CallStart):
                events += self._close("completed") + self._open_call(piece)
            elif isinstance(piece, CallArguments):
                events += self._arguments(piece.text)
        return events

    def finish(self, status: str) -> Events:
        """Close the open item (a message cut short is ``incomplete``; calls end complete)."""
        return self._close(status)

    # --- messages ---------------------------------------------------------------------------

    def _text(self, text: str) -> Events:
        events: Events = []
        if self._open is None or self._open.item.type != "message":
            events += self._close("completed")
            item = rs.ResponseItem(type="message", id=new_id("msg"), role="assistant", status="in_progress")
            item.content.SetInParent()
            self._open = _OpenItem(len(self.items), item)
            events.append(_event("response.output_item.added", output_index=self._open.index, item=item))
            events.append(self._part_event("response.content_part.added", part=output_text_part("")))
        self._open.text.append(text)
        events.append(self._part_event("response.output_text.delta", delta=text, logprobs=_empty_list()))
        return events

    def _part_event(self, kind: str, **fields: object) -> rs.CreateResponseStreamResponse:
        assert self._open is not None
        return _event(kind, item_id=self._open.item.id, output_index=self._open.index, content_index=0, **fields)

    # --- function calls ---------------------------------------------------------------------

    def _open_call(self, start: CallStart) -> Events:
        item = rs.ResponseItem(
            type="function_call",
            id=new_id("fc"),
            status="in_progress",
            call_id=start.id,
            name=start.name,
            arguments="",
        )
        self._open = _OpenItem(len(self.items), item)
        return [_event("response.output_item.added", output_index=self._open.index, item=item)]

    def _arguments(self, text: str) -> Events:
        assert self._open is not None and self._open.item.type == "function_call"
        self._open.text.append(text)
        return [
            _event(
                "response.function_call_arguments.delta",
                item_id=self._open.item.id,
                output_index=self._open.index,
                delta=text,
            )
        ]

    # --- closing ----------------------------------------------------------------------------

    def _close(self, status: str) -> Events:
        open_item, self._open = self._open, None
        if open_item is None:
            return []
        item, text = open_item.item, "".join(open_item.text)
        index = open_item.index
        events: Events = []
        if item.type == "message":
            part = output_text_part(text)
            common = {"item_id": item.id, "output_index": index, "content_index": 0}
            events.append(_event("response.output_text.done", text=text, logprobs=_empty_list(), **common))
            events.append(_event("response.content_part.done", part=part, **common))
            item.content.CopyFrom(text_parts("output_text", text))
            item.status = status
        else:
            events.append(
                _event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    arguments=text,
                    name=item.name,
                )
            )
            item.arguments = text
            item.status = "completed"
        self.items.append(item)
        events.append(_event("response.output_item.done", output_index=index, item=item))
        return events


class EventNumbers:
    """Numbers a stream's events from 0, in the order they go out."""

    def __init__(self) -> None:
        self.next = 0

    def number(self, event: rs.CreateResponseStreamResponse) -> rs.CreateResponseStreamResponse:
        event.sequence_number = self.next
        self.next += 1
        return event


def lifecycle(kind: str, response: rs.Response) -> rs.CreateResponseStreamResponse:
    """A ``response.*`` event carrying the response as it stands."""
    snapshot = rs.Response()
    snapshot.CopyFrom(response)
    return _event(kind, response=snapshot)
