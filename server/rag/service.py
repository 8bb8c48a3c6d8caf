"""RagService: the caller's documents indexed, searched and answered from, over the RagStore.

The owner of everything is the authenticated caller's identity (``Identity.id``), never a field of
the request. Work that takes time runs off the event loop: chunking and embedding on the embedding
worker's thread, in small units shared fairly between callers (engine.embedding.worker), SQLite and
FAISS on worker threads (the store is thread-safe). A caller that goes away (cancel, deadline, a
closed HTTP connection) stops its chunking and embedding after the running unit, and nothing of its
call is stored: the store writes a call's documents in one transaction, after all are embedded.

Everything is sized before it is paid for. Index, search and retrieve-and-generate are metered like
embeddings (server.services.embeddings.EmbeddingMeter): a request of the caller's rpm first, then,
once the chunks (or the query) are counted, their tokens from its tpm, before the model runs. An
index call's chunks are capped per document (MAX_DOCUMENT_CHUNKS) as they are planned, and its
stored size (records.stored_size) is checked against the owner's and its API key's quotas before
anything is embedded. Retrieve-and-generate puts the best chunks into the system message, sized
(placeholders times the sources) before it is built, and generates through the same in-flight path
as every other request (cancel, deadline, disconnect, usage, rate limits).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc

from protoserve.engine.api import ContextPolicy, TokenizedRequest, TooManyChunks
from protoserve.server import errors
from protoserve.server.calls.admission import Admission, AdmittingServicer
from protoserve.server.limits import (
    MAX_DOCUMENT_BYTES,
    MAX_DOCUMENT_CHUNKS,
    MAX_DOCUMENT_ID_CHARS,
    MAX_INDEX_DOCUMENTS,
    MAX_METADATA_CHARS,
    MAX_METADATA_ENTRIES,
    MAX_OVERLAP_PERCENT,
    MAX_PAGE_SIZE,
    MAX_PROMPT_BYTES,
    MAX_RAG_CONTEXT_CHUNKS,
    MAX_SEARCH_TOP_K,
)
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.models.output_conversion import FINISH_REASONS
from protoserve.server.models.served_model import CollectedOutput, ServedModel, new_request_id
from protoserve.server.rag.records import DocumentSize, Quotas, stored_size
from protoserve.server.security.auth import Identity
from protoserve.server.services.embeddings import EmbeddingMeter, Retrieval, ServedEmbedder
from protoserve.server.services.inference_service import call_deadline
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import rag_pb2 as rpb
from protoserve.v1 import rag_pb2_grpc

if TYPE_CHECKING:
    from protoserve.engine.api import TextChunk
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
CONTEXT_PLACEHOLDER = "{context}"
NO_SOURCES = "(no sources found)"
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


def _source(n: int, hit: StoredHit) -> str:
    return f"[{n}] (document {hit.document_id}) {hit.text}"


def context_text(hits: list[StoredHit]) -> str:
    """The numbered sources as the prompt shows them (NO_SOURCES when there are none)."""
    return "\n\n".join(_source(n, hit) for n, hit in enumerate(hits, 1)) or NO_SOURCES


def context_size(hits: list[StoredHit]) -> int:
    """UTF-8 bytes of ``context_text(hits)``, counted without building it."""
    if not hits:
        return len(NO_SOURCES)
    return 2 * (len(hits) - 1) + sum(
        len(f"[{n}] (document ) ") + errors.utf8_size(hit.document_id) + errors.utf8_size(hit.text)
        for n, hit in enumerate(hits, 1)
    )


@dataclasses.dataclass
class _Answering:
    """A checked RetrieveAndGenerate request, retrieved and ready to generate."""

    served: ServedModel
    request: TokenizedRequest
    citations: list[rpb.Citation]


class RagService(AdmittingServicer, rag_pb2_grpc.RagServiceServicer):
    """Index, search, list, get, delete and retrieve-and-generate over the caller's own documents."""

    def __init__(self, admission: Admission, *, retrieval: Retrieval) -> None:
        super().__init__(admission)
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
        meter = embedder.meter(self.inflight, identity)
        meter.admit()
        violations = self._document_violations(request)
        chunk_tokens, overlap = self._chunking(request.chunking, embedder, violations)
        if violations:
            raise errors.invalid_argument(violations)
        try:
            chunked = await self._chunked(request, embedder, identity, chunk_tokens, overlap)
            key, key_quotas = identity.quota_id, self._key_quotas(identity, store)
            sizes = [
                DocumentSize(
                    d.document_id,
                    stored_size(d.text, dict(d.metadata), [c.text for c in chunks], embedder.dimensions),
                )
                for d, chunks in zip(request.documents, chunked, strict=True)
            ]
            try:
                # Refused now rather than after embedding; the store checks again as it writes.
                await asyncio.to_thread(store.check_quotas, identity.id, sizes, key, key_quotas)
            except QuotaExceeded as exc:
                raise errors.quota_exceeded(str(exc)) from None
            texts = [c.text for chunks in chunked for c in chunks]
            meter.charge(sum(c.tokens for chunks in chunked for c in chunks))
            vectors = await embedder.worker.embed_texts(texts, identity.id)
        finally:
            meter.record()
        documents, at = [], 0
        for document, chunks in zip(request.documents, chunked, strict=True):
            inputs = [ChunkInput(c.start, c.end, c.text, vectors[at + j]) for j, c in enumerate(chunks)]
            at += len(chunks)
            documents.append(
                DocumentInput(document.document_id, document.text, dict(document.metadata), inputs)
            )
        try:
            indexed = await asyncio.to_thread(store.index, identity.id, documents, key, key_quotas)
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
    async def _chunked(
        request: rpb.IndexDocumentsRequest,
        embedder: ServedEmbedder,
        identity: Identity,
        chunk_tokens: int,
        overlap: int,
    ) -> list[list[TextChunk]]:
        """Each document's chunks, planned on the embedding worker a slice at a time; INVALID_ARGUMENT
        on ``documents[i].text`` for one that makes no chunk or more than MAX_DOCUMENT_CHUNKS."""
        chunked, empty = [], []
        for i, document in enumerate(request.documents):
            try:
                chunks = await embedder.worker.chunk(
                    document.text, chunk_tokens, overlap, MAX_DOCUMENT_CHUNKS, identity.id
                )
            except TooManyChunks:
                raise errors.invalid_argument(
                    [
                        (
                            f"documents[{i}].text",
                            f"makes more than {MAX_DOCUMENT_CHUNKS} chunks of {chunk_tokens} tokens overlapping "
                            f"by {overlap}; split the document, or raise chunking.chunk_tokens",
                        )
                    ]
                ) from None
            if not chunks:
                empty.append((f"documents[{i}].text", "holds no tokens"))
            chunked.append(chunks)
        if empty:
            raise errors.invalid_argument(empty)
        return chunked

    def _key_quotas(self, identity: Identity, store: RagStore) -> Quotas | None:
        """The caller's API key's own RAG quotas from the rate-limits file; None: the store's."""
        limiter = self.inflight.limiter
        if limiter is None:
            return None
        limits = limiter.limits(identity)
        if limits.rag_max_documents is None and limits.rag_max_bytes is None:
            return None
        default = store.key_quotas
        return Quotas(
            default.max_documents if limits.rag_max_documents is None else limits.rag_max_documents,
            default.max_bytes if limits.rag_max_bytes is None else limits.rag_max_bytes,
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
        # Past this share every token is embedded and stored several times over; it also stays under
        # a chunk's own text (size - 2 tokens: the model adds [CLS] and [SEP]) for any allowed size.
        most = size * MAX_OVERLAP_PERCENT // 100
        overlap = (
            options.overlap_tokens
            if options.HasField("overlap_tokens")
            else min(DEFAULT_OVERLAP_TOKENS, most)
        )
        if not MIN_CHUNK_TOKENS <= size <= embedder.max_tokens:
            violations.append(
                ("chunking.chunk_tokens", f"must be in [{MIN_CHUNK_TOKENS}, {embedder.max_tokens}]")
            )
        elif not 0 <= overlap <= most:
            violations.append(
                (
                    "chunking.overlap_tokens",
                    f"must be in [0, {most}]: at most {MAX_OVERLAP_PERCENT}% of chunk_tokens ({size})",
                )
            )
        return size, overlap

    @errors.reports_errors
    async def SearchDocuments(self, request: rpb.SearchDocumentsRequest, context: grpc.aio.ServicerContext):
        """The caller's chunks closest to the query."""
        identity, embedder, store = self._enter(context)
        meter = embedder.meter(self.inflight, identity)
        meter.admit()
        top_k = request.top_k if request.HasField("top_k") else DEFAULT_SEARCH_TOP_K
        try:
            hits, tokens = await self._search(
                identity,
                embedder,
                store,
                meter,
                request.query,
                top_k,
                MAX_SEARCH_TOP_K,
                request.filter,
                request.min_score if request.HasField("min_score") else None,
            )
        finally:
            meter.record()
        return rpb.SearchDocumentsResponse(
            chunks=[_hit(h) for h in hits], usage=pb.Usage(prompt_tokens=tokens, total_tokens=tokens)
        )

    async def _search(
        self,
        identity: Identity,
        embedder: ServedEmbedder,
        store: RagStore,
        meter: EmbeddingMeter,
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
        embedded = await embedder.embed_texts(
            [query], f"{prefix}query", tenant=identity.id, charge=meter.charge
        )
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
        system_bytes = errors.utf8_size(system)
        if system_bytes > MAX_PROMPT_BYTES:
            violations.append(("system_prompt", f"must be at most {MAX_PROMPT_BYTES} bytes"))
        elif CONTEXT_PLACEHOLDER not in system:
            violations.append(("system_prompt", "must contain {context}, where the sources go"))
        served.sampling.check(params, lambda f: f"sampling.{f}", violations)
        constraint_field = await served.check_constraint(params.constraint, lambda f: f"sampling.{f}")
        top_k = request.top_k if request.HasField("top_k") else DEFAULT_CONTEXT_CHUNKS
        meter = embedder.meter(self.inflight, identity, request=False)  # the call took its request
        try:
            hits, _ = await self._search(
                identity,
                embedder,
                store,
                meter,
                request.query,
                top_k,
                MAX_RAG_CONTEXT_CHUNKS,
                request.filter,
                request.min_score if request.HasField("min_score") else None,
            )
        finally:
            meter.record()
        self._check_expansion(system, system_bytes, hits)
        # Retrieved documents are others' text: their special-token strings stay text, whatever the
        # server parses in the caller's own messages (engine/tokenizer/special_text.py).
        protect = served.tokenizer.protect_special
        system_text = system.replace(CONTEXT_PLACEHOLDER, protect(context_text(hits)))
        policy = ContextPolicy.ALLOW_CONTEXT_STOP
        if served.tokenizer.has_chat_template:
            turns = [ChatTurn("system", system_text), ChatTurn("user", request.query)]
            prompt = await served.chat_ids(turns, path="query", policy=policy)
        else:
            query = request.query if served.parse_special_in_messages else protect(request.query)
            text = f"{system_text}\n\nQuestion: {query}\nAnswer:"
            prompt = await served.prompt_ids(text, path="query", policy=policy)
        tokenized = TokenizedRequest(
            request_id=f"{request_id}.0",
            prompt_token_ids=prompt,
            sampling=params,
            context_policy=policy,
            cache_salt=identity.cache_salt,
            sampling_checked=True,
            constraint_field=constraint_field,
        )
        citations = [rpb.Citation(number=n, chunk=_hit(h)) for n, h in enumerate(hits, 1)]
        return _Answering(served, tokenized, citations)

    @staticmethod
    def _check_expansion(system: str, system_bytes: int, hits: list[StoredHit]) -> None:
        """INVALID_ARGUMENT if the system message, every {context} replaced by the sources, would pass
        MAX_PROMPT_BYTES; sized from the placeholders and the sources, before anything is built."""
        sources = context_size(hits)
        if sources > MAX_PROMPT_BYTES:
            raise errors.invalid_argument(
                [("top_k", f"the {len(hits)} best chunks hold {sources} bytes, more than {MAX_PROMPT_BYTES}")]
            )
        placeholders = system.count(CONTEXT_PLACEHOLDER)
        expanded = system_bytes + placeholders * (sources - len(CONTEXT_PLACEHOLDER))
        if expanded > MAX_PROMPT_BYTES:
            raise errors.invalid_argument(
                [
                    (
                        "system_prompt",
                        f"its {placeholders} {{context}} placeholders, each replaced by the {sources} bytes "
                        f"of sources, make {expanded} bytes, more than {MAX_PROMPT_BYTES}",
                    )
                ]
            )

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
