"""The models this server has loaded, by name; the first one is the default."""

from __future__ import annotations

from protoserve.server import errors
from protoserve.server.limits import MAX_MODEL_NAME_CHARS
from protoserve.server.models.served_model import ServedModel


class ModelRegistry:
    """Name → ServedModel. Empty while the model loads, which callers see as NOT_READY."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}

    def add(self, served: ServedModel) -> None:
        """Serve ``served`` under its name; a name over the cap could never be asked for."""
        if len(served.name) > MAX_MODEL_NAME_CHARS:
            raise ValueError(
                f"model name {errors.echo(served.name)} is longer than {MAX_MODEL_NAME_CHARS} characters"
            )
        self._models[served.name] = served

    @property
    def names(self) -> list[str]:
        return list(self._models)

    def all(self) -> list[ServedModel]:
        return list(self._models.values())

    def get(self, name: str) -> ServedModel:
        """The named model, or the default for ""; NOT_FOUND for a model not loaded.

        The message quotes the name cut short (:func:`errors.echo`): the whole of a long one
        would overflow the status's trailers.
        """
        if not self._models:
            raise errors.not_ready()
        if not name:
            return next(iter(self._models.values()))
        try:
            return self._models[name]
        except KeyError:
            raise errors.model_not_found(name, self._models) from None

    def resolve(self, name: str) -> tuple[ServedModel, str | None]:
        """(model, LoRA adapter) that ``name`` asks for: a model's name (or "") gives it alone, an
        adapter's name gives the model holding that adapter (OpenAI's ``model`` names either)."""
        if name and name not in self._models:
            for served in self._models.values():
                if served.adapters is not None and name in served.adapters:
                    return served, name
        return self.get(name), None
