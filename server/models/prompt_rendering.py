"""Tokenization and chat templates: one model's text and conversations to token ids.

:class:`PromptRenderer` renders a conversation with the model's chat template (offering it tools in
the model's own call format) and tokenizes text, each sized against the model's
:class:`PromptLimits` first. Special-token strings in the messages' text stay text
(engine/tokenizer/special_text.py): only the template draws the conversation's boundaries. Short
input is tokenized on the event loop, long input on a small thread pool (the tokenizer releases the
GIL), so a long prompt does not stall other requests.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from protoserve.engine.api import ContextPolicy
from protoserve.server import errors
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.models.input_validation import PromptLimits
from protoserve.server.tool_calls.call import ToolSpec
from protoserve.server.tool_calls.rendering import (
    ToolTemplate,
    choose_format,
    template_messages,
    template_renders_tools,
)

if TYPE_CHECKING:
    from protoserve.engine.runtime import Tokenizer

T = TypeVar("T")

# Text shorter than this is tokenized on the event loop: it takes less time than a hop to a
# worker thread and back would (see INLINE_TOKENIZE_CHARS in the commit that set it).
INLINE_TOKENIZE_CHARS = 2048
# Longer texts are tokenized by these threads; the tokenizer releases the GIL meanwhile.
TOKENIZE_THREADS = max(1, min(4, os.cpu_count() or 1))


class PromptRenderer:
    """One model's prompts as token ids: plain text, and conversations through its chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: PromptLimits,
        *,
        model_name: str,
        tool_parser: str | None = None,
        parse_special_in_messages: bool = False,
    ) -> None:
        """``tool_parser``: the tool-call format (``--tool-parser``), else read off the chat template;
        ``parse_special_in_messages``: special-token strings in the caller's messages (not in tool results)
        encode as control tokens (``--parse-special-in-messages``)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_name = model_name
        self.tool_parser = tool_parser
        self.parse_special_in_messages = parse_special_in_messages
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")

    @functools.cached_property
    def tool_template(self) -> ToolTemplate | None:
        """How this model takes tools; None when it has no chat template or no known call format."""
        if not self.tokenizer.has_chat_template:
            return None
        renders = template_renders_tools(self.tokenizer.apply_chat_template)
        fmt = choose_format(self.tokenizer.chat_template or "", renders, self.tool_parser)
        return ToolTemplate(fmt, renders) if fmt is not None else None

    async def tokenizing(self, chars: int, work: Callable[[], T]) -> T:
        """Run ``work`` inline for short input, else on a tokenizer thread so the loop keeps serving."""
        if chars < INLINE_TOKENIZE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    # ---- text ------------------------------------------------------------------------

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text (with the GIL released for long text, so it suits worker threads)."""
        if len(text) < INLINE_TOKENIZE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(self.tokenizer.encode_unlocked(text, add_special_tokens=add_special_tokens))

    def checked_ids(
        self, text: str, *, path: str, policy: ContextPolicy | None, add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of ``text``, refusing first, without tokenizing, text that cannot be served
        (:meth:`PromptLimits.check_text`)."""
        self.limits.check_text(text, path=path, policy=policy)
        return self.encode_text(text, add_special_tokens=add_special_tokens)

    async def prompt_ids(
        self, text: str, *, path: str, policy: ContextPolicy | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """:meth:`checked_ids` of a prompt, off the event loop when it is long."""
        self.limits.check_text_chars(text, path)  # the huge refused here, without a hop to a thread
        return await self.tokenizing(
            len(text),
            functools.partial(
                self.checked_ids, text, path=path, policy=policy, add_special_tokens=add_special_tokens
            ),
        )

    # ---- conversations -------------------------------------------------------------

    async def chat_ids(
        self,
        turns: Sequence[ChatTurn],
        *,
        add_generation_prompt: bool = True,
        path: str = "chat.messages",
        policy: ContextPolicy | None = None,
        tools: Sequence[ToolSpec] = (),
    ) -> list[int]:
        """:meth:`render_chat` after the cheap checks, off the event loop when the conversation is long."""
        if not self.tokenizer.has_chat_template:
            raise errors.no_chat_template(self.model_name)
        chars = self.limits.check_turns(turns, path)
        return await self.tokenizing(
            chars,
            functools.partial(
                self.render_chat,
                turns,
                add_generation_prompt=add_generation_prompt,
                path=path,
                policy=policy,
                tools=tools,
            ),
        )

    def render_chat(
        self,
        turns: Sequence[ChatTurn],
        *,
        add_generation_prompt: bool = True,
        path: str = "chat.messages",
        policy: ContextPolicy | None = None,
        tools: Sequence[ToolSpec] = (),
    ) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, offered ``tools``.

        A template that refuses the conversation (say, roles that do not
        alternate) is the caller's error: INVALID_ARGUMENT on ``path``. The
        rendered text is size-checked as :meth:`checked_ids` does. Special-token
        strings in the messages' text stay text (engine/tokenizer/special_text.py):
        only the template draws the conversation's boundaries; tool results always,
        the caller's own messages and tools unless ``parse_special_in_messages``.
        """
        if not self.tokenizer.has_chat_template:
            raise errors.no_chat_template(self.model_name)
        turns = [self._guarded(t) for t in turns]
        if not self.parse_special_in_messages:
            guard = self.tokenizer.special_text
            tools = [replace(t, name=guard.protect(t.name), description=guard.protect(t.description),
                             parameters=guard.protect_tree(t.parameters)) for t in tools]
        variables: dict[str, Any] = {}
        if self.tool_template is not None:
            messages, variables = template_messages(turns, tools, self.tool_template)
        else:
            messages = [
                {"role": t.role, "content": t.content, **({"name": t.name} if t.name else {})} for t in turns
            ]
        # Imported here: the tokenizer package pulls in torch, and the server must bind
        # and answer health checks before anything that slow is imported.
        from protoserve.engine.runtime import ChatTemplateError

        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError as exc:
            raise errors.invalid_argument(
                [(path, f"the chat template refused the conversation: {exc}")]
            ) from None
        if isinstance(rendered, str):
            # The template writes any BOS itself; adding special tokens again would double it.
            return self.checked_ids(rendered, path=path, policy=policy, add_special_tokens=False)
        return list(rendered)

    def _guarded(self, turn: ChatTurn) -> ChatTurn:
        """``turn`` with every text the template may write protected, unless the caller wrote it and
        special tokens in messages are parsed."""
        if self.parse_special_in_messages and turn.role != "tool" and turn.from_caller:
            return turn
        protect = self.tokenizer.special_text.protect
        calls = tuple(
            replace(c, id=protect(c.id), name=protect(c.name), arguments=self._protected_arguments(c.arguments))
            for c in turn.tool_calls
        )
        return replace(turn, content=protect(turn.content), name=protect(turn.name), tool_calls=calls,
                       tool_call_id=protect(turn.tool_call_id))

    def _protected_arguments(self, arguments: str) -> str:
        """A call's arguments protected as the template will see them: rendering decodes a JSON object
        (server/tool_calls/rendering.py), whose escapes (``\\u003c``) could spell a special string."""
        guard = self.tokenizer.special_text
        try:
            value = json.loads(arguments)
        except ValueError:
            return guard.protect(arguments)
        if not isinstance(value, dict):
            return guard.protect(arguments)
        protected = guard.protect_tree(value)
        # Unchanged text keeps its exact spelling; rewritten, it decodes to the protected object.
        return arguments if protected == value else json.dumps(protected, ensure_ascii=False)
