"""A validated request, ready for the engine, built the same way by every surface that generates.

A surface reads its own request shape (completions' prompts, chat's messages, or another API's
input) into prompts or chat turns, tools and :class:`SamplingFields`; this module checks those
once against the served model and makes the engine's requests of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from protoserve.engine.api import ContextPolicy, SamplingParams, TokenizedRequest
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.models.served_model import ServedModel
from protoserve.server.security.auth import Identity
from protoserve.server.services.openai.translation import Violations
from protoserve.server.tool_calls.call import ToolChoice, ToolChoiceMode, ToolSpec
from protoserve.server.tool_calls.request import ToolPlan, tool_constraint


@dataclass
class Prompt:
    """One prompt of a request: its token ids and, for echo, its text."""

    token_ids: list[int]
    text: str


@dataclass
class SamplingFields:
    """A request's sampling as its surface read it.

    ``message``'s fields named as the engine's are copied by presence; ``api_defaults`` fill the ones
    the API leaves unset; ``converted`` are fields the surface converted itself (they win); ``paths``
    maps an engine field to the request's own field where their names differ.
    """

    message: Message
    api_defaults: dict[str, Any]
    converted: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolsAsked:
    """The tools a request offers, its choice among them, and whether calls may come several at once."""

    specs: list[ToolSpec]
    choice: ToolChoice
    parallel: bool = True


@dataclass
class PreparedRequest:
    """A validated request, ready for the engine."""

    served: ServedModel
    prompts: list[Prompt]
    sampling: SamplingParams
    echo: bool = False
    tools: ToolPlan | None = None  # set when the model may call tools: its output is parsed for calls
    adapter: str | None = None  # the LoRA adapter `model` named, if it named one
    constraint_field: str = ""  # the request's field holding its output constraint, if it has one

    @property
    def model(self) -> str:
        """The ``model`` the response names: the adapter asked for (as vLLM answers), else the model."""
        return self.adapter or self.served.name

    def engine_requests(self, public_id: str, identity: Identity) -> list[TokenizedRequest]:
        """One engine request per prompt, ``{public_id}.{i}``, each with its own copy of the sampling."""
        return [
            TokenizedRequest(
                request_id=f"{public_id}.{i}",
                prompt_token_ids=prompt.token_ids,
                sampling=dataclasses.replace(self.sampling),
                context_policy=ContextPolicy.ALLOW_CONTEXT_STOP,
                cache_salt=identity.cache_salt,
                sampling_checked=True,
                adapter=self.adapter,
                constraint_field=self.constraint_field,
            )
            for i, prompt in enumerate(self.prompts)
        ]


async def checked_sampling(
    served: ServedModel, fields: SamplingFields, violations: Violations
) -> tuple[SamplingParams, str]:
    """The engine's sampling for ``fields``, and the request field of its output constraint.

    Raises INVALID_ARGUMENT naming every violation found so far and every bad sampling field.
    """
    sampling = served.sampling.params(fields.message, api_defaults=fields.api_defaults, **fields.converted)
    served.sampling.check(sampling, fields.paths, violations)
    constraint_field = await served.check_constraint(sampling.constraint, fields.paths)
    return sampling, constraint_field


def plan_tools(
    served: ServedModel, tools: ToolsAsked, fields: SamplingFields, violations: Violations
) -> tuple[ToolPlan | None, list[ToolSpec]]:
    """The plan for a request's output under its tools, and the tools to render (none for "none").

    A call forced by the choice (or a strict tool under "auto") becomes the request's output
    constraint in ``fields``, so it cannot be combined with another one.
    """
    if tools.choice.mode == ToolChoiceMode.NONE or not tools.specs:
        return None, []
    template = served.tool_template
    if template is None:
        if served.tokenizer.has_chat_template:
            violations.append(
                (
                    "tools",
                    f"model {served.name}'s chat template writes tool calls in a format this server has no "
                    "parser for; start the server with --tool-parser",
                )
            )
        return None, []
    plan = ToolPlan(template.format, tools.choice, None if tools.parallel else 1)
    asked = fields.converted.get("constraint")
    if asked is not None:
        field_path = fields.paths.get(asked.field, "response_format")
        violations.append((field_path, 'cannot be combined with tools unless tool_choice is "none"'))
        return plan, tools.specs
    constraint = tool_constraint(tools.specs, plan)
    if constraint is not None:
        fields.converted["constraint"] = constraint
        fields.paths[constraint.field] = "tools"
    return plan, tools.specs


async def prepare_chat(
    served: ServedModel,
    turns: list[ChatTurn],
    fields: SamplingFields,
    violations: Violations,
    *,
    tools: ToolsAsked | None = None,
    adapter: str | None = None,
    messages_path: str = "messages",
) -> PreparedRequest:
    """A conversation (with the tools it offers) as one prompt through the model's chat template.

    ``violations`` are the surface's own so far; they are raised together with the sampling's.
    """
    plan, offered = plan_tools(served, tools, fields, violations) if tools is not None else (None, [])
    sampling, constraint_field = await checked_sampling(served, fields, violations)
    prompt_ids = await served.chat_ids(
        turns, path=messages_path, policy=ContextPolicy.ALLOW_CONTEXT_STOP, tools=offered
    )
    return PreparedRequest(
        served,
        [Prompt(prompt_ids, "")],
        sampling,
        tools=plan,
        adapter=adapter,
        constraint_field=constraint_field,
    )
