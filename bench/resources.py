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
_model: Path | None = None  # the run's model (``--model``); None: the default SmolLM2 GGUF


def use_model(name_or_path: str | None) -> None:
    """Every resource of this run loads ``name_or_path`` (an installed model's short name or a checkpoint path)."""
    from protoserve.engine.api import ModelLoadError, resolve_model

    global _model
    try:
        _model = None if name_or_path is None else resolve_model(name_or_path).path
    except ModelLoadError as exc:
        raise SystemExit(f"--model {name_or_path}: {exc}") from exc


def model_path() -> Path:
    """The checkpoint this run measures."""
    from protoserve.engine.api import default_model_path

    return default_model_path() if _model is None else _model


def model_args() -> list[str]:
    """The ``protoserve serve`` flags that load this run's model (none for the default)."""
    return [] if _model is None else ["--model", str(_model)]


@dataclass(frozen=True)
class Variant:
    """Model numerics: activation dtype, weight quantization and K/V storage (as ``--dtype`` /
    ``--quantization`` / ``--kv-cache-dtype``), and the servers' ``--activation-precision`` (engine-direct
    runs set theirs with ``Decoder.set_activation_precision``)."""

    dtype: str = "float32"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    activation_precision: str = "exact"

    @property
    def label(self) -> str:
        """'fp32', 'bf16', 'int8' (float32 activations around int8 weights), 'bf16-int4', 'int4-kvbf16', ...

        K/V storage is named when it differs from the activation dtype, as the engine resolves
        it (``auto`` under quantized weights is bfloat16).
        """
        import torch

        from protoserve.engine.runtime import resolve_kv_dtype

        dtype = DTYPE_LABELS.get(self.dtype, self.dtype)
        if self.quantization == "none":
            label = dtype
        else:
            label = self.quantization if self.dtype == "float32" else f"{dtype}-{self.quantization}"
        kv = str(resolve_kv_dtype(self.kv_cache_dtype, getattr(torch, self.dtype), self.quantization))
        kv = kv.removeprefix("torch.")
        if kv != self.dtype:
            label += f"-kv{DTYPE_LABELS.get(kv, kv)}"
        if self.activation_precision != "exact":
            label += f"-{self.activation_precision}"
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
    """A ``protoserve serve`` subprocess of one variant.

    ``speculative`` False serves with ``--speculative-ngram 0``: the figures that set the server beside
    the engine in-process (or llama-bench's engine-level decode) compare the same one-token steps.
    True keeps serve's default speculation, as a user starting ``protoserve serve`` gets it."""

    variant: Variant = DEFAULT_VARIANT
    speculative: bool = False
    # A server set up for one section (its label names it): more flags, more environment.
    label: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    order = 2

    def describe(self) -> str:
        return (f"protoserve server {self.variant.label}" + (" (default speculation)" if self.speculative else "")
                + (f" for {self.label}" if self.label else ""))

    @property
    def log_name(self) -> str:
        """The file its stderr goes to, in the results folder."""
        label = f"-{self.label}" if self.label else ""
        return f"server-{self.variant.label}{'-speculative' if self.speculative else ''}{label}.log"


ResourceKey = EngineModel | TransformersModel | Server


def load_engine_model(variant: Variant) -> Any:
    """The protoserve model (LoadedModel) of ``variant``, in this process."""
    from protoserve.engine.runtime import load_model

    return load_model(_model, dtype=variant.dtype, quantization=variant.quantization, progress=False)


def acquire(key: ResourceKey, results_dir: Path, threads: int) -> Any:
    """Load or start the resource; raises when it cannot be had (the runner reports that)."""
    if isinstance(key, EngineModel):
        return load_engine_model(key.variant)
    if isinstance(key, TransformersModel):
        from bench.transformers_baseline import TransformersBaseline

        return TransformersBaseline(model_path())
    from bench.server_process import ServerProcess

    return ServerProcess.start(results_dir / key.log_name, key.variant, threads, speculative=key.speculative,
                               extra_args=key.args, env=dict(key.env))


def release(key: ResourceKey, resource: Any) -> None:
    """Stop a server; models go when the caller drops its last reference (see ``collect``)."""
    if isinstance(key, Server) and resource is not None:
        resource.stop()


def collect() -> None:
    """Free dropped models now, so two never sit in memory together."""
    gc.collect()
