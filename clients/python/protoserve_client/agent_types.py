"""Typed events and results of agent runs and the tool list, converted from the protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from google.protobuf import json_format

from protoserve_client._stubs import agent_pb2 as apb
from protoserve_client.types import Usage


class AgentStopReason(StrEnum):
    """Why an agent run ended (``AgentStopReason`` in the proto, without its prefix)."""

    UNSPECIFIED = "unspecified"
    ANSWERED = "answered"
    MAX_STEPS = "max_steps"
    LENGTH = "length"

    @classmethod
    def from_proto(cls, value: int) -> AgentStopReason:
        """Map a ``protoserve.v1.AgentStopReason`` number to its member."""
        return cls(apb.AgentStopReason.Name(value).removeprefix("AGENT_STOP_REASON_").lower())


@dataclass(frozen=True, slots=True)
class AgentEventBase:
    """What every agent event carries.

    ``step`` counts model steps from 1; ``elapsed_s`` is the time since the run
    started; ``duration_s`` is the model step's time (the tool call's, for a
    ``AgentToolResult``); ``usage`` is the model step's tokens, set only on the
    step's first event.
    """

    run_id: str
    step: int
    elapsed_s: float
    duration_s: float
    usage: Usage | None


@dataclass(frozen=True, slots=True)
class AgentThought(AgentEventBase):
    """Text the model wrote in a step before calling tools."""

    content: str


@dataclass(frozen=True, slots=True)
class AgentToolCall(AgentEventBase):
    """A tool call the model made, sent when the tool starts; ``arguments`` is a string of JSON."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class AgentToolResult(AgentEventBase):
    """What a tool call returned (or its error, with ``is_error``), as the model reads it next step."""

    id: str
    name: str
    content: str
    is_error: bool


@dataclass(frozen=True, slots=True)
class AgentAnswer(AgentEventBase):
    """The run's last event: the answer, why the run ended, its steps and the tokens of every step."""

    content: str
    stop_reason: AgentStopReason
    steps: int
    run_usage: Usage


AgentEvent = AgentThought | AgentToolCall | AgentToolResult | AgentAnswer
"""What ``run_agent`` yields; the last event is always an ``AgentAnswer``."""


def agent_event_from_proto(msg: apb.RunAgentResponse) -> AgentEvent:
    """Convert one ``protoserve.v1.RunAgentResponse``."""
    common: dict[str, Any] = {
        "run_id": msg.run_id,
        "step": msg.step,
        "elapsed_s": msg.elapsed_s,
        "duration_s": msg.duration_s,
        "usage": Usage.from_proto(msg.usage) if msg.HasField("usage") else None,
    }
    kind = msg.WhichOneof("event")
    if kind == "thought":
        return AgentThought(**common, content=msg.thought.content)
    if kind == "tool_call":
        c = msg.tool_call
        return AgentToolCall(**common, id=c.id, name=c.name, arguments=c.arguments)
    if kind == "tool_result":
        r = msg.tool_result
        return AgentToolResult(**common, id=r.id, name=r.name, content=r.content, is_error=r.is_error)
    if kind == "answer":
        a = msg.answer
        return AgentAnswer(
            **common,
            content=a.content,
            stop_reason=AgentStopReason.from_proto(a.stop_reason),
            steps=a.steps,
            run_usage=Usage.from_proto(a.usage),
        )
    raise ValueError(f"agent run {msg.run_id!r} sent an event of no known kind")


@dataclass(frozen=True, slots=True)
class ToolInfo:
    """A tool an agent run may use: its name, description and the JSON Schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    @classmethod
    def from_proto(cls, msg: apb.ToolInfo) -> ToolInfo:
        """Convert a ``protoserve.v1.ToolInfo``; the schema becomes plain JSON data."""
        return cls(msg.name, msg.description, json_format.MessageToDict(msg.parameters))
