"""The tools an agent run may call: the built-in ones and those installed as entry points.

A deployment adds tools by installing a package that names them under the ``protoserve.tools``
entry point group, e.g. in its pyproject.toml::

    [project.entry-points."protoserve.tools"]
    weather = "my_tools:weather_tool"       # an AgentTool, or a factory returning one or a list

Every problem with a tool (a name OpenAI's API would refuse, two tools of one name, an entry point
that does not load, a schema that is not JSON Schema) is an error when the registry is built, so a
server never starts with fewer tools than its deployment installed.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol, runtime_checkable

import jsonschema
import jsonschema.exceptions
import jsonschema.protocols
import jsonschema.validators

from protoserve.server.agent import calculator
from protoserve.server.tool_calls.call import ToolSpec

ENTRY_POINT_GROUP = "protoserve.tools"
# OpenAI's rule for function names; a name outside it could not be offered to an OpenAI-style client.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@runtime_checkable
class AgentTool(Protocol):
    """A tool: its spec (what the model reads) and ``call``, sync or async, from arguments to text.

    A sync ``call`` runs in a worker thread, so it may block; a thread cannot be interrupted, so a
    sync call that times out keeps running to its end while the run goes on without it.
    """

    spec: ToolSpec

    def call(self, arguments: dict[str, Any]) -> str | Awaitable[str]: ...


@dataclass(frozen=True)
class FunctionTool:
    """An AgentTool from a plain function of the arguments dict; a sync one runs in a worker thread."""

    spec: ToolSpec
    function: Callable[[dict[str, Any]], str | Awaitable[str]]

    async def call(self, arguments: dict[str, Any]) -> str:
        if inspect.iscoroutinefunction(self.function):
            return await self.function(arguments)
        return await asyncio.to_thread(self.function, arguments)


class ToolRegistryError(RuntimeError):
    """The tools cannot be registered; the message names the tool and where it came from."""


class ToolSelectionError(ValueError):
    """A run named a tool it cannot have; ``index`` is its position in the run's list."""

    def __init__(self, message: str, *, name: str, index: int) -> None:
        super().__init__(message)
        self.name = name
        self.index = index


class UnknownToolError(LookupError):
    """A call named a tool that the registry (or the run) does not have."""


class InvalidArgumentsError(ValueError):
    """A call's arguments do not satisfy the tool's JSON Schema."""


async def _async_calculate(arguments: dict[str, Any]) -> str:
    # Bounded to milliseconds by the calculator's own limits, so it needs no thread.
    return calculator.calculate(arguments)


def builtin_tools() -> list[AgentTool]:
    """The tools every server has."""
    return [FunctionTool(calculator.SPEC, _async_calculate)]


@dataclass(frozen=True)
class _Entry:
    tool: AgentTool
    source: str  # "built-in" or the entry point, for error messages
    validator: jsonschema.protocols.Validator
    is_async: bool


class ToolRegistry:
    """Tools by name, each with its arguments' validator."""

    def __init__(self, tools: Iterable[tuple[AgentTool, str]] = ()) -> None:
        """``tools`` pairs each tool with where it came from (named in errors)."""
        self._entries: dict[str, _Entry] = {}
        for tool, source in tools:
            self._add(tool, source)

    @classmethod
    def load(cls, group: str = ENTRY_POINT_GROUP, *, builtins: bool = True) -> ToolRegistry:
        """The built-in tools and every tool installed under the entry point ``group``."""
        sources: list[tuple[AgentTool, str]] = []
        if builtins:
            sources += [(tool, "built-in") for tool in builtin_tools()]
        for ep in sorted(entry_points(group=group), key=lambda ep: ep.name):
            where = f"entry point {ep.name!r} ({ep.value}) of group {group!r}"
            sources += [(tool, where) for tool in _load_entry_point(ep, where)]
        return cls(sources)

    def _add(self, tool: AgentTool, source: str) -> None:
        if not _is_tool(tool):
            raise ToolRegistryError(
                f"{source}: {tool!r} is not an AgentTool (a ToolSpec `spec` and a `call`)"
            )
        name = tool.spec.name
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolRegistryError(f"{source}: tool name {name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$")
        if name in self._entries:
            raise ToolRegistryError(
                f"{source}: tool name {name!r} is already taken by {self._entries[name].source}"
            )
        schema = tool.spec.parameters
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise ToolRegistryError(
                f"{source}: tool {name!r}: parameters must be a JSON Schema of type object"
            )
        validator_class = jsonschema.validators.validator_for(schema)
        try:
            validator_class.check_schema(schema)
        except jsonschema.exceptions.SchemaError as exc:
            raise ToolRegistryError(f"{source}: tool {name!r}: parameters: {exc.message}") from None
        self._entries[name] = _Entry(
            tool=tool,
            source=source,
            validator=validator_class(schema),
            is_async=inspect.iscoroutinefunction(tool.call),
        )

    def with_tools(self, tools: Iterable[tuple[AgentTool, str]]) -> ToolRegistry:
        """A registry with these tools added (one run's own, say a search bound to its caller)."""
        registry = ToolRegistry()
        registry._entries = dict(self._entries)
        for tool, source in tools:
            registry._add(tool, source)
        return registry

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """Every tool's name, sorted."""
        return sorted(self._entries)

    def source(self, name: str) -> str:
        """Where the tool came from: "built-in" or its entry point."""
        return self._entries[name].source

    def specs(self, names: Sequence[str] | None = None) -> list[ToolSpec]:
        """The specs of ``names`` in their order, or of every tool by name when None or empty.

        ToolSelectionError names a tool the registry lacks or one named twice, and its index.
        """
        if not names:
            return [self._entries[n].tool.spec for n in self.names()]
        seen: set[str] = set()
        for index, name in enumerate(names):
            if name not in self._entries:
                raise ToolSelectionError(
                    f"unknown tool {name!r}; the tools are {', '.join(self.names())}", name=name, index=index
                )
            if name in seen:
                raise ToolSelectionError(f"tool {name!r} is named twice", name=name, index=index)
            seen.add(name)
        return [self._entries[n].tool.spec for n in names]

    def validate(self, name: str, arguments: dict[str, Any]) -> None:
        """InvalidArgumentsError unless ``arguments`` satisfy the tool's schema; UnknownToolError for a stranger."""
        entry = self._entry(name)
        error = jsonschema.exceptions.best_match(entry.validator.iter_errors(arguments))
        if error is not None:
            where = error.json_path if error.path else "arguments"
            raise InvalidArgumentsError(f"invalid arguments for {name!r}: {where}: {error.message}")

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Validates ``arguments`` and calls the tool; a sync tool runs in a worker thread.

        A tool's own exceptions pass through, as does a result that is not text (TypeError).
        """
        self.validate(name, arguments)
        entry = self._entry(name)
        if entry.is_async:
            result = await entry.tool.call(arguments)
        else:
            result = await asyncio.to_thread(entry.tool.call, arguments)
            if inspect.isawaitable(result):  # a sync def that returns a coroutine
                result = await result
        if not isinstance(result, str):
            raise TypeError(f"tool {name!r} returned {type(result).__name__}, not str")
        return result

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownToolError(
                f"unknown tool {name!r}; the tools are {', '.join(self.names())}"
            ) from None


def _is_tool(obj: object) -> bool:
    # A class with `spec` and `call` attributes is a factory of tools, not a tool.
    return (
        not isinstance(obj, type)
        and isinstance(getattr(obj, "spec", None), ToolSpec)
        and callable(getattr(obj, "call", None))
    )


def _load_entry_point(ep: EntryPoint, where: str) -> list[AgentTool]:
    try:
        loaded = ep.load()
        if _is_tool(loaded):
            return [loaded]
        if not callable(loaded):
            raise TypeError(f"loads {loaded!r}, not an AgentTool or a factory of them")
        made = loaded()
    except ToolRegistryError:
        raise
    except Exception as exc:
        raise ToolRegistryError(f"{where} failed to load: {type(exc).__name__}: {exc}") from exc
    tools = list(made) if isinstance(made, list | tuple) else [made]
    for tool in tools:
        if not _is_tool(tool):
            raise ToolRegistryError(f"{where}: its factory returned {tool!r}, not an AgentTool")
    if not tools:
        raise ToolRegistryError(f"{where}: its factory returned no tools")
    return tools
