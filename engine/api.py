"""The engine's public types: what a caller builds a request from and what comes back.

Importing this module loads no torch, so the server, the CLI and the bench can name requests,
parameters, configs and errors before (or without) loading a model. Running engines and models
is ``protoserve.engine.runtime``. Code outside ``engine/`` imports the engine through these two
modules only (the bench is held to it by ``tests/bench/test_engine_boundary.py``).
"""

from __future__ import annotations

from protoserve.engine.config import (
    ACTIVATION_PRECISIONS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATION_MODES,
    EngineConfig,
)
from protoserve.engine.embedding.chunking import TextChunk
from protoserve.engine.embedding.default_model import DEFAULT_EMBEDDING_PACKAGE
from protoserve.engine.embedding.errors import EmbeddingInputTooLong, TooManyChunks
from protoserve.engine.errors import (
    AdapterCapacityError,
    AdapterReloadNeededError,
    ConstraintFailedError,
    ContextLengthError,
    EngineError,
    EngineStoppedError,
    InvalidRequestError,
    ModelUnloadedError,
    QueueFullError,
)
from protoserve.engine.execution.omp_policy import prefer_passive_omp_wait
from protoserve.engine.loader.auto_quantization import AUTO
from protoserve.engine.loader.catalogue import (
    CatalogueEntry,
    ModelKind,
    ResolvedModel,
    catalogue,
    installed_bytes,
    resolve_model,
)
from protoserve.engine.loader.default_model import default_model_path
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.request import (
    Choice,
    CompletionDelta,
    FinishReason,
    PositionLogprobs,
    RequestOutput,
    RequestStats,
    Tenant,
    TokenizedRequest,
    TokenLogprob,
)
from protoserve.engine.sampling.constraints.constraint import Constraint, ConstraintKind
from protoserve.engine.sampling.sampling_params import MIROSTAT_REPLACES, ContextPolicy, SamplingParams
from protoserve.engine.speculative.params import SpeculativeParams
from protoserve.engine.tracing import CHAT, TEXT_COMPLETION, RequestTrace

__all__ = [
    "ACTIVATION_PRECISIONS",
    "AUTO",
    "CHAT",
    "DEFAULT_EMBEDDING_PACKAGE",
    "DEVICES",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "MIROSTAT_REPLACES",
    "QUANTIZATION_MODES",
    "TEXT_COMPLETION",
    "AdapterCapacityError",
    "CatalogueEntry",
    "AdapterReloadNeededError",
    "Choice",
    "CompletionDelta",
    "Constraint",
    "ConstraintFailedError",
    "ConstraintKind",
    "ContextLengthError",
    "ContextPolicy",
    "EmbeddingInputTooLong",
    "EngineConfig",
    "EngineError",
    "EngineStoppedError",
    "ModelUnloadedError",
    "FinishReason",
    "InvalidRequestError",
    "ModelConfig",
    "ModelKind",
    "ModelLoadError",
    "PositionLogprobs",
    "QueueFullError",
    "RequestOutput",
    "RequestStats",
    "RequestTrace",
    "ResolvedModel",
    "SamplingParams",
    "SpeculativeParams",
    "Tenant",
    "TextChunk",
    "TokenLogprob",
    "TokenizedRequest",
    "TooManyChunks",
    "catalogue",
    "default_model_path",
    "installed_bytes",
    "prefer_passive_omp_wait",
    "resolve_model",
]
