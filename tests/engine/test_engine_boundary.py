"""Code outside the engine (the bench, the server, the gateway) reaches it through its public modules
only (``protoserve.engine.api`` and ``protoserve.engine.runtime``), so the engine's internals can move
without breaking them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINE = "protoserve.engine"
PUBLIC = {f"{ENGINE}.api", f"{ENGINE}.runtime"}


def engine_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every engine module an import statement in ``tree`` names, nested ones included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == ENGINE:  # ``from protoserve.engine import llm_engine`` names a submodule
                found += [(node.lineno, f"{ENGINE}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return sorted((line, module) for line, module in found if module == ENGINE or module.startswith(f"{ENGINE}."))


def internal_imports(source: str) -> list[tuple[int, str]]:
    return [(line, module) for line, module in engine_imports(ast.parse(source)) if module not in PUBLIC]


def test_the_check_sees_every_form_of_import() -> None:
    source = (
        "import protoserve.engine.llm_engine\n"
        "from protoserve.engine import llm_engine, api\n"
        "def f():\n    from protoserve.engine.models.kv_cache import PagedKVCache\n"
        "from protoserve.engine.api import SamplingParams\n"
        "from protoserve.engine.runtime import load_model\n"
        "from protoserve.kernels.cpu import step_phases\n"
        "import protoserve.engine\n"
    )
    assert internal_imports(source) == [
        (1, "protoserve.engine.llm_engine"),
        (2, "protoserve.engine.llm_engine"),
        (4, "protoserve.engine.models.kv_cache"),
        (8, "protoserve.engine"),
    ]


@pytest.mark.parametrize("layer", ["bench", "server", "gateway"])
def test_only_the_engines_public_modules_are_imported(layer: str) -> None:
    files = sorted((REPO / layer).rglob("*.py"))
    assert len(files) > 20, f"found only {len(files)} modules under {layer}/"
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in files
        for line, module in internal_imports(path.read_text())
    ]
    assert not offenders, f"{layer}/ must import protoserve.engine.api or .runtime only:\n" + "\n".join(offenders)
