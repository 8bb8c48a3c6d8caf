"""Request builders shared by the sync and async clients.

They are public so callers can prepare ``GenerateRequest`` messages for
``batch()`` or for their own stubs with the same keyword arguments
``generate()`` takes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias, Unpack, cast

from protoserve_client._stubs import agent_pb2 as apb
from protoserve_client._stubs import embeddings_pb2 as epb
from protoserve_client._stubs import inference_pb2 as pb
from protoserve_client._stubs import rag_pb2 as rpb
from protoserve_client.rag_types import (
    Document,
)
from protoserve_client.types import (
    AnswerSamplingKwargs,
    ChatMessage,
    ContextPolicy,
    SamplingKwargs,
)

Message: TypeAlias = ChatMessage | Mapping[str, str] | pb.ChatMessage
"""A chat message: a ``ChatMessage``, a ``{"role", "content"[, "name"]}`` mapping or the proto."""

DocumentLike: TypeAlias = Document | Mapping[str, Any] | rpb.Document
"""A document to index: a ``Document``, a ``{"document_id", "text"[, "metadata"]}`` mapping or the proto."""

_DOCUMENT_KEYS = frozenset({"document_id", "text", "metadata"})


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


def _strings(value: Sequence[str], name: str) -> list[str]:
    """A list of strings; a lone string is refused rather than split into characters."""
    if isinstance(value, str):
        raise TypeError(f"{name} must be a list of strings, not one string; wrap it as [{name[:-1]}]")
    return list(value)


def embed_request(
    texts: Sequence[str] | None = None,
    *,
    token_ids: Sequence[Sequence[int]] | None = None,
    model: str = "",
) -> epb.EmbedRequest:
    """Build an ``EmbedRequest`` from exactly one of ``texts`` or ``token_ids`` (one id list per input).

    Raises:
        TypeError: when not exactly one input is given, or ``texts`` is a single string.
    """
    if (texts is None) == (token_ids is None):
        raise TypeError("give exactly one of texts or token_ids")
    req = epb.EmbedRequest(model=model)
    if texts is not None:
        req.texts.extend(_strings(texts, "texts"))
    else:
        assert token_ids is not None
        for ids in token_ids:
            req.token_ids.add().ids.extend(ids)
    return req


def document_proto(document: DocumentLike, index: int = 0) -> rpb.Document:
    """Build a ``Document`` message from any accepted form.

    Raises:
        TypeError: for a mapping without ``document_id`` or ``text``, or with any other key.
    """
    if isinstance(document, rpb.Document):
        return document
    if isinstance(document, Document):
        return rpb.Document(
            document_id=document.document_id, text=document.text, metadata=dict(document.metadata)
        )
    unknown = sorted(set(document) - _DOCUMENT_KEYS)
    if unknown:
        raise TypeError(f"documents[{index}]: unknown keys {unknown}; known: {sorted(_DOCUMENT_KEYS)}")
    missing = [k for k in ("document_id", "text") if k not in document]
    if missing:
        raise TypeError(f"documents[{index}]: missing {', '.join(missing)}")
    return rpb.Document(
        document_id=document["document_id"],
        text=document["text"],
        metadata=dict(document.get("metadata") or {}),
    )


def index_documents_request(
    documents: Iterable[DocumentLike],
    *,
    chunk_tokens: int | None = None,
    overlap_tokens: int | None = None,
) -> rpb.IndexDocumentsRequest:
    """Build an ``IndexDocumentsRequest``; unset chunking keeps the server's defaults."""
    req = rpb.IndexDocumentsRequest(documents=[document_proto(d, i) for i, d in enumerate(documents)])
    if chunk_tokens is not None:
        req.chunking.chunk_tokens = chunk_tokens
    if overlap_tokens is not None:
        req.chunking.overlap_tokens = overlap_tokens
    return req


def search_documents_request(
    query: str,
    *,
    top_k: int | None = None,
    filter: Mapping[str, str] | None = None,
    min_score: float | None = None,
) -> rpb.SearchDocumentsRequest:
    """Build a ``SearchDocumentsRequest``; unset options keep the server's defaults."""
    req = rpb.SearchDocumentsRequest(query=query, filter=dict(filter or {}))
    if top_k is not None:
        req.top_k = top_k
    if min_score is not None:
        req.min_score = min_score
    return req


def list_documents_request(page_size: int | None = None, page_token: str = "") -> rpb.ListDocumentsRequest:
    """Build a ``ListDocumentsRequest``; an unset page size keeps the server's default."""
    req = rpb.ListDocumentsRequest(page_token=page_token)
    if page_size is not None:
        req.page_size = page_size
    return req


def delete_documents_request(document_ids: Sequence[str]) -> rpb.DeleteDocumentsRequest:
    """Build a ``DeleteDocumentsRequest``.

    Raises:
        TypeError: when ``document_ids`` is a single string.
    """
    return rpb.DeleteDocumentsRequest(document_ids=_strings(document_ids, "document_ids"))


def retrieve_and_generate_request(
    query: str,
    *,
    top_k: int | None = None,
    filter: Mapping[str, str] | None = None,
    min_score: float | None = None,
    system_prompt: str | None = None,
    model: str = "",
    sampling_top_k: int | None = None,
    **sampling: Unpack[AnswerSamplingKwargs],
) -> rpb.RetrieveAndGenerateRequest:
    """Build a ``RetrieveAndGenerateRequest``.

    ``top_k`` is the number of chunks put into the prompt; sampling's own
    top-k is ``sampling_top_k``. The other keywords are sampling parameters.
    """
    params = sampling_params(**sampling)
    if sampling_top_k is not None:
        params.top_k = sampling_top_k
    req = rpb.RetrieveAndGenerateRequest(query=query, model=model, filter=dict(filter or {}), sampling=params)
    if top_k is not None:
        req.top_k = top_k
    if min_score is not None:
        req.min_score = min_score
    if system_prompt is not None:
        req.system_prompt = system_prompt
    return req


def run_agent_request(
    messages: Iterable[Message],
    *,
    tools: Sequence[str] | None = None,
    tool_choice: str | None = None,
    max_steps: int | None = None,
    timeout_seconds: float | None = None,
    tool_timeout_seconds: float | None = None,
    parallel_tool_calls: bool | None = None,
    model: str = "",
    **sampling: Unpack[SamplingKwargs],
) -> apb.RunAgentRequest:
    """Build a ``RunAgentRequest``; unset options keep the server's defaults (every tool, "auto", ...).

    Raises:
        TypeError: when ``tools`` is a single string.
    """
    req = apb.RunAgentRequest(
        model=model,
        messages=chat_input(messages).messages,
        tools=_strings(tools, "tools") if tools is not None else [],
        tool_choice=tool_choice or "",
        sampling=sampling_params(**sampling),
    )
    if max_steps is not None:
        req.max_steps = max_steps
    if timeout_seconds is not None:
        req.timeout_seconds = timeout_seconds
    if tool_timeout_seconds is not None:
        req.tool_timeout_seconds = tool_timeout_seconds
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    return req
