"""protoserve's clients, written once: ``AsyncClient`` on asyncio and ``Client``, which blocks.

``aio.py`` (with ``_aio_streams.py``) is the source of both: ``client.py``
(with ``_sync_streams.py``) is generated from it by unasync (``build_backend/protoserve_client_build.py``, run by wheel builds and
by ``make install``), which drops every ``async`` and ``await`` and the
``Async`` of every name. The I/O modules ``_aio_io`` and ``_sync_io`` hold what
each does its own way. Edit ``aio.py``, never ``client.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from time import monotonic
from types import TracebackType
from typing import Any, Self, Unpack

import grpc

from protoserve_client._aio_io import (
    Channel,
    insecure_channel,
    secure_channel,
    sleep,
)
from protoserve_client._aio_streams import (
    AsyncAgentRun,
    AsyncGenerateStream,
    AsyncRagAnswerStream,
)
from protoserve_client._common import (
    DEFAULT_TARGET,
    NOT_READY_CODES,
    CallOptions,
    Metadata,
    batch_results,
    not_ready,
    probe_timeout,
)
from protoserve_client._stubs import agent_pb2 as apb
from protoserve_client._stubs import agent_pb2_grpc as apb_grpc
from protoserve_client._stubs import embeddings_pb2_grpc as epb_grpc
from protoserve_client._stubs import inference_pb2 as pb
from protoserve_client._stubs import inference_pb2_grpc as pb_grpc
from protoserve_client._stubs import rag_pb2 as rpb
from protoserve_client._stubs import rag_pb2_grpc as rpb_grpc
from protoserve_client.agent_types import (
    ToolInfo,
)
from protoserve_client.builders import (
    DocumentLike,
    GenerateKwargs,
    Message,
    batch_request,
    delete_documents_request,
    detokenize_request,
    embed_request,
    generate_request,
    index_documents_request,
    list_documents_request,
    retrieve_and_generate_request,
    run_agent_request,
    search_documents_request,
    tokenize_request,
)
from protoserve_client.errors import ProtoserveError
from protoserve_client.rag_types import (
    ChunkHit,
    DeleteResult,
    DocumentInfo,
    DocumentPage,
    EmbedResult,
    IndexedDocument,
    RagAnswer,
    StoredDocument,
)
from protoserve_client.types import (
    AnswerSamplingKwargs,
    GenerateResult,
    Health,
    ModelInfo,
    SamplingKwargs,
    TokenizeResult,
)


class AsyncClient:
    """Client for protoserve's gRPC services: inference, embeddings, RAG and agent runs.

    ``Client`` blocks; ``AsyncClient`` takes the same arguments and has the same
    methods as coroutines (and async iterators where ``Client``'s iterate).
    Create an ``AsyncClient`` inside a running event loop (its channel binds to
    it) and close it with ``await client.close()`` or ``async with``.

    Args:
        target: ``host:port`` of the gRPC server.
        api_key: sent as ``authorization: Bearer <key>`` on every call.
        user_id: sent as ``x-user-id`` on every call; the server scopes Cancel by it.
        timeout: default deadline in seconds for every call (None: no deadline);
            each method's ``timeout`` overrides it.
        metadata: extra metadata for every call.
        credentials: TLS channel credentials; plaintext when None.
        options: gRPC channel options.
        wait_for_ready: queue calls while the channel connects instead of failing fast.
        channel: an existing channel to use instead of opening one; the
            client does not close a channel it did not open.

    Every method raises ``ProtoserveError`` when the call fails.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        user_id: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        wait_for_ready: bool = False,
        channel: Channel | None = None,
    ) -> None:
        self._owns_channel = channel is None
        if channel is None:
            channel = (
                secure_channel(target, credentials, options=options)
                if credentials is not None
                else insecure_channel(target, options=options)
            )
        self._channel = channel
        # The grpc plugin generates untyped code; the methods below type each response.
        self.stub = pb_grpc.InferenceServiceStub(channel)  # type: ignore[no-untyped-call,unused-ignore]
        self.embedding_stub = epb_grpc.EmbeddingServiceStub(channel)  # type: ignore[no-untyped-call,unused-ignore]
        self.rag_stub = rpb_grpc.RagServiceStub(channel)  # type: ignore[no-untyped-call,unused-ignore]
        self.agent_stub = apb_grpc.AgentServiceStub(channel)  # type: ignore[no-untyped-call,unused-ignore]
        self._opts = CallOptions(api_key, user_id, timeout, metadata)
        self._wait_for_ready = wait_for_ready

    async def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _unary(
        self, method: Callable[..., Any], request: Any, timeout: float | None, metadata: Metadata | None
    ) -> Any:
        try:
            return await method(
                request,
                timeout=self._opts.call_timeout(timeout),
                metadata=self._opts.call_metadata(metadata),
                wait_for_ready=self._wait_for_ready,
            )
        except grpc.RpcError as e:
            raise ProtoserveError.from_rpc_error(e) from e

    def _server_stream(
        self, method: Callable[..., Any], request: Any, timeout: float | None, metadata: Metadata | None
    ) -> Any:
        return method(
            request,
            timeout=self._opts.call_timeout(timeout),
            metadata=self._opts.call_metadata(metadata),
            wait_for_ready=self._wait_for_ready,
        )

    async def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **kwargs: Unpack[GenerateKwargs],
    ) -> GenerateResult:
        """Run one request to completion.

        Give the input as ``prompt`` text, ``token_ids=[...]`` or
        ``messages=[{"role": "user", "content": "..."}]``; the other keywords
        are sampling parameters (``max_tokens``, ``temperature``, ``stop``, ...),
        ``model``, ``request_id``, ``context_policy`` and ``priority``.
        """
        req = generate_request(prompt, **kwargs)
        return GenerateResult.from_proto(await self._unary(self.stub.Generate, req, timeout, metadata))

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **kwargs: Unpack[GenerateKwargs],
    ) -> AsyncGenerateStream:
        """Start a streaming generation; iterate the result for deltas and then the final.

        Takes the same arguments as ``generate``. Not a coroutine in
        ``AsyncClient`` either: the call starts at once and events arrive as
        they are read. ``timeout`` bounds the whole stream.
        """
        req = generate_request(prompt, **kwargs)
        call = self._server_stream(
            self.stub.GenerateStream, pb.GenerateStreamRequest(request=req), timeout, metadata
        )
        return AsyncGenerateStream(call, req.request_id)

    async def cancel(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """Stop a running or queued request of this caller; True if one was stopped."""
        resp: pb.CancelResponse = await self._unary(
            self.stub.Cancel, pb.CancelRequest(request_id=request_id), timeout, metadata
        )
        return resp.cancelled

    async def batch(
        self,
        requests: Iterable[pb.GenerateRequest | Mapping[str, Any]],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> list[GenerateResult | ProtoserveError]:
        """Run many requests concurrently on the server; one result or error per request, in order.

        Each request is a ``GenerateRequest`` (see ``builders.generate_request``)
        or a dict of ``generate`` keywords such as ``{"prompt": "Hi", "max_tokens": 8}``.
        A failed request comes back as a ``ProtoserveError`` in its slot; only a
        failure of the whole call raises.
        """
        resp = await self._unary(self.stub.Batch, batch_request(requests), timeout, metadata)
        return batch_results(resp)

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Iterable[Message] | None = None,
        add_generation_prompt: bool | None = None,
        model: str = "",
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> TokenizeResult:
        """Token ids and token texts of ``text`` or of chat ``messages`` rendered with the chat template."""
        req = tokenize_request(
            text,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            model=model,
            add_special_tokens=add_special_tokens,
        )
        resp = await self._unary(self.stub.Tokenize, req, timeout, metadata)
        return TokenizeResult(tuple(resp.token_ids), tuple(resp.tokens), resp.max_model_len)

    async def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        model: str = "",
        skip_special_tokens: bool | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> str:
        """Text of ``token_ids``."""
        req = detokenize_request(token_ids, model=model, skip_special_tokens=skip_special_tokens)
        resp: pb.DetokenizeResponse = await self._unary(self.stub.Detokenize, req, timeout, metadata)
        return resp.text

    async def list_models(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> list[ModelInfo]:
        """Every loaded model; the first is the default."""
        resp = await self._unary(self.stub.ListModels, pb.ListModelsRequest(), timeout, metadata)
        return [ModelInfo.from_proto(m) for m in resp.models]

    async def get_model(
        self, name: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ModelInfo:
        """One loaded model by name; NOT_FOUND when it is not loaded."""
        resp = await self._unary(self.stub.GetModel, pb.GetModelRequest(name=name), timeout, metadata)
        return ModelInfo.from_proto(resp.model)

    async def health(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> Health:
        """Readiness; raises UNAVAILABLE while the model loads or the server drains."""
        resp = await self._unary(self.stub.CheckHealth, pb.CheckHealthRequest(), timeout, metadata)
        return Health.from_proto(resp)

    # --- embeddings ---------------------------------------------------------

    async def embed(
        self,
        texts: Sequence[str] | None = None,
        *,
        token_ids: Sequence[Sequence[int]] | None = None,
        model: str = "",
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> EmbedResult:
        """Unit-length vectors of ``texts`` (or of ``token_ids`` of the embedding model), in input order.

        FAILED_PRECONDITION when the server runs without an embedding model.
        """
        req = embed_request(texts, token_ids=token_ids, model=model)
        return EmbedResult.from_proto(await self._unary(self.embedding_stub.Embed, req, timeout, metadata))

    # --- RAG: the caller's documents -----------------------------------------

    async def index_documents(
        self,
        documents: Iterable[DocumentLike],
        *,
        chunk_tokens: int | None = None,
        overlap_tokens: int | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> list[IndexedDocument]:
        """Chunk, embed and store documents (an id indexed again is replaced); returns once they are durable.

        Each document is a ``Document``, a ``{"document_id", "text"[, "metadata"]}``
        dict or the proto. Documents belong to the caller (API key and ``user_id``).
        """
        req = index_documents_request(documents, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens)
        resp: rpb.IndexDocumentsResponse = await self._unary(
            self.rag_stub.IndexDocuments, req, timeout, metadata
        )
        return [IndexedDocument.from_proto(d) for d in resp.documents]

    async def search_documents(
        self,
        query: str,
        *,
        top_k: int | None = None,
        filter: Mapping[str, str] | None = None,
        min_score: float | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> list[ChunkHit]:
        """The caller's chunks most similar to ``query``, best first.

        ``filter`` keeps documents whose metadata has all its pairs; ``min_score``
        drops chunks less similar (cosine) than it.
        """
        req = search_documents_request(query, top_k=top_k, filter=filter, min_score=min_score)
        resp: rpb.SearchDocumentsResponse = await self._unary(
            self.rag_stub.SearchDocuments, req, timeout, metadata
        )
        return [ChunkHit.from_proto(c) for c in resp.chunks]

    async def list_documents(
        self,
        page_size: int | None = None,
        page_token: str = "",
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> DocumentPage:
        """One page of the caller's documents, oldest first; pass ``next_page_token`` back for the next."""
        req = list_documents_request(page_size, page_token)
        return DocumentPage.from_proto(await self._unary(self.rag_stub.ListDocuments, req, timeout, metadata))

    async def iter_documents(
        self,
        page_size: int | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncIterator[DocumentInfo]:
        """Every document of the caller, oldest first, fetching pages as it goes (``timeout`` is per page)."""
        token = ""
        while True:
            page = await self.list_documents(page_size, token, timeout=timeout, metadata=metadata)
            for document in page.documents:
                yield document
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def get_document(
        self, document_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> StoredDocument:
        """One of the caller's documents with its text and chunks; NOT_FOUND when it has none by that id."""
        req = rpb.GetDocumentRequest(document_id=document_id)
        return StoredDocument.from_proto(await self._unary(self.rag_stub.GetDocument, req, timeout, metadata))

    async def delete_documents(
        self, document_ids: Sequence[str], *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> DeleteResult:
        """Remove the caller's documents by id; ids it has no document for come back in ``not_found``."""
        req = delete_documents_request(document_ids)
        resp: rpb.DeleteDocumentsResponse = await self._unary(
            self.rag_stub.DeleteDocuments, req, timeout, metadata
        )
        return DeleteResult(list(resp.deleted), list(resp.not_found))

    # --- RAG: answers -----------------------------------------------------------

    async def retrieve_and_generate(
        self,
        query: str,
        *,
        top_k: int | None = None,
        filter: Mapping[str, str] | None = None,
        min_score: float | None = None,
        system_prompt: str | None = None,
        model: str = "",
        sampling_top_k: int | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **sampling: Unpack[AnswerSamplingKwargs],
    ) -> RagAnswer:
        """Answer ``query`` from the caller's documents, with the chunks the model was given as citations.

        ``top_k`` is how many chunks go into the prompt; ``system_prompt`` must
        contain ``{context}``, where the numbered chunks go. The other keywords
        are sampling parameters (``max_tokens``, ``temperature``, ...), with
        sampling's own top-k as ``sampling_top_k``.
        """
        req = retrieve_and_generate_request(
            query,
            top_k=top_k,
            filter=filter,
            min_score=min_score,
            system_prompt=system_prompt,
            model=model,
            sampling_top_k=sampling_top_k,
            **sampling,
        )
        return RagAnswer.from_proto(
            await self._unary(self.rag_stub.RetrieveAndGenerate, req, timeout, metadata)
        )

    def retrieve_and_generate_stream(
        self,
        query: str,
        *,
        top_k: int | None = None,
        filter: Mapping[str, str] | None = None,
        min_score: float | None = None,
        system_prompt: str | None = None,
        model: str = "",
        sampling_top_k: int | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **sampling: Unpack[AnswerSamplingKwargs],
    ) -> AsyncRagAnswerStream:
        """Stream an answer: iterate for ``RagCitations``, then ``RagDelta`` texts, then one ``RagFinal``.

        Takes the same arguments as ``retrieve_and_generate``; ``timeout`` bounds
        the whole stream. Not a coroutine in ``AsyncClient`` either: the call starts at once.
        """
        req = retrieve_and_generate_request(
            query,
            top_k=top_k,
            filter=filter,
            min_score=min_score,
            system_prompt=system_prompt,
            model=model,
            sampling_top_k=sampling_top_k,
            **sampling,
        )
        wrapped = rpb.RetrieveAndGenerateStreamRequest(request=req)
        return AsyncRagAnswerStream(
            self._server_stream(self.rag_stub.RetrieveAndGenerateStream, wrapped, timeout, metadata)
        )

    # --- agent ------------------------------------------------------------------

    def run_agent(
        self,
        messages: Iterable[Message],
        *,
        tools: Sequence[str] | None = None,
        tool_choice: str | None = None,
        max_steps: int | None = None,
        timeout_seconds: float | None = None,
        tool_timeout_seconds: float | None = None,
        parallel_tool_calls: bool | None = None,
        model: str = "",
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **sampling: Unpack[SamplingKwargs],
    ) -> AsyncAgentRun:
        """Run the server's ReAct loop; iterate the result for its events, ending with an ``AgentAnswer``.

        ``messages`` are the conversation ending with the task (roles "system"
        and "user"); ``tools`` names the registry's tools the run may use
        (default: all); ``tool_choice="required"`` makes the first step call
        one. ``timeout_seconds`` bounds the run on the server, ``timeout`` the
        call. The other keywords sample each model step. Not a coroutine in
        ``AsyncClient`` either: the call starts at once.
        """
        req = run_agent_request(
            messages,
            tools=tools,
            tool_choice=tool_choice,
            max_steps=max_steps,
            timeout_seconds=timeout_seconds,
            tool_timeout_seconds=tool_timeout_seconds,
            parallel_tool_calls=parallel_tool_calls,
            model=model,
            **sampling,
        )
        return AsyncAgentRun(self._server_stream(self.agent_stub.RunAgent, req, timeout, metadata))

    async def list_tools(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> list[ToolInfo]:
        """The tools an agent run of this caller may use, by name."""
        resp: apb.ListToolsResponse = await self._unary(
            self.agent_stub.ListTools, apb.ListToolsRequest(), timeout, metadata
        )
        return [ToolInfo.from_proto(t) for t in resp.tools]

    async def wait_until_ready(self, timeout: float = 120.0, *, interval: float = 0.25) -> Health:
        """Poll ``health()`` until the server is serving, for at most ``timeout`` seconds.

        A server that is starting, loading its model or unreachable counts as
        "not yet"; after ``timeout`` the last such failure is raised. Other
        errors (say UNAUTHENTICATED from a proxy) are raised at once.
        """
        deadline = monotonic() + timeout
        last: ProtoserveError | None = None
        while True:
            try:
                health = await self.health(timeout=probe_timeout(deadline - monotonic()))
                if health.serving:
                    return health
            except ProtoserveError as e:
                if e.code not in NOT_READY_CODES:
                    raise
                last = e
            if monotonic() + interval >= deadline:
                raise not_ready(timeout, last)
            await sleep(interval)
