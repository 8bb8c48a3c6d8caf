"""ModelLifecycle: generative models loaded, unloaded and evicted while the server serves.

Loading happens at start (``--model``) and at run time (ModelService.LoadModel); either way the
checkpoint loads in a worker thread onto an engine of its own, so health and the other models keep
answering. At run time the model's footprint (engine/loader/footprint.py: its weights as served and
its KV pool) is held against the memory budget before any weight is read; models given at start
are recorded at what they took.

Unloading stops routing to the model first (requests naming it are NOT_FOUND from then on), gives
the requests under way a grace period, ends the rest with ModelUnloadedError, then frees the engine.

Idle eviction (``--model-idle-timeout``) frees an idle model's weights and KV pool and leaves it
served: its next request loads it again and waits for it (engine/async_engine.py). Its budget share
stays held, so the reload never fails for memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc

from protoserve.engine.api import EngineConfig
from protoserve.server import errors
from protoserve.server.models.model_registry import ModelRegistry, wrong_kind
from protoserve.server.models.model_spec import ModelSpec
from protoserve.server.models.served_model import ModelCard, ServedModel
from protoserve.server.observability.metrics import ServerMetrics
from protoserve.server.runtime.memory_budget import MemoryBudget
from protoserve.v1 import inference_pb2

if TYPE_CHECKING:
    from protoserve.engine.runtime import AsyncEngine

log = logging.getLogger(__name__)

# How often the idle check runs, as a share of the idle timeout (and at most this many seconds apart).
IDLE_CHECKS_PER_TIMEOUT = 4
MAX_IDLE_CHECK_S = 5.0

# Serves a started engine under its name and aliases (ServerApp.attach_engine).
Attach = Callable[["AsyncEngine", ModelCard, tuple[str, ...]], Awaitable[None]]


class NameTakenError(ValueError):
    """A name of the model being loaded is served already."""


@dataclass(frozen=True)
class LoadSettings:
    """How every generative model of this server loads (``serve``'s flags)."""

    dtype: str
    quantization: str
    engine: EngineConfig
    progress: bool
    loras: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0


@dataclass(frozen=True)
class LoadedModel:
    """A model just loaded, and what it took."""

    served: ServedModel
    seconds: float


@dataclass(frozen=True)
class UnloadOutcome:
    cancelled_requests: int
    freed_bytes: int


class ModelLifecycle:
    """Loads, unloads and evicts the generative models of one server."""

    def __init__(
        self,
        settings: LoadSettings,
        models: ModelRegistry,
        metrics: ServerMetrics,
        budget: MemoryBudget,
        attach: Attach,
    ) -> None:
        self.settings = settings
        self.models = models
        self.metrics = metrics
        self.budget = budget
        self._attach = attach
        self.engines: list[AsyncEngine] = []  # every engine loaded, to shut down with the server
        self._loading = asyncio.Lock()  # one run-time load at a time: each counts on the budget left

    async def load(self, spec: ModelSpec, config: EngineConfig, *, within_budget: bool) -> LoadedModel:
        """Load ``spec`` with ``config`` and serve it; ``within_budget`` refuses (MemoryBudgetExceeded)
        before loading when its footprint does not fit what is left, else it is recorded as loaded.

        ModelLoadError or ValueError for a checkpoint that cannot be served; ValueError for a name
        that is taken (the registry's)."""
        from protoserve.engine.api import ModelKind, ModelLoadError, resolve_model
        from protoserve.engine.runtime import AsyncEngine, estimate_footprint

        started = time.monotonic()
        # The engine resolves the name again (and applies the card's sampling values); the card records the file.
        resolved = await asyncio.to_thread(resolve_model, spec.source)
        if resolved.kind == ModelKind.EMBEDDING:
            raise ModelLoadError(resolved.path, f"{spec.source} is an embedding model: serve it with --embedding-model")
        held = f"loading-{secrets.token_hex(4)}"
        settings = self.settings
        if within_budget:
            footprint = await asyncio.to_thread(
                estimate_footprint, spec.source, settings.dtype, settings.quantization, config
            )
            self.budget.reserve(held, footprint.total_bytes)
        try:
            engine = await asyncio.to_thread(
                AsyncEngine.from_pretrained,
                spec.source,
                dtype=settings.dtype,
                quantization=settings.quantization,
                config=config,
                progress=settings.progress,
                model_name=spec.name,
            )
        except BaseException:
            self.budget.release(held)
            raise
        self.engines.append(engine)
        self.budget.record(held, engine.weight_bytes + engine.kv_pool_bytes)  # what it took, not the estimate
        if settings.loras or settings.max_loras:
            from protoserve.server.services.adapter_service import load_startup_adapters

            await asyncio.to_thread(load_startup_adapters, engine.engine, settings.loras, settings.max_loras)
        engine.start()
        card = ModelCard(
            dtype=settings.dtype,
            quantization=engine.quantization,
            source=os.fspath(resolved.path),
            kv_cache_dtype=engine.kv_cache_dtype,
            sampling_defaults=engine.sampling_defaults,
        )
        aliases = spec.aliases
        if not spec.names and resolved.name and resolved.name != engine.model_name:
            aliases = (resolved.name,)  # the catalogue's short name it was asked for by
        try:
            await self._attach(engine, card, aliases)
        except ValueError as exc:  # a name already served: nothing of this model stays
            self.budget.release(held)
            await self._discard(engine)
            raise NameTakenError(str(exc)) from None
        name = engine.model_name
        self.budget.rename(held, name)
        engine.on_reload = lambda seconds: self.metrics.observe_load(name, seconds)
        seconds = time.monotonic() - started
        self.metrics.observe_load(name, seconds)
        return LoadedModel(self.models.describe(name), seconds)  # type: ignore[arg-type]

    async def load_at_run_time(self, spec: ModelSpec) -> LoadedModel:
        """LoadModel: ``spec`` within the memory budget, its pool as a model given at start gets it."""
        config = self.settings.engine
        if spec.max_kv_blocks is not None:
            config = replace(config, max_kv_blocks=spec.max_kv_blocks)
        claimed = [n for n in spec.names if self.models.canonical(n) is not None]
        if claimed:  # before any file is read
            raise name_taken(claimed[0], self.models.canonical(claimed[0]) or "")
        async with self._loading:
            return await self.load(spec, config, within_budget=True)

    async def unload(self, name: str, grace_s: float) -> UnloadOutcome:
        """UnloadModel: stop routing to ``name``, give its requests ``grace_s``, end the rest, free it."""
        entry = self.models.describe(name)
        if not isinstance(entry, ServedModel):
            raise wrong_kind(name, entry.kind, "is served by --embedding-model and is not unloaded at run time",
                             self.models.names)
        if len(self.models.all()) == 1:
            problem = "is the server's only generative model: load another first"
            raise errors.ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION, inference_pb2.ERROR_REASON_INVALID_PARAMETER,
                f"{errors.echo(entry.name)} {problem}", violations=[("name", problem)],
            )
        self.models.remove(entry.name)
        engine = entry.engine
        del entry
        drained = await engine.wait_idle(grace_s)
        cancelled = 0 if drained else engine.requests_under_way()
        if cancelled:
            log.warning("unloading %s: ending %d requests after the %.1fs grace period",
                        engine.model_name, cancelled, grace_s)
        freed = self.budget.release(engine.model_name)
        await self._discard(engine)
        log.info("model %s unloaded (%d MiB freed)", engine.model_name, freed // 2**20)
        return UnloadOutcome(cancelled_requests=cancelled, freed_bytes=freed)

    async def _discard(self, engine: AsyncEngine) -> None:
        self.engines.remove(engine)
        await engine.unload()

    async def evict_idle(self, timeout_s: float) -> None:
        """Evict every model idle for ``timeout_s``, checking a few times per timeout; runs until cancelled."""
        interval = min(timeout_s / IDLE_CHECKS_PER_TIMEOUT, MAX_IDLE_CHECK_S)
        while True:
            await asyncio.sleep(interval)
            for served in self.models.all():
                engine = served.engine
                if engine.resident and engine.idle_seconds() >= timeout_s:
                    await engine.evict()

    async def shutdown(self) -> None:
        for engine in self.engines:
            await engine.shutdown()
        self.engines.clear()


def name_taken(name: str, owner: str) -> errors.ServiceError:
    return errors.ServiceError(
        grpc.StatusCode.ALREADY_EXISTS, inference_pb2.ERROR_REASON_INVALID_PARAMETER,
        f"model name {errors.echo(name)} is already served by {errors.echo(owner)}",
        violations=[("served_model_names", f"{errors.echo(name)} is taken")],
    )

