"""Request builders shared by the sync and async clients.

They are public so callers can prepare ``GenerateRequest`` messages for
``batch()`` or for their own stubs with the same keyword arguments
``generate()`` takes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias, Unpack, cast

from protoserve_client._stubs import inference_pb2 as pb
from protoserve_client.types import ChatMessage, ContextPolicy, SamplingKwargs

Message: TypeAlias = ChatMessage | Mapping[str, str] | pb.ChatMessage
"""A chat message: a ``ChatMessage``, a ``{"role", "content"[, "name"]}`` mapping or the proto."""


class GenerateKwargs(SamplingKwargs, total=False):
    """Keyword arguments of ``generate()`` and ``stream()`` besides the prompt: input, routing, sampling."""

    token_ids: Sequence[int]
    messages: Iterable[Message]
    add_generation_prompt: bool
    model: str
    request_id: str
    context_policy: ContextPolicy | str | int
    priority: int


_SAMPLING_FIELDS = pb.SamplingParams.DESCRIPTOR.fields_by_name


def new_request_id() -> str:
    """A fresh request id; the client picks ids itself so a stream can be cancelled before its first event."""
    return uuid.uuid4().hex


def sampling_params(**sampling: Unpack[SamplingKwargs]) -> pb.SamplingParams:
    """Build ``SamplingParams`` from keyword arguments named like its fields.

    Only the given fields are set, so optional fields the caller leaves out keep
    the server's default rather than becoming zero.

    Raises:
        TypeError: for a keyword that is not a ``SamplingParams`` field.
    """
    params = pb.SamplingParams()
    for name, value in sampling.items():
        fd = _SAMPLING_FIELDS.get(name)
        if fd is None:
            raise TypeError(
                f"unknown sampling parameter {name!r}; known: {', '.join(sorted(_SAMPLING_FIELDS))}"
            )
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            getattr(params, name).update(value)
        elif fd.is_repeated:
            # A lone stop string is a common slip; treat it as a list of one.
            getattr(params, name).extend([value] if isinstance(value, str) else value)
        elif fd.message_type is not None:  # a message (constraint) is copied in, never assigned
            getattr(params, name).CopyFrom(value)
        else:
            setattr(params, name, value)
    return params


def chat_input(messages: Iterable[Message], add_generation_prompt: bool | None = None) -> pb.ChatInput:
    """Build a ``ChatInput`` from chat messages in any of the accepted forms."""
    chat = pb.ChatInput()
    for m in messages:
        if isinstance(m, pb.ChatMessage):
            chat.messages.append(m)
        elif isinstance(m, ChatMessage):
            chat.messages.add(role=m.role, content=m.content, name=m.name)
        else:
            chat.messages.add(role=m["role"], content=m["content"], name=m.get("name", ""))
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


def _context_policy(policy: ContextPolicy | str | int | None) -> pb.ContextPolicy:
    if policy is None:
        return pb.CONTEXT_POLICY_UNSPECIFIED
    if isinstance(policy, int):
        return cast(pb.ContextPolicy, policy)
    return ContextPolicy(policy).to_proto()


def generate_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Iterable[Message] | None = None,
    add_generation_prompt: bool | None = None,
    model: str = "",
    request_id: str | None = None,
    context_policy: ContextPolicy | str | int | None = None,
    priority: int = 0,
    **sampling: Unpack[SamplingKwargs],
) -> pb.GenerateRequest:
    """Build a ``GenerateRequest`` from exactly one of ``prompt``, ``token_ids`` or ``messages``.

    ``request_id`` defaults to a fresh id, so the caller always knows which id
    to pass to ``cancel()``. Sampling keywords are those of ``SamplingKwargs``.

    Raises:
        TypeError: when not exactly one input is given, or for an unknown keyword.
    """
    given = [
        name
        for name, v in (("prompt", prompt), ("token_ids", token_ids), ("messages", messages))
        if v is not None
    ]
    if len(given) != 1:
        raise TypeError(f"give exactly one of prompt, token_ids or messages (got {given or 'none'})")
    req = pb.GenerateRequest(
        model=model,
        request_id=request_id if request_id is not None else new_request_id(),
        sampling=sampling_params(**sampling),
        context_policy=_context_policy(context_policy),
        priority=priority,
    )
    if prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        assert messages is not None
        req.chat.CopyFrom(chat_input(messages, add_generation_prompt))
    return req


def batch_request(requests: Iterable[pb.GenerateRequest | Mapping[str, Any]]) -> pb.BatchRequest:
    """Build a ``BatchRequest`` from ``GenerateRequest`` messages or ``generate_request`` keyword dicts."""
    batch = pb.BatchRequest()
    for r in requests:
        batch.requests.append(r if isinstance(r, pb.GenerateRequest) else generate_request(**r))
    return batch


def tokenize_request(
    text: str | None = None,
    *,
    messages: Iterable[Message] | None = None,
    add_generation_prompt: bool | None = None,
    model: str = "",
    add_special_tokens: bool | None = None,
) -> pb.TokenizeRequest:
    """Build a ``TokenizeRequest`` from exactly one of ``text`` or ``messages``.

    Raises:
        TypeError: when not exactly one input is given.
    """
    if (text is None) == (messages is None):
        raise TypeError("give exactly one of text or messages")
    req = pb.TokenizeRequest(model=model)
    if text is not None:
        req.text = text
    else:
        assert messages is not None
        req.chat.CopyFrom(chat_input(messages, add_generation_prompt))
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req


def detokenize_request(
    token_ids: Sequence[int], *, model: str = "", skip_special_tokens: bool | None = None
) -> pb.DetokenizeRequest:
    """Build a ``DetokenizeRequest``."""
    req = pb.DetokenizeRequest(model=model, token_ids=list(token_ids))
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    return req
