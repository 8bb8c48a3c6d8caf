"""ModelService: generative models loaded and unloaded at run time (server/models/model_lifecycle.py).

Like AdapterService it changes what the server serves for everyone, so with auth on only admin keys
may call it (PERMISSION_DENIED otherwise); with auth off anyone may. The checkpoint is the admin's to
name, a catalogue name or a path on the server, as adapters' paths are. Requests are checked here,
before any file is read; the lifecycle's failures map to their statuses here too.
"""

from __future__ import annotations

import math

import grpc

from protoserve.server import errors
from protoserve.server.calls.admission import Admission, AdmittingServicer
from protoserve.server.models.model_lifecycle import ModelLifecycle, NameTakenError
from protoserve.server.models.model_spec import ModelSpec, parse_names
from protoserve.server.runtime.memory_budget import MemoryBudgetExceeded
from protoserve.server.services.adapter_service import permission_denied
from protoserve.v1 import inference_pb2, models_pb2_grpc
from protoserve.v1 import models_pb2 as pb

MAX_SOURCE_CHARS = 4096
MAX_GRACE_S = 3600.0


class ModelService(AdmittingServicer, models_pb2_grpc.ModelServiceServicer):
    """LoadModel and UnloadModel over the server's ModelLifecycle."""

    def __init__(self, admission: Admission, *, lifecycle: ModelLifecycle, default_grace_s: float) -> None:
        super().__init__(admission)
        self.lifecycle = lifecycle
        self.default_grace_s = default_grace_s

    def _admin(self, context: grpc.aio.ServicerContext) -> None:
        identity = self._admit(context)
        if self.auth.enabled and not identity.admin:
            raise permission_denied("loading and unloading models needs an admin key")

    @errors.reports_errors
    async def LoadModel(self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext):
        """Load a model within the memory budget and serve it."""
        from protoserve.engine.api import ModelLoadError

        self._admin(context)
        spec = load_spec(request)
        try:
            loaded = await self.lifecycle.load_at_run_time(spec)
        except MemoryBudgetExceeded as exc:
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, inference_pb2.ERROR_REASON_MEMORY_BUDGET_EXCEEDED,
                f"model {errors.echo(request.model)} {exc}; unload a model or give a smaller max_kv_blocks",
                metadata={"needed_bytes": str(exc.needed), "free_bytes": str(exc.free),
                          "budget_bytes": str(exc.budget)},
            ) from None
        except NameTakenError as exc:
            raise errors.ServiceError(grpc.StatusCode.ALREADY_EXISTS, inference_pb2.ERROR_REASON_INVALID_PARAMETER,
                                      str(exc), violations=[("served_model_names", str(exc))]) from None
        except (ModelLoadError, ValueError, OSError) as exc:
            raise errors.invalid_argument([("model", f"cannot be loaded: {exc}")]) from None
        engine = loaded.served.engine
        return pb.LoadModelResponse(
            model=loaded.served.model_info(with_path=True),
            load_seconds=loaded.seconds,
            weight_bytes=engine.weight_bytes,
            kv_pool_bytes=engine.kv_pool_bytes,
        )

    @errors.reports_errors
    async def UnloadModel(self, request: pb.UnloadModelRequest, context: grpc.aio.ServicerContext):
        """Stop serving a model, drain or end its requests, free it."""
        self._admin(context)
        bad = []
        if not request.name:
            bad.append(("name", "is required"))
        grace = request.grace_s if request.HasField("grace_s") else self.default_grace_s
        if not (math.isfinite(grace) and 0 <= grace <= MAX_GRACE_S):
            bad.append(("grace_s", f"must be between 0 and {MAX_GRACE_S:g} seconds"))
        if bad:
            raise errors.invalid_argument(bad)
        outcome = await self.lifecycle.unload(request.name, grace)
        return pb.UnloadModelResponse(cancelled_requests=outcome.cancelled_requests, freed_bytes=outcome.freed_bytes)


def load_spec(request: pb.LoadModelRequest) -> ModelSpec:
    """The ModelSpec a LoadModelRequest asks for; INVALID_ARGUMENT naming each bad field."""
    bad: list[tuple[str, str]] = []
    if not request.model:
        bad.append(("model", "is required: an installed model's name, or a checkpoint on the server"))
    elif len(request.model) > MAX_SOURCE_CHARS or "\x00" in request.model:
        bad.append(("model", f"must be at most {MAX_SOURCE_CHARS} characters, without NUL"))
    names: tuple[str, ...] = ()
    if request.served_model_names:
        try:
            names = parse_names(",".join(request.served_model_names))
        except ValueError as exc:
            bad.append(("served_model_names", str(exc)))
        if any("," in n for n in request.served_model_names):
            bad.append(("served_model_names", "a name may not contain a comma"))
    if request.HasField("max_kv_blocks") and request.max_kv_blocks < 1:
        bad.append(("max_kv_blocks", "must be at least 1"))
    if bad:
        raise errors.invalid_argument(bad)
    blocks = request.max_kv_blocks if request.HasField("max_kv_blocks") else None
    return ModelSpec(source=request.model, names=names, max_kv_blocks=blocks)
