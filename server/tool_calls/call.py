"""Plain data of tool calling: a tool the model may call, a call it made, and the request's choice."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: its name, what it does and a JSON Schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request lists it (what chat templates take as ``tools``)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is the JSON text the model wrote, as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    """A fresh "call_..." id, as OpenAI's look."""
    return "call_" + secrets.token_hex(12)


class ToolChoiceMode(StrEnum):
    NONE = "none"  # tools are not offered to the model
    AUTO = "auto"  # the model may answer or call
    REQUIRED = "required"  # the model must call at least one tool
    NAMED = "named"  # the model must call the one named function


@dataclass(frozen=True)
class ToolChoice:
    """A request's ``tool_choice``; ``name`` is set for NAMED only."""

    mode: ToolChoiceMode
    name: str = ""

    @property
    def forced(self) -> bool:
        """Whether the output is held to the call format by a grammar."""
        return self.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
