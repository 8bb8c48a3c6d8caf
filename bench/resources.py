"""What a measurement needs loaded: an engine model variant, the transformers model, or a server.

Only one resource is alive at a time. On a 2-core machine anything else
resident and busy (a server's threads, a second model being touched) would
steal time from the path being measured, so the runner loads a resource, runs
every step that needs it, and releases it before the next one.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Variant:
    """Model numerics: activation dtype, weight quantization and K/V storage (as ``--dtype`` /
    ``--quantization`` / ``--kv-cache-dtype``)."""

    dtype: str = "float32"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"

    @property
    def label(self) -> str:
        """'fp32', 'bf16', 'int8' (float32 activations around int8 weights), 'bf16-int4', 'int4-kvbf16', ...

        K/V storage is named when it differs from the activation dtype, as the engine resolves
        it (``auto`` under quantized weights is bfloat16).
        """
        import torch

        from protoserve.engine.execution.model_runner import resolve_kv_dtype

        dtype = DTYPE_LABELS.get(self.dtype, self.dtype)
        if self.quantization == "none":
            label = dtype
        else:
            label = self.quantization if self.dtype == "float32" else f"{dtype}-{self.quantization}"
        kv = str(resolve_kv_dtype(self.kv_cache_dtype, getattr(torch, self.dtype), self.quantization))
        kv = kv.removeprefix("torch.")
        if kv != self.dtype:
            label += f"-kv{DTYPE_LABELS.get(kv, kv)}"
        return label


DEFAULT_VARIANT = Variant()


@dataclass(frozen=True)
class EngineModel:
    """The protoserve model (LoadedModel) of one variant, for engine-direct runs in this process."""

    variant: Variant = DEFAULT_VARIANT

    order = 0

    def describe(self) -> str:
        return f"engine model {self.variant.label}"


@dataclass(frozen=True)
class TransformersModel:
    """The transformers model loaded from the same GGUF."""

    order = 1

    def describe(self) -> str:
        return "transformers model"


@dataclass(frozen=True)
class Server:
    """A ``protoserve serve`` subprocess of one variant."""

    variant: Variant = DEFAULT_VARIANT

    order = 2

    def describe(self) -> str:
        return f"protoserve server {self.variant.label}"


ResourceKey = EngineModel | TransformersModel | Server


def load_engine_model(variant: Variant) -> Any:
    """The protoserve model (LoadedModel) of ``variant``, in this process."""
    from protoserve.engine.loader.load import load_model

    return load_model(None, dtype=variant.dtype, quantization=variant.quantization, progress=False)


def acquire(key: ResourceKey, results_dir: Path, threads: int) -> Any:
    """Load or start the resource; raises when it cannot be had (the runner reports that)."""
    if isinstance(key, EngineModel):
        return load_engine_model(key.variant)
    if isinstance(key, TransformersModel):
        from bench.transformers_baseline import TransformersBaseline
        from protoserve.engine.loader.default_model import default_model_path

        return TransformersBaseline(default_model_path())
    from bench.server_process import ServerProcess

    log_path = results_dir / f"server-{key.variant.label}.log"
    return ServerProcess.start(log_path, key.variant, threads)


def release(key: ResourceKey, resource: Any) -> None:
    """Stop a server; models go when the caller drops its last reference (see ``collect``)."""
    if isinstance(key, Server) and resource is not None:
        resource.stop()


def collect() -> None:
    """Free dropped models now, so two never sit in memory together."""
    gc.collect()
