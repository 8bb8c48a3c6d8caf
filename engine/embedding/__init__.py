"""Text embeddings for retrieval: a plain-torch BERT encoder behind a sentence-transformers-compatible pipeline.

``model.EmbeddingModel`` loads a sentence-transformers directory (default: the
packaged all-MiniLM-L6-v2), counts tokens, chunks documents by model tokens and
embeds texts or token ids; ``worker.EmbeddingWorker`` runs it on one dedicated
thread for asyncio callers. Nothing here imports ``transformers``, gRPC or protobuf.
"""
