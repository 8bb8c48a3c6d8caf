"""One owner's FAISS index: exact inner product ("flat") or HNSW, keyed by SQLite chunk ids.

Each owner gets its own index, so a search can only ever return that owner's chunks. Ids are the
chunks' SQLite row ids (AUTOINCREMENT, never reused), added in increasing order.

"flat" removes deleted ids at once and every search is exact. HNSW cannot remove vectors, so deleted
ids become tombstones that searches exclude with an ID selector; once tombstones pass
``REBUILD_DEAD_SHARE`` of the index it is rebuilt from its own stored vectors (HNSWFlat keeps them
in full). A search restricted to candidate ids (a metadata filter) is exact for both kinds: flat
searches with an ID selector, HNSW scans its flat storage with one.
"""

from __future__ import annotations

import logging

# FAISS's loader logs every CPU variant it tries at INFO, tracebacks' text included: noise in the
# server's log for what is a normal fallback.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)

import faiss  # noqa: E402
import numpy as np  # noqa: E402

INDEX_KINDS = ("flat", "hnsw")
HNSW_NEIGHBOURS = 32
# Above FAISS's defaults (40 / 16). Measured on 20k all-MiniLM-L6-v2 embeddings of short texts:
# recall@10 0.996 at efSearch 64, 0.999 at 128. Uniformly random vectors, which no embedding model
# produces, are HNSW's worst case (0.65 at 10k, 0.15 at 100k).
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 64
# Tombstones cost search time and memory; past this share the index is rebuilt without them.
REBUILD_DEAD_SHARE = 0.25

_NO_HITS = (np.empty(0, dtype=np.float32), np.empty(0, dtype=np.int64))


def _new_index(kind: str, dimensions: int) -> faiss.IndexIDMap2:
    if kind == "flat":
        inner = faiss.IndexFlatIP(dimensions)
    elif kind == "hnsw":
        inner = faiss.IndexHNSWFlat(dimensions, HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
        inner.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    else:
        raise ValueError(f"index_kind: must be one of {', '.join(INDEX_KINDS)}, got {kind!r}")
    return faiss.IndexIDMap2(inner)  # FAISS's wrapper keeps a reference to ``inner``


def _kind_of(index: faiss.Index) -> str | None:
    inner = faiss.downcast_index(index.index)
    if isinstance(inner, faiss.IndexHNSWFlat) and inner.metric_type == faiss.METRIC_INNER_PRODUCT:
        return "hnsw"
    if isinstance(inner, faiss.IndexFlatIP):
        return "flat"
    return None


class OwnerIndex:
    """The vectors of one owner's live chunks (plus, for HNSW, tombstones of deleted ones)."""

    def __init__(self, kind: str, dimensions: int, index: faiss.IndexIDMap2 | None = None) -> None:
        self.kind = kind
        self.dimensions = dimensions
        self._index = index if index is not None else _new_index(kind, dimensions)
        self._dead: set[int] = set()
        self._id_map: np.ndarray | None = None  # cached copy of internal position -> chunk id

    @classmethod
    def build(cls, kind: str, dimensions: int, ids: np.ndarray, vectors: np.ndarray) -> OwnerIndex:
        owner_index = cls(kind, dimensions)
        owner_index.add(ids, vectors)
        return owner_index

    @classmethod
    def from_bytes(cls, kind: str, dimensions: int, data: np.ndarray, live_ids: np.ndarray) -> OwnerIndex:
        """A serialized index, checked against the owner's live chunk ids; ValueError if it does not match."""
        try:
            index = faiss.deserialize_index(data)
        except RuntimeError as e:
            raise ValueError(f"unreadable FAISS index: {str(e).splitlines()[0]}") from None
        if not isinstance(index, faiss.IndexIDMap2):
            raise ValueError(f"expected an IndexIDMap2, found {type(index).__name__}")
        if index.d != dimensions or _kind_of(index) != kind:
            raise ValueError(
                f"index is {_kind_of(index)} of {index.d} dimensions, not {kind} of {dimensions}"
            )
        owner_index = cls(kind, dimensions, index)
        stored = owner_index._ids()
        if len(np.unique(stored)) != len(stored):
            raise ValueError("index holds an id twice")
        missing = np.setdiff1d(live_ids, stored, assume_unique=True)
        if len(missing):
            raise ValueError(f"index lacks {len(missing)} of the owner's {len(live_ids)} chunks")
        dead = np.setdiff1d(stored, live_ids, assume_unique=True)
        if len(dead) and kind == "flat":
            raise ValueError(f"index holds {len(dead)} chunks that no longer exist")
        owner_index._dead = set(dead.tolist())
        return owner_index

    def to_bytes(self) -> np.ndarray:
        return faiss.serialize_index(self._index)

    @property
    def live_count(self) -> int:
        return self._index.ntotal - len(self._dead)

    @property
    def dead_count(self) -> int:
        return len(self._dead)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if len(ids):
            self._index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ids.astype(np.int64))
            self._id_map = None

    def remove(self, ids: np.ndarray) -> None:
        if not len(ids):
            return
        ids = ids.astype(np.int64)
        if self.kind == "flat":
            removed = self._index.remove_ids(faiss.IDSelectorBatch(ids))
            if removed != len(ids):
                raise RuntimeError(f"removed {removed} of {len(ids)} chunk ids from the index")
            self._id_map = None
            return
        self._dead.update(ids.tolist())
        if self._dead and len(self._dead) > REBUILD_DEAD_SHARE * self._index.ntotal:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the HNSW graph from its stored vectors without the tombstones."""
        stored = self._ids()
        keep = ~np.isin(stored, np.fromiter(self._dead, dtype=np.int64, count=len(self._dead)))
        vectors = self._stored_vectors()[keep]
        self._index = _new_index(self.kind, self.dimensions)
        self._dead = set()
        self._id_map = None
        self.add(stored[keep], vectors)

    def _ids(self) -> np.ndarray:
        if self._id_map is None:
            self._id_map = faiss.vector_to_array(self._index.id_map).astype(np.int64, copy=False)
        return self._id_map

    def _storage(self) -> faiss.IndexFlat:
        return faiss.downcast_index(faiss.downcast_index(self._index.index).storage)

    def _stored_vectors(self) -> np.ndarray:
        codes = faiss.vector_to_array(self._storage().codes)
        return codes.view(np.float32).reshape(-1, self.dimensions)

    def search(
        self, query: np.ndarray, k: int, candidates: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, chunk ids), most similar first; only ``candidates`` (live ids) when given."""
        query = np.ascontiguousarray(query, dtype=np.float32).reshape(1, self.dimensions)
        if candidates is not None:
            return self._search_candidates(query, k, candidates.astype(np.int64))
        k = min(k, self.live_count)
        if k <= 0:
            return _NO_HITS
        if self.kind == "flat":
            scores, ids = self._index.search(query, k)
        else:
            # The candidate list must be well past k for the best k to survive the graph walk.
            params = faiss.SearchParametersHNSW(efSearch=max(HNSW_EF_SEARCH, 2 * k))
            if self._dead:
                dead = faiss.IDSelectorBatch(np.fromiter(self._dead, dtype=np.int64, count=len(self._dead)))
                not_dead = faiss.IDSelectorNot(dead)  # local names keep the selectors alive for the call
                params.sel = not_dead
            scores, ids = self._index.search(query, k, params=params)
        return _found(scores[0], ids[0])

    def _search_candidates(
        self, query: np.ndarray, k: int, candidates: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, len(candidates))
        if k <= 0:
            return _NO_HITS
        if self.kind == "flat":
            selector = faiss.IDSelectorBatch(candidates)
            scores, ids = self._index.search(query, k, params=faiss.SearchParameters(sel=selector))
            return _found(scores[0], ids[0])
        # Exact for HNSW too: scan the flat storage under the graph, restricted to the candidates' positions.
        stored = self._ids()
        positions = np.flatnonzero(np.isin(stored, candidates)).astype(np.int64)
        selector = faiss.IDSelectorBatch(positions)
        scores, found = self._storage().search(query, k, params=faiss.SearchParameters(sel=selector))
        scores, found = _found(scores[0], found[0])
        return scores, stored[found]


def _found(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # FAISS pads with -1 when fewer than k vectors qualify.
    keep = ids >= 0
    return scores[keep], ids[keep]
