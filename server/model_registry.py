"""The models this server has loaded, by name; the first one is the default."""

from __future__ import annotations

from server import errors
from server.frontend import Frontend


class ModelRegistry:
    """Name → Frontend. Empty while the model loads, which callers see as NOT_READY."""

    def __init__(self) -> None:
        self._frontends: dict[str, Frontend] = {}

    def add(self, frontend: Frontend) -> None:
        self._frontends[frontend.name] = frontend

    @property
    def names(self) -> list[str]:
        return list(self._frontends)

    def all(self) -> list[Frontend]:
        return list(self._frontends.values())

    def get(self, name: str) -> Frontend:
        """The named model, or the default for ""; NOT_FOUND for a model not loaded."""
        if not self._frontends:
            raise errors.not_ready()
        if not name:
            return next(iter(self._frontends.values()))
        try:
            return self._frontends[name]
        except KeyError:
            raise errors.model_not_found(name, self._frontends) from None
