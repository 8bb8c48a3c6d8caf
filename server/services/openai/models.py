"""OpenAI's models (``/v1/models``): every served model, each followed by its LoRA adapters (as vLLM lists
them), generative models first, then embedding models; each with vLLM's ``max_model_len`` and
protoserve's ``kind`` and ``aliases`` (OpenAI's clients keep fields they do not know)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.server import errors
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.models.served_model import ServedModel

if TYPE_CHECKING:
    from protoserve.server.models.model_registry import Served


def model_object(served: Served, adapter: str | None = None) -> oa.Model:
    """A model, or one of its LoRA adapters with ``parent`` naming it."""
    info = served.model_info(with_path=False)
    loaded_at = served.card.loaded_at if isinstance(served, ServedModel) else served.loaded_at
    model = oa.Model(
        id=adapter or served.name, object="model", created=int(loaded_at), owned_by="protoserve", kind=info.kind
    )
    if adapter:
        model.parent = served.name
    else:
        model.max_model_len = info.max_model_len
        model.aliases.extend(info.aliases)
    return model


class Models:
    """The models surface: the list, and one model by id."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def list(self) -> oa.ListModelsResponse:
        data = []
        for served in self.models.listing():
            data.append(model_object(served))
            adapters = served.adapters if isinstance(served, ServedModel) else None
            data.extend(model_object(served, a) for a in (adapters.names() if adapters else []))
        return oa.ListModelsResponse(object="list", data=data)

    def retrieve(self, request: oa.RetrieveModelRequest) -> oa.RetrieveModelResponse:
        """One model (by name or alias) or adapter by id; NOT_FOUND when it is not loaded."""
        if not request.model:
            raise errors.invalid_argument([("model", "is required")])
        for served in self.models.all():
            if served.adapters is not None and request.model in served.adapters:
                return oa.RetrieveModelResponse(model=model_object(served, request.model))
        return oa.RetrieveModelResponse(model=model_object(self.models.describe(request.model)))
