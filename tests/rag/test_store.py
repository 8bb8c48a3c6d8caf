"""RagStore round trips: exact ranked search, replacement, paging, get, delete, filters, HNSW, bad input."""

from __future__ import annotations

import base64
import hashlib

import numpy as np
import pytest

from protoserve.server.rag.store import (
    ChunkInput,
    DocumentInput,
    IndexedDocument,
    Quotas,
    RagStore,
)
from protoserve.server.rag.vector_index import REBUILD_DEAD_SHARE, OwnerIndex

DIM = 32
OWNER = hashlib.sha256(b"owner").hexdigest()


def unit_vectors(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def document(document_id: str, vectors: np.ndarray, metadata: dict[str, str] | None = None) -> DocumentInput:
    """A document with one word-like chunk per vector: text 'w0 w1 ...', chunk j is 'w<j>'."""
    words = [f"{document_id}-w{j}" for j in range(len(vectors))]
    text = " ".join(words)
    chunks, at = [], 0
    for word, vector in zip(words, vectors, strict=True):
        chunks.append(ChunkInput(at, at + len(word), word, vector))
        at += len(word) + 1
    return DocumentInput(document_id, text, metadata or {}, chunks)


def open_store(tmp_path, kind: str = "flat", **kwargs) -> RagStore:
    kwargs.setdefault("partitions", 2)
    return RagStore(tmp_path / "rag", dimensions=DIM, index_kind=kind, **kwargs)


@pytest.fixture
def corpus():
    """20 documents of 3 chunks; chunk vectors [doc, chunk, dim]."""
    rng = np.random.default_rng(7)
    vectors = unit_vectors(rng, 60).reshape(20, 3, DIM)
    metadata = [{"lang": "en" if i % 2 else "de", "team": "ab"[i % 3 == 0]} for i in range(20)]
    docs = [document(f"doc-{i}", vectors[i], metadata[i]) for i in range(20)]
    return docs, vectors, metadata


def expected_ranking(
    vectors: np.ndarray, query: np.ndarray, keep=lambda i: True
) -> list[tuple[str, int, float]]:
    scores = vectors @ query
    ranked = [(f"doc-{i}", j, float(scores[i, j])) for i in range(len(vectors)) for j in range(3) if keep(i)]
    return sorted(ranked, key=lambda hit: -hit[2])


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_search_ranks_chunks_by_exact_dot_product(tmp_path, corpus, kind):
    docs, vectors, metadata = corpus
    with open_store(tmp_path, kind) as store:
        assert store.index(OWNER, docs) == [IndexedDocument(f"doc-{i}", 3, False) for i in range(20)]
        query = unit_vectors(np.random.default_rng(1), 1)[0]
        hits = store.search(OWNER, query, 10)
        want = expected_ranking(vectors, query)[:10]
        assert [(h.document_id, h.chunk_index) for h in hits] == [(d, j) for d, j, _ in want]
        assert [h.score for h in hits] == pytest.approx([s for _, _, s in want], abs=1e-5)
        first = hits[0]
        i = int(first.document_id.split("-")[1])
        assert first.text == docs[i].text[first.start : first.end] == f"doc-{i}-w{first.chunk_index}"
        assert first.metadata == metadata[i]
        # A chunk's own vector finds it first, scoring 1.
        own = store.search(OWNER, vectors[4, 2], 1)
        assert [(own[0].document_id, own[0].chunk_index)] == [("doc-4", 2)]
        assert own[0].score == pytest.approx(1.0, abs=1e-5)
        # top_k past the owner's chunks returns all of them.
        assert len(store.search(OWNER, query, 500)) == 60


def test_replacing_a_document_swaps_its_chunks_and_moves_it_last(tmp_path, corpus):
    docs, vectors, _ = corpus
    rng = np.random.default_rng(2)
    with open_store(tmp_path) as store:
        store.index(OWNER, docs)
        new_vectors = unit_vectors(rng, 2)
        result = store.index(OWNER, [document("doc-3", new_vectors, {"lang": "fr"})])
        assert result == [IndexedDocument("doc-3", 2, True)]
        info, text, chunks = store.get_document(OWNER, "doc-3")
        assert (info.chunks, info.metadata, len(chunks)) == (2, {"lang": "fr"}, 2)
        assert text == "doc-3-w0 doc-3-w1"
        # The old chunks are gone from the index, the new ones are found.
        for old in vectors[3]:
            hit = store.search(OWNER, old, 1)[0]
            assert hit.score < 0.99 and not (hit.document_id == "doc-3" and hit.chunk_index == 2)
        assert [(h.document_id, h.chunk_index) for h in store.search(OWNER, new_vectors[1], 1)] == [
            ("doc-3", 1)
        ]
        # Its metadata changed too: it was "en", and filters see "fr" now.
        assert "doc-3" not in {
            h.document_id for h in store.search(OWNER, vectors[0, 0], 100, filter={"lang": "en"})
        }
        assert {h.document_id for h in store.search(OWNER, vectors[0, 0], 100, filter={"lang": "fr"})} == {
            "doc-3"
        }
        listed, _ = store.list_documents(OWNER, 100)
        assert [d.document_id for d in listed][-1] == "doc-3"
        assert len(listed) == 20


def test_list_pages_in_index_order_with_opaque_tokens(tmp_path, corpus):
    docs, _, metadata = corpus
    with open_store(tmp_path) as store:
        for doc in docs[:10]:
            store.index(OWNER, [doc])
        store.index(OWNER, docs[10:])
        pages, token = [], ""
        while True:
            page, token = store.list_documents(OWNER, 7, token)
            pages.append(page)
            if not token:
                break
        assert [len(p) for p in pages] == [7, 7, 6]
        listed = [d for page in pages for d in page]
        assert [d.document_id for d in listed] == [f"doc-{i}" for i in range(20)]
        assert [d.metadata for d in listed] == metadata
        assert all(d.chunks == 3 and d.bytes == len(docs[0].text.encode()) for d in listed[:10])
        assert listed == sorted(listed, key=lambda d: d.indexed_at)
        # The same token gives the same page; the order is stable.
        first, token = store.list_documents(OWNER, 7)
        assert store.list_documents(OWNER, 7, token) == store.list_documents(OWNER, 7, token)
        # A page exactly as large as what is left has no next token.
        assert store.list_documents(OWNER, 20)[1] == ""
        assert store.list_documents(OWNER, 19)[1] != ""
        # Deleting the document a token points after does not break the token.
        store.delete_documents(OWNER, [first[-1].document_id])
        page, _ = store.list_documents(OWNER, 3, token)
        assert [d.document_id for d in page] == ["doc-7", "doc-8", "doc-9"]


@pytest.mark.parametrize(
    "token",
    [
        "garbage!",
        "cmFnMTo",  # "rag1:" without a number
        base64.urlsafe_b64encode(b"rag1:-4").decode(),
        base64.urlsafe_b64encode(b"other:4").decode(),
        base64.urlsafe_b64encode(b"rag1:" + b"9" * 40).decode(),
    ],
)
def test_a_bad_page_token_is_a_value_error(tmp_path, corpus, token):
    with open_store(tmp_path) as store:
        store.index(OWNER, corpus[0][:3])
        with pytest.raises(ValueError, match="page_token"):
            store.list_documents(OWNER, 2, token)


def test_get_document_returns_text_and_chunks_in_order(tmp_path, corpus):
    docs, _, metadata = corpus
    with open_store(tmp_path) as store:
        store.index(OWNER, docs)
        info, text, chunks = store.get_document(OWNER, "doc-5")
        assert (info.document_id, info.metadata, info.chunks, info.bytes) == (
            "doc-5",
            metadata[5],
            3,
            len(text),
        )
        assert text == docs[5].text
        assert [(c.chunk_index, c.start, c.end, c.text, c.score) for c in chunks] == [
            (j, c.start, c.end, c.text, 0.0) for j, c in enumerate(docs[5].chunks)
        ]
        assert store.get_document(OWNER, "doc-99") is None


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_deleted_documents_are_never_returned(tmp_path, corpus, kind):
    docs, vectors, _ = corpus
    with open_store(tmp_path, kind) as store:
        store.index(OWNER, docs)
        gone = ["doc-1", "doc-2", "doc-11"]
        assert store.delete_documents(OWNER, ["doc-1", "nope", "doc-2", "doc-1", "doc-11"]) == (
            gone,
            ["nope"],
        )
        assert store.delete_documents(OWNER, gone) == ([], gone)
        for i in (1, 2, 11):
            for vector in vectors[i]:
                hits = store.search(OWNER, vector, 60)
                assert len(hits) == 51
                assert not {h.document_id for h in hits} & set(gone)
            assert store.get_document(OWNER, f"doc-{i}") is None
        assert len(store.search(OWNER, vectors[1, 0], 60, filter={"lang": "en"})) == 24
        assert [d.document_id for d in store.list_documents(OWNER, 100)[0]] == [
            f"doc-{i}" for i in range(20) if i not in (1, 2, 11)
        ]
    # After a restart too (for HNSW, its tombstones come back from the snapshot and SQLite).
    with open_store(tmp_path, kind) as store:
        for vector in vectors[[1, 2, 11]].reshape(-1, DIM):
            hits = store.search(OWNER, vector, 60)
            assert len(hits) == 51 and not {h.document_id for h in hits} & set(gone)


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_filter_and_min_score_are_exact(tmp_path, corpus, kind):
    docs, vectors, metadata = corpus
    query = unit_vectors(np.random.default_rng(3), 1)[0]
    with open_store(tmp_path, kind) as store:
        store.index(OWNER, docs)
        english = store.search(OWNER, query, 8, filter={"lang": "en"})
        want = expected_ranking(vectors, query, lambda i: metadata[i]["lang"] == "en")[:8]
        assert [(h.document_id, h.chunk_index) for h in english] == [(d, j) for d, j, _ in want]
        assert [h.score for h in english] == pytest.approx([s for _, _, s in want], abs=1e-5)
        both = store.search(OWNER, query, 100, filter={"lang": "en", "team": "b"})
        assert {h.document_id for h in both} == {f"doc-{i}" for i in range(20) if i % 2 and i % 3 == 0}
        assert len(both) == 3 * len({h.document_id for h in both})
        assert store.search(OWNER, query, 5, filter={"lang": "xx"}) == []
        assert store.search(OWNER, query, 5, filter={"nokey": "en"}) == []
        assert store.search(OWNER, query, 5, filter={}) == store.search(OWNER, query, 5)

        above = store.search(OWNER, query, 100, min_score=0.1)
        want = [hit for hit in expected_ranking(vectors, query) if hit[2] >= 0.1]
        assert 0 < len(above) < 60
        assert [(h.document_id, h.chunk_index) for h in above] == [(d, j) for d, j, _ in want]
        assert len(store.search(OWNER, query, 2, min_score=0.1)) == 2
        assert store.search(OWNER, query, 10, min_score=1.01) == []
        assert len(store.search(OWNER, query, 100, min_score=-1.0)) == 60
        combined = store.search(OWNER, query, 100, filter={"lang": "de"}, min_score=0.05)
        assert all(h.score >= 0.05 and h.metadata["lang"] == "de" for h in combined)
        assert len(combined) == sum(
            1 for d, j, s in expected_ranking(vectors, query) if s >= 0.05 and int(d[4:]) % 2 == 0
        )


def test_flat_and_hnsw_agree_on_top_hits(tmp_path):
    rng = np.random.default_rng(11)
    dim = 64
    vectors = unit_vectors(rng, 3000, dim).reshape(300, 10, dim)
    docs = [document(f"doc-{i}", vectors[i]) for i in range(300)]
    queries = vectors.reshape(-1, dim)[rng.choice(3000, 40, replace=False)]
    queries = queries + 0.05 * rng.standard_normal(queries.shape).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    results = {}
    for kind in ("flat", "hnsw"):
        with RagStore(tmp_path / kind, partitions=1, dimensions=dim, index_kind=kind) as store:
            store.index(OWNER, docs)
            results[kind] = [
                [(h.document_id, h.chunk_index) for h in store.search(OWNER, q, 10)] for q in queries
            ]
    flat_scores = (queries @ vectors.reshape(-1, dim).T).max(axis=1)
    assert all(r[0] for r in results["flat"])
    top1 = np.mean([f[0] == h[0] for f, h in zip(results["flat"], results["hnsw"], strict=True)])
    recall = np.mean(
        [len(set(f) & set(h)) / 10 for f, h in zip(results["flat"], results["hnsw"], strict=True)]
    )
    assert top1 >= 0.95, top1
    assert recall >= 0.9, recall
    assert (flat_scores > 0.9).all()  # the queries are near a stored chunk


def test_hnsw_tombstones_are_compacted_past_their_share():
    rng = np.random.default_rng(5)
    vectors = unit_vectors(rng, 100)
    index = OwnerIndex.build("hnsw", DIM, np.arange(1, 101, dtype=np.int64), vectors)
    limit = int(REBUILD_DEAD_SHARE * 100)
    index.remove(np.arange(1, limit + 1, dtype=np.int64))
    assert (index.live_count, index.dead_count) == (100 - limit, limit)
    scores, ids = index.search(vectors[0], 100)
    assert len(ids) == 100 - limit and ids.min() > limit
    index.remove(np.array([limit + 1], dtype=np.int64))
    assert (index.live_count, index.dead_count) == (100 - limit - 1, 0)
    scores, ids = index.search(vectors[50], 3)
    assert ids[0] == 51 and scores[0] == pytest.approx(1.0, abs=1e-5)


def test_reopening_with_other_dimensions_or_partitions_is_refused(tmp_path, corpus):
    with open_store(tmp_path) as store:
        store.index(OWNER, corpus[0][:1])
    with pytest.raises(ValueError, match="dimensions"):
        RagStore(tmp_path / "rag", partitions=2, dimensions=DIM * 2)
    with pytest.raises(ValueError, match="partitions"):
        RagStore(tmp_path / "rag", partitions=3, dimensions=DIM)
    with open_store(tmp_path) as store:
        with pytest.raises(RuntimeError, match="has it open"):
            open_store(tmp_path)
        assert store.get_document(OWNER, "doc-0") is not None
    with pytest.raises(RuntimeError, match="closed"):
        store.search(OWNER, corpus[1][0, 0], 1)


def _bad_inputs(corpus):
    docs, vectors, _ = corpus
    good = docs[0]
    chunk = good.chunks[0]

    def with_chunk(**changes):
        fields = {
            "start": chunk.start,
            "end": chunk.end,
            "text": chunk.text,
            "vector": chunk.vector,
        } | changes
        return DocumentInput(good.document_id, good.text, {}, [ChunkInput(**fields)])

    nan = chunk.vector.copy()
    nan[3] = np.nan
    inf = chunk.vector.copy()
    inf[0] = np.inf
    return [
        (
            [with_chunk(vector=np.full(DIM + 1, (DIM + 1) ** -0.5, np.float32))],
            r"chunks\[0\]\.vector: must have shape",
        ),
        ([with_chunk(vector=nan)], "non-finite"),
        ([with_chunk(vector=inf)], "non-finite"),
        ([with_chunk(vector=chunk.vector * 2)], "unit length"),
        ([with_chunk(vector=chunk.vector.astype(np.float64))], "float32"),
        ([with_chunk(vector=list(chunk.vector))], "float32"),
        ([with_chunk(end=len(good.text) + 1)], "offsets"),
        ([with_chunk(start=3, end=2)], "offsets"),
        ([with_chunk(text="other")], r"chunks\[0\]\.text"),
        ([good, docs[1], good], r"documents\[2\]\.document_id: 'doc-0' appears twice"),
        ([DocumentInput("", good.text, {}, [])], r"documents\[0\]\.document_id"),
        ([DocumentInput("x", good.text, {"k": 1}, [])], r"documents\[0\]\.metadata"),
        ([DocumentInput("x", good.text, {}, [chunk.vector])], r"chunks\[0\]: must be a ChunkInput"),
    ]


def test_bad_input_is_refused_before_anything_is_written(tmp_path, corpus):
    vectors = corpus[1]
    with open_store(tmp_path) as store:
        for documents, message in _bad_inputs(corpus):
            with pytest.raises(ValueError, match=message):
                store.index(OWNER, documents)
        assert store.list_documents(OWNER, 10) == ([], "")
        store.index(OWNER, corpus[0][:2])
        query = vectors[0, 0]
        for call, message in [
            (lambda: store.search(OWNER, query[:-1], 3), "vector: must have shape"),
            (lambda: store.search(OWNER, query * np.nan, 3), "non-finite"),
            (lambda: store.search(OWNER, query, 0), "top_k"),
            (lambda: store.search(OWNER, query, 3, min_score=float("nan")), "min_score"),
            (lambda: store.search(OWNER, query, 3, filter={"lang": 1}), "filter"),
            (lambda: store.search("XYZ", query, 3), "owner"),
            (lambda: store.search("", query, 3), "owner"),
            (lambda: store.search("0x1f", query, 3), "owner"),
            (lambda: store.list_documents(OWNER, 0), "page_size"),
            (lambda: store.get_document(OWNER, ""), "document_id"),
            (lambda: store.delete_documents(OWNER, ["a", 3]), r"document_ids\[1\]"),
            (lambda: RagStore.partition_of(OWNER, 0), "partitions"),
        ]:
            with pytest.raises(ValueError, match=message):
                call()
        assert [d.document_id for d in store.list_documents(OWNER, 10)[0]] == ["doc-0", "doc-1"]
    for call, message in [
        (lambda: RagStore(tmp_path / "other", partitions=0, dimensions=DIM), "partitions"),
        (lambda: RagStore(tmp_path / "other", partitions=1, dimensions=0), "dimensions"),
        (lambda: RagStore(tmp_path / "other", partitions=1, dimensions=DIM, index_kind="ivf"), "index_kind"),
        (lambda: Quotas(max_documents=-1), "max_documents"),
        (lambda: Quotas(max_bytes=1.5), "max_bytes"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()


def test_partition_of_follows_the_identity_hex():
    assert RagStore.partition_of("ff", 16) == 15
    assert RagStore.partition_of(OWNER, 7) == int(OWNER, 16) % 7
    assert RagStore.partition_of(OWNER, 1) == 0
