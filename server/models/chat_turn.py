"""A chat message as the server sees it, whichever API it came from, and the roles it may have.

Apart from served_model so that the CLI's parser can name the roles without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from protoserve.server.tool_calls.call import ToolCall

# Roles the chat templates of supported models understand.
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatTurn:
    """One chat message, whichever API it came from."""

    role: str
    content: str
    name: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str = ""  # the call a tool turn answers
    # False for text the caller did not write (an agent run's own steps): its special-token strings stay
    # text even under --parse-special-in-messages, as a tool turn's always do.
    from_caller: bool = True
