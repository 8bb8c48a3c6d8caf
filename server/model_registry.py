"""The models this server has loaded, by name; the first one is the default."""

from __future__ import annotations

from server import errors
from server.frontend import Frontend
from server.limits import MAX_MODEL_NAME_CHARS


class ModelRegistry:
    """Name → Frontend. Empty while the model loads, which callers see as NOT_READY."""

    def __init__(self) -> None:
        self._frontends: dict[str, Frontend] = {}

    def add(self, frontend: Frontend) -> None:
        """Serve ``frontend`` under its name; a name over the cap could never be asked for."""
        if len(frontend.name) > MAX_MODEL_NAME_CHARS:
            raise ValueError(
                f"model name {errors.echo(frontend.name)} is longer than {MAX_MODEL_NAME_CHARS} characters"
            )
        self._frontends[frontend.name] = frontend

    @property
    def names(self) -> list[str]:
        return list(self._frontends)

    def all(self) -> list[Frontend]:
        return list(self._frontends.values())

    def get(self, name: str) -> Frontend:
        """The named model, or the default for ""; NOT_FOUND for a model not loaded.

        The message quotes the name cut short (:func:`errors.echo`): the whole of a long one
        would overflow the status's trailers.
        """
        if not self._frontends:
            raise errors.not_ready()
        if not name:
            return next(iter(self._frontends.values()))
        try:
            return self._frontends[name]
        except KeyError:
            raise errors.model_not_found(name, self._frontends) from None
