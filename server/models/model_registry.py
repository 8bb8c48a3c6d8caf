"""The models this server serves, by name and alias: generative models and embedding models.

The first generative model is the default for requests that name none; the first embedding model
is the default for embedding requests that name none. Every name and alias is unique across both
kinds, so a request's ``model`` picks one model; a name of the wrong kind (a chat request to the
embedding model, an embedding request to a chat model) is INVALID_ARGUMENT on ``model``, not
NOT_FOUND: the model is loaded, the request cannot go to it. Models are added (and removed) on the
event loop while the server serves, so loading one at run time is an ``add``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeAlias

from protoserve.server import errors
from protoserve.server.limits import MAX_MODEL_NAME_CHARS
from protoserve.server.models.served_model import ServedModel

if TYPE_CHECKING:
    from protoserve.server.services.embeddings import ServedEmbedder

    # A served model of either kind: both have name, aliases, kind and model_info().
    Served: TypeAlias = ServedModel | ServedEmbedder


class ModelRegistry:
    """Name or alias → served model. Empty while the models load, which callers see as NOT_READY."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}  # generative, by name, in load order
        self._embedders: dict[str, ServedEmbedder] = {}
        self._names: dict[str, str] = {}  # every name and alias → the model's name

    def add(self, served: ServedModel) -> None:
        """Serve a generative model under its name and aliases."""
        self._claim(served)
        self._models[served.name] = served

    def add_embedder(self, embedder: ServedEmbedder) -> None:
        """Serve an embedding model under its name and aliases."""
        self._claim(embedder)
        self._embedders[embedder.name] = embedder

    def remove(self, name: str) -> Served:
        """Stop routing to the model ``name`` (or an alias of it) names; returns it. NOT_FOUND if none."""
        entry = self.describe(name)
        self._models.pop(entry.name, None)
        self._embedders.pop(entry.name, None)
        self._names = {n: m for n, m in self._names.items() if m != entry.name}
        return entry

    def _claim(self, served: Served) -> None:
        """Check the model's names are new and within the cap; a name over the cap could never be asked for."""
        for name in (served.name, *served.aliases):
            if len(name) > MAX_MODEL_NAME_CHARS:
                raise ValueError(
                    f"model name {errors.echo(name)} is longer than {MAX_MODEL_NAME_CHARS} characters"
                )
            if name in self._names:
                raise ValueError(f"model name {errors.echo(name)} is already served by {self._names[name]}")
        for name in (served.name, *served.aliases):
            self._names[name] = served.name

    @property
    def names(self) -> list[str]:
        """The generative models' names, the default first."""
        return list(self._models)

    def all(self) -> list[ServedModel]:
        """The generative models, the default first."""
        return list(self._models.values())

    def embedders(self) -> list[ServedEmbedder]:
        return list(self._embedders.values())

    def listing(self) -> list[Served]:
        """Every served model, generative ones first (ListModels, /v1/models)."""
        return [*self._models.values(), *self._embedders.values()]

    def canonical(self, name: str) -> str | None:
        """The name of the model ``name`` (a name or an alias) names; None when none."""
        return self._names.get(name)

    def _lookup(self, name: str) -> Served | None:
        canonical = self._names.get(name)
        if canonical is None:
            return None
        return self._models.get(canonical) or self._embedders.get(canonical)

    def describe(self, name: str) -> Served:
        """The model ``name`` names, of either kind (GetModel, /v1/models/{id}); NOT_FOUND if none."""
        if not self._models and not self._embedders:
            raise errors.not_ready()
        entry = self._lookup(name)
        if entry is None:
            raise errors.model_not_found(name, self._names)
        return entry

    def get(self, name: str) -> ServedModel:
        """The generative model ``name`` names, or the default for ""; NOT_FOUND for a model not loaded,
        INVALID_ARGUMENT on ``model`` for an embedding model.

        The message quotes the name cut short (:func:`errors.echo`): the whole of a long one
        would overflow the status's trailers.
        """
        if not self._models:
            raise errors.not_ready()
        if not name:
            return next(iter(self._models.values()))
        entry = self.describe(name)
        if not isinstance(entry, ServedModel):
            raise wrong_kind(name, entry.kind, "generates no text", self._models)
        return entry

    def embedder(self, name: str) -> ServedEmbedder | None:
        """The embedding model ``name`` names, the default for "", None when the server has none;
        NOT_FOUND for a model not loaded, INVALID_ARGUMENT on ``model`` for a generative model.

        Without an embedding model any name gives None: that the server embeds nothing is the answer.
        """
        if not name or not self._embedders:
            return next(iter(self._embedders.values()), None)
        entry = self.describe(name)
        if isinstance(entry, ServedModel):
            raise wrong_kind(name, entry.kind, "does not embed", self._embedders)
        return entry  # type: ignore[return-value]

    def resolve(self, name: str) -> tuple[ServedModel, str | None]:
        """(model, LoRA adapter) that ``name`` asks for: a model's name or alias (or "") gives it alone, an
        adapter's name gives the model holding that adapter (OpenAI's ``model`` names either)."""
        if name and name not in self._names:
            for served in self._models.values():
                if served.adapters is not None and name in served.adapters:
                    return served, name
        return self.get(name), None


def wrong_kind(name: str, kind: str, what: str, others: Iterable[str]) -> errors.ServiceError:
    """INVALID_ARGUMENT for a request that names a loaded model of the other kind."""
    listed = ", ".join(others) or "none"
    article = "an" if kind[0] in "aeiou" else "a"
    return errors.invalid_argument(
        [("model", f"{errors.echo(name)} is {article} {kind} model and {what} (models that do: {listed})")]
    )
