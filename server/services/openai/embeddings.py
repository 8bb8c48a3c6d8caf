"""OpenAI's embeddings (``/v1/embeddings``): a vector per input, as floats or base64 float32s."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from google.protobuf import struct_pb2

from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server import errors
from protoserve.server.calls.inflight import InflightRequests
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.security.auth import Identity
from protoserve.server.services.embeddings import ServedEmbedder, embeddings_disabled
from protoserve.server.services.openai.translation import Violations, as_token_ids, python_value

if TYPE_CHECKING:
    import numpy as np


def embedding_inputs(value: Any, violations: Violations) -> tuple[list[str], list[list[int]] | None]:
    """OpenAI's input forms: a string, strings, token ids, or lists of token ids (texts, or ids)."""
    if isinstance(value, str):
        return [value], None
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value, None
        ids = as_token_ids(value)
        if ids is not None:
            return [], [ids]
        lists = [as_token_ids(item) if isinstance(item, list) else None for item in value]
        if all(item is not None for item in lists):
            return [], lists
    violations.append(("input", "must be a string, a list of strings, token ids or lists of token ids"))
    return [], None


def _option_violations(request: oa.CreateEmbeddingRequest, embedder: ServedEmbedder) -> Violations:
    violations: Violations = []
    if request.encoding_format not in ("", "float", "base64"):
        violations.append(("encoding_format", 'must be "float" or "base64"'))
    if request.HasField("dimensions") and request.dimensions != embedder.dimensions:
        violations.append(
            (
                "dimensions",
                f"model {embedder.name} returns {embedder.dimensions} dimensions and cannot shorten them",
            )
        )
    return violations


def _embedding_value(vector: np.ndarray, encoding_format: str) -> struct_pb2.Value:
    embedding = struct_pb2.Value()
    if encoding_format == "base64":
        embedding.string_value = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    else:
        embedding.list_value.values.extend(struct_pb2.Value(number_value=x) for x in vector.tolist())
    return embedding


class Embeddings:
    """The embeddings surface, on the embedding model ``model`` names (refused when none is loaded)."""

    def __init__(self, inflight: InflightRequests, models: ModelRegistry) -> None:
        self.inflight = inflight
        self.models = models

    async def create(
        self, request: oa.CreateEmbeddingRequest, identity: Identity
    ) -> oa.CreateEmbeddingResponse:
        embedder = self.models.embedder(request.model)
        if embedder is None:
            raise embeddings_disabled()
        meter = embedder.meter(self.inflight, identity)
        meter.admit()  # a request of the caller's rpm; its tokens are charged before the model runs
        violations = _option_violations(request, embedder)
        value = python_value(request.input) if request.HasField("input") else None
        texts, ids = embedding_inputs(value, violations)
        if violations:
            raise errors.invalid_argument(violations)
        path = "input"
        try:
            if ids is not None:
                done = await embedder.embed_token_ids(ids, path, tenant=identity.id, charge=meter.charge)
            else:
                done = await embedder.embed_texts(texts, path, tenant=identity.id, charge=meter.charge)
        finally:
            meter.record()
        data = [
            oa.EmbeddingObject(
                object="embedding", index=i, embedding=_embedding_value(v, request.encoding_format)
            )
            for i, v in enumerate(done.vectors)
        ]
        return oa.CreateEmbeddingResponse(
            object="list",
            data=data,
            model=embedder.name,
            usage=oa.EmbeddingUsage(prompt_tokens=done.total_tokens, total_tokens=done.total_tokens),
        )
