"""The tool registry: built-ins, entry-point tools, startup errors, selection and argument checks."""

from __future__ import annotations

import asyncio
import secrets
import textwrap
import threading
from pathlib import Path

import pytest

from protoserve.server.agent.tool_registry import (
    ENTRY_POINT_GROUP,
    FunctionTool,
    InvalidArgumentsError,
    ToolRegistry,
    ToolRegistryError,
    ToolSelectionError,
    UnknownToolError,
)
from protoserve.server.tool_calls.call import ToolSpec

ECHO_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def _tool(name: str, function=None, schema=None) -> FunctionTool:
    async def echo(arguments: dict) -> str:
        return arguments["text"]

    return FunctionTool(ToolSpec(name, "test tool", schema or ECHO_SCHEMA), function or echo)


def _install_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module_source: str, entries: str) -> str:
    """A distribution in tmp_path (dist-info with entry points, and its module) on sys.path.

    Returns the module name, unique per call so no test reads another's cached module.
    """
    module = f"agent_tools_{secrets.token_hex(4)}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(module_source))
    dist_info = tmp_path / f"{module}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    lines = textwrap.dedent(entries).strip().replace("MODULE", module)
    (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


TOOLS_MODULE = """
    import asyncio
    from protoserve.server.agent.tool_registry import FunctionTool
    from protoserve.server.tool_calls.call import ToolSpec

    SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    async def _weather(arguments):
        return "sunny in " + arguments["city"]

    weather = FunctionTool(ToolSpec("weather", "The weather of a city.", SCHEMA), _weather)

    class Upper:
        spec = ToolSpec("upper", "Upper-cases text.", {"type": "object", "properties": {"text": {"type": "string"}}})

        def call(self, arguments):  # a sync tool: runs in a worker thread
            return arguments["text"].upper()

    def make_many():
        return [FunctionTool(ToolSpec("first", "", SCHEMA), _weather), FunctionTool(ToolSpec("second", "", SCHEMA), _weather)]

    bad_name = FunctionTool(ToolSpec("has space", "", SCHEMA), _weather)
    dup_calculator = FunctionTool(ToolSpec("calculator", "", SCHEMA), _weather)
    not_a_tool = 42

    def returns_junk():
        return ["not a tool"]
"""


async def test_builtin_calculator() -> None:
    registry = ToolRegistry.load()
    assert registry.names() == ["calculator"]
    assert registry.source("calculator") == "built-in"
    assert await registry.call("calculator", {"expression": "6 * 7"}) == "42"


async def test_entry_points_load_tools_instances_and_factories(tmp_path, monkeypatch) -> None:
    module = _install_dist(
        tmp_path,
        monkeypatch,
        TOOLS_MODULE,
        """
        weather = MODULE:weather
        upper = MODULE:Upper
        many = MODULE:make_many
        """,
    )
    registry = ToolRegistry.load()
    assert registry.names() == ["calculator", "first", "second", "upper", "weather"]
    assert f"entry point 'weather' ({module}:weather)" in registry.source("weather")
    assert await registry.call("weather", {"city": "Oslo"}) == "sunny in Oslo"
    assert await registry.call("upper", {"text": "abc"}) == "ABC"
    # Without the entry points' distribution, only the built-in remains.
    monkeypatch.undo()
    assert ToolRegistry.load().names() == ["calculator"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("badname = MODULE:bad_name", "tool name 'has space' must match"),
        ("dup = MODULE:dup_calculator", "already taken by built-in"),
        ("missing = MODULE:no_such_attribute", "failed to load: AttributeError"),
        ("number = MODULE:not_a_tool", "failed to load: TypeError: loads 42"),
        ("junk = MODULE:returns_junk", "its factory returned 'not a tool', not an AgentTool"),
        ("gone = no_such_module_for_agent_tools:tool", "failed to load: ModuleNotFoundError"),
    ],
)
def test_bad_entry_points_fail_loudly_naming_the_entry_point(tmp_path, monkeypatch, entry, message) -> None:
    _install_dist(tmp_path, monkeypatch, TOOLS_MODULE, entry)
    name = entry.split(" = ")[0]
    with pytest.raises(ToolRegistryError) as info:
        ToolRegistry.load()
    assert f"entry point {name!r}" in str(info.value)
    assert message in str(info.value)


def test_module_that_raises_on_import_is_a_startup_error(tmp_path, monkeypatch) -> None:
    _install_dist(
        tmp_path, monkeypatch, "raise RuntimeError('no config for the tools')\n", "broken = MODULE:tool"
    )
    with pytest.raises(
        ToolRegistryError, match=r"entry point 'broken' .* RuntimeError: no config for the tools"
    ):
        ToolRegistry.load()


def test_two_entry_points_with_one_tool_name(tmp_path, monkeypatch) -> None:
    _install_dist(tmp_path, monkeypatch, TOOLS_MODULE, "a = MODULE:weather\nb = MODULE:weather")
    with pytest.raises(
        ToolRegistryError, match=r"entry point 'b' .*'weather' is already taken by entry point 'a'"
    ):
        ToolRegistry.load()


@pytest.mark.parametrize("name", ["", "a" * 65, "dotted.name", "naïve", "new\nline", "tab\t"])
def test_names_outside_openai_rule_are_refused(name: str) -> None:
    with pytest.raises(ToolRegistryError, match="must match"):
        ToolRegistry([(_tool(name), "test")])


def test_name_rule_accepts_its_whole_alphabet() -> None:
    registry = ToolRegistry([(_tool("Az_09-x" + "y" * 57), "test")])
    assert registry.names() == ["Az_09-x" + "y" * 57]


def test_bad_schema_and_non_tools_are_refused() -> None:
    with pytest.raises(ToolRegistryError, match="parameters must be a JSON Schema of type object"):
        ToolRegistry([(_tool("t", schema={"type": "string"}), "test")])
    with pytest.raises(ToolRegistryError, match=r"tool 't': parameters: .*"):
        ToolRegistry([(_tool("t", schema={"type": "object", "properties": {"x": {"type": 5}}}), "test")])
    with pytest.raises(ToolRegistryError, match="is not an AgentTool"):
        ToolRegistry([(object(), "test")])


def test_specs_selection() -> None:
    registry = ToolRegistry([(_tool("b"), "test"), (_tool("a"), "test"), (_tool("c"), "test")])
    assert [s.name for s in registry.specs(None)] == ["a", "b", "c"]
    assert [s.name for s in registry.specs([])] == ["a", "b", "c"]
    assert [s.name for s in registry.specs(["c", "a"])] == ["c", "a"]
    with pytest.raises(ToolSelectionError, match="unknown tool 'zz'") as info:
        registry.specs(["a", "zz"])
    assert (info.value.name, info.value.index) == ("zz", 1)
    with pytest.raises(ToolSelectionError, match="named twice") as info:
        registry.specs(["a", "b", "a"])
    assert info.value.index == 2


async def test_arguments_are_validated_before_the_tool_runs() -> None:
    calls = []

    async def record(arguments: dict) -> str:
        calls.append(arguments)
        return "ok"

    registry = ToolRegistry([(_tool("t", record), "test")])
    with pytest.raises(InvalidArgumentsError, match=r"'text' is a required property"):
        await registry.call("t", {})
    with pytest.raises(InvalidArgumentsError, match=r"\$\.text: 3 is not of type 'string'"):
        await registry.call("t", {"text": 3})
    assert calls == []
    assert await registry.call("t", {"text": "x"}) == "ok"
    with pytest.raises(UnknownToolError, match="unknown tool 'u'"):
        await registry.call("u", {})


async def test_sync_tools_run_in_a_thread_async_ones_on_the_loop() -> None:
    loop_thread = threading.get_ident()
    seen = {}

    def sync_tool(arguments: dict) -> str:
        seen["sync"] = threading.get_ident()
        return "s"

    async def async_tool(arguments: dict) -> str:
        seen["async"] = threading.get_ident()
        return "a"

    registry = ToolRegistry([(_tool("s", sync_tool), "test"), (_tool("a", async_tool), "test")])
    assert await asyncio.gather(registry.call("s", {"text": ""}), registry.call("a", {"text": ""})) == [
        "s",
        "a",
    ]
    assert seen["async"] == loop_thread
    assert seen["sync"] != loop_thread


async def test_a_result_that_is_not_text_is_an_error() -> None:
    async def number(arguments: dict) -> int:
        return 4

    registry = ToolRegistry([(_tool("n", number), "test")])
    with pytest.raises(TypeError, match="returned int, not str"):
        await registry.call("n", {"text": ""})
