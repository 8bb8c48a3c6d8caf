"""Retrieval-augmented generation: each caller's documents, stored, indexed and searched by meaning.

``service`` is the gRPC servicer. ``store.RagStore`` is the storage half: documents and their chunks
with vectors in SQLite (one database per partition, every row tagged with its owner's identity), and
a FAISS index per owner, loaded from a snapshot or rebuilt from SQLite when that is missing, stale or
damaged. ``records`` holds its plain data, ``partition_store`` one partition, ``documents_db`` its
SQLite schema and statements, ``vector_index`` one owner's FAISS index and ``snapshot`` the snapshot
file. The store never embeds: callers pass unit-length float32 vectors.
"""
