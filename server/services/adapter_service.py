"""AdapterService: LoRA adapters loaded, unloaded and listed at runtime (engine/lora's AdapterStack).

Adapters change what the model says for everyone who names them, so with auth on only admin keys may
call it (PERMISSION_DENIED otherwise); with auth off anyone may, as on vLLM. Names and paths are
checked by server/models/adapter_input.py before any file is touched; loading reads the files off
the event loop, and a malformed or unreadable adapter is INVALID_ARGUMENT on the field the loader
names, changing nothing. Unloading an adapter that waiting or running requests use is
FAILED_PRECONDITION: they keep it until they finish, and the caller retries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from protoserve.engine.runtime import (
    AdapterError,
    AdapterInfo,
    AdapterInUseError,
    AdapterStack,
    UnknownAdapterError,
)
from protoserve.server import errors
from protoserve.server.calls.admission import AdmittingServicer
from protoserve.server.models.adapter_input import adapter_load_problems
from protoserve.server.models.served_model import ServedModel
from protoserve.server.security.auth import Identity
from protoserve.v1 import adapters_pb2 as pb
from protoserve.v1 import adapters_pb2_grpc, inference_pb2

if TYPE_CHECKING:
    from protoserve.engine.runtime import LLMEngine


def permission_denied(message: str) -> errors.ServiceError:
    return errors.ServiceError(grpc.StatusCode.PERMISSION_DENIED, inference_pb2.ERROR_REASON_PERMISSION_DENIED, message)


def adapter_to_proto(info: AdapterInfo, base_model: str) -> pb.Adapter:
    return pb.Adapter(name=info.name, base_model=base_model, path=info.path, rank=info.rank, alpha=info.alpha,
                      target_modules=list(info.target_modules), resident=info.resident,
                      active_requests=info.active_requests, needs_reload=info.needs_reload)


def stack_of(served: ServedModel) -> AdapterStack:
    stack = served.adapters
    if stack is None:
        raise errors.feature_disabled(f"model {errors.echo(served.name)} serves no LoRA adapters "
                                      "(start the server with --max-loras or --lora)")
    return stack


class AdapterService(AdmittingServicer, adapters_pb2_grpc.AdapterServiceServicer):
    """LoadAdapter, UnloadAdapter and ListAdapters over every served model's AdapterStack."""

    def _admin(self, context: grpc.aio.ServicerContext) -> Identity:
        identity = self._admit(context)
        if self.auth.enabled and not identity.admin:
            raise permission_denied("managing LoRA adapters needs an admin key")
        return identity

    def _owner(self, name: str) -> tuple[ServedModel, AdapterStack]:
        """The model whose stack holds adapter ``name``; NOT_FOUND when none does."""
        for served in self.models.all():
            if served.adapters is not None and name in served.adapters:
                return served, served.adapters
        raise errors.ServiceError(grpc.StatusCode.NOT_FOUND, inference_pb2.ERROR_REASON_MODEL_NOT_FOUND,
                                  f"no adapter named {errors.echo(name)} is loaded", metadata={"adapter": errors.clip(name)})

    @errors.reports_errors
    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext):
        """Read, check and register an adapter; INVALID_ARGUMENT naming what is wrong with it."""
        self._admin(context)
        served = self.models.get(request.model)
        stack = stack_of(served)
        bad = adapter_load_problems(request.name, request.path)
        if not bad and request.name in self.models.names:
            bad.append(("name", f"{errors.echo(request.name)} is a model's name; pick another"))
        if bad:
            raise errors.invalid_argument(bad)
        try:
            info = await asyncio.to_thread(stack.load, request.name, request.path)
        except AdapterError as exc:
            raise errors.invalid_argument([(exc.field, str(exc))]) from None
        return pb.LoadAdapterResponse(adapter=adapter_to_proto(info, served.name))

    @errors.reports_errors
    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext):
        """Forget an adapter no request uses; FAILED_PRECONDITION while requests use it."""
        self._admin(context)
        if not request.name:
            raise errors.invalid_argument([("name", "is required")])
        _, stack = self._owner(request.name)
        try:
            stack.unload(request.name)
        except AdapterInUseError as exc:
            raise errors.ServiceError(grpc.StatusCode.FAILED_PRECONDITION, inference_pb2.ERROR_REASON_ADAPTER_IN_USE,
                                      str(exc), metadata={"active_requests": str(exc.requests)}) from None
        except UnknownAdapterError:  # unloaded by another call since _owner
            self._owner(request.name)
        return pb.UnloadAdapterResponse()

    @errors.reports_errors
    async def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext):
        """Every loaded adapter of every model, by name."""
        self._admin(context)
        out = [adapter_to_proto(info, served.name) for served in self.models.all()
               if served.adapters is not None for info in served.adapters.list()]
        return pb.ListAdaptersResponse(adapters=sorted(out, key=lambda a: a.name))


DEFAULT_MAX_LORAS = 4


def load_startup_adapters(engine: LLMEngine, loras: Sequence[tuple[str, str]], max_loras: int) -> None:
    """Turn LoRA on (``max_loras`` slots, DEFAULT_MAX_LORAS when 0) and load each ``--lora NAME=PATH``;
    a bad one stops the start with ModelLoadError naming it."""
    from protoserve.engine.api import ModelLoadError

    stack = engine.enable_lora(max_loras or DEFAULT_MAX_LORAS)
    for name, path in loras:
        bad = adapter_load_problems(name, path)
        if bad:
            raise ModelLoadError(errors.clip(path),
                                 f"--lora {errors.clip(name)}: " + "; ".join(f"{f} {p}" for f, p in bad))
        try:
            stack.load(name, path)
        except AdapterError as exc:
            raise ModelLoadError(path, f"--lora {name}: {exc}") from None
