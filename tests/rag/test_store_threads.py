"""Concurrent index, search, list and delete from several threads, across and within partitions."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from protoserve.server.rag.store import ChunkInput, DocumentInput, RagStore

DIM = 16
OWNERS = [hashlib.sha256(f"thread-owner-{n}".encode()).hexdigest() for n in range(4)]
DOCS_PER_WRITER = 25


def vector_of(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def doc(document_id: str, seed: int) -> DocumentInput:
    return DocumentInput(
        document_id,
        document_id,
        {"seed": str(seed)},
        [ChunkInput(0, len(document_id), document_id, vector_of(seed))],
    )


def run_threads(targets) -> None:
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as e:  # surfaced below, with the thread's traceback
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_concurrent_writers_and_readers(tmp_path, kind):
    done = threading.Event()
    writers = 8
    remaining = [writers]
    remaining_lock = threading.Lock()
    with RagStore(tmp_path / "rag", partitions=2, dimensions=DIM, index_kind=kind) as store:

        def writer(w: int):
            # Two writers per owner: concurrent calls for the same owner, and owners sharing a partition.
            owner = OWNERS[w % len(OWNERS)]
            try:
                for i in range(DOCS_PER_WRITER):
                    store.index(owner, [doc(f"w{w}-{i}", 1000 * w + i)])
                    if i % 5 == 4:
                        store.delete_documents(owner, [f"w{w}-{i - 1}"])
            finally:
                with remaining_lock:
                    remaining[0] -= 1
                    if not remaining[0]:
                        done.set()

        def reader(r: int):
            owner = OWNERS[r % len(OWNERS)]
            searches = 0
            while not done.is_set() or not searches:
                for hit in store.search(owner, vector_of(r), 5):
                    # Only this owner's writers' documents, never anyone else's.
                    assert int(hit.document_id[1:].split("-")[0]) % len(OWNERS) == r % len(OWNERS)
                store.list_documents(owner, 10)
                searches += 1

        def snapshotter():
            while not done.is_set():
                store.snapshot()  # the file written while others index and search

        run_threads(
            [lambda w=w: writer(w) for w in range(writers)]
            + [lambda r=r: reader(r) for r in range(3)]
            + [snapshotter]
        )
        store.snapshot()

        for w in range(writers):
            owner = OWNERS[w % len(OWNERS)]
            for i in range(DOCS_PER_WRITER):
                hits = store.search(owner, vector_of(1000 * w + i), 1)
                deleted = i % 5 == 3
                assert (hits[0].document_id == f"w{w}-{i}") != deleted
        for owner in OWNERS:
            assert len(store.list_documents(owner, 1000)[0]) == 2 * (DOCS_PER_WRITER - DOCS_PER_WRITER // 5)
    # What the last snapshot (written by close) holds loads back whole.
    with RagStore(tmp_path / "rag", partitions=2, dimensions=DIM, index_kind=kind) as store:
        for w in range(writers):
            hit = store.search(OWNERS[w % len(OWNERS)], vector_of(1000 * w), 1)[0]
            assert hit.document_id == f"w{w}-0"
