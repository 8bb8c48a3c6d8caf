"""OpenAI's models (``/v1/models``): every loaded model, then its LoRA adapters (as vLLM lists them)."""

from __future__ import annotations

from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server import errors
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.models.served_model import ServedModel


def model_object(served: ServedModel, adapter: str | None = None) -> oa.Model:
    """A model, or one of its LoRA adapters with ``parent`` naming it."""
    model = oa.Model(
        id=adapter or served.name, object="model", created=int(served.card.loaded_at), owned_by="protoserve"
    )
    if adapter:
        model.parent = served.name
    return model


class Models:
    """The models surface: the list, and one model by id."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def list(self) -> oa.ListModelsResponse:
        data = []
        for served in self.models.all():
            data.append(model_object(served))
            data.extend(model_object(served, a) for a in (served.adapters.names() if served.adapters else []))
        return oa.ListModelsResponse(object="list", data=data)

    def retrieve(self, request: oa.RetrieveModelRequest) -> oa.RetrieveModelResponse:
        """One model (or adapter) by id; NOT_FOUND when it is not loaded."""
        if not request.model:
            raise errors.invalid_argument([("model", "is required")])
        return oa.RetrieveModelResponse(model=model_object(*self.models.resolve(request.model)))
