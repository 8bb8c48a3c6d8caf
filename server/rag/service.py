"""RagService: the caller's documents indexed, searched and answered from, over the RagStore.

The owner of everything is the authenticated caller's identity (``Identity.id``), never a field of
the request. Work that takes time runs off the event loop: chunking on a worker thread, embedding on
the embedding worker's thread, SQLite and FAISS on worker threads (the store is thread-safe).
Retrieve-and-generate puts the best chunks into the system message and generates through the same
in-flight path as every other request (cancel, deadline, disconnect, usage, rate limits).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc

from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import ContextPolicy
from protoserve.server import errors
from protoserve.server.calls.admission import AdmittingServicer
from protoserve.server.limits import (
    MAX_DOCUMENT_BYTES,
    MAX_DOCUMENT_ID_CHARS,
    MAX_INDEX_DOCUMENTS,
    MAX_METADATA_CHARS,
    MAX_METADATA_ENTRIES,
    MAX_PAGE_SIZE,
    MAX_RAG_CONTEXT_CHUNKS,
    MAX_SEARCH_TOP_K,
)
from protoserve.server.models.served_model import (
    FINISH_REASONS,
    ChatTurn,
    CollectedOutput,
    ServedModel,
    new_request_id,
)
from protoserve.server.security.auth import Identity
from protoserve.server.services.embeddings import Retrieval, ServedEmbedder
from protoserve.server.services.inference_service import call_deadline
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import rag_pb2 as rpb
from protoserve.v1 import rag_pb2_grpc

if TYPE_CHECKING:
    from protoserve.server.rag.store import ChunkHit as StoredHit
    from protoserve.server.rag.store import RagStore

DEFAULT_CHUNK_TOKENS = 256
DEFAULT_OVERLAP_TOKENS = 32
MIN_CHUNK_TOKENS = 16
DEFAULT_SEARCH_TOP_K = 5
DEFAULT_CONTEXT_CHUNKS = 4
DEFAULT_PAGE_SIZE = 50
DEFAULT_SYSTEM_PROMPT = (
    "Answer the question using only the sources below. Cite the sources you use as [n].\n\n"
    "Sources:\n{context}"
)
Violations = list[tuple[str, str]]


def rag_disabled() -> errors.ServiceError:
    return errors.feature_disabled("this server runs without RAG (it needs an embedding model)")


def _metadata_violations(metadata: Mapping[str, str], path: str) -> Violations:
    if len(metadata) > MAX_METADATA_ENTRIES:
        return [(path, f"at most {MAX_METADATA_ENTRIES} entries")]
    if any(len(k) > MAX_METADATA_CHARS or len(v) > MAX_METADATA_CHARS for k, v in metadata.items()):
        return [(path, f"keys and values are at most {MAX_METADATA_CHARS} characters")]
    return []


def _document_id_violations(document_id: str, path: str) -> Violations:
    if not document_id:
        return [(path, "is required")]
    if len(document_id) > MAX_DOCUMENT_ID_CHARS:
        return [(path, f"must be at most {MAX_DOCUMENT_ID_CHARS} characters")]
    return []


def _hit(hit: StoredHit) -> rpb.ChunkHit:
    return rpb.ChunkHit(
        document_id=hit.document_id,
        chunk_index=hit.chunk_index,
        start=hit.start,
        end=hit.end,
        text=hit.text,
        score=hit.score,
        metadata=hit.metadata,
    )


def _info(info: Any) -> rpb.DocumentInfo:
    return rpb.DocumentInfo(
        document_id=info.document_id,
        metadata=info.metadata,
        chunks=info.chunks,
        bytes=info.bytes,
        indexed_at=info.indexed_at,
    )


def context_text(hits: list[StoredHit]) -> str:
    """The numbered sources as the prompt shows them."""
    return "\n\n".join(f"[{n}] (document {hit.document_id}) {hit.text}" for n, hit in enumerate(hits, 1))


@dataclasses.dataclass
class _Answering:
    """A checked RetrieveAndGenerate request, retrieved and ready to generate."""

    served: ServedModel
    request: TokenizedRequest
    citations: list[rpb.Citation]


class RagService(AdmittingServicer, rag_pb2_grpc.RagServiceServicer):
    """Index, search, list, get, delete and retrieve-and-generate over the caller's own documents."""

    def __init__(self, *services: Any, retrieval: Retrieval) -> None:
        super().__init__(*services)
        self.retrieval = retrieval

    def _parts(self) -> tuple[ServedEmbedder, RagStore]:
        embedder, store = self.retrieval.embedder, self.retrieval.store
        if embedder is None or store is None:
            raise rag_disabled()
        return embedder, store

    def _enter(self, context: grpc.aio.ServicerContext) -> tuple[Identity, ServedEmbedder, RagStore]:
        identity = self._admit(context)
        return (identity, *self._parts())

    # ---- documents --------------------------------------------------------------------

    @errors.reports_errors
    async def IndexDocuments(self, request: rpb.IndexDocumentsRequest, context: grpc.aio.ServicerContext):
        """Chunk, embed and store the documents; returns once they are durable."""
        # Imported here: the store pulls in faiss, and the server answers health checks before it loads.
        from protoserve.server.rag.store import ChunkInput, DocumentInput, QuotaExceeded

        identity, embedder, store = self._enter(context)
        violations = self._document_violations(request)
        chunk_tokens, overlap = self._chunking(request.chunking, embedder, violations)
        if violations:
            raise errors.invalid_argument(violations)
        model = embedder.model
        chunked = await asyncio.to_thread(
            lambda: [model.chunk(d.text, chunk_tokens, overlap) for d in request.documents]
        )
        empty = [
            (f"documents[{i}].text", "holds no tokens") for i, chunks in enumerate(chunked) if not chunks
        ]
        if empty:
            raise errors.invalid_argument(empty)
        texts = [c.text for chunks in chunked for c in chunks]
        vectors = await embedder.worker.embed_texts(texts)
        documents, at = [], 0
        for document, chunks in zip(request.documents, chunked, strict=True):
            inputs = [ChunkInput(c.start, c.end, c.text, vectors[at + j]) for j, c in enumerate(chunks)]
            at += len(chunks)
            documents.append(
                DocumentInput(document.document_id, document.text, dict(document.metadata), inputs)
            )
        try:
            indexed = await asyncio.to_thread(store.index, identity.id, documents)
        except QuotaExceeded as exc:
            raise errors.quota_exceeded(str(exc)) from None
        tokens = {
            d.document_id: sum(c.tokens for c in chunks)
            for d, chunks in zip(request.documents, chunked, strict=True)
        }
        return rpb.IndexDocumentsResponse(
            documents=[
                rpb.IndexedDocument(
                    document_id=d.document_id,
                    chunks=d.chunks,
                    tokens=tokens[d.document_id],
                    replaced=d.replaced,
                )
                for d in indexed
            ]
        )

    @staticmethod
    def _document_violations(request: rpb.IndexDocumentsRequest) -> Violations:
        if not request.documents:
            return [("documents", "must hold at least one document")]
        if len(request.documents) > MAX_INDEX_DOCUMENTS:
            return [("documents", f"at most {MAX_INDEX_DOCUMENTS} documents per call")]
        violations: Violations = []
        seen: set[str] = set()
        for i, document in enumerate(request.documents):
            path = f"documents[{i}]"
            violations += _document_id_violations(document.document_id, f"{path}.document_id")
            if document.document_id in seen:
                violations.append((f"{path}.document_id", "appears twice in this call"))
            seen.add(document.document_id)
            if not document.text.strip():
                violations.append((f"{path}.text", "must not be empty"))
            elif (
                len(document.text) > MAX_DOCUMENT_BYTES
                or errors.utf8_size(document.text) > MAX_DOCUMENT_BYTES
            ):
                violations.append((f"{path}.text", f"must be at most {MAX_DOCUMENT_BYTES} bytes"))
            violations += _metadata_violations(document.metadata, f"{path}.metadata")
        return violations

    @staticmethod
    def _chunking(
        options: rpb.ChunkingOptions, embedder: ServedEmbedder, violations: Violations
    ) -> tuple[int, int]:
        size = (
            options.chunk_tokens
            if options.HasField("chunk_tokens")
            else min(DEFAULT_CHUNK_TOKENS, embedder.max_tokens)
        )
        overlap = options.overlap_tokens if options.HasField("overlap_tokens") else DEFAULT_OVERLAP_TOKENS
        if not MIN_CHUNK_TOKENS <= size <= embedder.max_tokens:
            violations.append(
                ("chunking.chunk_tokens", f"must be in [{MIN_CHUNK_TOKENS}, {embedder.max_tokens}]")
            )
        elif not 0 <= overlap < size - 2:
            # A chunk's own text is at most size - 2 tokens: the model adds [CLS] and [SEP].
            violations.append(("chunking.overlap_tokens", f"must be in [0, {size - 3}]"))
        return size, overlap

    @errors.reports_errors
    async def SearchDocuments(self, request: rpb.SearchDocumentsRequest, context: grpc.aio.ServicerContext):
        """The caller's chunks closest to the query."""
        identity, embedder, store = self._enter(context)
        top_k = request.top_k if request.HasField("top_k") else DEFAULT_SEARCH_TOP_K
        hits, tokens = await self._search(
            identity,
            embedder,
            store,
            request.query,
            top_k,
            MAX_SEARCH_TOP_K,
            request.filter,
            request.min_score if request.HasField("min_score") else None,
        )
        return rpb.SearchDocumentsResponse(
            chunks=[_hit(h) for h in hits], usage=pb.Usage(prompt_tokens=tokens, total_tokens=tokens)
        )

    async def _search(
        self,
        identity: Identity,
        embedder: ServedEmbedder,
        store: RagStore,
        query: str,
        top_k: int,
        max_top_k: int,
        filter: Mapping[str, str],
        min_score: float | None,
        prefix: str = "",
    ) -> tuple[list[StoredHit], int]:
        violations: Violations = []
        if not query.strip():
            violations.append((f"{prefix}query", "must not be empty"))
        if not 1 <= top_k <= max_top_k:
            violations.append((f"{prefix}top_k", f"must be in [1, {max_top_k}]"))
        if min_score is not None and not -1.0 <= min_score <= 1.0:
            violations.append((f"{prefix}min_score", "must be in [-1, 1]"))
        violations += _metadata_violations(filter, f"{prefix}filter")
        if violations:
            raise errors.invalid_argument(violations)
        embedded = await embedder.embed_texts([query], f"{prefix}query")
        hits = await asyncio.to_thread(
            store.search, identity.id, embedded.vectors[0], top_k, dict(filter) or None, min_score
        )
        return hits, embedded.total_tokens

    @errors.reports_errors
    async def ListDocuments(self, request: rpb.ListDocumentsRequest, context: grpc.aio.ServicerContext):
        """A page of the caller's documents, oldest first."""
        identity, _, store = self._enter(context)
        size = request.page_size if request.HasField("page_size") else DEFAULT_PAGE_SIZE
        if not 1 <= size <= MAX_PAGE_SIZE:
            raise errors.invalid_argument([("page_size", f"must be in [1, {MAX_PAGE_SIZE}]")])
        try:
            infos, token = await asyncio.to_thread(
                store.list_documents, identity.id, size, request.page_token
            )
        except ValueError:
            raise errors.invalid_argument([("page_token", "is not a token this server gave")]) from None
        return rpb.ListDocumentsResponse(documents=[_info(i) for i in infos], next_page_token=token)

    @errors.reports_errors
    async def GetDocument(self, request: rpb.GetDocumentRequest, context: grpc.aio.ServicerContext):
        """One of the caller's documents, its text and its chunks."""
        identity, _, store = self._enter(context)
        violations = _document_id_violations(request.document_id, "document_id")
        if violations:
            raise errors.invalid_argument(violations)
        found = await asyncio.to_thread(store.get_document, identity.id, request.document_id)
        if found is None:
            raise errors.document_not_found(request.document_id)
        info, text, chunks = found
        return rpb.GetDocumentResponse(document=_info(info), text=text, chunks=[_hit(c) for c in chunks])

    @errors.reports_errors
    async def DeleteDocuments(self, request: rpb.DeleteDocumentsRequest, context: grpc.aio.ServicerContext):
        """Remove the caller's documents by id."""
        identity, _, store = self._enter(context)
        if not request.document_ids:
            raise errors.invalid_argument([("document_ids", "must name at least one document")])
        if len(request.document_ids) > MAX_INDEX_DOCUMENTS:
            raise errors.invalid_argument([("document_ids", f"at most {MAX_INDEX_DOCUMENTS} ids per call")])
        violations = [
            v
            for i, d in enumerate(request.document_ids)
            for v in _document_id_violations(d, f"document_ids[{i}]")
        ]
        if violations:
            raise errors.invalid_argument(violations)
        deleted, missing = await asyncio.to_thread(
            store.delete_documents, identity.id, list(request.document_ids)
        )
        return rpb.DeleteDocumentsResponse(deleted=deleted, not_found=missing)

    # ---- retrieve and generate ------------------------------------------------------------

    async def _answering(
        self, identity: Identity, request: rpb.RetrieveAndGenerateRequest, request_id: str, *, streaming: bool
    ) -> _Answering:
        embedder, store = self._parts()
        served = self.models.get(request.model)
        violations: Violations = []
        if request.stream and not streaming:
            violations.append(("stream", "true needs the streaming method; this one answers once"))
        params = served.sampling.params(request.sampling, api_defaults={"max_tokens": None})
        if params.n != 1:
            violations.append(("sampling.n", "must be 1: an answer is one text"))
        system = request.system_prompt if request.HasField("system_prompt") else DEFAULT_SYSTEM_PROMPT
        if "{context}" not in system:
            violations.append(("system_prompt", "must contain {context}, where the sources go"))
        served.sampling.check(params, lambda f: f"sampling.{f}", violations)
        await served.check_constraint(params.constraint, lambda f: f"sampling.{f}")
        top_k = request.top_k if request.HasField("top_k") else DEFAULT_CONTEXT_CHUNKS
        hits, _ = await self._search(
            identity,
            embedder,
            store,
            request.query,
            top_k,
            MAX_RAG_CONTEXT_CHUNKS,
            request.filter,
            request.min_score if request.HasField("min_score") else None,
        )
        system_text = system.replace("{context}", context_text(hits) or "(no sources found)")
        policy = ContextPolicy.ALLOW_CONTEXT_STOP
        if served.tokenizer.has_chat_template:
            turns = [ChatTurn("system", system_text), ChatTurn("user", request.query)]
            prompt = await served.chat_ids(turns, path="query", policy=policy)
        else:
            text = f"{system_text}\n\nQuestion: {request.query}\nAnswer:"
            prompt = await served.prompt_ids(text, path="query", policy=policy)
        tokenized = TokenizedRequest(
            request_id=f"{request_id}.0",
            prompt_token_ids=prompt,
            sampling=params,
            context_policy=policy,
            cache_salt=identity.cache_salt,
            sampling_checked=True,
        )
        citations = [rpb.Citation(number=n, chunk=_hit(h)) for n, h in enumerate(hits, 1)]
        return _Answering(served, tokenized, citations)

    @errors.reports_errors
    async def RetrieveAndGenerate(
        self, request: rpb.RetrieveAndGenerateRequest, context: grpc.aio.ServicerContext
    ):
        """Retrieve the question's sources and answer from them."""
        identity = self._admit(context)
        request_id = new_request_id("rag")
        async with self.inflight.call(identity, request_id, call_deadline(context)) as call:
            answering = await self._answering(identity, request, request_id, streaming=False)
            result = CollectedOutput(n=1)
            async for output in self.inflight.generate(call, answering.served.engine, answering.request):
                result.add(output)
        [choice] = result.choices
        return rpb.RetrieveAndGenerateResponse(
            request_id=request_id,
            model=answering.served.name,
            answer=choice.text,
            citations=answering.citations,
            finish_reason=FINISH_REASONS[choice.finish_reason],
            usage=result.usage(),
        )

    @errors.reports_errors
    async def RetrieveAndGenerateStream(
        self, request: rpb.RetrieveAndGenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Citations, then the answer's text as it is generated, then the final event."""
        identity = self._admit(context)
        request_id = new_request_id("rag")
        async with self.inflight.call(identity, request_id, call_deadline(context)) as call:
            answering = await self._answering(identity, request.request, request_id, streaming=True)
            result = CollectedOutput(n=1)
            started = False
            async for output in self.inflight.generate(call, answering.served.engine, answering.request):
                if not started:
                    # After the engine took the request: its refusals stay plain error statuses.
                    started = True
                    await context.write(
                        rpb.RetrieveAndGenerateStreamResponse(
                            request_id=request_id,
                            citations=rpb.RetrieveAndGenerateCitations(citations=answering.citations),
                        )
                    )
                result.add(output)
                for delta in output.deltas:
                    if delta.text:
                        await context.write(
                            rpb.RetrieveAndGenerateStreamResponse(request_id=request_id, text=delta.text)
                        )
        [choice] = result.choices
        await context.write(
            rpb.RetrieveAndGenerateStreamResponse(
                request_id=request_id,
                final=rpb.RetrieveAndGenerateFinal(
                    model=answering.served.name,
                    finish_reason=FINISH_REASONS[choice.finish_reason],
                    usage=result.usage(),
                ),
            )
        )
